/* A forward pass of a Llama-architecture decoder over GGUF block-quantized weights, all layers in one call:
   a decode step of a batch (one token per row) or a prefill window (several tokens of one row).

   Why in C: at one token per row a 135M model's matmuls take a few milliseconds, and the per-layer Python of
   the fused torch step (a dozen operators and frames per layer, 30 layers) cost as much again. Here a forward
   is one call: embedding lookup, per layer RMSNorm, q/k/v, rotary, the KV write, attention, the output
   projection, RMSNorm, gate/up, SiLU-gate, down, then the final norm and the LM head.

   Each token t has its own position, KV cache row `kv_row[t]` and column `kv_col[t]` (where its key and value
   are written). A decode step passes the batch's attention mask [rows, width] (0 = padding or a column the row
   does not hold): token t sees the columns 0 .. kv_col[t] its row's mask shows. A prefill window passes no
   mask: token t sees columns 0 .. kv_col[t]. With a mask, a row may bring several tokens (a speculative draft
   verified in one pass: deltafin/engine/local/speculative): they come one after another, in column order.

   The KV cache stays transformers' (deltafin/engine/llama/native.py hands in the buffers of each layer's
   `DynamicCache` tensors): keys stored rotated, [rows, kv heads, capacity, head dim].

   A token's result depends only on its own inputs and the cache columns it sees, never on the other tokens
   of the call: every matmul output is one dot product in one order (ggml_quants.c), activations are quantized
   per token, and attention runs per token over its visible columns in column order. So a row gets the same
   bits alone or in a batch, and a prompt the same bits whether it is prefilled at once, in windows, or after a
   prefix taken from the prefix cache. Built into the same library as ggml_quants.c (one translation unit). */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_quants.c"

/* The barrier between phases. OpenMP's own barrier spins for a long while (libgomp: ~300k iterations by
   default) before it sleeps; on a 2-core machine where the event loop, the tokenizer or another process takes
   a core, the spinning thread holds the very core its preempted teammate needs, and a step of ~200 barriers
   went from ~20 ms to ~500 ms (measured under load). This one spins briefly, then yields the core. */
typedef struct {
    atomic_int arrived;
    atomic_int phase;
    int threads;
} team_barrier;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void team_wait(team_barrier *b, int *phase) {
    const int next = *phase + 1;
    *phase = next;
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->threads - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, next, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&b->phase, memory_order_acquire) != next; spins++) {
        if (spins < 64) relax();
        else sched_yield();
    }
}

typedef struct {
    const float *attn_norm, *ffn_norm;
    qmatrix q, k, v, o, gate, up, down;
} llama_layer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, vocab;
    float eps, scale;
    const llama_layer *layer;
    qmatrix embed, head;
    const float *norm;
} llama_model;

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* rotate-half rotary (transformers' layout), cos/sin: [head_dim / 2] for this position */
static void rotate(float *v, int64_t dim, const float *cos, const float *sin) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i] + a * sin[i];
    }
}

/* Rows n of several matrices run as one parallel loop (one barrier): n in [0, sum of their rows).
   With `residual`, each output is also added to residual[m * ldo + n] by the thread that computed it. */
static void matrices_for(const qmatrix *const *mats, float *const *outs, int64_t ldo, int count, const qrows *x,
                         int64_t m_rows, float *residual) {
    int64_t total = 0;
    for (int i = 0; i < count; i++) total += mats[i]->rows;
    #pragma omp for schedule(static) nowait
    for (int64_t n = 0; n < total; n++) {
        int64_t r = n;
        int i = 0;
        while (r >= mats[i]->rows) r -= mats[i++]->rows;
        matrix_rows(mats[i], r, r + 1, x, m_rows, outs[i], ldo);
        if (residual)
            for (int64_t m = 0; m < m_rows; m++) residual[m * ldo + r] += outs[i][m * ldo + r];
    }
}

