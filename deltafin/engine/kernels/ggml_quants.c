/* GGUF's block-quantized weights (ggml's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the K-quants Q4_K, Q5_K, Q6_K)
   times float activations, in their stored form: no float copy of the weights is ever made.

   As llama.cpp does, the activations are quantized to 8 bits per block of 32 (one float scale per block and
   row: a row's bits never depend on the other rows), so a weight block times an activation block is an integer
   dot product (exact), scaled by two floats:

       contribution(block) = (d_w * d_x) * float(sum u*v - offset * sum v)  [+ (m_w * d_x) * float(sum v)]

   where u are the weight block's unsigned codes, v the activation's int8 codes, `offset` the format's zero
   point (8 for Q4_0, 16 for Q5_0, 0 otherwise) and m_w the block minimum of Q4_1 / Q5_1. The K-quants'
   super-blocks of 256 values are 8 such blocks (see "K-quants" below for the mapping).

   One summation order per output, whatever the CPU variant and the number of rows: block b's contribution is
   added to lane b % 8, and the eight lanes are summed as ((0+1)+(2+3))+((4+5)+(6+7)). The integer parts are
   exact, every float operation is the same IEEE operation in every variant (built with -ffp-contract=off and
   without reassociation), so the portable build, the AVX2 build and the AVX-512 build give the same bits,
   and a row gets the same bits alone or in a batch of any size.

   Variants (deltafin/engine/kernels/__init__.py builds each with its own flags and picks one at run time):
   DELTAFIN_VARIANT_AVX512 (AVX-512 F/BW/VL + VNNI: vpdpbusd), DELTAFIN_VARIANT_AVX2 (AVX2 + FMA + F16C:
   vpmaddubsw), neither: portable C. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(DELTAFIN_VARIANT_AVX2) || defined(DELTAFIN_VARIANT_AVX512)
#include <immintrin.h>
#define DELTAFIN_SIMD 1
#endif

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
       GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };
#define QK 32
#define QK_K 256  /* values of a K-quant super-block: 8 blocks of 32, one lane group */
#define LANES 8

/* ---- half precision (exact conversion, as ggml's scalar path) ---- */

static inline float fp32_from_bits(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t fp32_to_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

static inline float half_to_float(uint16_t h) {
#ifdef DELTAFIN_SIMD
    return _cvtsh_ss(h);  /* F16C: exact, as the portable conversion below */
#endif
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = 0xE0u << 23;
    const float exp_scale = fp32_from_bits(0x7800000u);
    const float normalized = fp32_from_bits((two_w >> 4) + exp_offset) * exp_scale;
    const uint32_t magic_mask = 126u << 23;
    const float magic_bias = 0.5f;
    const float denormalized = fp32_from_bits((two_w >> 17) | magic_mask) - magic_bias;
    const uint32_t denormalized_cutoff = 1u << 27;
    const uint32_t result = sign | (two_w < denormalized_cutoff ? fp32_to_bits(denormalized) : fp32_to_bits(normalized));
    return fp32_from_bits(result);
}

static inline uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t read_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* ---- formats ---- */

typedef struct {
    int64_t bytes;   /* per block of `values` (32; a K-quant's super-block: 256) */
    int32_t offset;  /* zero point subtracted from the codes (signed formats: 0) */
    int32_t has_min; /* Q4_1 / Q5_1 / Q4_K / Q5_K: w = d * u + m */
    int32_t values;  /* values per block: QK, or QK_K for the K-quants */
} format_info;

static int format_of(int type, format_info *f) {
    switch (type) {
    case GGML_Q4_0: *f = (format_info){18, 8, 0, QK}; return 1;
    case GGML_Q4_1: *f = (format_info){20, 0, 1, QK}; return 1;
    case GGML_Q5_0: *f = (format_info){22, 16, 0, QK}; return 1;
    case GGML_Q5_1: *f = (format_info){24, 0, 1, QK}; return 1;
    case GGML_Q8_0: *f = (format_info){34, 0, 0, QK}; return 1;
    case GGML_Q4_K: *f = (format_info){144, 0, 1, QK_K}; return 1;
    case GGML_Q5_K: *f = (format_info){176, 0, 1, QK_K}; return 1;
    case GGML_Q6_K: *f = (format_info){210, 0, 0, QK_K}; return 1;
    default: return 0;
    }
}

static inline int is_kquant(int type) { return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K; }

/* Block scale d and minimum m (0 where the format has none). */
static inline void block_scales(int type, const uint8_t *b, float *d, float *m) {
    *d = half_to_float(read_u16(b));
    *m = (type == GGML_Q4_1 || type == GGML_Q5_1) ? half_to_float(read_u16(b + 2)) : 0.0f;
}

/* The 32 codes of a block, portable C: unsigned 0..15 / 0..31 for Q4 / Q5, signed for Q8_0. */
static inline void unpack_codes(int type, const uint8_t *b, int16_t *u) {
    const uint8_t *qs;
    uint32_t qh = 0;
    switch (type) {
    case GGML_Q8_0:
        for (int i = 0; i < QK; i++) u[i] = (int8_t)b[2 + i];
        return;
    case GGML_Q4_0: qs = b + 2; break;
    case GGML_Q4_1: qs = b + 4; break;
    case GGML_Q5_0: qh = read_u32(b + 2); qs = b + 6; break;
    default /* Q5_1 */: qh = read_u32(b + 4); qs = b + 8; break;
    }
    for (int i = 0; i < 16; i++) {
        u[i] = (int16_t)((qs[i] & 0x0F) | (((qh >> i) & 1u) << 4));
        u[i + 16] = (int16_t)((qs[i] >> 4) | (((qh >> (i + 16)) & 1u) << 4));
    }
}

/* ---- K-quants (ggml's Q4_K, Q5_K, Q6_K): super-blocks of 256 values = 8 blocks of 32 = one lane group ----

   Layouts (ggml's block_q4_K / block_q5_K / block_q6_K; the `gguf` package's quants.py is the reference):
     Q4_K (144 bytes): half d, half dmin, scales[12] (eight 6-bit scales sc_j and mins m_j, packed as ggml's
                       get_scale_min_k4), qs[128]: block j's 4-bit codes are the low (j even) or high (j odd)
                       nibbles of qs[32 * (j / 2) .. + 32].
     Q5_K (176 bytes): as Q4_K, with qh[32] before qs: bit j of qh[i] is bit 4 of block j's code i.
     Q6_K (210 bytes): ql[128], qh[64], int8 scales[16], half d: value e (block j = e / 32) has the 4 low bits
                       of ql[64 * (j / 4) + 32 * (j % 2) + i] (high nibble where j % 4 >= 2), the 2 high bits
                       of qh[32 * (j / 4) + i] at bit 2 * (j % 4), a code q in 0..63, and w = d * scales[e / 16] * (q - 32).

   Mapped onto the blocks of 32 (block b of a row is block b % 8 of super-block b / 8, so the super-block is
   exactly the group of 8 lanes and the lane of a block is the same as for the other formats):
     Q4_K / Q5_K: w = (d * sc_j) * u - (dmin * m_j), u unsigned 0..15 / 0..31: Q4_1's term with
                  dw = d * sc_j and mw = -(dmin * m_j) (a half times a 6-bit integer: exact in float), so
                  term = (dw * dx) * float(sum u*v) + (mw * dx) * float(s), as block_term.
     Q6_K:        the codes are taken signed (q - 32, -32..31) and the block's two 16-value scales go into the
                  integer part: dot = sc_a * sum_{i<16} (q-32)*v + sc_b * sum_{i>=16} (q-32)*v (exact int32:
                  at most 2 * 128 * 16 * 32 * 127 in magnitude), term = (d * dx) * float(dot).
   Both are the same IEEE operations in every variant, as for the other formats. What differs is only how the
   exact integers and the (exact) scale products are obtained: portable C unpacks bytes (k_scales, k_codes);
   the SIMD builds unpack a super-block's codes and scales straight into registers (k_codes_simd,
   k_scales_simd), AVX-512 takes two blocks per vpdpbusd (and multiplies Q6_K's per-4-values sums by their
   scale), AVX2 applies Q6_K's scales in vpmaddwd. Dequantization gives gguf's values exactly:
   (d * sc_j) * u - dmin * m_j, and (d * scale) * (q - 32), both products exact in float.
   Measured (one thread, 2048 x 1536, this 2-core AVX-512 machine, best of 15): one row Q4_K 0.13 ms, Q5_K
   0.16, Q6_K 0.19, against Q4_1 0.17 and Q8_0 0.16; 16 rows 1.08 / 1.08 / 1.31 against 1.10 / 1.19. */

/* Scale and min of sub-block j (ggml's get_scale_min_k4). */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* A super-block's float factors: per block j, dw[j] and mw[j] (Q4_K / Q5_K: d * sc_j, -(dmin * m_j); Q6_K: d
   and 0), and Q6_K's 16 integer scales (sc16, else untouched). */
