/* Published checkpoints' quantized weights times float32 activations, in their stored form:

   - 4-bit codes, two per byte (element 2j in the low nibble of byte j, 2j+1 in the high one), one scale per
     group of `group` values of a row:
       int4 (compressed-tensors pack-quantized, symmetric): w = (u - 8) * scale, scale bfloat16 / float16 /
            float32 as stored;
       mxfp4 (compressed-tensors mxfp4-pack-quantized, OCP MX): w = E2M1[u] * 2^(e - 127), e an E8M0 byte,
            groups of 32;
   - fp8 (DeepSeek-V3 blocks): one e4m3fn byte per weight, w = e4m3(b) * scale_inv[block row, block column]
     with blocks of block_n x block_k, the last ones partial. A matrix may stack several parts of `part_rows`
     rows, each with its own block grid (an expert's [gate; up], I rows each, I not always a multiple of 128).

   The activations are not quantized. Each weight is decoded to its exact float32 value (int4 with a 16-bit
   scale and mxfp4: the product is exact; int4 with a float32 scale and fp8: one IEEE product, the same in
   every variant), a few rows at a time into a per-thread buffer, never a whole matrix. Then every output is

       y[m, n] = sum over k of w[n, k] * x[m, k]  in 16 lanes: element k goes to lane k % 16, each lane a
                 running sum in k order of separate multiplies and adds (no FMA: built -ffp-contract=off),
                 the lanes summed (l + l+8), then (+4), (+2), (+1)

   one fixed order whatever the CPU variant, the thread count or the other rows of the call: the portable
   build, the AVX2 build (two 8-lane registers per 16 lanes) and the AVX-512 build (one register) give the same
   bits, and a row gets the same bits alone or in a batch. A width that is not a multiple of 16 (fp8 only)
   ends with a partial chunk whose missing lanes add 0 * 0 in every variant.

   Variants as in ggml_quants.c (DELTAFIN_VARIANT_AVX512, DELTAFIN_VARIANT_AVX2, neither: portable C); the
   SIMD builds differ only in how they decode (vpshufb table lookups, F16C conversions) and how many lanes
   one instruction adds. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(DELTAFIN_VARIANT_AVX2) || defined(DELTAFIN_VARIANT_AVX512)
#include <immintrin.h>
#define PACKED_SIMD 1
#endif

enum { PACKED_INT4 = 1, PACKED_MXFP4 = 2, PACKED_FP8 = 3 };
enum { SCALE_BF16 = 0, SCALE_F16 = 1, SCALE_F32 = 2, SCALE_E8M0 = 3 };
#define LANES 16
/* weight rows decoded together, and activation rows run against them together */
#define TILE 4

typedef struct {
    int format;
    int64_t rows, cols;           /* N, K */
    const uint8_t *data;          /* 4-bit: codes [N][stride bytes]; fp8: e4m3 bytes [N][stride] */
    int64_t stride;
    const void *scales;           /* 4-bit: [N][scale_stride] of scale_type; fp8: float [grid rows][scale_stride] */
    int scale_type;
    int64_t scale_stride;
    int64_t group;                /* 4-bit: values per scale */
    int64_t block_n, block_k, part_rows;  /* fp8 */
} pmatrix;

/* ---- scalar conversions (exact) ---- */

static inline float bits_float(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }

/* IEEE half -> float, exact, subnormals included */
static inline float half_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    if (exponent == 0x1F) return bits_float(sign | 0x7F800000u | (mantissa << 13));
    if (exponent == 0) {
        if (mantissa == 0) return bits_float(sign);
        /* subnormal: mantissa * 2^-24, a float32 normal */
        const float magnitude = (float)mantissa * bits_float(0x33800000u);
        return sign ? -magnitude : magnitude;
    }
    return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

/* E8M0 byte e -> 2^(e - 128), half the MX scale (the codes below are doubled: all integers) */
static inline float e8m0_half(uint8_t e) {
    return e >= 2 ? bits_float((uint32_t)(e - 1) << 23) : bits_float(0x00200000u << e);
}

