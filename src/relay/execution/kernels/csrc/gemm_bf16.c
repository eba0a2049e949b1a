// bfloat16 GEMMs for CPUs with AVX512-BF16: y[M, N] = x[M, K] . w[N, K]^T (+ bias).
//
// relay_gemm_bf16, 1-8 rows: at a few rows a decode step's GEMMs only stream the weights once;
// it reads each weight row once for all M rows of x with VDPBF16PS (32 bf16 products per
// instruction, fp32 accumulation), threads splitting the output features, so it runs near the
// memory's bandwidth where torch/oneDNN reach a third to a half of it (docs/benchmarks.md).
//
// relay_gemm_bf16_panels, any rows: compute-bound GEMMs on a weight repacked once into panels
// (relay/execution/kernels/cpu_gemm.py pack_panels): see the comment above it.
//
// Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU);
// relay_gemm_bf16_available() tells the caller.
#include <stdlib.h>

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

// relay_gemm_bf16_panels: the weight in panels of NR output features, [panels][K / 2][NR] 32-bit
// pairs (lane n of pair p: feature n's weights 2p, 2p + 1), so one register tile of MR rows x NR
// features walks its panel front to back: per pair 3 weight loads and MR broadcasts of x feed
// 3 * MR VDPBF16PS into accumulators that stay in registers for the whole of K (no partial sums
// through memory, no horizontal sums). A thread takes (panel, row tile) items panel by panel, so
// a panel read from memory once serves every row tile from L2. The first tile of a panel would
// wait on memory while the others only compute, so each tile also asks for its share of the
// next panel's lines into L2 (prefetcht1), spread over its pairs: the next panel streams in while
// this one computes (a whole step's GEMMs 1.2x faster at 8-32 rows, 1.07x at 64, on a Zen 4; into
// L1, or two panels ahead, were no better). On a 2-core Zen 4, the default model's four layer
// GEMMs x 30 layers streaming from memory: 1.3x oneDNN's time at 32 rows, 1.5-1.9x at 8-16, 1.08x
// at 256, before that prefetch (docs/benchmarks.md).
#define NR 48  // output features per panel (3 vectors)
#define MR 8  // rows per register tile: 3 * MR = 24 accumulators of the 32 registers
#define MC 256  // rows per pass over the panels: their bf16 x stays in L2

#if defined(__AVX512BF16__)
static inline __m512 vload_masked_bf16(const uint16_t* p, __mmask16 live) {  // lanes off live read as 0
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
}

static inline __attribute__((always_inline)) void panel_tile(const int64_t R, const uint32_t* x, int64_t x_stride,
                                                             const uint32_t* panel, int64_t pairs,
                                                             const uint16_t* bias, void* y, int64_t y_stride,
                                                             int y_f32, int64_t n0, int64_t N, const char* pf,
                                                             int64_t pf_lines) {
    __m512 acc[MR][3];
    const int64_t pf_step = (pf_lines + pairs - 1) / pairs;  // lines of the next panel per pair
    for (int64_t i = 0; i < R; i++)
        for (int64_t h = 0; h < 3; h++) acc[i][h] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + p * NR);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + p * NR + 16);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(panel + p * NR + 32);
        for (int64_t j = p * pf_step; j < (p + 1) * pf_step && j < pf_lines; j++) __builtin_prefetch(pf + j * 64, 0, 2);
        for (int64_t i = 0; i < R; i++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[i * x_stride + p]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xv, w2);
        }
    }
    for (int64_t h = 0; h < 3; h++) {
        const __mmask16 live = strip_mask(N - n0, h);
        const __m512 b = bias ? vload_masked_bf16(bias + n0 + 16 * h, live) : _mm512_setzero_ps();
        for (int64_t i = 0; i < R; i++) {
            const __m512 v = _mm512_add_ps(acc[i][h], b);
            if (y_f32) _mm512_mask_storeu_ps((float*)y + i * y_stride + n0 + 16 * h, live, v);
            else _mm256_mask_storeu_epi16((uint16_t*)y + i * y_stride + n0 + 16 * h, live, vcvt_bf16(v));
        }
    }
}