static inline void k_scales(int type, const uint8_t *b, float *dw, float *mw, int32_t *sc16) {
    if (type == GGML_Q6_K) {
        const float d = half_to_float(read_u16(b + 208));
        for (int j = 0; j < LANES; j++) { dw[j] = d; mw[j] = 0.0f; }
        for (int j = 0; j < 16; j++) sc16[j] = (int8_t)b[192 + j];
        return;
    }
    const float d = half_to_float(read_u16(b)), dmin = half_to_float(read_u16(b + 2));
    for (int j = 0; j < LANES; j++) {
        int sc, m;
        k_scale_min(b + 4, j, &sc, &m);
        dw[j] = d * (float)sc;
        mw[j] = -(dmin * (float)m);
    }
}

/* The codes of block j of a super-block, portable C: Q4_K / Q5_K unsigned, Q6_K signed (q - 32). */
static inline void k_codes(int type, const uint8_t *b, int j, int8_t *u) {
    if (type == GGML_Q6_K) {
        const uint8_t *ql = b + 64 * (j / 4) + 32 * (j % 2), *qh = b + 128 + 32 * (j / 4);
        const int low_shift = 4 * ((j % 4) / 2), high_shift = 2 * (j % 4);
        for (int i = 0; i < QK; i++)
            u[i] = (int8_t)((((ql[i] >> low_shift) & 0x0F) | (((qh[i] >> high_shift) & 3) << 4)) - 32);
        return;
    }
    const uint8_t *qs = b + (type == GGML_Q5_K ? 48 : 16) + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int i = 0; i < QK; i++) u[i] = (int8_t)((qs[i] >> shift) & 0x0F);
    if (type == GGML_Q5_K)
        for (int i = 0; i < QK; i++) u[i] = (int8_t)(u[i] | (((b[16 + i] >> j) & 1) << 4));
}

/* ---- activations: 8 bits per block of 32, per row ---- */

typedef struct {
    int8_t *q;   /* [M, K] */
    float *d;    /* [M, K / 32] */
    int32_t *s;  /* [M, K / 32]: sum of the block's codes */
    int64_t k;
    /* [M, K] or NULL: q again, each full group of 16 blocks (512 bytes) with its blocks' 4-byte words interleaved
       (word j of the group's block b at 64 j + 4 b; blocks past the last full group as in q): what a repacked
       weight row (deltafin_ggml_repack) is multiplied with. Written by interleave_block as q is. */
    int8_t *t;
} qrows;

/* Blocks in a repacked group: a vpdpbusd over one word of each gives the 16 blocks' dot products in its lanes. */
#define GROUP 16
/* A qmatrix type with this bit: its rows are repacked (deltafin_ggml_repack) */
#define REPACKED 0x10000

/* Block `block` of activation row `row` (rows of k values), as quantized into q, copied into t's layout (no-op
   without t). */
static inline void interleave_block(const qrows *r, int64_t row, int64_t k, int64_t block) {
    if (!r->t) return;
    const int64_t full = k / QK / GROUP * GROUP;
    const int8_t *from = r->q + row * k + block * QK;
    if (block >= full) {
        memcpy(r->t + row * k + block * QK, from, QK);
        return;
    }
    int8_t *to = r->t + row * k + (block / GROUP) * GROUP * QK + 4 * (block % GROUP);
    for (int j = 0; j < QK / 4; j++) memcpy(to + 4 * GROUP * j, from + 4 * j, 4);
}

/* Rounds half to even (nearbyintf in the default rounding mode): the same in every variant, vectorized or not. */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *d, int32_t *s) {
    for (int64_t b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float scale = amax / 127.0f;
        const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < QK; i++) {
            const int32_t v = (int32_t)nearbyintf(xb[i] * inverse);
            q[b * QK + i] = (int8_t)v;
            sum += v;
        }
        d[b] = scale;
        s[b] = sum;
    }
}

