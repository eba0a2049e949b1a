// Small helpers the CPU kernels share: bfloat16 <-> float, 16-lane loads of either, exp, and a
// 16x16 transpose-and-sum. Everything static inline: each kernel source gets its own copy.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// A float16 (IEEE binary16) as float32: exact for every value (normals, subnormals, signed zeros;
// inf and NaN kept), portable C for any level (the k-quants' compact scales, blocks.h).
static inline float f16_to_f32(uint16_t h) {
    const uint32_t e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (e == 0) {  // zero or subnormal: man * 2^-24, exact in float32
        const float v = (float)man * 0x1p-24f;
        memcpy(&bits, &v, sizeof bits);
    } else {
        bits = (e == 31 ? 0x7f800000u : (e + 112) << 23) | man << 13;
    }
    bits |= (uint32_t)(h & 0x8000u) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept NaN
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

// Row loads into float: is_bf16 says how the row is stored.
static inline void load_row(float* dst, const void* src, int64_t D, int is_bf16) {
    if (is_bf16) {
        const uint16_t* s = (const uint16_t*)src;
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(s[d]);
    } else {
        memcpy(dst, src, sizeof(float) * D);
    }
}

// Products of VDPBF16PS over values unpacked in pairs (VPUNPCK{L,H}WD of two rows, 32 dims at a
// time) come out permuted: lane i of the c-th 16-dim accumulator holds output dimension
// (c / 2) * 32 + (i / 4) * 8 + (c % 2) * 4 + i % 4. unpack_order32 puts a chunk back in order.
#if defined(__AVX512F__)
// The 32 dims of one chunk back in order from its two accumulators (lo: c even, hi: c + 1) in
// VPUNPCK order (above): dims 0-15 into *first, 16-31 into *second, in two permutes.
static inline void unpack_order32(__m512 lo, __m512 hi, __m512* first, __m512* second) {
    const __m512i a = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    *first = _mm512_permutex2var_ps(lo, a, hi);
    *second = _mm512_permutex2var_ps(lo, _mm512_add_epi32(a, _mm512_set1_epi32(8)), hi);
}

static inline __m512 vload(const void* base, int64_t i, int is_bf16) {
    if (is_bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float*)base + i);
}

// Which of the 16 output features of vector h of a strip or panel exist, `left` features from its
// start on (gemm_blocks.c, gemm_bf16.c).
static inline __mmask16 strip_mask(int64_t left, int64_t h) {
    left -= 16 * h;
    return left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : (__mmask16)0;
}

// 2^x for x <= 0 (scores are pre-multiplied by log2(e)); ~1 ulp over the range softmax uses.
static inline __m512 vexp2(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 xi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, xi);  // [0, 1)
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(xi), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
// Sixteen vectors in, one out: lane j is the sum of v[j]'s lanes (a 16x16 transpose and add in
// 45 instructions, where 16 horizontal sums take ~130).
static inline __m512 transpose_sum16(const __m512* v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  // per 128-bit lane: v[2i] and v[2i+1], two partial sums each
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  // per 128-bit lane: one partial sum each of 4 vectors
        b[i] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]))));
    for (int i = 0; i < 2; i++)  // across 128-bit lanes: halves
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// A 16x16 transpose of 32-bit elements: r[i] holds row i; on return r[j] holds column j.
static inline void transpose16_epi32(__m512i* r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // Now r[4a + b] holds, per 128-bit lane L, elements (4a..4a+3, column 4L + b)... gather lanes.
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

// 16 floats to 16 bfloat16 values (round to nearest even; no NaN inputs here).
static inline __m256i vcvt_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i round = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(bits, 16),
                                                                                 _mm512_set1_epi32(1)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, round), 16));
}

#if defined(__AVX512BF16__)
// The same in one VCVTNEPS2BF16, for values known to be normal or zero (it flushes subnormals):
// softmax probabilities, which vexp2 keeps at or above 2^-126.
static inline __m256i vcvt_bf16_normal(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#endif

// x [M, K] float32, rows x_stride apart, rounded into out [M, K] bfloat16 (contiguous rows): the
// activations a bfloat16 GEMM multiplies (gemm_blocks.c, gemm_bf16.c).
static inline void round_rows_bf16(const float* x, int64_t x_stride, int64_t M, int64_t K, uint16_t* out) {
    for (int64_t i = 0; i < M; i++) {
        const float* xr = x + i * x_stride;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) _mm256_storeu_si256((__m256i*)(out + i * K + k), vcvt_bf16(_mm512_loadu_ps(xr + k)));
        for (; k < K; k++) out[i * K + k] = f32_to_bf16(xr[k]);
    }
}
#endif