/* scale g of row n, `type` a constant where it is inlined */
static inline __attribute__((always_inline)) float scale_of(const pmatrix *w, const int type, int64_t n, int64_t g) {
    const uint8_t *base = (const uint8_t *)w->scales;
    switch (type) {
    case SCALE_BF16: { uint16_t v; memcpy(&v, base + 2 * (n * w->scale_stride + g), 2); return bits_float((uint32_t)v << 16); }
    case SCALE_F16: { uint16_t v; memcpy(&v, base + 2 * (n * w->scale_stride + g), 2); return half_float(v); }
    case SCALE_F32: { float v; memcpy(&v, base + 4 * (n * w->scale_stride + g), 4); return v; }
    default: return e8m0_half(base[n * w->scale_stride + g]);
    }
}

/* E2M1 values doubled (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, times 2) */
static const int8_t MXFP4_DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* e4m3fn byte -> value / 256 as half bits: exact for every code, subnormals included (the NaN codes 0x7F and
   0xFF come out as +-480, which the loader refuses before they get here) */
static inline uint16_t fp8_half_bits(uint8_t b) { return (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7)); }

/* ---- decoding rows into float32 (the exact weights) ---- */

/* Row n's K 4-bit values, `format` and `type` constants in each instantiation below. */
static inline __attribute__((always_inline)) void decode4_row(const pmatrix *w, const int format, const int type,
                                                              int64_t n, float *out) {
    const uint8_t *codes = w->data + n * w->stride;
#ifdef PACKED_SIMD
    const __m128i nibble = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i table = _mm_loadu_si128((const __m128i *)MXFP4_DOUBLED);
#endif
    for (int64_t k0 = 0; k0 < w->cols; k0 += 32) {
        const float s0 = scale_of(w, type, n, k0 / w->group), s1 = scale_of(w, type, n, (k0 + 16) / w->group);
#ifdef PACKED_SIMD
        /* the 32 codes in element order (byte j: element 2j low, 2j + 1 high), then their int8 values */
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + k0 / 2));
        const __m128i lo = _mm_and_si128(bytes, nibble), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
        __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);
        if (format == PACKED_INT4) {
            a = _mm_sub_epi8(a, eight);
            b = _mm_sub_epi8(b, eight);
        } else {
            a = _mm_shuffle_epi8(table, a);
            b = _mm_shuffle_epi8(table, b);
        }
#ifdef DELTAFIN_VARIANT_AVX512
        _mm512_storeu_ps(out + k0, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)), _mm512_set1_ps(s0)));
        _mm512_storeu_ps(out + k0 + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(s1)));
#else
        const __m256 v0 = _mm256_set1_ps(s0), v1 = _mm256_set1_ps(s1);
        _mm256_storeu_ps(out + k0, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)), v0));
        _mm256_storeu_ps(out + k0 + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))), v0));
        _mm256_storeu_ps(out + k0 + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), v1));
        _mm256_storeu_ps(out + k0 + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), v1));
#endif
#else
        for (int i = 0; i < 32; i++) {
            const int u = (codes[(k0 + i) / 2] >> (4 * (i & 1))) & 0x0F;
            const int v = format == PACKED_INT4 ? u - 8 : MXFP4_DOUBLED[u];
            out[k0 + i] = (float)v * (i < 16 ? s0 : s1);
        }
#endif
    }
}

static void decode_int4_bf16(const pmatrix *w, int64_t n, float *out) { decode4_row(w, PACKED_INT4, SCALE_BF16, n, out); }
static void decode_int4_f16(const pmatrix *w, int64_t n, float *out) { decode4_row(w, PACKED_INT4, SCALE_F16, n, out); }
static void decode_int4_f32(const pmatrix *w, int64_t n, float *out) { decode4_row(w, PACKED_INT4, SCALE_F32, n, out); }
static void decode_mxfp4(const pmatrix *w, int64_t n, float *out) { decode4_row(w, PACKED_MXFP4, SCALE_E8M0, n, out); }

/* the block-grid row of weight row n (parts of part_rows rows, each its own grid) */
static inline int64_t fp8_grid_row(const pmatrix *w, int64_t n) {
    const int64_t per_part = (w->part_rows + w->block_n - 1) / w->block_n;
    return (n / w->part_rows) * per_part + (n % w->part_rows) / w->block_n;
}

static inline float fp8_value(uint8_t b) { return half_float(fp8_half_bits(b)) * 256.0f; }