/* ---- one group of up to 8 blocks of one weight row against one activation row: integer dot products ---- */

#ifdef DELTAFIN_SIMD
static inline __m256i codes_q4(const uint8_t *qs) {
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* bit i of qh -> 0x10 in byte i */
static inline __m256i high_bits(uint32_t qh) {
    const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)qh), shuffle);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

/* The block's 32 codes in a register: unsigned for Q4/Q5, signed for Q8_0. */
static inline __m256i block_codes(int type, const uint8_t *b) {
    switch (type) {
    case GGML_Q8_0: return _mm256_loadu_si256((const __m256i *)(b + 2));
    case GGML_Q4_0: return codes_q4(b + 2);
    case GGML_Q4_1: return codes_q4(b + 4);
    case GGML_Q5_0: return _mm256_or_si256(codes_q4(b + 6), high_bits(read_u32(b + 2)));
    default: return _mm256_or_si256(codes_q4(b + 8), high_bits(read_u32(b + 4)));
    }
}

/* The 8 blocks' codes of a K-quant super-block in registers (the same values as k_codes). */
static inline void k_codes_simd(int type, const uint8_t *b, __m256i *codes) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    if (type == GGML_Q6_K) {
        const __m256i three = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
        for (int half = 0; half < 2; half++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * half));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
            const __m256i low[4] = {_mm256_and_si256(l0, nibble), _mm256_and_si256(l1, nibble),
                                    _mm256_and_si256(_mm256_srli_epi16(l0, 4), nibble),
                                    _mm256_and_si256(_mm256_srli_epi16(l1, 4), nibble)};
            const __m256i high[4] = {_mm256_and_si256(h, three), _mm256_and_si256(_mm256_srli_epi16(h, 2), three),
                                     _mm256_and_si256(_mm256_srli_epi16(h, 4), three),
                                     _mm256_and_si256(_mm256_srli_epi16(h, 6), three)};
            for (int j = 0; j < 4; j++)  /* high bits <= 3 << 4: the 16-bit shift moves nothing across bytes */
                codes[4 * half + j] = _mm256_sub_epi8(_mm256_or_si256(low[j], _mm256_slli_epi16(high[j], 4)), bias);
        }
        return;
    }
    const uint8_t *qs = b + (type == GGML_Q5_K ? 48 : 16);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        codes[2 * c] = _mm256_and_si256(v, nibble);
        codes[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    }
    if (type == GGML_Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)), bit4 = _mm256_set1_epi8(0x10);
        for (int j = 0; j < LANES; j++) {  /* bit j of each byte -> 0x10 */
            const __m256i moved = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
            codes[j] = _mm256_or_si256(codes[j], _mm256_and_si256(moved, bit4));
        }
    }
}

/* k_scales in registers (the same floats: the same IEEE products, the sign flipped as by unary minus): dw, mw
   per block; Q6_K: d in every lane, mw 0, and the 16 integer scales as int32 (sc_low: 0-7, sc_high: 8-15). */
static inline void k_scales_simd(int type, const uint8_t *b, __m256 *dw, __m256 *mw, __m256i *sc_low, __m256i *sc_high) {
    if (type == GGML_Q6_K) {
        *dw = _mm256_set1_ps(half_to_float(read_u16(b + 208)));
        *mw = _mm256_setzero_ps();
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(b + 192));
        *sc_low = _mm256_cvtepi8_epi32(bytes);
        *sc_high = _mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8));
        return;
    }
    /* k_scale_min for the 8 sub-blocks at once, four bytes per word */
    const uint32_t a0 = read_u32(b + 4), a1 = read_u32(b + 8), a2 = read_u32(b + 12);
    const uint32_t sc_first = a0 & 0x3F3F3F3Fu, sc_last = (a2 & 0x0F0F0F0Fu) | ((a0 >> 2) & 0x30303030u);
    const uint32_t m_first = a1 & 0x3F3F3F3Fu, m_last = ((a2 >> 4) & 0x0F0F0F0Fu) | ((a1 >> 2) & 0x30303030u);
    const __m256i sc = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)(((uint64_t)sc_last << 32) | sc_first)));
    const __m256i m = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)(((uint64_t)m_last << 32) | m_first)));
    *dw = _mm256_mul_ps(_mm256_set1_ps(half_to_float(read_u16(b))), _mm256_cvtepi32_ps(sc));
    *mw = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(half_to_float(read_u16(b + 2))), _mm256_cvtepi32_ps(m)),
                        _mm256_set1_ps(-0.0f));
    *sc_low = *sc_high = _mm256_setzero_si256();
}

/* unsigned u8 x signed s8, 32 pairs -> 8 int32 partial sums */
static inline __m256i dot_us(__m256i u, __m256i s) {
#ifdef DELTAFIN_VARIANT_AVX512
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));  /* |pair| <= 2*128*127: no saturation */
#endif
}

static inline __m256i dot_ss(__m256i a, __m256i s) {
    return dot_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(s, a));
}

/* 8 vectors of 8 int32 -> one vector holding each one's total */
static inline __m256i sum8(const __m256i *p) {
    const __m256i a = _mm256_hadd_epi32(p[0], p[1]), b = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i c = _mm256_hadd_epi32(p[4], p[5]), d = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

#ifdef DELTAFIN_VARIANT_AVX512
static inline __m512i dot_ss512(__m512i a, __m512i s) {
    /* signed x signed as vpdpbusd's unsigned x signed: |a| times s with a's sign moved onto s */
    const __mmask64 negative = _mm512_movepi8_mask(a);
    const __m512i magnitude = _mm512_abs_epi8(a);
    const __m512i signed_s = _mm512_mask_sub_epi8(s, negative, _mm512_setzero_si512(), s);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, signed_s);
}

/* Four registers, each the 8 int32 partial sums of two blocks (blocks 2j, 2j + 1) -> the 8 blocks' totals in
   block order. Integer sums are exact in any order, so this gives sum8's result with 12 operations, not 21. */
