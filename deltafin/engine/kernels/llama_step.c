/* A forward pass of a Llama-architecture decoder over GGUF block-quantized weights, all layers in one call:
   a decode step of a batch (one token per row) or a prefill window (several tokens of one row).

   Why in C: at one token per row a 135M model's matmuls take a few milliseconds, and the per-layer Python of
   the fused torch step (a dozen operators and frames per layer, 30 layers) cost as much again. Here a forward
   is one call: embedding lookup, per layer RMSNorm, q/k/v, rotary, the KV write, attention, the output
   projection, RMSNorm, gate/up, SiLU-gate, down, then the final norm and the LM head.

   Each token t has its own position, KV cache row `kv_row[t]` and column `kv_col[t]` (where its key and value
   are written). A decode step passes the batch's attention mask [rows, width] (0 = left padding): token t sees
   the columns its row's mask shows. A prefill window passes no mask: token t sees columns 0 .. kv_col[t].

   The KV cache stays transformers' (deltafin/engine/native_step.py hands in the buffers of each layer's
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
}

typedef struct {
    const int64_t *positions, *kv_row, *kv_col, *mask;
    int64_t width, capacity, qkv_width;
    float *const *keys, *const *values;
    const float *cos, *sin;
} attention_args;

/* Token t's rotated key and its value into the cache of kv head g. */
static void write_kv(const llama_model *model, const attention_args *a, int64_t l, float *qkv, int64_t t, int64_t g) {
    const int64_t D = model->head_dim, A = model->heads * D, Hk = model->kv_heads, half = D / 2;
    float *row = qkv + t * a->qkv_width;
    const int64_t at = ((a->kv_row[t] * Hk + g) * a->capacity + a->kv_col[t]) * D;
    rotate(row + A + g * D, D, a->cos + a->positions[t] * half, a->sin + a->positions[t] * half);
    memcpy(a->keys[l] + at, row + A + g * D, sizeof(float) * D);
    memcpy(a->values[l] + at, row + A + (Hk + g) * D, sizeof(float) * D);
}

/* Lanes of a score's dot product (see group_scores). */
#define LANES 16

/* scores[h * stride + c] = (query h . key c) * scale for the `group` query heads sharing these keys, columns
   [0, columns); head_dim D is a multiple of 32. Each dot product is LANES partial sums (lane j: elements
   i = j mod LANES, in order) added in a fixed tree: the same IEEE operations in every variant (no contraction,
   no reassociation), which the compiler turns into vector code. A plain `dot += q[i] * k[i]` loop was a chain
   of D dependent adds per column; at ~1k columns attention then cost more than all the matmuls of a decode
   step (a repeated long prompt's TTFT, issue 20). */
static void group_scores(const float *const *query, int64_t group, const float *keys, int64_t D, int64_t columns,
                         float scale, float *scores, int64_t stride) {
    for (int64_t c = 0; c < columns; c++) {
        const float *k = keys + c * D;
        for (int64_t h = 0; h < group; h++) {
            const float *qh = query[h];
            float acc[LANES];
            for (int64_t j = 0; j < LANES; j++) acc[j] = qh[j] * k[j];
            for (int64_t i = LANES; i < D; i += LANES)
                for (int64_t j = 0; j < LANES; j++) acc[j] += qh[i + j] * k[i + j];
            for (int64_t width = LANES / 2; width > 0; width /= 2)
                for (int64_t j = 0; j < width; j++) acc[j] += acc[j + width];
            scores[h * stride + c] = acc[0] * scale;
        }
    }
}

/* Attention of token t's query heads of kv group g over the columns it sees; outputs quantized per block.
   `scores`: [group, columns] of this thread. */