static inline void quantize_block(const float *v, qrows *q, int64_t row, int64_t k, int64_t block) {
    quantize_row(v, QK, q->q + row * k + block * QK, q->d + row * (k / QK) + block, q->s + row * (k / QK) + block);
    interleave_block(q, row, k, block);
}

/* Row `row` of a layer's input (k values) quantized into q (and t's layout, where q has one). */
static inline void quantize_token(const float *v, qrows *q, int64_t row, int64_t k) {
    quantize_row(v, k, q->q + row * k, q->d + row * (k / QK), q->s + row * (k / QK));
    for (int64_t block = 0; block < k / QK; block++) interleave_block(q, row, k, block);
}

typedef struct {
    const int64_t *positions, *kv_row, *kv_col, *mask;
    int64_t width, capacity, qkv_width;
    float *const *keys, *const *values;
    const float *cos, *sin;
} attention_args;

/* Whether any matrix's rows are repacked (ggml_quants.c): its activations are then written in t's layout too. */
static int any_repacked(const llama_model *model) {
    int any = (int)(model->head.type & REPACKED);
    for (int64_t l = 0; l < model->layers; l++) {
        const llama_layer *L = model->layer + l;
        const qmatrix *m[7] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down};
        for (int i = 0; i < 7; i++) any |= (int)(m[i]->type & REPACKED);
    }
    return any != 0;
}

/* Every matrix's input width is whole blocks of its type (a K-quant's: super-blocks of 256), and its type is one this
   kernel variant runs. */
static int matrices_fit(const llama_model *model) {
    const qmatrix *all[2] = {&model->embed, &model->head};
    for (int i = 0; i < 2; i++) {
        const int64_t values = deltafin_ggml_block_values((int)all[i]->type);
        if (!values || all[i]->cols % values || !deltafin_ggml_supported((int)all[i]->type)) return 0;
    }
    for (int64_t l = 0; l < model->layers; l++) {
        const llama_layer *L = model->layer + l;
        const qmatrix *m[7] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down};
        for (int i = 0; i < 7; i++) {
            const int64_t values = deltafin_ggml_block_values((int)m[i]->type);
            if (!values || m[i]->cols % values || !deltafin_ggml_supported((int)m[i]->type)) return 0;
        }
    }
    return 1;
}

/* Token t's rotated key and its value into the cache of kv head g. */
static void write_kv(const llama_model *model, const attention_args *a, int64_t l, float *qkv, int64_t t, int64_t g) {
    const int64_t D = model->head_dim, A = model->heads * D, Hk = model->kv_heads, half = D / 2;
    float *row = qkv + t * a->qkv_width;
    const int64_t at = ((a->kv_row[t] * Hk + g) * a->capacity + a->kv_col[t]) * D;
    rotate(row + A + g * D, D, a->cos + a->positions[t] * half, a->sin + a->positions[t] * half);
    memcpy(a->keys[l] + at, row + A + g * D, sizeof(float) * D);
    memcpy(a->values[l] + at, row + A + (Hk + g) * D, sizeof(float) * D);
}

/* Lanes of a score's dot product and of the softmax's denominator (see group_scores, attend). */
#define ATTN_LANES 16

#ifdef DELTAFIN_VARIANT_AVX512
/* The ATTN_LANES partial sums of q . k (one column): the loop of group_scores in one register. */
static inline __attribute__((always_inline)) __m512 lane_sums(const float *q, const float *k, int64_t D) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    for (int64_t i = ATTN_LANES; i < D; i += ATTN_LANES)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i)));
    return acc;
}

/* The tree of group_scores (lane l += lane l + width, width 8, 4, 2, 1) for sixteen columns' lane sums at once:
   each step adds two shuffled vectors holding the pairs of several columns, so the 16 trees take 45 vector
   operations instead of 16 horizontal reductions. The same additions as the plain loop (a + b = b + a in IEEE),
   so the same bits. Column c ends in lane 4 * (c % 4) + c / 4; returned in column order. */