static inline __m256i sum8_pairs(const __m512i *p) {
    /* 128-bit quarters: p[j] = [2j lo, 2j hi, 2j+1 lo, 2j+1 hi] -> per quarter q, block (j-th pair's) 4 sums */
    const __m512i t0 = _mm512_add_epi32(_mm512_shuffle_i32x4(p[0], p[1], 0x88), _mm512_shuffle_i32x4(p[0], p[1], 0xDD));
    const __m512i t1 = _mm512_add_epi32(_mm512_shuffle_i32x4(p[2], p[3], 0x88), _mm512_shuffle_i32x4(p[2], p[3], 0xDD));
    /* t0 quarters: blocks 0, 1, 2, 3; t1: blocks 4, 5, 6, 7 (4 partial sums each) */
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi32(t0, t1), _mm512_unpackhi_epi32(t0, t1));
    /* per quarter q: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] with a = block q, b = block q + 4 */
    const __m512i w = _mm512_add_epi32(u, _mm512_shuffle_epi32(u, _MM_PERM_BADC));
    /* per quarter q: lane 0 = block q's total, lane 1 = block q + 4's */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, w));
}
#endif
#endif

/* ---- one weight row against M activation rows ---- */

#define ROW_CHUNK 16

static inline float lanes_total(const float *a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* The contribution of one block to lane `acc`: the same IEEE operations in every variant. */
static inline float block_term(int32_t dot, int32_t s, float dw, float mw, float dx, const format_info *f) {
    if (f->has_min) return (dw * dx) * (float)dot + (mw * dx) * (float)s;
    return (dw * dx) * (float)(dot - f->offset * s);
}

/* Scales of blocks g .. g + count of a row. */
static inline __attribute__((always_inline)) void group_scales(const int type, const uint8_t *row, int64_t bytes,
                                                               int64_t g, int count, float *dw, float *mw) {
    for (int j = 0; j < count; j++) block_scales(type, row + (g + j) * bytes, &dw[j], &mw[j]);
}

/* The remainder group (fewer than 8 blocks), and every group of the portable build: plain C. */
static inline __attribute__((always_inline)) void group_portable(const int type, const format_info *f,
        const uint8_t *row, int64_t k, const qrows *x, int64_t m_first, int64_t mcount, int64_t g, int count,
        float (*acc)[LANES]) {
    const int64_t nb = k / QK;
    float dw[LANES], mw[LANES];
    int16_t codes[LANES][QK];
    group_scales(type, row, f->bytes, g, count, dw, mw);
    for (int j = 0; j < count; j++) unpack_codes(type, row + (g + j) * f->bytes, codes[j]);
    for (int64_t i = 0; i < mcount; i++) {
        const int64_t m = m_first + i;
        const int8_t *xq = x->q + m * k + g * QK;
        for (int j = 0; j < count; j++) {
            int32_t dot = 0;
            for (int t = 0; t < QK; t++) dot += (int32_t)codes[j][t] * xq[j * QK + t];
            acc[i][j] += block_term(dot, x->s[m * nb + g + j], dw[j], mw[j], x->d[m * nb + g + j], f);
        }
    }
}

#ifdef DELTAFIN_SIMD
/* The scales (and minimums) of blocks g .. g + 8 of a row in two vectors: one gather of each block's first
   four bytes (d, and m where the format has one, as halves), no trip through memory. Lanes past `lanes`
   (a mask) read nothing and are 0. The same floats as block_scales: half to float is exact. */
static inline void group_scales_simd(const uint8_t *first, int64_t bytes, __m256i lanes, __m256 *d, __m256 *m) {
    const __m256i offsets = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)bytes));
    const __m256i words = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)first, offsets, lanes, 1);
    const __m256i low = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                         0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i high = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                          2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(words, low), 0x08)));
    *m = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(words, high), 0x08)));
}

/* A group of `count` (<= 8) blocks against `mcount` activation rows: vpdpbusd / vpmaddubsw, then the same
   float operations as block_term, lane by lane; lanes past `count` are left as they are. */
static inline __attribute__((always_inline)) void group_simd(const int type, const format_info *f,
        const uint8_t *row, int64_t k, const qrows *x, int64_t m_first, int64_t mcount, int64_t g, int count,
        float (*acc)[LANES]) {
    const int64_t nb = k / QK;
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 vdw, vmw;
    group_scales_simd(row + g * f->bytes, f->bytes, lanes, &vdw, &vmw);
    if (!f->has_min) vmw = _mm256_setzero_ps();
    __m256i codes[LANES];
    for (int j = 0; j < LANES; j++)
        codes[j] = j < count ? block_codes(type, row + (g + j) * f->bytes) : _mm256_setzero_si256();
#ifdef DELTAFIN_VARIANT_AVX512
    /* blocks 2j and 2j + 1 in one register (codes past `count` are 0, so whatever activations sit beside the
       row's last block add nothing: qrows_alloc leaves 64 bytes of room past the last row) */
    const int npairs = (count + 1) / 2;
    __m512i pairs[LANES / 2];
    for (int j = 0; j < npairs; j++) pairs[j] = _mm512_inserti64x4(_mm512_castsi256_si512(codes[2 * j]), codes[2 * j + 1], 1);
#endif
    for (int64_t i = 0; i < mcount; i++) {
        const int64_t m = m_first + i;
        const int8_t *xq = x->q + m * k + g * QK;
        __m256i dots;
#ifdef DELTAFIN_VARIANT_AVX512
        {
            __m512i p[LANES / 2];
            for (int j = 0; j < LANES / 2; j++) {
                if (j >= npairs) { p[j] = _mm512_setzero_si512(); continue; }
                const __m512i v = _mm512_loadu_si512((const void *)(xq + 2 * j * QK));
                p[j] = type == GGML_Q8_0 ? dot_ss512(pairs[j], v) : _mm512_dpbusd_epi32(_mm512_setzero_si512(), pairs[j], v);
            }
            dots = sum8_pairs(p);
        }
#else
        {
            __m256i p[LANES];
            for (int j = 0; j < LANES; j++) {
                if (j >= count) { p[j] = _mm256_setzero_si256(); continue; }
                const __m256i v = _mm256_loadu_si256((const __m256i *)(xq + j * QK));
                p[j] = type == GGML_Q8_0 ? dot_ss(codes[j], v) : dot_us(codes[j], v);
            }
            dots = sum8(p);
        }
#endif
        __m256 vdx;
        __m256i s;
        if (count == LANES) {
            vdx = _mm256_loadu_ps(x->d + m * nb + g);
            s = _mm256_loadu_si256((const __m256i *)(x->s + m * nb + g));
        } else {  /* never read past the row's last block */
            vdx = _mm256_maskload_ps(x->d + m * nb + g, lanes);
            s = _mm256_maskload_epi32((const int *)(x->s + m * nb + g), lanes);
        }
        __m256 term;
        if (f->has_min) {
            term = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(vdw, vdx), _mm256_cvtepi32_ps(dots)),
                                 _mm256_mul_ps(_mm256_mul_ps(vmw, vdx), _mm256_cvtepi32_ps(s)));
        } else if (f->offset) {
            const __m256i centred = _mm256_sub_epi32(dots, _mm256_mullo_epi32(_mm256_set1_epi32(f->offset), s));
            term = _mm256_mul_ps(_mm256_mul_ps(vdw, vdx), _mm256_cvtepi32_ps(centred));
        } else {
            term = _mm256_mul_ps(_mm256_mul_ps(vdw, vdx), _mm256_cvtepi32_ps(dots));
        }
        const __m256 old = _mm256_loadu_ps(acc[i]), sum = _mm256_add_ps(old, term);
        _mm256_storeu_ps(acc[i], count == LANES ? sum : _mm256_blendv_ps(old, sum, _mm256_castsi256_ps(lanes)));
    }
}
#endif

