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
   every variant), and every output is

       y[m, n] = sum over k of w[n, k] * x[m, k]  in 16 lanes, each lane a running sum in k order of separate
                 multiplies and adds (no FMA: built -ffp-contract=off), the lanes summed (l + l+8), then (+4),
                 (+2), (+1);
                 4-bit: element k goes to lane (k % 32) / 2 (the two elements of a byte share a lane, so a
                 byte's nibbles decode in place, without a shuffle across lanes); fp8: lane k % 16

   one fixed order whatever the CPU variant, the thread count or the other rows of the call: the portable
   build, the AVX2 build (two 8-lane registers per 16 lanes) and the AVX-512 build (one register) give the same
   bits, and a row gets the same bits alone or in a batch. A width that is not a multiple of 16 (fp8 only)
   ends with a partial chunk whose missing lanes add 0 * 0 in every variant.

   4-bit weights against a few activation rows (a decode step: one to four rows per matrix) are decoded in
   registers and multiplied there, block by block, never stored (fused_tile); against more rows, a few weight
   rows at a time are decoded into a per-thread buffer and shared by every activation row (tile_dot), as fp8
   rows always are. The activations go in lane order once per call (lane_order), so both paths read them
   with plain loads.

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


/* e4m3fn byte -> value / 256 as half bits: exact for every code, subnormals included (the NaN codes 0x7F and
   0xFF come out as +-480, which the loader refuses before they get here) */
static inline uint16_t fp8_half_bits(uint8_t b) { return (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7)); }

/* ---- 4-bit blocks: the exact weights in lane order ---- */

/* The decoded values indexed by the 4-bit code: int4's u - 8, MXFP4's E2M1 values doubled (0, 0.5, 1, 1.5, 2,
   3, 4, 6 and their negatives, times 2: integers, scaled by half the MX scale); AVX2 looks them up as int8 */
#if defined(DELTAFIN_VARIANT_AVX2) && !defined(DELTAFIN_VARIANT_AVX512)
static const int8_t MXFP4_DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#else
static const float INT4_VALUES[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
static const float MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#endif

/* A 32-value block of a 4-bit row holds element k0 + 2i in the low nibble of byte i and k0 + 2i + 1 in its
   high nibble: lane i of the 16 lanes takes both (see the header), so a block decodes without moving a nibble
   across lanes into `even` (lane i: element k0 + 2i) and `odd` (k0 + 2i + 1). Each is code value x scale,
   exact (int4 with a float32 scale: one IEEE product, the same in every variant); lanes 0-7 are the block's
   first 16 elements (scale s0), lanes 8-15 its last 16 (s1, another group where the group is 16 or 48). */
#if defined(DELTAFIN_VARIANT_AVX512)
typedef struct { __m512 even, odd; } block4;

static inline __attribute__((always_inline)) block4 decode4_block(const pmatrix *w, const int format, const int type,
                                                                  int64_t n, int64_t k0, const __m512 values) {
    block4 b;
    /* byte i in lane i: the permutes read its low 4 bits (the even element), the shifted copy its high ones */
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w->data + n * w->stride + k0 / 2)));
    const __m512i high = _mm512_srli_epi32(bytes, 4);
    const int64_t g0 = k0 / w->group, g1 = (k0 + 16) / w->group;
    if (format == PACKED_MXFP4 || g0 == g1) {
        /* one scale: scale the 16 values once, then every lookup is a weight */
        const __m512 scaled = _mm512_mul_ps(values, _mm512_set1_ps(scale_of(w, type, n, g0)));
        b.even = _mm512_permutexvar_ps(bytes, scaled);
        b.odd = _mm512_permutexvar_ps(high, scaled);
    } else {
        const __m512 s = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(scale_of(w, type, n, g0)),
                                              _mm512_set1_ps(scale_of(w, type, n, g1)));
        b.even = _mm512_mul_ps(_mm512_permutexvar_ps(bytes, values), s);
        b.odd = _mm512_mul_ps(_mm512_permutexvar_ps(high, values), s);
    }
    return b;
}
#elif defined(DELTAFIN_VARIANT_AVX2)
typedef struct { __m256 even_lo, even_hi, odd_lo, odd_hi; } block4;

