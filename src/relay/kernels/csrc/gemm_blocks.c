// GEMM on weights kept in GGUF-style blocks of 32, for CPUs with AVX-512: y[M, N] = x[M, K] . W^T
// with float32 activations and float32 math.
//
// A checkpoint shipped as Q4_1 (w = d * q + m, q in 0..15) or Q8_0 (w = d * q, q in -127..127)
// is dequantized into float32 when it loads; relay/weight_blocks.py recovers the blocks from those
// floats and keeps them only where they give back every weight bit for bit. Reading 4.5 or 8.5
// bits per weight instead of 32 is what a decode step's GEMMs are bound by at a few rows.
//
// Work is split into strips of NS = 32 output features, laid out feature-minor so that one
// 16-byte load unpacks into two vectors of 16 features' weights at consecutive k (4 bits) or one
// (8 bits). A thread unpacks a strip KC inputs at a time into wbuf [KC][32] float32 (16 KiB, in
// L1), computing each weight as the dequantizer did (d * q, then + m, rounded separately), then
// runs all M rows of x over it, MB rows at a time: per input, two weight vectors and MB
// broadcasts of x feed 2 * MB FMAs into accumulators that stay in registers (no horizontal sums).
// Partial sums wait in y between chunks of KC. Up to GEMV_ROWS rows (decode steps of a few
// requests) skip wbuf: unpacking is then most of the work, and gemv_strip does less of it.
//
// Layouts, per strip s (features 32s .. 32s + 31, rows past N zero): q4 [s][K / 2][32] bytes, byte
// n of pair p holding feature n's weight 2p (low nibble) and 2p + 1 (high); q8 [s][K][32] int8;
// d, m [s][K / 32][32] float32. x [M, K] rows x_stride apart; y [M, N] rows y_stride apart.
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define NS 32  // output features per strip
#define KC 128  // inputs unpacked at a time (the last chunk of a row may be shorter)
#define GEMV_ROWS 6  // at most this many rows go straight from the blocks (gemv_strip)
#define MB 8  // rows of x per register tile (TILE_ROWS below covers 1 .. MB)

int relay_gemm_blocks_available(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
// Weights of strip s for inputs [k0, k0 + kn) into wbuf [kn][NS].
static inline void unpack(int bits, const uint8_t* q, const float* d, const float* m, int64_t s, int64_t K,
                          int64_t k0, int64_t kn, float* wbuf) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    for (int64_t b = k0 / 32; b < (k0 + kn) / 32; b++) {
        const float* db = d + (s * (K / 32) + b) * NS;
        const float* mb = m + (s * (K / 32) + b) * NS;
        for (int64_t h = 0; h < 2; h++) {  // features 16h .. 16h + 15
            const __m512 dv = _mm512_loadu_ps(db + 16 * h), mv = _mm512_loadu_ps(mb + 16 * h);
            for (int64_t k = b * 32; k < b * 32 + 32; k += 2) {
                float* w = wbuf + (k - k0) * NS + 16 * h;
                if (bits == 4) {
                    const __m128i raw = _mm_loadu_si128((const __m128i*)(q + (s * (K / 2) + k / 2) * NS + 16 * h));
                    const __m512 even = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
                    const __m512 odd = _mm512_cvtepi32_ps(
                        _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
                    _mm512_storeu_ps(w, _mm512_add_ps(_mm512_mul_ps(dv, even), mv));
                    _mm512_storeu_ps(w + NS, _mm512_add_ps(_mm512_mul_ps(dv, odd), mv));
                } else {
                    const int8_t* qk = (const int8_t*)q + (s * K + k) * NS + 16 * h;
                    _mm512_storeu_ps(w, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(
                                                              _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qk)))));
                    _mm512_storeu_ps(w + NS, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                                   _mm_loadu_si128((const __m128i*)(qk + NS))))));
                }
            }
        }
    }
}

