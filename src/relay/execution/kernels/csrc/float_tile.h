// Float32 register tiles over a strip of NS = 32 output features whose weights were widened into a
// float32 buffer (wbuf [kn][32], feature-minor): gemm_blocks.c's float path widens blocks into it,
// gemm_widen.c bfloat16 weights. Both read it the same way, so the tile and its edge handling live here.
#pragma once
#include <stdint.h>

#include "vec.h"

#define TILE_NS 32  // features per strip (the includer's NS)
#define TILE_ROWS_MAX 6  // rows per register tile: 2 vectors of 6 rows are 12 of AVX2's 16 registers

// Features of vector h of a strip that exist, `left` from the strip's start on: all VL, or fewer.
static inline int64_t lanes_live(int64_t left, int64_t h) {
    left -= VL * h;
    return left >= VL ? VL : left > 0 ? left : 0;
}

static inline void store_live(float* y, vf v, int64_t live) {
    if (live == VL) vf_store(y, v);
    else if (live > 0) vf_store_n(y, v, live);
}

// y[m0 .. m0 + R, features h0 * VL .. (h0 + 2) * VL of the strip] (+)= x . wbuf, R <= TILE_ROWS_MAX
// rows; inputs k0 .. k0 + kn of x; the partial sums of earlier chunks of K wait in y (first: this is
// the first chunk).
static inline __attribute__((always_inline)) void float_tile(const int64_t R, const float* x, int64_t x_stride,
                                                             int64_t m0, const float* wbuf, int64_t h0, int64_t k0,
                                                             int64_t kn, float* y, int64_t y_stride, int64_t n0,
                                                             int64_t N, int first) {
    const float* xr[TILE_ROWS_MAX];
    for (int64_t i = 0; i < R; i++) xr[i] = x + (m0 + i) * x_stride + k0;
    const int64_t live0 = lanes_live(N - n0, h0), live1 = lanes_live(N - n0, h0 + 1);
    vf acc[TILE_ROWS_MAX][2];
    for (int64_t i = 0; i < R; i++) {
        float* yr = y + (m0 + i) * y_stride + n0 + VL * h0;
        acc[i][0] = first || !live0 ? vf_zero() : live0 == VL ? vf_load(yr) : vf_load_n(yr, live0);
        acc[i][1] = first || !live1 ? vf_zero() : live1 == VL ? vf_load(yr + VL) : vf_load_n(yr + VL, live1);
    }
    for (int64_t k = 0; k < kn; k++) {
        const vf w0 = vf_load(wbuf + k * TILE_NS + VL * h0), w1 = vf_load(wbuf + k * TILE_NS + VL * (h0 + 1));
        for (int64_t i = 0; i < R; i++) {
            const vf xv = vf_set1(xr[i][k]);
            acc[i][0] = vf_fma(xv, w0, acc[i][0]);
            acc[i][1] = vf_fma(xv, w1, acc[i][1]);
        }
    }
    for (int64_t i = 0; i < R; i++) {
        float* yr = y + (m0 + i) * y_stride + n0 + VL * h0;
        store_live(yr, acc[i][0], live0);
        store_live(yr + VL, acc[i][1], live1);
    }
}