static void decode_fp8_row(const pmatrix *w, int64_t n, float *out) {
    const uint8_t *bytes = w->data + n * w->stride;
    const float *grid = (const float *)w->scales + fp8_grid_row(w, n) * w->scale_stride;
    for (int64_t kb = 0; kb * w->block_k < w->cols; kb++) {
        const int64_t start = kb * w->block_k;
        const int64_t end = start + w->block_k < w->cols ? start + w->block_k : w->cols;
        const float s = grid[kb];
        int64_t k = start;
#ifdef PACKED_SIMD
        /* (value / 256) * (256 * s): the same real product as value * s, so the same rounding */
        const float s256 = 256.0f * s;
        for (; k + 16 <= end; k += 16) {
            const __m256i b16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(bytes + k)));
            const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b16, _mm256_set1_epi16(0x80)), 8),
                                              _mm256_slli_epi16(_mm256_and_si256(b16, _mm256_set1_epi16(0x7F)), 7));
#ifdef DELTAFIN_VARIANT_AVX512
            _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(s256)));
#else
            const __m256 vs = _mm256_set1_ps(s256);
            _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), vs));
            _mm256_storeu_ps(out + k + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), vs));
#endif
        }
#endif
        for (; k < end; k++) out[k] = fp8_value(bytes[k]) * s;
    }
}

/* weight row n, all K values, into out (then zeros up to a multiple of 16) */
static void decode_row(const pmatrix *w, int64_t n, float *out) {
    if (w->format == PACKED_FP8) decode_fp8_row(w, n, out);
    else if (w->format == PACKED_MXFP4) decode_mxfp4(w, n, out);
    else if (w->scale_type == SCALE_BF16) decode_int4_bf16(w, n, out);
    else if (w->scale_type == SCALE_F16) decode_int4_f16(w, n, out);
    else decode_int4_f32(w, n, out);
    for (int64_t k = w->cols; k % LANES; k++) out[k] = 0.0f;
}

/* ---- decoded rows times activation rows: the 16-lane sums ---- */

static inline float total_of_lanes(const float *l) {
    float t8[8], t4[4], t2[2];
    for (int i = 0; i < 8; i++) t8[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) t4[i] = t8[i] + t8[i + 4];
    for (int i = 0; i < 2; i++) t2[i] = t4[i] + t4[i + 2];
    return t2[0] + t2[1];
}

/* out[i * mb + j] = decoded row i . activation row j, for i < NB, j < MB (constants at each call site).
   `w` rows are `kp` floats (zero-padded); x rows are `k` floats, `ldx` apart. */
static inline __attribute__((always_inline)) void tile_dot(const int NB, const int MB, const float *w, int64_t kp,
                                                           const float *x, int64_t ldx, int64_t k, float *out) {
#if defined(DELTAFIN_VARIANT_AVX512)
    const int64_t full = k / LANES * LANES;
    __m512 acc[TILE][TILE];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c <= full; c += LANES) {
        if (c == k) break;
        const __mmask16 mask = c < full ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - full)) - 1u);
        __m512 xv[TILE];
        for (int j = 0; j < MB; j++) xv[j] = _mm512_maskz_loadu_ps(mask, x + j * ldx + c);
        for (int i = 0; i < NB; i++) {
            const __m512 wv = _mm512_loadu_ps(w + i * kp + c);
            for (int j = 0; j < MB; j++) acc[i][j] = _mm512_add_ps(acc[i][j], _mm512_mul_ps(wv, xv[j]));
        }
    }
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) {
            float l[LANES];
            _mm512_storeu_ps(l, acc[i][j]);
            out[i * MB + j] = total_of_lanes(l);
        }
#elif defined(DELTAFIN_VARIANT_AVX2)
    const int64_t full = k / LANES * LANES;
    __m256 lo[TILE][TILE], hi[TILE][TILE];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) lo[i][j] = hi[i][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c <= full; c += LANES) {
        if (c == k) break;
        __m256 xl[TILE], xh[TILE];
        if (c < full) {
            for (int j = 0; j < MB; j++) {
                xl[j] = _mm256_loadu_ps(x + j * ldx + c);
                xh[j] = _mm256_loadu_ps(x + j * ldx + c + 8);
            }
        } else {
            const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i ml = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(k - full)), index);
            const __m256i mh = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(k - full) - 8), index);
            for (int j = 0; j < MB; j++) {
                xl[j] = _mm256_maskload_ps(x + j * ldx + c, ml);
                xh[j] = _mm256_maskload_ps(x + j * ldx + c + 8, mh);
            }
        }
        for (int i = 0; i < NB; i++) {
            const __m256 wl = _mm256_loadu_ps(w + i * kp + c), wh = _mm256_loadu_ps(w + i * kp + c + 8);
            for (int j = 0; j < MB; j++) {
                lo[i][j] = _mm256_add_ps(lo[i][j], _mm256_mul_ps(wl, xl[j]));
                hi[i][j] = _mm256_add_ps(hi[i][j], _mm256_mul_ps(wh, xh[j]));
            }
        }
    }
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) {
            float l[LANES];
            _mm256_storeu_ps(l, lo[i][j]);
            _mm256_storeu_ps(l + 8, hi[i][j]);
            out[i * MB + j] = total_of_lanes(l);
        }