/* y[m * ldy] = row . x[m] for m < rows; `type` a constant in each specialization below. */
static inline __attribute__((always_inline)) void row_times_body(const int type, const uint8_t *row, int64_t k,
        const qrows *x, int64_t rows, float *y, int64_t ldy) {
    format_info f;
    format_of(type, &f);
    const int64_t nb = k / QK;
    for (int64_t mc = 0; mc < rows; mc += ROW_CHUNK) {
        const int64_t mcount = rows - mc < ROW_CHUNK ? rows - mc : ROW_CHUNK;
        float acc[ROW_CHUNK][LANES];
        for (int64_t i = 0; i < mcount; i++)  /* a plain loop: memset's `rep stos` start-up cost was 4% of a prefill */
            for (int j = 0; j < LANES; j++) acc[i][j] = 0.0f;
        int64_t g = 0;
#ifdef DELTAFIN_SIMD
        for (; g + LANES <= nb; g += LANES) group_simd(type, &f, row, k, x, mc, mcount, g, LANES, acc);
        if (g < nb) group_simd(type, &f, row, k, x, mc, mcount, g, (int)(nb - g), acc);
        g = nb;
#endif
        for (; g < nb; g += LANES)
            group_portable(type, &f, row, k, x, mc, mcount, g, nb - g < LANES ? (int)(nb - g) : LANES, acc);
        for (int64_t i = 0; i < mcount; i++) y[(mc + i) * ldy] = lanes_total(acc[i]);
    }
}

/* A K-quant row (k a multiple of 256) against `rows` activation rows: one super-block = one group of 8 lanes,
   block b's term added to lane b % 8 as for the other formats. */
static inline __attribute__((always_inline)) void row_times_k_body(const int type, const uint8_t *row, int64_t k,
        const qrows *x, int64_t rows, float *y, int64_t ldy) {
    format_info f;
    format_of(type, &f);
    const int64_t nb = k / QK, nsb = k / QK_K;
    for (int64_t mc = 0; mc < rows; mc += ROW_CHUNK) {
        const int64_t mcount = rows - mc < ROW_CHUNK ? rows - mc : ROW_CHUNK;
        float acc[ROW_CHUNK][LANES];
        memset(acc, 0, sizeof(acc[0]) * (size_t)mcount);
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *b = row + sb * f.bytes;
#ifdef DELTAFIN_SIMD
            __m256 vdw, vmw;
            __m256i sc_low, sc_high;
            k_scales_simd(type, b, &vdw, &vmw, &sc_low, &sc_high);
            __m256i codes[LANES];
            k_codes_simd(type, b, codes);
#ifdef DELTAFIN_VARIANT_AVX512
            __m512i pairs[LANES / 2], pair_scales[LANES / 2];  /* blocks 2j and 2j + 1 in one register */
            for (int j = 0; j < LANES / 2; j++)
                pairs[j] = _mm512_inserti64x4(_mm512_castsi256_si512(codes[2 * j]), codes[2 * j + 1], 1);
            if (type == GGML_Q6_K) {  /* int32 lanes 4g .. 4g + 3 of pair j: 16-value group 4j + g */
                const __m512i all = _mm512_inserti64x4(_mm512_castsi256_si512(sc_low), sc_high, 1);
                for (int j = 0; j < LANES / 2; j++)
                    pair_scales[j] = _mm512_permutexvar_epi32(
                        _mm512_add_epi32(_mm512_set1_epi32(4 * j), _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)), all);
            }
#else
            __m256i scales[LANES];  /* int16 lanes 0-7 of block j: 16-value group 2j, lanes 8-15: 2j + 1 */
            if (type == GGML_Q6_K)
                for (int j = 0; j < LANES; j++) {
                    const __m256i wide = _mm256_permutevar8x32_epi32(j < 4 ? sc_low : sc_high,
                        _mm256_add_epi32(_mm256_set1_epi32(2 * (j % 4)), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)));
                    scales[j] = _mm256_packs_epi32(wide, wide);  /* per 128-bit half: its scale 8 times */
                }
#endif
            for (int64_t i = 0; i < mcount; i++) {
                const int64_t m = mc + i;
                const int8_t *xq = x->q + m * k + sb * QK_K;
#ifdef DELTAFIN_VARIANT_AVX512
                __m512i p[LANES / 2];
                for (int j = 0; j < LANES / 2; j++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(xq + 2 * j * QK));
                    p[j] = type == GGML_Q6_K ? _mm512_mullo_epi32(dot_ss512(pairs[j], v), pair_scales[j])
                                             : _mm512_dpbusd_epi32(_mm512_setzero_si512(), pairs[j], v);
                }
                const __m256i dots = sum8_pairs(p);
#else
                __m256i p[LANES];
                for (int j = 0; j < LANES; j++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(xq + j * QK));
                    if (type == GGML_Q6_K)  /* |pair| <= 2 * 32 * 127, times a scale <= 128, two summed: exact */
                        p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(codes[j], codes[j]),
                                                                      _mm256_sign_epi8(v, codes[j])), scales[j]);
                    else
                        p[j] = dot_us(codes[j], v);
                }
                const __m256i dots = sum8(p);
