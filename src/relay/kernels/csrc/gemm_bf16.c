// Small-batch bfloat16 GEMM for CPUs with AVX512-BF16: y[M, N] = x[M, K] . w[N, K]^T (+ bias).
//
// At a few rows a decode step's GEMMs only stream the weights once; this kernel reads each
// weight row once for all M rows of x with VDPBF16PS (32 bf16 products per instruction,
// fp32 accumulation), threads splitting the output features, so it runs near the memory's
// bandwidth where torch/oneDNN reach a third to a half of it (docs/benchmarks.md).
//
// Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU);
// relay_gemm_bf16_available() tells the caller.
#include "simd.h"

int relay_gemm_bf16_available(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
// One output feature for all M rows: its weight row is read front to back (each thread walks a
// contiguous range of rows: one sequential stream the prefetchers follow), two accumulators per
// row of x so consecutive VDPBF16PS do not wait on each other.
static inline __attribute__((always_inline)) void row(const int64_t M, const uint16_t* x, const uint16_t* w,
                                                       int64_t K, float* sums) {
    __m512 acc0[M], acc1[M];
    for (int64_t m = 0; m < M; m++) { acc0[m] = _mm512_setzero_ps(); acc1[m] = _mm512_setzero_ps(); }
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        const __m512i w0 = _mm512_loadu_si512((const void*)(w + k));
        const __m512i w1 = _mm512_loadu_si512((const void*)(w + k + 32));
        for (int64_t m = 0; m < M; m++) {
            acc0[m] = _mm512_dpbf16_ps(acc0[m], (__m512bh)_mm512_loadu_si512((const void*)(x + m * K + k)),
                                       (__m512bh)w0);
            acc1[m] = _mm512_dpbf16_ps(acc1[m], (__m512bh)_mm512_loadu_si512((const void*)(x + m * K + k + 32)),
                                       (__m512bh)w1);
        }
    }
    for (; k < K; k += 32) {  // what is left: whole 32s, then a masked tail (zeros add nothing)
        const __mmask32 live = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << (K - k)) - 1ull);
        const __m512i w0 = _mm512_maskz_loadu_epi16(live, w + k);
        for (int64_t m = 0; m < M; m++)
            acc0[m] = _mm512_dpbf16_ps(acc0[m], (__m512bh)_mm512_maskz_loadu_epi16(live, x + m * K + k),
                                       (__m512bh)w0);
    }
    for (int64_t m = 0; m < M; m++) sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
}

static inline __attribute__((always_inline)) void gemm_m(const int64_t M, const uint16_t* x, const uint16_t* w,
                                                          const uint16_t* bias, void* y, int64_t N, int64_t K,
                                                          int out_f32) {
    _Pragma("omp parallel for schedule(static)")
    for (int64_t n = 0; n < N; n++) {
        float sums[8];
        row(M, x, w + n * K, K, sums);
        const float b = bias ? bf16_to_f32(bias[n]) : 0.f;
        for (int64_t m = 0; m < M; m++) {
            if (out_f32) ((float*)y)[m * N + n] = sums[m] + b;
            else ((uint16_t*)y)[m * N + n] = f32_to_bf16(sums[m] + b);
        }
    }
}
#endif

// x [M, K] bf16, w [N, K] bf16, bias [N] bf16 or NULL; y [M, N] bf16, or float32 if out_f32.
// M must be 1..8.
void relay_gemm_bf16(const void* x, const void* w, const void* bias, void* y, int64_t M, int64_t N, int64_t K,
                     int out_f32) {
#if defined(__AVX512BF16__)
    const uint16_t* xs = (const uint16_t*)x;
    const uint16_t* ws = (const uint16_t*)w;
    const uint16_t* bs = (const uint16_t*)bias;
    switch (M) {
        case 1: gemm_m(1, xs, ws, bs, y, N, K, out_f32); break;
        case 2: gemm_m(2, xs, ws, bs, y, N, K, out_f32); break;
        case 3: gemm_m(3, xs, ws, bs, y, N, K, out_f32); break;
        case 4: gemm_m(4, xs, ws, bs, y, N, K, out_f32); break;
        case 5: gemm_m(5, xs, ws, bs, y, N, K, out_f32); break;
        case 6: gemm_m(6, xs, ws, bs, y, N, K, out_f32); break;
        case 7: gemm_m(7, xs, ws, bs, y, N, K, out_f32); break;
        case 8: gemm_m(8, xs, ws, bs, y, N, K, out_f32); break;
        default: break;
    }
#else
    (void)x; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)out_f32;
#endif
}