#else
    float acc[TILE][TILE][LANES];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++)
            for (int l = 0; l < LANES; l++) acc[i][j][l] = 0.0f;
    for (int64_t c = 0; c < k; c += LANES) {
        float xv[TILE][LANES];
        for (int j = 0; j < MB; j++)
            for (int l = 0; l < LANES; l++) xv[j][l] = c + l < k ? x[j * ldx + c + l] : 0.0f;
        for (int i = 0; i < NB; i++)
            for (int j = 0; j < MB; j++)
                for (int l = 0; l < LANES; l++) acc[i][j][l] = acc[i][j][l] + w[i * kp + c + l] * xv[j][l];
    }
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) out[i * MB + j] = total_of_lanes(acc[i][j]);
#endif
}

static void tile_44(const float *w, int64_t kp, const float *x, int64_t ldx, int64_t k, float *out) { tile_dot(4, 4, w, kp, x, ldx, k, out); }
static void tile_41(const float *w, int64_t kp, const float *x, int64_t ldx, int64_t k, float *out) { tile_dot(4, 1, w, kp, x, ldx, k, out); }
static void tile_14(const float *w, int64_t kp, const float *x, int64_t ldx, int64_t k, float *out) { tile_dot(1, 4, w, kp, x, ldx, k, out); }
static void tile_11(const float *w, int64_t kp, const float *x, int64_t ldx, int64_t k, float *out) { tile_dot(1, 1, w, kp, x, ldx, k, out); }

/* Weight rows n0 .. n0 + nb (nb <= TILE) against every activation row; `scratch` holds TILE decoded rows. */
static void rows_times(const pmatrix *w, int64_t n0, int nb, const float *x, int64_t m_rows, int64_t ldx,
                       const float *bias, float *y, int64_t ldy, float *scratch, int64_t kp) {
    for (int i = 0; i < nb; i++) decode_row(w, n0 + i, scratch + i * kp);
    float out[TILE * TILE];
    for (int64_t m = 0; m < m_rows;) {
        const int mb = m_rows - m >= TILE ? TILE : 1;
        const float *xm = x + m * ldx;
        if (nb == TILE) {
            if (mb == TILE) tile_44(scratch, kp, xm, ldx, w->cols, out);
            else tile_41(scratch, kp, xm, ldx, w->cols, out);
            for (int i = 0; i < TILE; i++)
                for (int j = 0; j < mb; j++) y[(m + j) * ldy + n0 + i] = out[i * mb + j];
        } else {
            for (int i = 0; i < nb; i++) {
                if (mb == TILE) tile_14(scratch + i * kp, kp, xm, ldx, w->cols, out);
                else tile_11(scratch + i * kp, kp, xm, ldx, w->cols, out);
                for (int j = 0; j < mb; j++) y[(m + j) * ldy + n0 + i] = out[j];
            }
        }
        if (bias)
            for (int j = 0; j < mb; j++)
                for (int i = 0; i < nb; i++) y[(m + j) * ldy + n0 + i] += bias[n0 + i];
        m += mb;
    }
}

static int64_t padded(int64_t k) { return (k + LANES - 1) / LANES * LANES; }

static int valid(const pmatrix *w) {
    if (w->rows < 0 || w->cols <= 0) return 0;
    switch (w->format) {
    case PACKED_INT4:
        if (w->scale_type != SCALE_BF16 && w->scale_type != SCALE_F16 && w->scale_type != SCALE_F32) return 0;
        return w->cols % 32 == 0 && w->group > 0 && w->group % 16 == 0 && w->cols % w->group == 0;
    case PACKED_MXFP4:
        return w->scale_type == SCALE_E8M0 && w->group == 32 && w->cols % 32 == 0;
    case PACKED_FP8:
        return w->block_n > 0 && w->block_k > 0 && w->part_rows > 0;
    default:
        return 0;
    }
}