#endif
                const __m256 vdx = _mm256_loadu_ps(x->d + m * nb + sb * LANES);
                __m256 term = _mm256_mul_ps(_mm256_mul_ps(vdw, vdx), _mm256_cvtepi32_ps(dots));
                if (f.has_min) {
                    const __m256i s = _mm256_loadu_si256((const __m256i *)(x->s + m * nb + sb * LANES));
                    term = _mm256_add_ps(term, _mm256_mul_ps(_mm256_mul_ps(vmw, vdx), _mm256_cvtepi32_ps(s)));
                }
                _mm256_storeu_ps(acc[i], _mm256_add_ps(_mm256_loadu_ps(acc[i]), term));
            }
#else
            float dw[LANES], mw[LANES];
            int32_t sc16[16];
            k_scales(type, b, dw, mw, sc16);
            int8_t codes[LANES][QK];
            for (int j = 0; j < LANES; j++) k_codes(type, b, j, codes[j]);
            for (int64_t i = 0; i < mcount; i++) {
                const int64_t m = mc + i;
                const int8_t *xq = x->q + m * k + sb * QK_K;
                for (int j = 0; j < LANES; j++) {
                    int32_t dot;
                    if (type == GGML_Q6_K) {
                        int32_t first = 0, second = 0;
                        for (int t = 0; t < QK / 2; t++) first += (int32_t)codes[j][t] * xq[j * QK + t];
                        for (int t = QK / 2; t < QK; t++) second += (int32_t)codes[j][t] * xq[j * QK + t];
                        dot = sc16[2 * j] * first + sc16[2 * j + 1] * second;
                    } else {
                        dot = 0;
                        for (int t = 0; t < QK; t++) dot += (int32_t)codes[j][t] * xq[j * QK + t];
                    }
                    const float dx = x->d[m * nb + sb * LANES + j];
                    float term = (dw[j] * dx) * (float)dot;
                    if (f.has_min) term = term + (mw[j] * dx) * (float)x->s[m * nb + sb * LANES + j];
                    acc[i][j] += term;
                }
            }
#endif
        }
        for (int64_t i = 0; i < mcount; i++) y[(mc + i) * ldy] = lanes_total(acc[i]);
    }
}

/* ---- repacked rows (AVX-512): the blocks of each full group of 16 stored so that a vpdpbusd sums one 4-byte
   word of all 16 at once ----

   Why: a row in the file's layout costs, per 8 blocks and activation row, 4 vpdpbusd and then 12 operations to
   add each block's lanes into one total (sum8_pairs) before its scales apply. Once a pass holds several tokens
   that reduction, not the weights' read, is the row's time (a speculative draft checked, a prefill window). In a
   group whose word j of block b sits at lane b of register j, the group's 8 vpdpbusd leave each block's total in
   its own lane: no reduction at all. A repacked row is a permutation of the file's bytes within each full group
   of 16 blocks:
     Q4_0: d[16] (halves) | qs word j of block b at 32 + 64 j + 4 b, j < 4                       (288 bytes)
     Q4_1: d[16] | m[16] | qs word j of block b at 64 + 64 j + 4 b, j < 4                         (320 bytes)
     Q8_0: d[16] | qs word j of block b at 32 + 64 j + 4 b, j < 8                                 (544 bytes)
   and blocks past the last full group are left as they are. A Q4 byte holds element i (low nibble) and i + 16
   (high), so word j's low nibbles are the block's elements 4j .. 4j + 3 and its high nibbles elements
   16 + 4j .. 16 + 4j + 3: the activation words j and j + 4 of t's layout.

   The same bits as the file's layout: each block's integer dot product is exact in any order, and its float
   term and the lane it is added to are block_term's and group_simd's, in the same order (blocks g .. g + 7, then
   g + 8 .. g + 15, as two groups of 8). */

#ifdef DELTAFIN_VARIANT_AVX512
static inline __attribute__((always_inline)) void row_times_repacked_body(const int type, const uint8_t *row,
        int64_t k, const qrows *x, int64_t rows, float *y, int64_t ldy) {
    format_info f;
    format_of(type, &f);
    const int64_t nb = k / QK, full = nb / GROUP * GROUP;
    const int64_t head = f.has_min ? 4 * GROUP : 2 * GROUP;  /* the group's scale bytes */
    for (int64_t mc = 0; mc < rows; mc += ROW_CHUNK) {
        const int64_t mcount = rows - mc < ROW_CHUNK ? rows - mc : ROW_CHUNK;
        float acc[ROW_CHUNK][LANES];
        for (int64_t i = 0; i < mcount; i++)
            for (int j = 0; j < LANES; j++) acc[i][j] = 0.0f;
        for (int64_t g = 0; g < full; g += GROUP) {
            const uint8_t *base = row + g * f.bytes;
            const __m512 vdw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)base));
            const __m512 vmw = f.has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(base + 2 * GROUP)))
                                         : _mm512_setzero_ps();
            __m512i codes[8];  /* register j: word j of every block (Q8_0: |codes|, the signs in `negative`) */
            __mmask64 negative[8] = {0};
            if (type == GGML_Q8_0) {
                for (int j = 0; j < 8; j++) {
                    const __m512i w = _mm512_loadu_si512((const void *)(base + head + 64 * j));
                    negative[j] = _mm512_movepi8_mask(w);
                    codes[j] = _mm512_abs_epi8(w);
                }
            } else {
                const __m512i low = _mm512_set1_epi8(0x0F);
                for (int j = 0; j < 4; j++) {
                    const __m512i w = _mm512_loadu_si512((const void *)(base + head + 64 * j));
                    codes[j] = _mm512_and_si512(w, low);
                    codes[j + 4] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
                }
            }
            for (int64_t i = 0; i < mcount; i++) {
                const int64_t m = mc + i;
                const int8_t *xt = x->t + m * k + g * QK;
                __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
                for (int j = 0; j < 8; j += 2) {
                    __m512i v0 = _mm512_loadu_si512((const void *)(xt + 64 * j));
                    __m512i v1 = _mm512_loadu_si512((const void *)(xt + 64 * (j + 1)));
                    if (type == GGML_Q8_0) {  /* signed x signed: the weight's sign moved onto the activation */
                        v0 = _mm512_mask_sub_epi8(v0, negative[j], _mm512_setzero_si512(), v0);
                        v1 = _mm512_mask_sub_epi8(v1, negative[j + 1], _mm512_setzero_si512(), v1);
                    }
                    even = _mm512_dpbusd_epi32(even, codes[j], v0);
                    odd = _mm512_dpbusd_epi32(odd, codes[j + 1], v1);
                }
                const __m512i dots = _mm512_add_epi32(even, odd);
                const __m512 vdx = _mm512_loadu_ps(x->d + m * nb + g);
                const __m512i s = _mm512_loadu_si512((const void *)(x->s + m * nb + g));
                __m512 term;
                if (f.has_min) {
                    term = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(vdw, vdx), _mm512_cvtepi32_ps(dots)),
                                         _mm512_mul_ps(_mm512_mul_ps(vmw, vdx), _mm512_cvtepi32_ps(s)));
                } else if (f.offset) {
                    const __m512i centred = _mm512_sub_epi32(dots, _mm512_mullo_epi32(_mm512_set1_epi32(f.offset), s));
                    term = _mm512_mul_ps(_mm512_mul_ps(vdw, vdx), _mm512_cvtepi32_ps(centred));
                } else {
                    term = _mm512_mul_ps(_mm512_mul_ps(vdw, vdx), _mm512_cvtepi32_ps(dots));
                }
                __m256 sum = _mm256_add_ps(_mm256_loadu_ps(acc[i]), _mm512_castps512_ps256(term));
                sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(term), 1)));
                _mm256_storeu_ps(acc[i], sum);
            }
        }
        int64_t g = full;  /* the blocks past the last full group, in the file's layout */
        for (; g + LANES <= nb; g += LANES) group_simd(type, &f, row, k, x, mc, mcount, g, LANES, acc);
        if (g < nb) group_simd(type, &f, row, k, x, mc, mcount, g, (int)(nb - g), acc);
        for (int64_t i = 0; i < mcount; i++) y[(mc + i) * ldy] = lanes_total(acc[i]);
    }
}

