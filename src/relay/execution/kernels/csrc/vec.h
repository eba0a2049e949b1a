// A small vector layer for the kernels written once for every instruction-set level: `vf` holds
// VL float32 lanes, and every operation a kernel needs has one name here, with three bodies:
//
//   AVX-512 (VL 16)   __m512 and its intrinsics
//   AVX2 + FMA (VL 8) __m256 and its intrinsics (FMA fused, as the AVX-512 kernels are)
//   generic (VL 8)    GCC/Clang vector extensions: no intrinsics, so it compiles for any target
//                     (aarch64 included) and the compiler picks the target's own vector unit;
//                     a * b + c there is two roundings (C11 does not contract), which the tests
//                     allow for: generic is the path that must be right everywhere, not the fast one.
//
// Kernels use VL for their strides and never assume it; a kernel tuned by hand for AVX-512 keeps its
// own code and takes the portable one only below it (`#if !defined(__AVX512F__)`).
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

// VEC_YMM (defined before this header): the AVX2 body at an AVX-512 level too, for a kernel that
// wants 8 lanes there (gemm_dot_ymm.c)
#if defined(__AVX512F__) && !defined(VEC_YMM)
#define VL 16
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vf_hmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline vf vf_floor(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// 2^n for integral n in [-126, 127] held as floats
static inline vf vf_pow2i(vf n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// VL unsigned / signed bytes as floats
static inline vf vf_from_u8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline vf vf_from_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// VL bytes' low and high nibbles as floats (a Q4 block's two weights per byte)
static inline void vf_from_nibbles(const uint8_t* p, vf* lo, vf* hi) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)p), low4 = _mm_set1_epi8(0x0f);
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
}
static inline vf vf_from_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void vf_store_bf16(uint16_t* p, vf v) { _mm256_storeu_si256((__m256i*)p, vcvt_bf16(v)); }
// VL float16 values as floats (exact)
static inline vf vf_from_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
// VL floats rounded to the nearest integer (ties to even, as lrintf), stored as int8 (|v| <= 127)
static inline void vf_store_i8(int8_t* p, vf v) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v))); }
// the first n < VL lanes (the rest read as 0 / left alone)
static inline vf vf_load_n(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
}
static inline void vf_store_n(float* p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1u), v); }
// VL vectors in, one out: lane j is the sum of v[j]'s lanes (VL dot products' partial sums at once)
static inline vf vf_sums(const vf* v) { return transpose_sum16(v); }
// r[i] holds row i of a VL x VL block; on return r[j] holds column j
static inline void vf_transpose(vf* r) {
    __m512i t[16];
    for (int i = 0; i < 16; i++) t[i] = _mm512_castps_si512(r[i]);
    transpose16_epi32(t);
    for (int i = 0; i < 16; i++) r[i] = _mm512_castsi512_ps(t[i]);
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vf_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vf_hmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vf_floor(vf x) { return _mm256_floor_ps(x); }
static inline vf vf_pow2i(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf vf_from_u8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline vf vf_from_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline void vf_from_nibbles(const uint8_t* p, vf* lo, vf* hi) {
    const __m128i raw = _mm_loadl_epi64((const __m128i*)p), low4 = _mm_set1_epi8(0x0f);
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(raw, low4)));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
}
static inline vf vf_from_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline vf vf_from_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }  // F16C
static inline void vf_store_bf16(uint16_t* p, vf v) {  // round to nearest even (no NaN inputs here)
    __m256i bits = _mm256_castps_si256(v);
    bits = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                   _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1))));
    bits = _mm256_srli_epi32(bits, 16);  // 8 values in the low halves of 32-bit lanes
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128((__m128i*)p, packed);
}
static inline void vf_store_i8(int8_t* p, vf v) {
    const __m256i i = _mm256_cvtps_epi32(v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64((__m128i*)p, _mm_packs_epi16(w, w));
}
static inline __m256i vf_lanes_below(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf vf_load_n(const float* p, int64_t n) { return _mm256_maskload_ps(p, vf_lanes_below(n)); }
static inline void vf_store_n(float* p, vf v, int64_t n) { _mm256_maskstore_ps(p, vf_lanes_below(n), v); }
static inline vf vf_sums(const vf* v) {  // pairs within 128-bit halves, then quads, then the halves
    __m256 a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
static inline void vf_transpose(vf* r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {  // u[i + c]: column c (c < 4) of rows i..i+3, and column c + 4 above it
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
        r[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
    }
}

// 2 * VL bfloat16 values widened in the order vf_order2 gives (AVX2: dims 0-3, 8-11 into *a and
// 4-7, 12-15 into *b, two shuffles and no shift: a widening per vector cost a shift on the FMA
// ports). For dot products against queries in the same order, and sums to put back in order.
static inline void vf_from_bf16_2(const uint16_t* p, vf* a, vf* b) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)p), zero = _mm256_setzero_si256();
    *a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
    *b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
}
// two consecutive vectors (dims 0-7, 8-15) into vf_from_bf16_2's order, and back (its own inverse)
static inline void vf_order2(vf* a, vf* b) {
    const vf x = *a, y = *b;
    *a = _mm256_permute2f128_ps(x, y, 0x20);
    *b = _mm256_permute2f128_ps(x, y, 0x31);
}

#else
#define VL 8
typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi_ __attribute__((vector_size(4 * VL)));
typedef uint8_t vu8_ __attribute__((vector_size(VL)));
typedef int8_t vi8_ __attribute__((vector_size(VL)));
typedef uint16_t vu16_ __attribute__((vector_size(2 * VL)));
static inline vf vf_zero(void) { return (vf){0}; }
static inline vf vf_set1(float x) { return x - (vf){0}; }
static inline vf vf_load(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void vf_store(float* p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vf_add(vf a, vf b) { return a + b; }
static inline vf vf_sub(vf a, vf b) { return a - b; }
static inline vf vf_mul(vf a, vf b) { return a * b; }
static inline vf vf_div(vf a, vf b) { return a / b; }
static inline vf vf_max(vf a, vf b) {
    for (int i = 0; i < VL; i++) a[i] = b[i] > a[i] ? b[i] : a[i];
    return a;
}
static inline vf vf_min(vf a, vf b) {
    for (int i = 0; i < VL; i++) a[i] = b[i] < a[i] ? b[i] : a[i];
    return a;
}
static inline vf vf_fma(vf a, vf b, vf c) { return a * b + c; }
static inline float vf_sum(vf v) {  // pairwise, as the vector units do
    float t[VL];
    memcpy(t, &v, sizeof t);
    for (int w = VL / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
}
static inline float vf_hmax(vf v) {
    float m = v[0];
    for (int i = 1; i < VL; i++) m = v[i] > m ? v[i] : m;
    return m;
}
static inline vf vf_floor(vf x) {
    for (int i = 0; i < VL; i++) x[i] = floorf(x[i]);
    return x;
}
static inline vf vf_pow2i(vf n) {
    vi_ e = (__builtin_convertvector(n, vi_) + 127) << 23;
    vf r;
    memcpy(&r, &e, sizeof r);
    return r;
}
static inline vf vf_from_u8(const uint8_t* p) {
    vu8_ b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vf);
}
static inline vf vf_from_i8(const int8_t* p) {
    vi8_ b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vf);
}
static inline void vf_store_i8(int8_t* p, vf v) {
    for (int i = 0; i < VL; i++) p[i] = (int8_t)lrintf(v[i]);
}
static inline void vf_from_nibbles(const uint8_t* p, vf* lo, vf* hi) {
    vu8_ b;
    memcpy(&b, p, sizeof b);
    *lo = __builtin_convertvector(b & 15, vf);
    *hi = __builtin_convertvector(b >> 4, vf);
}
static inline vf vf_from_bf16(const uint16_t* p) {
    vu16_ h;
    memcpy(&h, p, sizeof h);
    vi_ bits = __builtin_convertvector(h, vi_) << 16;
    vf r;
    memcpy(&r, &bits, sizeof r);
    return r;
}
static inline vf vf_from_f16(const uint16_t* p) {  // no F16C here: simd.h's exact scalar conversion
    vf r;
    for (int i = 0; i < VL; i++) {
        uint16_t h;
        memcpy(&h, p + i, sizeof h);
        r[i] = f16_to_f32(h);
    }
    return r;
}
static inline void vf_store_bf16(uint16_t* p, vf v) {
    for (int i = 0; i < VL; i++) p[i] = f32_to_bf16(v[i]);
}
static inline vf vf_load_n(const float* p, int64_t n) {
    vf v = {0};
    memcpy(&v, p, sizeof(float) * (size_t)n);
    return v;
}
static inline void vf_store_n(float* p, vf v, int64_t n) { memcpy(p, &v, sizeof(float) * (size_t)n); }
static inline vf vf_sums(const vf* v) {
    vf r;
    for (int j = 0; j < VL; j++) r[j] = vf_sum(v[j]);
    return r;
}
static inline void vf_transpose(vf* r) {
    float t[VL][VL];
    memcpy(t, r, sizeof t);
    for (int i = 0; i < VL; i++)
        for (int j = 0; j < VL; j++) r[j][i] = t[i][j];
}
#endif

#if !(defined(__AVX2__) && defined(__FMA__)) || (defined(__AVX512F__) && !defined(VEC_YMM))
// (AVX2's order is its own; elsewhere the natural one: dims 0..VL-1, then VL..2VL-1)
static inline void vf_from_bf16_2(const uint16_t* p, vf* a, vf* b) {
    *a = vf_from_bf16(p);
    *b = vf_from_bf16(p + VL);
}
static inline void vf_order2(vf* a, vf* b) { (void)a; (void)b; }
#endif

// Activations stored as float32 or bfloat16 (is_bf16), VL of them from element i on.
static inline vf vf_load_act(const void* base, int64_t i, int is_bf16) {
    return is_bf16 ? vf_from_bf16((const uint16_t*)base + i) : vf_load((const float*)base + i);
}
static inline void vf_store_act(void* base, int64_t i, vf v, int is_bf16) {
    if (is_bf16) vf_store_bf16((uint16_t*)base + i, v);
    else vf_store((float*)base + i, v);
}

// 2^x for x <= 0 (softmax scores pre-multiplied by log2(e)); ~1 ulp, the polynomial simd.h's vexp2
// uses, so every level computes the same function.
static inline vf vf_exp2(vf x) {
    x = vf_max(x, vf_set1(-126.0f));
    const vf xi = vf_floor(x), f = vf_sub(x, xi);
    vf p = vf_set1(1.535336188319500e-4f);
    p = vf_fma(p, f, vf_set1(1.339887440266574e-3f));
    p = vf_fma(p, f, vf_set1(9.618437357674640e-3f));
    p = vf_fma(p, f, vf_set1(5.550332471162809e-2f));
    p = vf_fma(p, f, vf_set1(2.402264791363012e-1f));
    p = vf_fma(p, f, vf_set1(6.931472028550421e-1f));
    p = vf_fma(p, f, vf_set1(1.0f));
    return vf_mul(p, vf_pow2i(xi));
}

// e^x, clamped to |x| <= 87.
static inline vf vf_exp(vf x) {
    x = vf_min(vf_max(x, vf_set1(-87.f)), vf_set1(87.f));
    return vf_exp2(vf_mul(x, vf_set1(1.4426950408889634f)));
}

// tanh(x) as (1 - e^-2x) / (1 + e^-2x): vf_exp's clamp keeps both ends finite (+-1 exactly far
// out), and near 0 the absolute error stays ~1e-7, which is what a soft-capped score needs.
static inline vf vf_tanh(vf x) {
    const vf t = vf_exp(vf_mul(x, vf_set1(-2.f))), one = vf_set1(1.f);
    return vf_div(vf_sub(one, t), vf_add(one, t));
}

// Attention logit soft-capping (Gemma 2): a score s -> cap * tanh(s * scale / cap). The kernels'
// softmax runs in base 2 (scores times log2 e), so they pass cap * log2 e: the same function there;
// scale: what the scores still need multiplying by (1 where they come scaled).
static inline vf vf_soft_cap(vf s, float scale, float cap) {
    return vf_mul(vf_set1(cap), vf_tanh(vf_mul(s, vf_set1(scale / cap))));
}

// The same over s[0, n), in place.
static inline void soft_cap(float* s, int64_t n, float scale, float cap) {
    int64_t j = 0;
    for (; j + VL <= n; j += VL) vf_store(s + j, vf_soft_cap(vf_load(s + j), scale, cap));
    if (j < n) vf_store_n(s + j, vf_soft_cap(vf_load_n(s + j, n - j), scale, cap), n - j);
}