/* Below this many multiply-adds a call runs on one thread: a parallel region's start and end cost more than
   they save on a decode step's expert (~1.5M), and on a busy machine a team waits for its slowest member's
   core (measured on 2 shared cores: a decode step of 32 experts took 6x the CPU on two threads). */
#define PARALLEL_WORK 8000000

/* `groups` matrices of one shape and format (the experts of a layer: one slot each), group g's weights at
   data[g] / scales[g], its m_rows[g] activation rows at x[g] (rows ldx apart), its outputs at y[g] (ldy
   apart): one parallel region over every (group, block of TILE weight rows). */
static int matmul_groups(const pmatrix *shape, int64_t groups, const uint8_t *const *data, const void *const *scales,
                         const float *const *x, const int64_t *m_rows, int64_t ldx, const float *bias,
                         float *const *y, int64_t ldy, int threads) {
    if (!valid(shape) || groups < 0) return -1;
    int64_t rows_in = 0;
    for (int64_t g = 0; g < groups; g++) {
        if (m_rows[g] < 0) return -1;
        rows_in += m_rows[g];
    }
    if (rows_in == 0 || shape->rows == 0) return 0;
    const int64_t kp = padded(shape->cols), blocks = (shape->rows + TILE - 1) / TILE;
    if ((double)rows_in * (double)shape->rows * (double)shape->cols < PARALLEL_WORK) threads = 1;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *scratch = aligned_alloc(64, (size_t)(TILE * kp) * sizeof(float));
        if (!scratch) {
            #pragma omp atomic write
            failed = 1;
        }
        /* every thread meets the loop (a work-sharing construct), with memory or not */
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < groups * blocks; item++) {
            const int64_t g = item / blocks, n0 = (item % blocks) * TILE;
            if (!scratch || m_rows[g] == 0) continue;
            pmatrix w = *shape;
            w.data = data[g];
            w.scales = scales[g];
            const int nb = w.rows - n0 < TILE ? (int)(w.rows - n0) : TILE;
            rows_times(&w, n0, nb, x[g], m_rows[g], ldx, bias, y[g], ldy, scratch, kp);
        }
        free(scratch);
    }
    return failed ? -2 : 0;
}

static int matmul(const pmatrix *w, const float *x, int64_t m_rows, int64_t ldx, const float *bias, float *y,
                  int64_t ldy, int threads) {
    const void *scales = w->scales;
    return matmul_groups(w, 1, &w->data, &scales, &x, &m_rows, ldx, bias, &y, ldy, threads);
}

static int dequantize(const pmatrix *w, const int64_t *ids, int64_t count, float *out) {
    if (!valid(w)) return -1;
    const int64_t kp = padded(w->cols);
    float *row = aligned_alloc(64, (size_t)kp * sizeof(float));
    if (!row) return -2;
    for (int64_t r = 0; r < count; r++) {
        if (ids[r] < 0 || ids[r] >= w->rows) { free(row); return -1; }
        decode_row(w, ids[r], row);
        memcpy(out + r * w->cols, row, (size_t)w->cols * sizeof(float));
    }
    free(row);
    return 0;
}

/* ---- entry points (0: done; -1: arguments this kernel does not take; -2: no memory) ---- */

/* y[m * ldy + n] = sum_k x[m * ldx + k] * W[n, k] (+ bias[n]) for m < m_rows, n < n_rows; W from 4-bit
   `codes` (row n at n * codes_stride bytes) and `scales` (row n at n * scales_stride elements of scale_type),
   one scale per `group` values. format PACKED_INT4 (scales bf16 / f16 / f32, group a multiple of 16
   dividing k) or PACKED_MXFP4 (E8M0 scales, group 32); k a multiple of 32. */