static inline __attribute__((always_inline)) block4 decode4_block(const pmatrix *w, const int format, const int type,
                                                                  int64_t n, int64_t k0, const __m128i table) {
    block4 b;
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(w->data + n * w->stride + k0 / 2));
    __m128i lo = _mm_and_si128(bytes, nibble), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    if (format == PACKED_INT4) {
        lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
        hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    } else {  /* the doubled E2M1 values as int8 */
        lo = _mm_shuffle_epi8(table, lo);
        hi = _mm_shuffle_epi8(table, hi);
    }
    const float s0 = scale_of(w, type, n, k0 / w->group);
    const float s1 = format == PACKED_MXFP4 ? s0 : scale_of(w, type, n, (k0 + 16) / w->group);
    const __m256 v0 = _mm256_set1_ps(s0), v1 = _mm256_set1_ps(s1);
    b.even_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), v0);
    b.even_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), v1);
    b.odd_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), v0);
    b.odd_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), v1);
    return b;
}
#else
typedef struct { float even[LANES], odd[LANES]; } block4;

static inline __attribute__((always_inline)) block4 decode4_block(const pmatrix *w, const int format, const int type,
                                                                  int64_t n, int64_t k0, const float *values) {
    block4 b;
    const uint8_t *bytes = w->data + n * w->stride + k0 / 2;
    const float s0 = scale_of(w, type, n, k0 / w->group);
    const float s1 = format == PACKED_MXFP4 ? s0 : scale_of(w, type, n, (k0 + 16) / w->group);
    for (int i = 0; i < LANES; i++) {
        b.even[i] = values[bytes[i] & 0x0F] * (i < 8 ? s0 : s1);
        b.odd[i] = values[bytes[i] >> 4] * (i < 8 ? s0 : s1);
    }
    return b;
}
#endif

/* the decode table of a format: a register where the variant has one */
#if defined(DELTAFIN_VARIANT_AVX512)
typedef __m512 table4;
static inline table4 table_of(const int format) { return _mm512_loadu_ps(format == PACKED_INT4 ? INT4_VALUES : MXFP4_VALUES); }
#elif defined(DELTAFIN_VARIANT_AVX2)
typedef __m128i table4;
static inline table4 table_of(const int format) { (void)format; return _mm_loadu_si128((const __m128i *)MXFP4_DOUBLED); }
#else
typedef const float *table4;
static inline table4 table_of(const int format) { return format == PACKED_INT4 ? INT4_VALUES : MXFP4_VALUES; }
#endif

/* Row n's K 4-bit values in lane order (block k0: its even elements at k0 .. k0 + 15, its odd ones at
   k0 + 16 .. k0 + 31), for the rows a batch of many activation rows shares. */
static inline __attribute__((always_inline)) void decode4_row(const pmatrix *w, const int format, const int type,
                                                              int64_t n, float *out) {
    const table4 table = table_of(format);
    for (int64_t k0 = 0; k0 < w->cols; k0 += 32) {
        const block4 b = decode4_block(w, format, type, n, k0, table);
#if defined(DELTAFIN_VARIANT_AVX512)
        _mm512_storeu_ps(out + k0, b.even);
        _mm512_storeu_ps(out + k0 + 16, b.odd);
#elif defined(DELTAFIN_VARIANT_AVX2)
        _mm256_storeu_ps(out + k0, b.even_lo);
        _mm256_storeu_ps(out + k0 + 8, b.even_hi);
        _mm256_storeu_ps(out + k0 + 16, b.odd_lo);
        _mm256_storeu_ps(out + k0 + 24, b.odd_hi);
#else
        memcpy(out + k0, b.even, sizeof b.even);
        memcpy(out + k0 + 16, b.odd, sizeof b.odd);
#endif
    }
}

static void decode_int4_bf16(const pmatrix *w, int64_t n, float *out) { decode4_row(w, PACKED_INT4, SCALE_BF16, n, out); }
static void decode_int4_f16(const pmatrix *w, int64_t n, float *out) { decode4_row(w, PACKED_INT4, SCALE_F16, n, out); }
static void decode_int4_f32(const pmatrix *w, int64_t n, float *out) { decode4_row(w, PACKED_INT4, SCALE_F32, n, out); }
static void decode_mxfp4(const pmatrix *w, int64_t n, float *out) { decode4_row(w, PACKED_MXFP4, SCALE_E8M0, n, out); }