// y[m0 .. m0 + R, strip s] (+)= x[.., k0 .. k0 + kn] . wbuf for R <= MB rows (a compile-time
// constant after inlining, so the accumulators stay in registers and a short last tile does
// no work for rows that do not exist); features past N masked off.
static inline __attribute__((always_inline)) void tile(const int64_t R, const float* x, int64_t x_stride,
                                                       int64_t m0, const float* wbuf, int64_t k0, int64_t kn,
                                                       float* y, int64_t y_stride, int64_t n0, int64_t N, int first) {
    const float* xr[MB];
    for (int64_t i = 0; i < R; i++) xr[i] = x + (m0 + i) * x_stride + k0;
    const int64_t left = N - n0;
    const __mmask16 live0 = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    const __mmask16 live1 = left >= 32 ? (__mmask16)0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1u) : 0;
    __m512 acc[MB][2];
    for (int64_t i = 0; i < R; i++) {
        float* yr = y + (m0 + i) * y_stride + n0;
        acc[i][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(live0, yr);
        acc[i][1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(live1, yr + 16);
    }
    for (int64_t k = 0; k < kn; k++) {
        const __m512 w0 = _mm512_load_ps(wbuf + k * NS), w1 = _mm512_load_ps(wbuf + k * NS + 16);
        for (int64_t i = 0; i < R; i++) {
            const __m512 xv = _mm512_set1_ps(xr[i][k]);
            acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
        }
    }
    for (int64_t i = 0; i < R; i++) {
        float* yr = y + (m0 + i) * y_stride + n0;
        _mm512_mask_storeu_ps(yr, live0, acc[i][0]);
        _mm512_mask_storeu_ps(yr + 16, live1, acc[i][1]);
    }
}

#define TILE_ROWS(RV) case RV: tile(RV, x, x_stride, m0, wbuf, k0, kn, y, y_stride, n0, N, first); break;

static void tiles(const float* x, int64_t x_stride, int64_t M, const float* wbuf, int64_t k0, int64_t kn, float* y,
                  int64_t y_stride, int64_t n0, int64_t N, int first) {
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        switch (M - m0 < MB ? M - m0 : MB) {
            TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4) TILE_ROWS(5) TILE_ROWS(6) TILE_ROWS(7) TILE_ROWS(8)
        }
    }
}