#define PANEL_TILE(RV)                                                                                            \
    case RV:                                                                                                      \
        panel_tile(RV, xp + m0 * xp_stride, xp_stride, panels + p * pairs * NR, pairs, bias,                      \
                   y_f32 ? (void*)((float*)y + m0 * y_stride) : (void*)((uint16_t*)y + m0 * y_stride), y_stride, \
                   y_f32, p * NR, N, pf, pf_lines);                                                               \
        break;
#endif

int relay_gemm_bf16_panel_features(void) { return NR; }

int relay_gemm_amx_panels(const uint16_t* x, int64_t x_stride, const uint32_t* panels, const uint16_t* bias, void* y,
                          int64_t y_stride, int y_f32, int64_t M, int64_t N, int64_t K);  // gemm_amx.c

// x [M, K] rows x_stride apart: float32 (x_f32; rounded to bfloat16 first, as the model's GEMMs
// round their inputs) or bfloat16 with an even x_stride. panels as above for a [N, K] weight, K
// even; bias [N] bfloat16 or NULL; y [M, N] rows y_stride apart, float32 (y_f32) or bfloat16.
// Returns 0 where this build has no AVX512-BF16 or K is odd (the caller keeps its other path).
// Where the CPU has AMX (gemm_amx.c), the tiles run it instead.
int relay_gemm_bf16_panels(const void* x, int64_t x_stride, int x_f32, const uint32_t* panels, const uint16_t* bias,
                           void* y, int64_t y_stride, int y_f32, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512BF16__)
    if (K % 2 || M < 1 || (!x_f32 && x_stride % 2)) return 0;
    const int64_t pairs = K / 2, n_panels = (N + NR - 1) / NR, panel_lines = pairs * NR * 4 / 64;
    uint16_t* rounded = NULL;
    const uint32_t* xp = (const uint32_t*)x;
    int64_t xp_stride = x_stride / 2;
    if (x_f32) {
        rounded = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)(M * K));
        if (!rounded) return 0;
        round_rows_bf16((const float*)x, x_stride, M, K, rounded);
        xp = (const uint32_t*)rounded;
        xp_stride = pairs;
    }
    if (relay_gemm_amx_panels((const uint16_t*)xp, xp_stride * 2, panels, bias, y, y_stride, y_f32, M, N, K)) {
        free(rounded);
        return 1;
    }
    for (int64_t mc = 0; mc < M; mc += MC) {
        const int64_t rows = M - mc < MC ? M - mc : MC, tiles = (rows + MR - 1) / MR;
        _Pragma("omp parallel for collapse(2) schedule(static)")
        for (int64_t p = 0; p < n_panels; p++)
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t m0 = mc + t * MR;
                // this tile's share of the next panel, into L2 while this one computes
                const int64_t share = (panel_lines + tiles - 1) / tiles;
                const int64_t first = t * share < panel_lines ? t * share : panel_lines;
                const int64_t pf_lines = p + 1 < n_panels ? (first + share < panel_lines ? share : panel_lines - first) : 0;
                const char* pf = (const char*)(panels + (p + 1) * pairs * NR) + first * 64;
                switch (M - m0 < MR ? M - m0 : MR) {
                    PANEL_TILE(1) PANEL_TILE(2) PANEL_TILE(3) PANEL_TILE(4)
                    PANEL_TILE(5) PANEL_TILE(6) PANEL_TILE(7) PANEL_TILE(8)
                }
            }
    }
    free(rounded);
    return 1;
#else
    (void)x; (void)x_stride; (void)x_f32; (void)panels; (void)bias; (void)y; (void)y_stride; (void)y_f32; (void)M;
    (void)N; (void)K;
    return 0;
#endif
}