static void attend(const llama_model *model, const attention_args *a, int64_t l, float *qkv, float *attended,
                   qrows *q, float *scores, int64_t t, int64_t g) {
    const int64_t D = model->head_dim, Hq = model->heads, Hk = model->kv_heads, A = Hq * D, half = D / 2;
    const int64_t group = Hq / Hk;
    const int64_t *visible = a->mask ? a->mask + a->kv_row[t] * a->width : NULL;
    const int64_t columns = a->mask ? a->width : a->kv_col[t] + 1;
    const float *keys = a->keys[l] + (a->kv_row[t] * Hk + g) * a->capacity * D;
    const float *values = a->values[l] + (a->kv_row[t] * Hk + g) * a->capacity * D;
    const float *queries[group];
    for (int64_t h = 0; h < group; h++) {
        float *query = qkv + t * a->qkv_width + (g * group + h) * D;
        rotate(query, D, a->cos + a->positions[t] * half, a->sin + a->positions[t] * half);
        queries[h] = query;
    }
    /* Hidden columns are scored too (their scores are never read). */
    group_scores(queries, group, keys, D, columns, model->scale, scores, columns);
    for (int64_t h = 0; h < group; h++) {
        const int64_t head = g * group + h;
        float *own = scores + h * columns;
        float top = -INFINITY;
        for (int64_t c = 0; c < columns; c++) {
            if (visible && !visible[c]) continue;
            top = own[c] > top ? own[c] : top;
        }
        float total = 0.0f;
        for (int64_t c = 0; c < columns; c++) {
            if (visible && !visible[c]) continue;
            own[c] = expf(own[c] - top);
            total += own[c];
        }
        float *out = attended + t * A + head * D;
        for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
        for (int64_t c = 0; c < columns; c++) {
            if (visible && !visible[c]) continue;
            const float weight = own[c] / total;
            for (int64_t i = 0; i < D; i++) out[i] += weight * values[c * D + i];
        }
        for (int64_t blk = 0; blk < D / QK; blk++) quantize_block(out + blk * QK, q, t, A, head * (D / QK) + blk);
    }
}

/* tokens, positions, kv_row, kv_col: [T]; mask: [rows, width] or NULL (see above); keys, values: per layer,
   [rows, kv heads, capacity, head dim]; cos, sin: [positions, head_dim / 2]; logits: [T - first_logit, vocab]
   for tokens first_logit .. T-1. Returns 0; -1 when out of memory, -2 for widths not in blocks of 32.

   Seven barriers a layer (eight for a prefill window, whose keys must all be written before any token
   attends): norm | q,k,v | rotary + cache write + attention + quantize, per (token, kv head) |
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
    if (H % QK || I % QK || D % QK) return -2;
    float *x = malloc(sizeof(float) * T * H);
    float *h = malloc(sizeof(float) * T * widest);
    float *qkv = malloc(sizeof(float) * T * qkv_width);
    float *attended = malloc(sizeof(float) * T * A);
    float *gate_up = malloc(sizeof(float) * T * 2 * I);
    const int64_t group = Hq / Hk;
    float *scores = malloc(sizeof(float) * threads * group * columns);
    qrows q, gated;  /* a layer's quantized inputs; the gated MLP activations (written while q is read) */
    const int ok = qrows_alloc(&q, T, widest) & qrows_alloc(&gated, T, I) && x && h && qkv && attended && gate_up
                   && scores;
    if (!ok) {
        free(x); free(h); free(qkv); free(attended); free(gate_up); free(scores); qrows_free(&q); qrows_free(&gated);
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
                quantize_row(h + t * H, H, q.q + t * H, q.d + t * (H / QK), q.s + t * (H / QK));
            }
            SYNC();
            {
                const qmatrix *mats[3] = {&L->q, &L->k, &L->v};
                float *outs[3] = {qkv, qkv + A, qkv + A + Hk * D};
                matrices_for(mats, outs, qkv_width, 3, &q, T, NULL);
            }
            SYNC();
            if (mask) {  /* a decode step: each token sees only its own row's columns, its own key included */
                #pragma omp for schedule(static) nowait
                for (int64_t task = 0; task < T * Hk; task++) {
                    write_kv(model, &args, l, qkv, task / Hk, task % Hk);
                    attend(model, &args, l, qkv, attended, &q, own_scores, task / Hk, task % Hk);
                }
            } else {
                #pragma omp for schedule(static) nowait
                for (int64_t task = 0; task < T * Hk; task++) write_kv(model, &args, l, qkv, task / Hk, task % Hk);
                SYNC();
                #pragma omp for schedule(static) nowait
                for (int64_t task = 0; task < T * Hk; task++)
                    attend(model, &args, l, qkv, attended, &q, own_scores, task / Hk, task % Hk);
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
                quantize_row(h + t * H, H, q.q + t * H, q.d + t * (H / QK), q.s + t * (H / QK));
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
            quantize_row(h + t * H, H, q.q + t * H, q.d + t * (H / QK), q.s + t * (H / QK));
        }
        SYNC();
        {
            const qrows wanted = {q.q + first_logit * H, q.d + first_logit * (H / QK), q.s + first_logit * (H / QK), H};
            const qmatrix *mats[1] = {&model->head};
            float *outs[1] = {logits};
            matrices_for(mats, outs, model->vocab, 1, &wanted, T - first_logit, NULL);
        }
#undef SYNC
    }
    free(x); free(h); free(qkv); free(attended); free(gate_up); free(scores); qrows_free(&q); qrows_free(&gated);
    return 0;
}