/* Activation rows in the 4-bit lane order (each block of 32: its even elements, then its odd ones): rows
   `ldx` apart in, `k` apart out. */
static void lane_order(const float *x, int64_t m_rows, int64_t ldx, int64_t k, float *out) {
    for (int64_t m = 0; m < m_rows; m++)
        for (int64_t k0 = 0; k0 < k; k0 += 32)
            for (int i = 0; i < 16; i++) {
                out[m * k + k0 + i] = x[m * ldx + k0 + 2 * i];
                out[m * k + k0 + 16 + i] = x[m * ldx + k0 + 2 * i + 1];
            }
}

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

/* The tiles' last step: out[i * MB + j] = the total of accumulator (i, j)'s 16 lanes (AVX2 keeps them as two
   halves of 8), the same order in every variant. */
#if defined(DELTAFIN_VARIANT_AVX512)
static inline __attribute__((always_inline)) void lane_totals(const int NB, const int MB, __m512 acc[TILE][TILE],
                                                              float *out) {
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) {
            float l[LANES];
            _mm512_storeu_ps(l, acc[i][j]);
            out[i * MB + j] = total_of_lanes(l);
        }
}
#elif defined(DELTAFIN_VARIANT_AVX2)
static inline __attribute__((always_inline)) void lane_totals(const int NB, const int MB, __m256 lo[TILE][TILE],
                                                              __m256 hi[TILE][TILE], float *out) {
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) {
            float l[LANES];
            _mm256_storeu_ps(l, lo[i][j]);
            _mm256_storeu_ps(l + 8, hi[i][j]);
            out[i * MB + j] = total_of_lanes(l);
        }
}
#else
static inline __attribute__((always_inline)) void lane_totals(const int NB, const int MB,
                                                              float acc[TILE][TILE][LANES], float *out) {
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) out[i * MB + j] = total_of_lanes(acc[i][j]);
}
#endif

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
    lane_totals(NB, MB, acc, out);
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
    lane_totals(NB, MB, lo, hi, out);
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
    lane_totals(NB, MB, acc, out);
#endif
}

static void tile_44(const float *w, int64_t kp, const float *x, int64_t ldx, int64_t k, float *out) { tile_dot(4, 4, w, kp, x, ldx, k, out); }
static void tile_41(const float *w, int64_t kp, const float *x, int64_t ldx, int64_t k, float *out) { tile_dot(4, 1, w, kp, x, ldx, k, out); }
static void tile_14(const float *w, int64_t kp, const float *x, int64_t ldx, int64_t k, float *out) { tile_dot(1, 4, w, kp, x, ldx, k, out); }
static void tile_11(const float *w, int64_t kp, const float *x, int64_t ldx, int64_t k, float *out) { tile_dot(1, 1, w, kp, x, ldx, k, out); }

/* ---- 4-bit rows times a few activation rows, decoded in registers ---- */

/* Weight rows this far below the ones being multiplied are fetched into the cache ahead of use, a cache line
   (128 codes) at a time: one core's demand misses alone leave memory idle between them (measured on the bench
   model's experts, one activation row each: 1.2-1.8x). */
#define PREFETCH_ROWS (2 * TILE)

static inline void prefetch_ahead(const pmatrix *w, int64_t n0, int nb, int64_t k0) {
    if (k0 % 128) return;
    for (int i = 0; i < nb && n0 + i + PREFETCH_ROWS < w->rows; i++)
        __builtin_prefetch(w->data + (n0 + i + PREFETCH_ROWS) * w->stride + k0 / 2);
}

/* out[i * MB + j] = 4-bit row n0 + i . activation row j (lane order, `ldx` apart), for i < NB, j < MB: each
   block decoded into registers and multiplied there (the decode step's case, a row or a few per expert,
   where a decoded row would be stored and loaded once for one use). The same products added to the same
   lanes in the same order as tile_dot over decode4_row's rows: the same bits. */