#define ROW_TIMES_REPACKED(T) \
    static void row_times_##T##_repacked(const uint8_t *row, int64_t k, const qrows *x, int64_t rows, float *y, int64_t ldy) { \
        row_times_repacked_body(GGML_##T, row, k, x, rows, y, ldy); \
    }
ROW_TIMES_REPACKED(Q4_0) ROW_TIMES_REPACKED(Q4_1) ROW_TIMES_REPACKED(Q8_0)
#endif

/* Code words per block of the repacked layout of `type`, or 0: this variant does not repack it. */
static int repacked_words(int type) {
#ifdef DELTAFIN_VARIANT_AVX512
    switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: return 4;
    case GGML_Q8_0: return 8;
    default: return 0;
    }
#else
    (void)type;
    return 0;
#endif
}

#define ROW_TIMES(T) \
    static void row_times_##T(const uint8_t *row, int64_t k, const qrows *x, int64_t rows, float *y, int64_t ldy) { \
        row_times_body(GGML_##T, row, k, x, rows, y, ldy); \
    }
ROW_TIMES(Q4_0) ROW_TIMES(Q4_1) ROW_TIMES(Q5_0) ROW_TIMES(Q5_1) ROW_TIMES(Q8_0)
#define ROW_TIMES_K(T) \
    static void row_times_##T(const uint8_t *row, int64_t k, const qrows *x, int64_t rows, float *y, int64_t ldy) { \
        row_times_k_body(GGML_##T, row, k, x, rows, y, ldy); \
    }
ROW_TIMES_K(Q4_K) ROW_TIMES_K(Q5_K) ROW_TIMES_K(Q6_K)

typedef void (*row_fn)(const uint8_t *, int64_t, const qrows *, int64_t, float *, int64_t);

static row_fn row_function(int type) {
    switch (type) {
#ifdef DELTAFIN_VARIANT_AVX512
    case GGML_Q4_0 | REPACKED: return row_times_Q4_0_repacked;
    case GGML_Q4_1 | REPACKED: return row_times_Q4_1_repacked;
    case GGML_Q8_0 | REPACKED: return row_times_Q8_0_repacked;
#endif
    case GGML_Q4_0: return row_times_Q4_0;
    case GGML_Q4_1: return row_times_Q4_1;
    case GGML_Q5_0: return row_times_Q5_0;
    case GGML_Q5_1: return row_times_Q5_1;
    case GGML_Q4_K: return row_times_Q4_K;
    case GGML_Q5_K: return row_times_Q5_K;
    case GGML_Q6_K: return row_times_Q6_K;
    default: return row_times_Q8_0;
    }
}

/* ---- entry points ---- */

typedef struct {
    const uint8_t *data; /* [N, row_bytes] */
    int64_t type, rows, cols, row_bytes;
} qmatrix;

static void matrix_rows(const qmatrix *w, int64_t n0, int64_t n1, const qrows *x, int64_t m_rows, float *y, int64_t ldy) {
    const row_fn run = row_function((int)w->type);
    for (int64_t n = n0; n < n1; n++) run(w->data + n * w->row_bytes, w->cols, x, m_rows, y + n, ldy);
}

static int qrows_alloc(qrows *r, int64_t m_rows, int64_t k) {
    r->k = k;
    r->q = malloc((size_t)(m_rows * k) + 64);
    r->d = malloc(sizeof(float) * (size_t)(m_rows * (k / QK) + 1));
    r->s = malloc(sizeof(int32_t) * (size_t)(m_rows * (k / QK) + 1));
    r->t = NULL;
    return r->q && r->d && r->s;
}

static void qrows_free(qrows *r) { free(r->q); free(r->d); free(r->s); free(r->t); }

/* w's rows [rows, row_bytes] of `type` into `out` (w itself allowed) in the repacked layout (see
   row_times_repacked_body). Returns the type to pass the repacked rows as (type | REPACKED), or 0 where this
   variant does not repack the type or the rows are not whole blocks (out untouched). */
int deltafin_ggml_repack(const uint8_t *w, int type, int64_t rows, int64_t k, int64_t row_bytes, uint8_t *out) {
    format_info f;
    const int words = repacked_words(type);
    if (!words || !format_of(type, &f) || k % QK || row_bytes != k / QK * f.bytes) return 0;
    const int64_t nb = k / QK, full = nb / GROUP * GROUP;
    const int64_t scales = f.has_min ? 2 : 1, head = 2 * GROUP * scales;
    uint8_t file[GROUP * 34];  /* one group as the file has it (Q8_0's are the largest blocks repacked) */
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *from = w + r * row_bytes;
        uint8_t *to = out + r * row_bytes;
        if (to != from) memcpy(to + full * f.bytes, from + full * f.bytes, (size_t)((nb - full) * f.bytes));
        for (int64_t g = 0; g < full; g += GROUP) {
            memcpy(file, from + g * f.bytes, (size_t)(GROUP * f.bytes));
            uint8_t *group = to + g * f.bytes;
            for (int b = 0; b < GROUP; b++) {
                const uint8_t *block = file + b * f.bytes;
                for (int64_t c = 0; c < scales; c++) memcpy(group + 2 * GROUP * c + 2 * b, block + 2 * c, 2);
                for (int j = 0; j < words; j++) memcpy(group + head + 64 * j + 4 * b, block + 2 * scales + 4 * j, 4);
            }
        }
    }
    return type | REPACKED;
}

