// GEMM on bfloat16 weights for CPUs without bfloat16 dot products (AVX2, AVX-512 without BF16,
// generic C): y[M, N] = x[M, K] . w[N, K]^T with float32 x and y, each weight widened to float32 in
// registers (a bfloat16 is a float32's top half: a zero-extend and a 16-bit left shift; vec.h's
// vf_from_bf16) and float32 FMAs. A bfloat16 checkpoint served in float32 keeps its weights in
// bfloat16 (half the memory of a float32 copy) and its GEMMs compute exactly what float32 GEMMs on
// the widened weights do, up to the order of the sums.
//
// w is the checkpoint's own [N, K] layout, untouched: an embedding's rows are a tied LM head's weight.
// Written once over vec.h's VL lanes, so each level builds its own body (AVX-512: 16; AVX2 + FMA
// and generic C: 8). Threads split the output features (strips of them), as gemm_blocks.c does.
//
// Up to GEMV_MAX rows (decode steps) a GEMV streams the weights once for every GEMV_ROWS rows of x
// (what bounds it is reading the weights: half float32's bytes): one row of x against one weight
// row at a time where K is short (x stays in L1; two accumulators hide the FMAs' latency), else NF
// weight rows at a time against up to GEMV_ROWS rows of x, each x vector loaded once for NF FMAs
// (single-threaded on a Zen 4 at AVX2, a [2048 x 8192] weight: 1 row 3.0 -> 2.0 ms, 2 rows 4.4 ->
// 2.2, 4 rows 5.8 -> 3.4; 1 row with K 2048 is faster one weight row at a time: 1.4 against 2.0).
// More rows (prompt chunks) run register tiles as gemm_blocks.c's: a strip of NS features is
// widened KC inputs at a time into wbuf [KC][NS] float32 (transposed VL x VL at a time), and every
// row of x runs over it, MB rows at a time.
#include <stdint.h>

#include "float_tile.h"
#include "vec.h"

#define GEMV_ROWS 4  // rows of x per pass of the GEMV over a weight row (2 accumulators each)
#define GEMV_MAX 8  // at most this many rows take the GEMV (a weight row read ceil(M / 4) times)
#define NF 4  // weight rows at a time of the GEMV over several rows of x, or a long K
#define SHORT_K 4096  // up to this K a single row of x takes one weight row at a time
#define NS 32  // output features per strip of the tiles
#define NV (NS / VL)
#define KC 256  // inputs widened into wbuf at a time (a multiple of VL; 128 was ~3 % slower at AVX2)
#define MB TILE_ROWS_MAX  // rows per register tile (float_tile.h): 2 vectors x 6 rows = 12 accumulators

int relay_gemm_widen_available(void) { return 1; }  // every level: vec.h's body for it

// sums[i] = x[i] . w over K for R rows of x (rows x_stride apart), one weight row w.
static inline __attribute__((always_inline)) void gemv_row(const int64_t R, const float* x, int64_t x_stride,
                                                           const uint16_t* w, int64_t K, float* sums) {
    vf acc0[GEMV_ROWS], acc1[GEMV_ROWS];
    for (int64_t i = 0; i < R; i++) acc0[i] = acc1[i] = vf_zero();
    int64_t k = 0;
    for (; k + 2 * VL <= K; k += 2 * VL) {  // two accumulators per row: consecutive FMAs do not wait
        const vf w0 = vf_from_bf16(w + k), w1 = vf_from_bf16(w + k + VL);
        for (int64_t i = 0; i < R; i++) {
            acc0[i] = vf_fma(vf_load(x + i * x_stride + k), w0, acc0[i]);
            acc1[i] = vf_fma(vf_load(x + i * x_stride + k + VL), w1, acc1[i]);
        }
    }
    for (; k + VL <= K; k += VL) {
        const vf w0 = vf_from_bf16(w + k);
        for (int64_t i = 0; i < R; i++) acc0[i] = vf_fma(vf_load(x + i * x_stride + k), w0, acc0[i]);
    }
    for (int64_t i = 0; i < R; i++) {
        float s = vf_sum(vf_add(acc0[i], acc1[i]));
        for (int64_t t = k; t < K; t++) s += x[i * x_stride + t] * bf16_to_f32(w[t]);
        sums[i] = s;
    }
}

// sums[i * NF + f] = x[i] . w[f] over K for R rows of x and NF weight rows (K apart): one
// accumulator each, every x vector loaded once for NF FMAs.
static inline __attribute__((always_inline)) void gemv_rows(const int64_t R, const float* x, int64_t x_stride,
                                                            const uint16_t* w, int64_t K, float* sums) {
    vf acc[GEMV_ROWS][NF];
    for (int64_t i = 0; i < R; i++)
        for (int64_t f = 0; f < NF; f++) acc[i][f] = vf_zero();
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        vf wv[NF];
        for (int64_t f = 0; f < NF; f++) wv[f] = vf_from_bf16(w + f * K + k);
        for (int64_t i = 0; i < R; i++) {
            const vf xv = vf_load(x + i * x_stride + k);
            for (int64_t f = 0; f < NF; f++) acc[i][f] = vf_fma(xv, wv[f], acc[i][f]);
        }
    }
    for (int64_t i = 0; i < R; i++)
        for (int64_t f = 0; f < NF; f++) {
            float s = vf_sum(acc[i][f]);
            for (int64_t t = k; t < K; t++) s += x[i * x_stride + t] * bf16_to_f32(w[f * K + t]);
            sums[i * NF + f] = s;
        }
}

