/* One decode step of a Llama-architecture decoder over GGUF block-quantized weights, all layers in one call.

   Why in C: at one token per row a 135M model's matmuls take a few milliseconds, and the per-layer Python of
   the fused torch step (a dozen operators and frames per layer, 30 layers) cost as much again. Here a step is
   one call: embedding lookup, per layer RMSNorm, q/k/v, rotary, the KV append, attention, the output
   projection, RMSNorm, gate/up, SiLU-gate, down, then the final norm and the LM head.

   The KV cache stays transformers' (deltafin/engine/native_step.py hands in the buffers of each layer's
   `DynamicCache` tensors): keys stored rotated, [rows, kv heads, capacity, head dim], the new position written
   at column `width - 1`, left-padded rows hidden by the attention mask. A row's result never depends on the
   other rows: every matmul output is one dot product in one order (ggml_quants.c) and attention is per row.
   Built into the same library as ggml_quants.c (one translation unit per variant). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_quants.c"

typedef struct {
    const float *attn_norm, *ffn_norm;
    qmatrix q, k, v, o, gate, up, down;
    float *keys, *values; /* [rows, kv heads, capacity, head dim] */
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
    #pragma omp for schedule(static)
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

/* tokens, positions: [B]; mask: [B, width] (0 = padding); cos, sin: [positions, head_dim / 2];
   logits: [B, vocab]. Returns 0, or -1 when out of memory.

   Seven barriers a layer: norm | q,k,v | rotary + cache write + attention + quantize, per (row, kv head) |
   o (+ residual) | norm | gate and up by blocks of 32 columns, SiLU-gate and quantize | down (+ residual). */