// y[0 .. R, strip s] = x . W^T for R <= GEMV_ROWS rows, straight from the blocks: per block of 32
// inputs the sums x . q over the raw quants, then d * that (+ m * the block's sum of x for Q4_1):
// the same dot product with one multiply per block instead of one per weight and no trip through
// wbuf (121 GEMMs of the default model at 1 row 1.36-1.44x, 4 rows 1.23x, 6 rows 1.17x on a
// 2-core Xeon; and closer to float64 than the weight-by-weight sum).
static inline __attribute__((always_inline)) void gemv_strip(const int64_t R, int bits, const uint8_t* q,
                                                             const float* d, const float* m, int64_t s, int64_t K,
                                                             const float* x, int64_t x_stride, const float* xsum,
                                                             float* y, int64_t y_stride, int64_t N) {
    const int64_t n0 = s * NS, left = N - n0, nb = K / 32;
    const __mmask16 live0 = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    const __mmask16 live1 = left >= 32 ? (__mmask16)0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1u) : 0;
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m512 acc[GEMV_ROWS][2];
    for (int64_t i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 part[GEMV_ROWS][2];
        for (int64_t i = 0; i < R; i++) part[i][0] = part[i][1] = _mm512_setzero_ps();
        if (bits == 4) {
            const uint8_t* qb = q + (s * (K / 2) + b * 16) * NS;
            for (int64_t p = 0; p < 16; p++) {
                for (int64_t h = 0; h < 2; h++) {
                    const __m128i raw = _mm_loadu_si128((const __m128i*)(qb + p * NS + 16 * h));
                    const __m512 even = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
                    const __m512 odd =
                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
                    for (int64_t i = 0; i < R; i++) {
                        const float* xr = x + i * x_stride + b * 32 + 2 * p;
                        part[i][h] = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), even, part[i][h]);
                        part[i][h] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), odd, part[i][h]);
                    }
                }
            }
        } else {
            const int8_t* qb = (const int8_t*)q + (s * K + b * 32) * NS;
            for (int64_t k = 0; k < 32; k++)
                for (int64_t h = 0; h < 2; h++) {
                    const __m128i raw = _mm_loadu_si128((const __m128i*)(qb + k * NS + 16 * h));
                    const __m512 qv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
                    for (int64_t i = 0; i < R; i++)
                        part[i][h] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * x_stride + b * 32 + k]), qv, part[i][h]);
                }
        }
        const float* db = d + (s * nb + b) * NS;
        const float* mb = m + (s * nb + b) * NS;
        for (int64_t h = 0; h < 2; h++) {
            const __m512 dv = _mm512_loadu_ps(db + 16 * h);
            for (int64_t i = 0; i < R; i++) acc[i][h] = _mm512_fmadd_ps(dv, part[i][h], acc[i][h]);
            if (bits == 4) {
                const __m512 mv = _mm512_loadu_ps(mb + 16 * h);
                for (int64_t i = 0; i < R; i++)
                    acc[i][h] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[i * nb + b]), acc[i][h]);
            }
        }
    }
    for (int64_t i = 0; i < R; i++) {
        _mm512_mask_storeu_ps(y + i * y_stride + n0, live0, acc[i][0]);
        _mm512_mask_storeu_ps(y + i * y_stride + n0 + 16, live1, acc[i][1]);
    }
}

#define GEMV_CASE(RV) case RV: gemv_strip(RV, bits, q, d, m, s, K, x, x_stride, xsum, y, y_stride, N); break;
#endif

// bits 4 (Q4_1: d, m) or 8 (Q8_0: d; m unused). K a multiple of 32. Returns 0 where this build
// has no AVX-512 or the shape is not one it takes (the caller keeps its float path).
int relay_gemm_blocks(int bits, const uint8_t* q, const float* d, const float* m, const float* x, int64_t x_stride,
                      float* y, int64_t y_stride, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512F__)
    if (K % 32 || M < 1) return 0;
    const int64_t strips = (N + NS - 1) / NS;
    if (M <= GEMV_ROWS) {
        float xsum[GEMV_ROWS * (K / 32)];  // each row's sum over each block (Q4_1's m term)
        for (int64_t i = 0; i < (bits == 4 ? M : 0); i++)
            for (int64_t b = 0; b < K / 32; b++) {
                float t = 0.f;
                for (int64_t k = 0; k < 32; k++) t += x[i * x_stride + b * 32 + k];
                xsum[i * (K / 32) + b] = t;
            }
        _Pragma("omp parallel for schedule(static)")
        for (int64_t s = 0; s < strips; s++) {
            switch (M) { GEMV_CASE(1) GEMV_CASE(2) GEMV_CASE(3) GEMV_CASE(4) GEMV_CASE(5) GEMV_CASE(6) }
        }
        return 1;
    }
    _Pragma("omp parallel")
    {
        float wbuf[KC * NS] __attribute__((aligned(64)));
        _Pragma("omp for schedule(static)")
        for (int64_t s = 0; s < strips; s++)
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kn = K - k0 < KC ? K - k0 : KC;
                unpack(bits, q, d, m, s, K, k0, kn, wbuf);
                tiles(x, x_stride, M, wbuf, k0, kn, y, y_stride, s * NS, N, k0 == 0);
            }
    }
    return 1;
#else
    (void)bits; (void)q; (void)d; (void)m; (void)x; (void)x_stride; (void)y; (void)y_stride; (void)M; (void)N; (void)K;
    return 0;
#endif
}