#define GEMV_CASE(RV) case RV: gemv_row(RV, xr, x_stride, w + n * K, K, sums); break;
#define ROWS_CASE(RV) case RV: gemv_rows(RV, xr, x_stride, w + n * K, K, sums); break;

// Weight rows n .. n + NF (all within N) against every row of x, up to GEMV_ROWS at a time.
static void gemv_group(const float* x, int64_t x_stride, const uint16_t* w, float* y, int64_t y_stride, int64_t M,
                       int64_t n, int64_t K) {
    for (int64_t r0 = 0; r0 < M; r0 += GEMV_ROWS) {
        const float* xr = x + r0 * x_stride;
        const int64_t rows = M - r0 < GEMV_ROWS ? M - r0 : GEMV_ROWS;
        float sums[GEMV_ROWS * NF];
        switch (rows) { ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) }
        for (int64_t i = 0; i < rows; i++)
            for (int64_t f = 0; f < NF; f++) y[(r0 + i) * y_stride + n + f] = sums[i * NF + f];
    }
}

// Weight row n against every row of x, up to GEMV_ROWS at a time.
static void gemv_one(const float* x, int64_t x_stride, const uint16_t* w, float* y, int64_t y_stride, int64_t M,
                     int64_t n, int64_t K) {
    for (int64_t r0 = 0; r0 < M; r0 += GEMV_ROWS) {
        const float* xr = x + r0 * x_stride;
        const int64_t rows = M - r0 < GEMV_ROWS ? M - r0 : GEMV_ROWS;
        float sums[GEMV_ROWS];
        switch (rows) { GEMV_CASE(1) GEMV_CASE(2) GEMV_CASE(3) GEMV_CASE(4) }
        for (int64_t i = 0; i < rows; i++) y[(r0 + i) * y_stride + n] = sums[i];
    }
}

static void gemv(const float* x, int64_t x_stride, const uint16_t* w, float* y, int64_t y_stride, int64_t M,
                 int64_t N, int64_t K) {
    const int64_t step = M == 1 && K <= SHORT_K ? 1 : NF;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t n = 0; n < N; n += step) {
        if (step == NF && n + NF <= N) gemv_group(x, x_stride, w, y, y_stride, M, n, K);
        else
            for (int64_t f = n; f < n + step && f < N; f++) gemv_one(x, x_stride, w, y, y_stride, M, f, K);
    }
}

// Features n0 .. n0 + NS of w, inputs k0 .. k0 + kn, widened into wbuf [kn][NS] (features past N: 0).
static void widen_strip(const uint16_t* w, int64_t n0, int64_t N, int64_t K, int64_t k0, int64_t kn, float* wbuf) {
    for (int64_t h = 0; h < NV; h++) {
        int64_t k = 0;
        for (; k + VL <= kn; k += VL) {  // VL features x VL inputs, transposed to inputs x features
            vf r[VL];
            for (int64_t j = 0; j < VL; j++) {
                const int64_t n = n0 + h * VL + j;
                r[j] = n < N ? vf_from_bf16(w + n * K + k0 + k) : vf_zero();
            }
            vf_transpose(r);
            for (int64_t j = 0; j < VL; j++) vf_store(wbuf + (k + j) * NS + h * VL, r[j]);
        }
        for (; k < kn; k++)  // K's tail, past the last whole VL
            for (int64_t j = 0; j < VL; j++) {
                const int64_t n = n0 + h * VL + j;
                wbuf[k * NS + h * VL + j] = n < N ? bf16_to_f32(w[n * K + k0 + k]) : 0.f;
            }
    }
}

#define TILE_ROWS(RV) case RV: float_tile(RV, x, x_stride, m0, wbuf, h0, k0, kn, y, y_stride, n0, N, k0 == 0); break;

static void tiles(const float* x, int64_t x_stride, const uint16_t* w, float* y, int64_t y_stride, int64_t M,
                  int64_t N, int64_t K) {
    const int64_t strips = (N + NS - 1) / NS;
    _Pragma("omp parallel")
    {
        float wbuf[KC * NS] __attribute__((aligned(64)));
        _Pragma("omp for schedule(static)")
        for (int64_t s = 0; s < strips; s++) {
            const int64_t n0 = s * NS;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kn = K - k0 < KC ? K - k0 : KC;
                widen_strip(w, n0, N, K, k0, kn, wbuf);
                // a tile's rows of x once from L2 for every pair of vectors of the strip (in L1 after)
                for (int64_t m0 = 0; m0 < M; m0 += MB)
                    for (int64_t h0 = 0; h0 < NV; h0 += 2) {
                        switch (M - m0 < MB ? M - m0 : MB) {
                            TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4) TILE_ROWS(5) TILE_ROWS(6)
                        }
                    }
            }
        }
    }
}

// x [M, K] float32 rows x_stride apart; w [N, K] bfloat16, contiguous; y [M, N] float32 rows
// y_stride apart. Returns 0 for a shape it does not take (the caller keeps its torch path).
int relay_gemm_widen(const float* x, int64_t x_stride, const uint16_t* w, float* y, int64_t y_stride, int64_t M,
                     int64_t N, int64_t K) {
    if (M < 1 || N < 1 || K < 1) return 0;
    if (M <= GEMV_MAX) gemv(x, x_stride, w, y, y_stride, M, N, K);
    else tiles(x, x_stride, w, y, y_stride, M, N, K);
    return 1;
}