int deltafin_llama_step(const llama_model *model, const int64_t *tokens, const int64_t *positions,
                        const int64_t *mask, int64_t rows, int64_t width, int64_t capacity,
                        const float *cos, const float *sin, float *logits, int threads) {
    const int64_t H = model->hidden, D = model->head_dim, Hq = model->heads, Hk = model->kv_heads;
    const int64_t I = model->intermediate, group = Hq / Hk, half = D / 2, col = width - 1, A = Hq * D;
    const int64_t qkv_width = (Hq + 2 * Hk) * D;
    const int64_t widest = I > H ? (I > A ? I : A) : (H > A ? H : A);
    if (H % QK || I % QK || D % QK) return -2;
    float *x = malloc(sizeof(float) * rows * H);
    float *h = malloc(sizeof(float) * rows * widest);
    float *qkv = malloc(sizeof(float) * rows * qkv_width);
    float *attended = malloc(sizeof(float) * rows * A);
    float *gate_up = malloc(sizeof(float) * rows * 2 * I);
    float *scores = malloc(sizeof(float) * rows * Hq * width);
    qrows q, gated;  /* a layer's quantized inputs; the gated MLP activations (written while q is read) */
    const int ok = qrows_alloc(&q, rows, widest) & qrows_alloc(&gated, rows, I) && x && h && qkv && attended
                   && gate_up && scores;
    if (!ok) {
        free(x); free(h); free(qkv); free(attended); free(gate_up); free(scores); qrows_free(&q); qrows_free(&gated);
        return -1;
    }
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < rows; b++)
            deltafin_ggml_dequantize(model->embed.data, (int)model->embed.type, H, model->embed.row_bytes,
                                     tokens + b, 1, x + b * H);
        for (int64_t l = 0; l < model->layers; l++) {
            const llama_layer *L = model->layer + l;
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < rows; b++) {
                rms_norm(x + b * H, L->attn_norm, H, model->eps, h + b * H);
                quantize_row(h + b * H, H, q.q + b * H, q.d + b * (H / QK), q.s + b * (H / QK));
            }
            {
                const qmatrix *mats[3] = {&L->q, &L->k, &L->v};
                float *outs[3] = {qkv, qkv + A, qkv + A + Hk * D};
                matrices_for(mats, outs, qkv_width, 3, &q, rows, NULL);
            }
            /* per (row, kv head): its key and value into the cache, then its query heads' attention */
            #pragma omp for schedule(static)
            for (int64_t task = 0; task < rows * Hk; task++) {
                const int64_t b = task / Hk, g = task % Hk;
                float *row = qkv + b * qkv_width;
                const float *c = cos + positions[b] * half, *s = sin + positions[b] * half;
                const int64_t at = ((b * Hk + g) * capacity + col) * D;
                rotate(row + A + g * D, D, c, s);
                memcpy(L->keys + at, row + A + g * D, sizeof(float) * D);
                memcpy(L->values + at, row + A + (Hk + g) * D, sizeof(float) * D);
                const float *keys = L->keys + (b * Hk + g) * capacity * D;
                const float *values = L->values + (b * Hk + g) * capacity * D;
                const int64_t *visible = mask + b * width;
                for (int64_t head = g * group; head < (g + 1) * group; head++) {
                    float *query = row + head * D;
                    rotate(query, D, c, s);
                    float *p = scores + (b * Hq + head) * width;
                    float top = -INFINITY;
                    for (int64_t t = 0; t < width; t++) {
                        if (!visible[t]) continue;
                        float dot = 0.0f;
                        for (int64_t i = 0; i < D; i++) dot += query[i] * keys[t * D + i];
                        p[t] = dot * model->scale;
                        top = p[t] > top ? p[t] : top;
                    }
                    float total = 0.0f;
                    for (int64_t t = 0; t < width; t++) {
                        if (!visible[t]) continue;
                        p[t] = expf(p[t] - top);
                        total += p[t];
                    }
                    float *out = attended + b * A + head * D;
                    for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
                    for (int64_t t = 0; t < width; t++) {
                        if (!visible[t]) continue;
                        const float weight = p[t] / total;
                        for (int64_t i = 0; i < D; i++) out[i] += weight * values[t * D + i];
                    }
                    for (int64_t blk = 0; blk < D / QK; blk++)
                        quantize_block(out + blk * QK, &q, b, A, head * (D / QK) + blk);
                }
            }
            {
                const qmatrix *mats[1] = {&L->o};
                float *outs[1] = {h};
                matrices_for(mats, outs, H, 1, &q, rows, x);
            }
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < rows; b++) {
                rms_norm(x + b * H, L->ffn_norm, H, model->eps, h + b * H);
                quantize_row(h + b * H, H, q.q + b * H, q.d + b * (H / QK), q.s + b * (H / QK));
            }
            /* gate and up by blocks of 32 columns: the thread that computed a block gates and quantizes it */
            #pragma omp for schedule(static)
            for (int64_t blk = 0; blk < I / QK; blk++) {
                const int64_t i0 = blk * QK;
                for (int64_t r = i0; r < i0 + QK; r++) {
                    matrix_rows(&L->gate, r, r + 1, &q, rows, gate_up, 2 * I);
                    matrix_rows(&L->up, r, r + 1, &q, rows, gate_up + I, 2 * I);
                }
                for (int64_t b = 0; b < rows; b++) {
                    const float *gu = gate_up + b * 2 * I;
                    float act[QK];
                    for (int64_t i = 0; i < QK; i++) {
                        const float g = gu[i0 + i];
                        act[i] = (g / (1.0f + expf(-g))) * gu[I + i0 + i];
                    }
                    quantize_block(act, &gated, b, I, blk);
                }
            }
            {
                const qmatrix *mats[1] = {&L->down};
                float *outs[1] = {h};
                matrices_for(mats, outs, H, 1, &gated, rows, x);
            }
        }
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < rows; b++) {
            rms_norm(x + b * H, model->norm, H, model->eps, h + b * H);
            quantize_row(h + b * H, H, q.q + b * H, q.d + b * (H / QK), q.s + b * (H / QK));
        }
        {
            const qmatrix *mats[1] = {&model->head};
            float *outs[1] = {logits};
            matrices_for(mats, outs, model->vocab, 1, &q, rows, NULL);
        }
    }
    free(x); free(h); free(qkv); free(attended); free(gate_up); free(scores); qrows_free(&q); qrows_free(&gated);
    return 0;
}