/* Block b of a repacked row as the file has it (in `room`, 34 bytes or more), or the row's own bytes for a
   block past the last full group. */
static const uint8_t *file_block(const uint8_t *row, int type, const format_info *f, int64_t nb, int64_t b,
                                 uint8_t *room) {
    if (b >= nb / GROUP * GROUP) return row + b * f->bytes;
    const int64_t scales = f->has_min ? 2 : 1, head = 2 * GROUP * scales, lane = b % GROUP;
    const uint8_t *group = row + (b - lane) * f->bytes;
    for (int64_t c = 0; c < scales; c++) memcpy(room + 2 * c, group + 2 * GROUP * c + 2 * lane, 2);
    for (int j = 0; j < repacked_words(type); j++) memcpy(room + 2 * scales + 4 * j, group + head + 64 * j + 4 * lane, 4);
    return room;
}


int deltafin_ggml_supported(int type) {
    format_info f;
    return (type & REPACKED) ? repacked_words(type & ~REPACKED) > 0 : format_of(type, &f);
}

/* Bytes of one block of `type`, which holds deltafin_ggml_block_values(type) values (32; 256 for the K-quants'
   super-blocks): a row of K values takes K / values * bytes. 0 for an unknown type. */
int64_t deltafin_ggml_block_bytes(int type) { format_info f; return format_of(type & ~REPACKED, &f) ? f.bytes : 0; }

int64_t deltafin_ggml_block_values(int type) { format_info f; return format_of(type & ~REPACKED, &f) ? f.values : 0; }

/* y [M, N] = x [M, K] . w [N, K]^T (+ bias [N]); returns 0, or -1 for an unknown type or no memory. */
int deltafin_ggml_matmul(const float *x, int64_t m_rows, const uint8_t *w, int type, int64_t n, int64_t k,
                         int64_t row_bytes, const float *bias, float *y, int threads) {
    format_info f;
    if (!deltafin_ggml_supported(type) || !format_of(type & ~REPACKED, &f) || k % f.values) return -1;
    qrows q;
    int ok = qrows_alloc(&q, m_rows, k);
    if (ok && (type & REPACKED)) ok = (q.t = malloc((size_t)(m_rows * k) + 64)) != NULL;
    if (!ok) { qrows_free(&q); return -1; }
    const qmatrix mat = {w, type, n, k, row_bytes};
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < m_rows; m++) {
            quantize_row(x + m * k, k, q.q + m * k, q.d + m * (k / QK), q.s + m * (k / QK));
            for (int64_t b = 0; b < k / QK; b++) interleave_block(&q, m, k, b);
        }
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            matrix_rows(&mat, i, i + 1, &q, m_rows, y, n);
            if (bias)
                for (int64_t m = 0; m < m_rows; m++) y[m * n + i] += bias[i];
        }
    }
    qrows_free(&q);
    return 0;
}

/* rows [ids] of w, as float [len(ids), K] (embedding lookups, tests). */
int deltafin_ggml_dequantize(const uint8_t *w, int type, int64_t k, int64_t row_bytes, const int64_t *ids,
                             int64_t count, float *out) {
    format_info f;
    const int repacked = type & REPACKED;
    type &= ~REPACKED;
    if ((repacked && !repacked_words(type)) || !format_of(type, &f) || k % f.values) return -1;
    if (is_kquant(type)) {
        for (int64_t r = 0; r < count; r++) {
            const uint8_t *row = w + ids[r] * row_bytes;
            for (int64_t sb = 0; sb < k / QK_K; sb++) {
                const uint8_t *block = row + sb * f.bytes;
                float dw[LANES], mw[LANES];
                int32_t sc16[16];
                int8_t u[QK];
                float *o = out + r * k + sb * QK_K;
                k_scales(type, block, dw, mw, sc16);
                for (int j = 0; j < LANES; j++) {
                    k_codes(type, block, j, u);
                    for (int i = 0; i < QK; i++)
                        o[j * QK + i] = type == GGML_Q6_K ? (dw[j] * (float)sc16[2 * j + i / 16]) * (float)u[i]
                                                          : (float)u[i] * dw[j] + mw[j];
                }
            }
        }
        return 0;
    }
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *row = w + ids[r] * row_bytes;
        for (int64_t b = 0; b < k / QK; b++) {
            uint8_t room[64];
            const uint8_t *block = repacked ? file_block(row, type, &f, k / QK, b, room) : row + b * f.bytes;
            float d, m;
            int16_t u[QK];
            block_scales(type, block, &d, &m);
            unpack_codes(type, block, u);
            for (int i = 0; i < QK; i++)
                out[r * k + b * QK + i] = f.has_min ? (float)u[i] * d + m : (float)(u[i] - f.offset) * d;
        }
    }
    return 0;
}

/* The 8-bit activations the matmul uses (tests compare them with an independent reference). */
void deltafin_ggml_quantize_activations(const float *x, int64_t m_rows, int64_t k, int8_t *q, float *d, int32_t *s) {
    for (int64_t m = 0; m < m_rows; m++) quantize_row(x + m * k, k, q + m * k, d + m * (k / QK), s + m * (k / QK));
}

/* Which variant this library was built as: 0 portable, 1 AVX2, 2 AVX-512. */
int deltafin_kernel_variant(void) {
#if defined(DELTAFIN_VARIANT_AVX512)
    return 2;
#elif defined(DELTAFIN_VARIANT_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* What this CPU can run: bit 0 AVX2+FMA+F16C, bit 1 AVX-512 F/BW/VL/VNNI (and bit 0). */
int deltafin_cpu_features(void) {
    int bits = 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) bits |= 1;
    if ((bits & 1) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        bits |= 2;
#endif
    return bits;
}
