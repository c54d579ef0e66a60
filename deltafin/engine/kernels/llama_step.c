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

/* Rows n of several matrices run as one parallel loop (one barrier): n in [0, sum of their rows). */
static void matrices_for(const qmatrix *const *mats, float *const *outs, const int64_t *ldo, int count,
                         const qrows *x, int64_t m_rows) {
    int64_t total = 0;
    for (int i = 0; i < count; i++) total += mats[i]->rows;
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < total; n++) {
        int64_t r = n;
        int i = 0;
        while (r >= mats[i]->rows) r -= mats[i++]->rows;
        matrix_rows(mats[i], r, r + 1, x, m_rows, outs[i], ldo[i]);
    }
}

/* tokens, positions: [B]; mask: [B, width] (0 = padding); cos, sin: [positions, head_dim / 2];
   logits: [B, vocab]. Returns 0, or -1 when out of memory. */
int deltafin_llama_step(const llama_model *model, const int64_t *tokens, const int64_t *positions,
                        const int64_t *mask, int64_t rows, int64_t width, int64_t capacity,
                        const float *cos, const float *sin, float *logits, int threads) {
    const int64_t H = model->hidden, D = model->head_dim, Hq = model->heads, Hk = model->kv_heads;
    const int64_t I = model->intermediate, group = Hq / Hk, half = D / 2, col = width - 1;
    const int64_t qkv_width = (Hq + 2 * Hk) * D;
    const int64_t widest = I > H ? (I > Hq * D ? I : Hq * D) : (H > Hq * D ? H : Hq * D);
    float *x = malloc(sizeof(float) * rows * H);
    float *h = malloc(sizeof(float) * rows * widest);
    float *qkv = malloc(sizeof(float) * rows * qkv_width);
    float *attended = malloc(sizeof(float) * rows * Hq * D);
    float *gate_up = malloc(sizeof(float) * rows * 2 * I);
    float *scores = malloc(sizeof(float) * rows * Hq * width);
    qrows q;
    const int ok = qrows_alloc(&q, rows, widest) && x && h && qkv && attended && gate_up && scores;
    if (!ok) {
        free(x); free(h); free(qkv); free(attended); free(gate_up); free(scores); qrows_free(&q);
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
                float *outs[3] = {qkv, qkv + Hq * D, qkv + (Hq + Hk) * D};
                const int64_t ldo[3] = {qkv_width, qkv_width, qkv_width};
                matrices_for(mats, outs, ldo, 3, &q, rows);
            }
            /* rotary on q and k, then the new key and value into the cache at column `col` */
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < rows; b++) {
                float *row = qkv + b * qkv_width;
                const float *c = cos + positions[b] * half, *s = sin + positions[b] * half;
                for (int64_t head = 0; head < Hq + Hk; head++) rotate(row + head * D, D, c, s);
                for (int64_t g = 0; g < Hk; g++) {
                    const int64_t at = ((b * Hk + g) * capacity + col) * D;
                    memcpy(L->keys + at, row + (Hq + g) * D, sizeof(float) * D);
                    memcpy(L->values + at, row + (Hq + Hk + g) * D, sizeof(float) * D);
                }
            }
            #pragma omp for schedule(static)
            for (int64_t task = 0; task < rows * Hq; task++) {
                const int64_t b = task / Hq, head = task % Hq, g = head / group;
                const float *query = qkv + b * qkv_width + head * D;
                const float *keys = L->keys + (b * Hk + g) * capacity * D;
                const float *values = L->values + (b * Hk + g) * capacity * D;
                const int64_t *visible = mask + b * width;
                float *p = scores + task * width;
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
                float *out = attended + b * Hq * D + head * D;
                for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
                for (int64_t t = 0; t < width; t++) {
                    if (!visible[t]) continue;
                    const float weight = p[t] / total;
                    for (int64_t i = 0; i < D; i++) out[i] += weight * values[t * D + i];
                }
            }
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < rows; b++)
                quantize_row(attended + b * Hq * D, Hq * D, q.q + b * Hq * D, q.d + b * (Hq * D / QK),
                             q.s + b * (Hq * D / QK));
            {
                const qmatrix *mats[1] = {&L->o};
                float *outs[1] = {h};
                const int64_t ldo[1] = {H};
                matrices_for(mats, outs, ldo, 1, &q, rows);
            }
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < rows; b++) {
                for (int64_t i = 0; i < H; i++) x[b * H + i] += h[b * H + i];
                rms_norm(x + b * H, L->ffn_norm, H, model->eps, h + b * H);
                quantize_row(h + b * H, H, q.q + b * H, q.d + b * (H / QK), q.s + b * (H / QK));
            }
            {
                const qmatrix *mats[2] = {&L->gate, &L->up};
                float *outs[2] = {gate_up, gate_up + I};
                const int64_t ldo[2] = {2 * I, 2 * I};
                matrices_for(mats, outs, ldo, 2, &q, rows);
            }
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < rows; b++) {
                float *gu = gate_up + b * 2 * I;
                for (int64_t i = 0; i < I; i++) {
                    const float g = gu[i];
                    h[b * I + i] = (g / (1.0f + expf(-g))) * gu[I + i];
                }
                quantize_row(h + b * I, I, q.q + b * I, q.d + b * (I / QK), q.s + b * (I / QK));
            }
            {
                const qmatrix *mats[1] = {&L->down};
                float *outs[1] = {gate_up};  /* free again: [B, H] with stride H */
                const int64_t ldo[1] = {H};
                matrices_for(mats, outs, ldo, 1, &q, rows);
            }
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < rows; b++)
                for (int64_t i = 0; i < H; i++) x[b * H + i] += gate_up[b * H + i];
        }
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < rows; b++) {
            rms_norm(x + b * H, model->norm, H, model->eps, h + b * H);
            quantize_row(h + b * H, H, q.q + b * H, q.d + b * (H / QK), q.s + b * (H / QK));
        }
        {
            const qmatrix *mats[1] = {&model->head};
            float *outs[1] = {logits};
            const int64_t ldo[1] = {model->vocab};
            matrices_for(mats, outs, ldo, 1, &q, rows);
        }
    }
    free(x); free(h); free(qkv); free(attended); free(gate_up); free(scores); qrows_free(&q);
    return 0;
}