static inline __m512 tree16(const __m512 *a) {
    __m512 r8[8], r4[4], r2[2];
    for (int m = 0; m < 8; m++)  /* [A lanes 0-7 | B lanes 0-7] + [A lanes 8-15 | B lanes 8-15] */
        r8[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                              _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
    for (int m = 0; m < 4; m++)  /* 128-bit blocks: [A0-3 B0-3 C0-3 D0-3] + [A4-7 B4-7 C4-7 D4-7] */
        r4[m] = _mm512_add_ps(_mm512_shuffle_f32x4(r8[2 * m], r8[2 * m + 1], 0x88),
                              _mm512_shuffle_f32x4(r8[2 * m], r8[2 * m + 1], 0xDD));
    for (int m = 0; m < 2; m++)  /* in each block: [x0 x1 | y0 y1] + [x2 x3 | y2 y3] */
        r2[m] = _mm512_add_ps(_mm512_shuffle_ps(r4[2 * m], r4[2 * m + 1], 0x44),
                              _mm512_shuffle_ps(r4[2 * m], r4[2 * m + 1], 0xEE));
    const __m512 last = _mm512_add_ps(_mm512_shuffle_ps(r2[0], r2[1], 0x88), _mm512_shuffle_ps(r2[0], r2[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), last);
}
#endif

/* scores[h * stride + j] = (query h . key of column cols[j]) * scale for the `group` query heads sharing these
   keys, j in [0, count) (cols NULL: column j itself); head_dim D is a multiple of 32. Each dot product is ATTN_LANES
   partial sums (lane j: elements i = j mod ATTN_LANES, in order) added in a fixed tree: the same IEEE operations in
   every variant (no contraction, no reassociation), which the compiler turns into vector code. A plain
   `dot += q[i] * k[i]` loop was a chain of D dependent adds per column; at ~1k columns attention then cost more
   than all the matmuls of a decode step (a repeated long prompt's TTFT). */
static void group_scores(const float *const *query, int64_t group, const float *keys, const int64_t *cols,
                         int64_t D, int64_t count, float scale, float *scores, int64_t stride) {
    int64_t first = 0;
#ifdef DELTAFIN_VARIANT_AVX512
    for (; first + ATTN_LANES <= count; first += ATTN_LANES) {
        const float *k[ATTN_LANES];
        for (int c = 0; c < ATTN_LANES; c++) k[c] = keys + (cols ? cols[first + c] : first + c) * D;
        for (int64_t h = 0; h < group; h++) {
            __m512 sums[ATTN_LANES];
            if (D == 64)  /* the common head sizes as constants: the loop unrolled, q kept in registers */
                for (int c = 0; c < ATTN_LANES; c++) sums[c] = lane_sums(query[h], k[c], 64);
            else if (D == 128)
                for (int c = 0; c < ATTN_LANES; c++) sums[c] = lane_sums(query[h], k[c], 128);
            else
                for (int c = 0; c < ATTN_LANES; c++) sums[c] = lane_sums(query[h], k[c], D);
            _mm512_storeu_ps(scores + h * stride + first, _mm512_mul_ps(tree16(sums), _mm512_set1_ps(scale)));
        }
    }
#endif
    for (int64_t j = first; j < count; j++) {
        const float *k = keys + (cols ? cols[j] : j) * D;
        for (int64_t h = 0; h < group; h++) {
            const float *qh = query[h];
            float acc[ATTN_LANES];
            for (int64_t l = 0; l < ATTN_LANES; l++) acc[l] = qh[l] * k[l];
            for (int64_t i = ATTN_LANES; i < D; i += ATTN_LANES)
                for (int64_t l = 0; l < ATTN_LANES; l++) acc[l] += qh[i + l] * k[i + l];
            for (int64_t width = ATTN_LANES / 2; width > 0; width /= 2)
                for (int64_t l = 0; l < width; l++) acc[l] += acc[l + width];
            scores[h * stride + j] = acc[0] * scale;
        }
    }
}

/* e^x for x <= 0 (a score minus its row's maximum), within 1 ulp (checked over [-87, 0] in steps of 1e-6):
   Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial, times 2^n), 0 below -87. Why not libm's
   expf: it is a call per score that the compiler cannot vectorize, and with the scores themselves it was a
   third of a long prompt's prefill. Plain IEEE operations (n rounded by the 1.5 * 2^23 trick, not nearbyintf),
   so every variant gives the same bits, vectorized or not. */
static inline float exp_nonpositive(float x) {
    const float big = 12582912.0f;  /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = (clamped * 1.44269504088896341f + big) - big;
    float r = clamped - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    const float z = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * z + r;
    p = p + 1.0f;
    const float two_n = fp32_from_bits((uint32_t)((int32_t)n + 127) << 23);  /* n >= -126: a normal power of two */
    return x < -87.0f ? 0.0f : p * two_n;
}

/* Attention of token t's query heads of kv group g over the columns it sees; outputs quantized per block.
   `work`: this thread's [group, columns] scores; `cols`: its [columns] room for a decode step's visible columns.

   A token's result never depends on where its columns sit: a decode step's visible columns (its row's mask;
   left padding hidden) are gathered first, and everything after runs over the j-th visible column, in order.
   So a row gets the same bits alone and left-padded in a batch, and a token the same bits in a decode step and
   in a prefill window. Work per score is vector code: the scores, e^x, the denominator (ATTN_LANES partial sums in
   a fixed tree), the weights and the weighted sum of the values. */
static void attend(const llama_model *model, const attention_args *a, int64_t l, float *qkv, float *attended,
                   qrows *q, float *work, int64_t *cols, int64_t t, int64_t g) {
    const int64_t D = model->head_dim, Hq = model->heads, Hk = model->kv_heads, A = Hq * D, half = D / 2;
    const int64_t group = Hq / Hk;
    const int64_t columns = a->kv_col[t] + 1;  /* a decode step's token sits at its row's last column */
    const float *keys = a->keys[l] + (a->kv_row[t] * Hk + g) * a->capacity * D;
    const float *values = a->values[l] + (a->kv_row[t] * Hk + g) * a->capacity * D;
    int64_t count = columns;
    if (!a->mask) {
        cols = NULL;
    } else {
        const int64_t *visible = a->mask + a->kv_row[t] * a->width;
        count = 0;
        for (int64_t c = 0; c < columns; c++)
            if (visible[c]) cols[count++] = c;
    }
    const float *queries[group];
    for (int64_t h = 0; h < group; h++) {
        float *query = qkv + t * a->qkv_width + (g * group + h) * D;
        rotate(query, D, a->cos + a->positions[t] * half, a->sin + a->positions[t] * half);
        queries[h] = query;
    }
    group_scores(queries, group, keys, cols, D, count, model->scale, work, columns);
    for (int64_t h = 0; h < group; h++) {
        float *restrict own = work + h * columns;
        float top = -INFINITY;
        int64_t from = 0;
#ifdef DELTAFIN_VARIANT_AVX512
        /* sixteen running maxima, then theirs: the same `>` as the loop below (a NaN never wins), and where the
           order picks another zero of equal value, own[j] - top and so e^x are the same. One chain of vmaxss
           per column was a seventh of attention's time. */
        __m512 tops = _mm512_set1_ps(-INFINITY);
        for (; from + ATTN_LANES <= count; from += ATTN_LANES) {
            const __m512 v = _mm512_loadu_ps(own + from);
            tops = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, tops, _CMP_GT_OQ), tops, v);
        }
        float maxima[ATTN_LANES];
        _mm512_storeu_ps(maxima, tops);
        for (int k = 0; k < ATTN_LANES; k++) top = maxima[k] > top ? maxima[k] : top;
#endif
        for (int64_t j = from; j < count; j++) top = own[j] > top ? own[j] : top;
        for (int64_t j = 0; j < count; j++) own[j] = exp_nonpositive(own[j] - top);
        float lanes[ATTN_LANES] = {0};
        int64_t j = 0;
        for (; j + ATTN_LANES <= count; j += ATTN_LANES)
            for (int64_t k = 0; k < ATTN_LANES; k++) lanes[k] += own[j + k];
        for (int64_t k = 0; j + k < count; k++) lanes[k] += own[j + k];
        for (int64_t width = ATTN_LANES / 2; width > 0; width /= 2)
            for (int64_t k = 0; k < width; k++) lanes[k] += lanes[k + width];
        const float total = lanes[0];
        for (j = 0; j < count; j++) own[j] = own[j] / total;
    }
    /* out[i] = sum over j of weight[j] * value[j][i], in order of j, sixteen elements at a time: the sixteen
       partial outputs stay in a register instead of a store and a load per column. */
#ifdef DELTAFIN_VARIANT_AVX512
    /* Eight or more (head, sixteen elements) outputs at a time, so independent chains of additions interleave
       (one output's chain alone waits on each addition's latency); the same operations per element. */
    const int64_t pieces = group * (D / ATTN_LANES);
    int64_t done = 0;  /* pieces [0, done) are written */
    if (D == 4 * ATTN_LANES)  /* head_dim 64: up to three heads at a time, each value row loaded once for them */
        for (; done < pieces; done += 12 < pieces - done ? 12 : pieces - done) {
            const int heads = (int)((pieces - done < 12 ? pieces - done : 12) / 4);
            __m512 acc[12];
            const float *w[3];
            for (int p = 0; p < 12; p++) acc[p] = _mm512_setzero_ps();
            for (int e = 0; e < heads; e++) w[e] = work + (done / 4 + e) * columns;
            for (int64_t j = 0; j < count; j++) {
                const float *v = values + (cols ? cols[j] : j) * D;
                const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                             v3 = _mm512_loadu_ps(v + 48);
                for (int e = 0; e < heads; e++) {
                    const __m512 weight = _mm512_set1_ps(w[e][j]);
                    acc[4 * e] = _mm512_add_ps(acc[4 * e], _mm512_mul_ps(weight, v0));
                    acc[4 * e + 1] = _mm512_add_ps(acc[4 * e + 1], _mm512_mul_ps(weight, v1));
                    acc[4 * e + 2] = _mm512_add_ps(acc[4 * e + 2], _mm512_mul_ps(weight, v2));
                    acc[4 * e + 3] = _mm512_add_ps(acc[4 * e + 3], _mm512_mul_ps(weight, v3));
                }
            }
            for (int p = 0; p < 4 * heads; p++)
                _mm512_storeu_ps(attended + t * A + g * group * D + (done + p) * ATTN_LANES, acc[p]);
        }
    for (; done + 8 <= pieces; done += 8) {
        __m512 acc[8];
        const float *w[8];
        int64_t off[8];
        for (int p = 0; p < 8; p++) {
            acc[p] = _mm512_setzero_ps();
            w[p] = work + ((done + p) / (D / ATTN_LANES)) * columns;
            off[p] = ((done + p) % (D / ATTN_LANES)) * ATTN_LANES;
        }
        for (int64_t j = 0; j < count; j++) {
            const float *v = values + (cols ? cols[j] : j) * D;
            for (int p = 0; p < 8; p++)
                acc[p] = _mm512_add_ps(acc[p], _mm512_mul_ps(_mm512_set1_ps(w[p][j]), _mm512_loadu_ps(v + off[p])));
        }
        for (int p = 0; p < 8; p++)
            _mm512_storeu_ps(attended + t * A + g * group * D + (done + p) * ATTN_LANES, acc[p]);
    }
#else
    const int64_t done = 0;
#endif
    for (int64_t h = 0; h < group; h++) {
        float *restrict out = attended + t * A + (g * group + h) * D;
        const float *own = work + h * columns;
        for (int64_t i0 = 0; i0 < D; i0 += ATTN_LANES) {
            if (h * (D / ATTN_LANES) + i0 / ATTN_LANES < done) continue;
            float acc[ATTN_LANES] = {0};
            for (int64_t j = 0; j < count; j++) {
                const float *restrict v = values + (cols ? cols[j] : j) * D + i0;
                const float weight = own[j];
                for (int64_t k = 0; k < ATTN_LANES; k++) acc[k] += weight * v[k];
            }
            for (int64_t k = 0; k < ATTN_LANES; k++) out[i0 + k] = acc[k];
        }
        for (int64_t blk = 0; blk < D / QK; blk++) quantize_block(out + blk * QK, q, t, A, (g * group + h) * (D / QK) + blk);
    }
}