static inline __attribute__((always_inline)) void fused_tile(const pmatrix *w, const int format, const int type,
                                                             const int NB, const int MB, int64_t n0, const float *x,
                                                             int64_t ldx, float *out) {
    const table4 table = table_of(format);
#if defined(DELTAFIN_VARIANT_AVX512)
    __m512 acc[TILE][TILE];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < w->cols; k0 += 32) {
        __m512 xe[TILE], xo[TILE];
        for (int j = 0; j < MB; j++) {
            xe[j] = _mm512_loadu_ps(x + j * ldx + k0);
            xo[j] = _mm512_loadu_ps(x + j * ldx + k0 + 16);
        }
        prefetch_ahead(w, n0, NB, k0);
        for (int i = 0; i < NB; i++) {
            const block4 b = decode4_block(w, format, type, n0 + i, k0, table);
            for (int j = 0; j < MB; j++) {
                acc[i][j] = _mm512_add_ps(acc[i][j], _mm512_mul_ps(b.even, xe[j]));
                acc[i][j] = _mm512_add_ps(acc[i][j], _mm512_mul_ps(b.odd, xo[j]));
            }
        }
    }
    lane_totals(NB, MB, acc, out);
#elif defined(DELTAFIN_VARIANT_AVX2)
    __m256 lo[TILE][TILE], hi[TILE][TILE];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) lo[i][j] = hi[i][j] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < w->cols; k0 += 32) {
        prefetch_ahead(w, n0, NB, k0);
        for (int i = 0; i < NB; i++) {
            const block4 b = decode4_block(w, format, type, n0 + i, k0, table);
            for (int j = 0; j < MB; j++) {
                const float *xj = x + j * ldx + k0;
                lo[i][j] = _mm256_add_ps(lo[i][j], _mm256_mul_ps(b.even_lo, _mm256_loadu_ps(xj)));
                hi[i][j] = _mm256_add_ps(hi[i][j], _mm256_mul_ps(b.even_hi, _mm256_loadu_ps(xj + 8)));
                lo[i][j] = _mm256_add_ps(lo[i][j], _mm256_mul_ps(b.odd_lo, _mm256_loadu_ps(xj + 16)));
                hi[i][j] = _mm256_add_ps(hi[i][j], _mm256_mul_ps(b.odd_hi, _mm256_loadu_ps(xj + 24)));
            }
        }
    }
    lane_totals(NB, MB, lo, hi, out);
#else
    float acc[TILE][TILE][LANES];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++)
            for (int l = 0; l < LANES; l++) acc[i][j][l] = 0.0f;
    for (int64_t k0 = 0; k0 < w->cols; k0 += 32) {
        prefetch_ahead(w, n0, NB, k0);
        for (int i = 0; i < NB; i++) {
            const block4 b = decode4_block(w, format, type, n0 + i, k0, table);
            for (int j = 0; j < MB; j++)
                for (int l = 0; l < LANES; l++) {
                    acc[i][j][l] = acc[i][j][l] + b.even[l] * x[j * ldx + k0 + l];
                    acc[i][j][l] = acc[i][j][l] + b.odd[l] * x[j * ldx + k0 + 16 + l];
                }
        }
    }
    lane_totals(NB, MB, acc, out);
#endif
}

/* fused_tile for nb (<= TILE) rows and mb (1 .. TILE) activation rows, `format` and `type` constants */
static inline __attribute__((always_inline)) void fused_rows(const pmatrix *w, const int format, const int type,
                                                             int nb, int mb, int64_t n0, const float *x, int64_t ldx,
                                                             float *out) {
    if (nb == TILE) {
        switch (mb) {
        case 1: fused_tile(w, format, type, TILE, 1, n0, x, ldx, out); return;
        case 2: fused_tile(w, format, type, TILE, 2, n0, x, ldx, out); return;
        case 3: fused_tile(w, format, type, TILE, 3, n0, x, ldx, out); return;
        default: fused_tile(w, format, type, TILE, 4, n0, x, ldx, out); return;
        }
    }
    for (int i = 0; i < nb; i++) switch (mb) {
        case 1: fused_tile(w, format, type, 1, 1, n0 + i, x, ldx, out + i * mb); break;
        case 2: fused_tile(w, format, type, 1, 2, n0 + i, x, ldx, out + i * mb); break;
        case 3: fused_tile(w, format, type, 1, 3, n0 + i, x, ldx, out + i * mb); break;
        default: fused_tile(w, format, type, 1, 4, n0 + i, x, ldx, out + i * mb); break;
        }
}