int deltafin_packed4_matmul(const float *x, int64_t m_rows, int64_t ldx, int64_t k, const uint8_t *codes,
                            int64_t codes_stride, const void *scales, int scale_type, int64_t scales_stride,
                            int64_t group, int format, int64_t n_rows, const float *bias, float *y, int64_t ldy,
                            int threads) {
    const pmatrix w = {format, n_rows, k, codes, codes_stride, scales, scale_type, scales_stride, group, 0, 0, 0};
    if (format != PACKED_INT4 && format != PACKED_MXFP4) return -1;
    return matmul(&w, x, m_rows, ldx, bias, y, ldy, threads);
}

int deltafin_packed4_dequantize(const uint8_t *codes, int64_t codes_stride, const void *scales, int scale_type,
                                int64_t scales_stride, int64_t group, int format, int64_t k, int64_t n_rows,
                                const int64_t *ids, int64_t count, float *out) {
    const pmatrix w = {format, n_rows, k, codes, codes_stride, scales, scale_type, scales_stride, group, 0, 0, 0};
    if (format != PACKED_INT4 && format != PACKED_MXFP4) return -1;
    return dequantize(&w, ids, count, out);
}

/* The same for e4m3fn `weights` (row n at n * w_stride bytes) with float32 `scale_inv` (grid row r at
   r * scale_stride), blocks of block_n x block_k, parts of part_rows rows each with its own grid; any k. */
int deltafin_fp8_matmul(const float *x, int64_t m_rows, int64_t ldx, int64_t k, const uint8_t *weights,
                        int64_t w_stride, const float *scale_inv, int64_t scale_stride, int64_t block_n,
                        int64_t block_k, int64_t part_rows, int64_t n_rows, const float *bias, float *y,
                        int64_t ldy, int threads) {
    const pmatrix w = {PACKED_FP8, n_rows, k, weights, w_stride, scale_inv, SCALE_F32, scale_stride, 0,
                       block_n, block_k, part_rows};
    return matmul(&w, x, m_rows, ldx, bias, y, ldy, threads);
}

int deltafin_fp8_dequantize(const uint8_t *weights, int64_t w_stride, const float *scale_inv, int64_t scale_stride,
                            int64_t block_n, int64_t block_k, int64_t part_rows, int64_t k, int64_t n_rows,
                            const int64_t *ids, int64_t count, float *out) {
    const pmatrix w = {PACKED_FP8, n_rows, k, weights, w_stride, scale_inv, SCALE_F32, scale_stride, 0,
                       block_n, block_k, part_rows};
    return dequantize(&w, ids, count, out);
}

/* Several matrices of one shape and format at once (a layer's experts, one per slot): group g is
   (codes[g], scales[g]) times its m_rows[g] rows at x[g] into y[g]; the other arguments as above, shared.
   Each output gets the bits a call of its own would give. */
int deltafin_packed4_grouped(int64_t groups, const float *const *x, const int64_t *m_rows, int64_t ldx, int64_t k,
                             const uint8_t *const *codes, int64_t codes_stride, const void *const *scales,
                             int scale_type, int64_t scales_stride, int64_t group, int format, int64_t n_rows,
                             float *const *y, int64_t ldy, int threads) {
    const pmatrix w = {format, n_rows, k, NULL, codes_stride, NULL, scale_type, scales_stride, group, 0, 0, 0};
    if (format != PACKED_INT4 && format != PACKED_MXFP4) return -1;
    return matmul_groups(&w, groups, codes, scales, x, m_rows, ldx, NULL, y, ldy, threads);
}

int deltafin_fp8_grouped(int64_t groups, const float *const *x, const int64_t *m_rows, int64_t ldx, int64_t k,
                         const uint8_t *const *weights, int64_t w_stride, const void *const *scale_inv,
                         int64_t scale_stride, int64_t block_n, int64_t block_k, int64_t part_rows, int64_t n_rows,
                         float *const *y, int64_t ldy, int threads) {
    const pmatrix w = {PACKED_FP8, n_rows, k, NULL, w_stride, NULL, SCALE_F32, scale_stride, 0,
                       block_n, block_k, part_rows};
    return matmul_groups(&w, groups, weights, scale_inv, x, m_rows, ldx, NULL, y, ldy, threads);
}

/* Which variant this library was built as: 0 portable, 1 AVX2, 2 AVX-512. */
int deltafin_packed_variant(void) {
#if defined(DELTAFIN_VARIANT_AVX512)
    return 2;
#elif defined(DELTAFIN_VARIANT_AVX2)
    return 1;
#else
    return 0;
#endif
}