/* tokens, positions, kv_row, kv_col: [T]; mask: [rows, width] or NULL (see above); keys, values: per layer,
   [rows, kv heads, capacity, head dim]; cos, sin: [positions, head_dim / 2]; logits: [T - first_logit, vocab]
   for tokens first_logit .. T-1. Returns 0; -1 when out of memory, -2 for widths not in blocks of 32.

   Seven barriers a layer (eight for a prefill window or a row of several tokens, whose keys must all be
   written before any token attends): norm | q,k,v | rotary + cache write + attention + quantize, per (token, kv head) |
   o (+ residual) | norm | gate and up by blocks of 32 columns, SiLU-gate and quantize | down (+ residual). */
int deltafin_llama_forward(const llama_model *model, const int64_t *tokens, const int64_t *positions,
                           const int64_t *kv_row, const int64_t *kv_col, const int64_t *mask, int64_t count,
                           int64_t width, int64_t capacity, float *const *keys, float *const *values,
                           const float *cos, const float *sin, float *logits, int64_t first_logit, int threads) {
    const int64_t H = model->hidden, D = model->head_dim, Hq = model->heads, Hk = model->kv_heads;
    const int64_t I = model->intermediate, A = Hq * D, T = count;
    const int64_t qkv_width = (Hq + 2 * Hk) * D;
    const int64_t widest = I > H ? (I > A ? I : A) : (H > A ? H : A);
    int64_t columns = width;
    for (int64_t t = 0; !mask && t < T; t++) columns = kv_col[t] + 1 > columns ? kv_col[t] + 1 : columns;
    /* a row with several tokens: each sees the keys of the ones before it, so all are written first */
    int several = !mask;
    for (int64_t t = 1; !several && t < T; t++) several = kv_row[t] == kv_row[t - 1];
    if (H % QK || I % QK || D % QK || !matrices_fit(model)) return -2;
    float *x = malloc(sizeof(float) * T * H);
    float *h = malloc(sizeof(float) * T * widest);
    float *qkv = malloc(sizeof(float) * T * qkv_width);
    float *attended = malloc(sizeof(float) * T * A);
    float *gate_up = malloc(sizeof(float) * T * 2 * I);
    const int64_t group = Hq / Hk;
    float *scores = malloc(sizeof(float) * threads * group * columns);
    int64_t *cols = malloc(sizeof(int64_t) * threads * columns);
    qrows q, gated;  /* a layer's quantized inputs; the gated MLP activations (written while q is read) */
    int ok = qrows_alloc(&q, T, widest) & qrows_alloc(&gated, T, I) && x && h && qkv && attended && gate_up
             && scores && cols;
    if (ok && any_repacked(model)) {  /* their activations in t's layout too */
        q.t = malloc((size_t)(T * widest) + 64);
        gated.t = malloc((size_t)(T * I) + 64);
        ok = q.t && gated.t;
    }
    if (!ok) {
        free(x); free(h); free(qkv); free(attended); free(gate_up); free(scores); free(cols); qrows_free(&q); qrows_free(&gated);
        return -1;
    }
    const attention_args args = {positions, kv_row, kv_col, mask, width, capacity, qkv_width, keys, values, cos, sin};
    team_barrier bar = {0, 0, threads};
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp single
        bar.threads = omp_get_num_threads();  /* the team may be smaller than asked; single's barrier publishes it */
        int phase = 0;
#define SYNC() team_wait(&bar, &phase)
        float *own_scores = scores + omp_get_thread_num() * group * columns;
        int64_t *own_cols = cols + omp_get_thread_num() * columns;
        #pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < T; t++)
            deltafin_ggml_dequantize(model->embed.data, (int)model->embed.type, H, model->embed.row_bytes,
                                     tokens + t, 1, x + t * H);
        SYNC();
        for (int64_t l = 0; l < model->layers; l++) {
            const llama_layer *L = model->layer + l;
            #pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++) {
                rms_norm(x + t * H, L->attn_norm, H, model->eps, h + t * H);
                quantize_token(h + t * H, &q, t, H);
            }
            SYNC();
            {
                const qmatrix *mats[3] = {&L->q, &L->k, &L->v};
                float *outs[3] = {qkv, qkv + A, qkv + A + Hk * D};
                matrices_for(mats, outs, qkv_width, 3, &q, T, NULL);
            }
            SYNC();
            if (!several) {  /* one token a row: each sees only its own row's columns, its own key included */
                #pragma omp for schedule(static) nowait
                for (int64_t task = 0; task < T * Hk; task++) {
                    write_kv(model, &args, l, qkv, task / Hk, task % Hk);
                    attend(model, &args, l, qkv, attended, &q, own_scores, own_cols, task / Hk, task % Hk);
                }
            } else {
                #pragma omp for schedule(static) nowait
                for (int64_t task = 0; task < T * Hk; task++) write_kv(model, &args, l, qkv, task / Hk, task % Hk);
                SYNC();
                /* interleaved: a later token sees more columns, so halves of the window are unequal work */
                #pragma omp for schedule(static, 1) nowait
                for (int64_t task = 0; task < T * Hk; task++)
                    attend(model, &args, l, qkv, attended, &q, own_scores, own_cols, task / Hk, task % Hk);
            }
            SYNC();
            {
                const qmatrix *mats[1] = {&L->o};
                float *outs[1] = {h};
                matrices_for(mats, outs, H, 1, &q, T, x);
            }
            SYNC();
            #pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++) {
                rms_norm(x + t * H, L->ffn_norm, H, model->eps, h + t * H);
                quantize_token(h + t * H, &q, t, H);
            }
            SYNC();
            /* gate and up by blocks of 32 columns: the thread that computed a block gates and quantizes it */
            #pragma omp for schedule(static) nowait
            for (int64_t blk = 0; blk < I / QK; blk++) {
                const int64_t i0 = blk * QK;
                for (int64_t r = i0; r < i0 + QK; r++) {
                    matrix_rows(&L->gate, r, r + 1, &q, T, gate_up, 2 * I);
                    matrix_rows(&L->up, r, r + 1, &q, T, gate_up + I, 2 * I);
                }
                for (int64_t t = 0; t < T; t++) {
                    const float *gu = gate_up + t * 2 * I;
                    float act[QK];
                    for (int64_t i = 0; i < QK; i++) {
                        const float g = gu[i0 + i];
                        act[i] = (g / (1.0f + expf(-g))) * gu[I + i0 + i];
                    }
                    quantize_block(act, &gated, t, I, blk);
                }
            }
            SYNC();
            {
                const qmatrix *mats[1] = {&L->down};
                float *outs[1] = {h};
                matrices_for(mats, outs, H, 1, &gated, T, x);
            }
            SYNC();
        }
        #pragma omp for schedule(static) nowait
        for (int64_t t = first_logit; t < T; t++) {
            rms_norm(x + t * H, model->norm, H, model->eps, h + t * H);
            quantize_token(h + t * H, &q, t, H);
        }
        SYNC();
        {
            const qrows wanted = {q.q + first_logit * H, q.d + first_logit * (H / QK), q.s + first_logit * (H / QK), H,
                                  q.t ? q.t + first_logit * H : NULL};
            const qmatrix *mats[1] = {&model->head};
            float *outs[1] = {logits};
            matrices_for(mats, outs, model->vocab, 1, &wanted, T - first_logit, NULL);
        }
#undef SYNC
    }
    free(x); free(h); free(qkv); free(attended); free(gate_up); free(scores); free(cols); qrows_free(&q); qrows_free(&gated);
    return 0;
}