static void fused_int4_bf16(const pmatrix *w, int nb, int mb, int64_t n0, const float *x, int64_t ldx, float *out) { fused_rows(w, PACKED_INT4, SCALE_BF16, nb, mb, n0, x, ldx, out); }
static void fused_int4_f16(const pmatrix *w, int nb, int mb, int64_t n0, const float *x, int64_t ldx, float *out) { fused_rows(w, PACKED_INT4, SCALE_F16, nb, mb, n0, x, ldx, out); }
static void fused_int4_f32(const pmatrix *w, int nb, int mb, int64_t n0, const float *x, int64_t ldx, float *out) { fused_rows(w, PACKED_INT4, SCALE_F32, nb, mb, n0, x, ldx, out); }
static void fused_mxfp4(const pmatrix *w, int nb, int mb, int64_t n0, const float *x, int64_t ldx, float *out) { fused_rows(w, PACKED_MXFP4, SCALE_E8M0, nb, mb, n0, x, ldx, out); }

/* 4-bit rows n0 .. n0 + nb against m_rows <= TILE activation rows (lane order), no row decoded to memory */
static void rows_times_fused(const pmatrix *w, int64_t n0, int nb, const float *x, int64_t m_rows, int64_t ldx,
                             const float *bias, float *y, int64_t ldy) {
    float out[TILE * TILE];
    const int mb = (int)m_rows;
    if (w->format == PACKED_MXFP4) fused_mxfp4(w, nb, mb, n0, x, ldx, out);
    else if (w->scale_type == SCALE_BF16) fused_int4_bf16(w, nb, mb, n0, x, ldx, out);
    else if (w->scale_type == SCALE_F16) fused_int4_f16(w, nb, mb, n0, x, ldx, out);
    else fused_int4_f32(w, nb, mb, n0, x, ldx, out);
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) {
            y[j * ldy + n0 + i] = out[i * mb + j];
            if (bias) y[j * ldy + n0 + i] += bias[n0 + i];
        }
}

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
    const int four_bit = shape->format != PACKED_FP8;
    /* 4-bit: every group's activation rows in lane order, `cols` apart (pointers per group) */
    float *lanes = NULL;
    const float **xs = NULL;
    if (four_bit) {
        const size_t bytes = (size_t)(rows_in * shape->cols) * sizeof(float);
        lanes = aligned_alloc(64, (bytes + 63) / 64 * 64);
        xs = malloc((size_t)groups * sizeof *xs);
        if (!lanes || !xs) {
            free(lanes);
            free(xs);
            return -2;
        }
        for (int64_t g = 0, at = 0; g < groups; at += m_rows[g], g++) {
            xs[g] = lanes + at * shape->cols;
            lane_order(x[g], m_rows[g], ldx, shape->cols, lanes + at * shape->cols);
        }
    }
    const int64_t ldx_in = four_bit ? shape->cols : ldx;
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
            const float *xg = four_bit ? xs[g] : x[g];
            if (four_bit && m_rows[g] <= TILE)
                rows_times_fused(&w, n0, nb, xg, m_rows[g], ldx_in, bias, y[g], ldy);
            else
                rows_times(&w, n0, nb, xg, m_rows[g], ldx_in, bias, y[g], ldy, scratch, kp);
        }
        free(scratch);
    }
    free(lanes);
    free(xs);
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
        float *to = out + r * w->cols;
        if (w->format == PACKED_FP8) {
            memcpy(to, row, (size_t)w->cols * sizeof(float));
            continue;
        }
        for (int64_t k0 = 0; k0 < w->cols; k0 += 32)  /* lane order back to element order */
            for (int i = 0; i < 16; i++) {
                to[k0 + 2 * i] = row[k0 + i];
                to[k0 + 2 * i + 1] = row[k0 + 16 + i];
            }
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
