/* Weight-only int8 matrix times a few float rows, for decode steps (one to a few dozen rows).

   y[m, n] = scale[n] * sum_k w[n, k] * x[m, k] (+ bias[n])     w: int8 [N, K] row-major, x: float [M, K]

   A decode step reads every weight once per token and does two flops per weight, so the rate is set by how
   fast int8 weights stream from memory: plain C, vectorized by the compiler (-O3 -march=native, reassociation allowed),
   reaches the memory bandwidth where torch's _weight_int8pack_mm, its bfloat16 conversions included, runs at
   half of it. Each output is one dot product whose order depends only on K, never on M or on the other rows,
   so a row gets the same bits alone or in a batch. Threads split the output channels (OpenMP: the same
   libgomp torch has loaded, so its thread pool is shared rather than doubled). */
#include <stdint.h>

static inline float dot(const int8_t *w, const float *x, int64_t K) {
    float acc = 0.0f;
    for (int64_t k = 0; k < K; k++) acc += (float)w[k] * x[k];
    return acc;
}

void int8_matvec(const float *x, const int8_t *w, const float *scale, const float *bias, float *y,
                 int64_t M, int64_t N, int64_t K, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *row = w + n * K;
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m = 0; m < M; m++) y[m * N + n] = dot(row, x + m * K, K) * scale[n] + b;
    }
}
