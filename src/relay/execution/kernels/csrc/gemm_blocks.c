// GEMM on weights kept in GGUF-style blocks of 32, for CPUs with AVX-512: y[M, N] = x[M, K] . W^T
// with float32 activations and float32 math (a bfloat16 model's, where the CPU has AVX512-BF16:
// bfloat16 products, float32 sums; see gemm_blocks_bf16).
//
// A checkpoint shipped as Q4_1 (w = d * q + m, q in 0..15) or Q8_0 (w = d * q, q in -127..127)
// is dequantized into float32 when it loads; relay/execution/weight_blocks.py recovers the blocks from those
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
// The same kernels take the k-quants' forms (blocks.h): 8-bit quants with a minimum (Q5_K, Q5_1:
// w = d * q + m, q 0..31) and scales per 16 inputs (Q6_K: d = its float16 scale times an int8 one,
// q = quant - 32), and any fused weight lifted to one of them (gguf_blocks.common_form). A GEMV
// then sums x . q per group of 16 (or 32) inputs and scales each sum by its d (+ m times the
// group's sum of x); the tiles' wbuf holds d * q (+ m) per weight, as the dequantizer computes it.
//
// Layouts, per strip s (features 32s .. 32s + 31, rows past N zero): q4 [s][K / 2][32] bytes, byte
// n of pair p holding feature n's weight 2p (low nibble) and 2p + 1 (high); q8 [s][K][32] int8;
// q6 [s][K / 32][768] bytes (blocks.h: per block bits 4's 16 pairs of u = q + 32's low nibbles,
// then 8 rows of their high 2 bits), each q = u - 32 becoming the float the 8-bit form's int8 does,
// summed in the same order: the 6-bit form's outputs are the 8-bit form's bit for bit;
// d, m [s][K / g][32] float32, g the group (32, or 16 with G16_FLAG); m only where the form has
// one; with KS_FLAG, d is the k-quants' compact records instead (blocks.h) and each group's d and m
// are computed from them as they are read (kscales.h: D * sc, -Dmin * mn, the dequantizer's float32
// products), prefetched with the quants. x [M, K] rows x_stride apart; y [M, N] rows y_stride apart.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "kscales.h"
#include "float_tile.h"
#include "vec.h"

#define NS 32  // output features per strip
#define KC 128  // inputs unpacked at a time (the last chunk of a row may be shorter)
#define GEMV_ROWS 6  // at most this many rows go straight from the blocks (gemv_strip) at a time
#ifndef GEMV_GROUPS_MAX_ROWS
#define GEMV_GROUPS_MAX_ROWS 6  // up to this many rows run as groups of GEMV_ROWS (more: unpacked tiles)
#endif
#ifndef GEMV_AHEAD
#define GEMV_AHEAD 8  // blocks ahead the GEMVs prefetch (prefetch_block)
#endif
#define MB 8  // rows of x per register tile (TILE_ROWS below covers 1 .. MB)

int relay_gemm_dot(int bits, const uint8_t* q, const float* d, const float* m, const float* x, int64_t x_stride,
                   float* y, int64_t y_stride, int64_t M, int64_t N, int64_t K);

int relay_gemm_blocks_available(void) { return 1; }  // every level: AVX-512 below, vec.h's otherwise

// Block b (32 inputs) of strip s (quants, d and, where the form has one, m) on its way into the
// caches, for nobody to wait on it later: the GEMVs read three streams (quants, d, m), each running
// on from one strip to the next (a thread's strips are consecutive), and ask for each GEMV_AHEAD
// blocks ahead (past the end: a prefetch does not fault). Streaming the default model's 120 layer
// GEMMs at 1-6 rows on a Zen 5 (interleaved builds): 1.16-1.19x at 1 row, 1.28-1.46x at 2-6 (to
// ~42 GB/s). g: the group d and m are per (a block is 32 / g groups of them).
static inline void prefetch_block(int bits, int g, int has_m, int ks, const uint8_t* q, const float* d,
                                  const float* m, int64_t s, int64_t K, int64_t b) {
    const int64_t nb = K / 32, per = 32 / g, qbytes = form_block_bytes(bits);
    const char* qb = (const char*)q + (s * nb + b) * qbytes;  // strips of nb blocks, each qbytes
    for (int64_t o = 0; o < qbytes; o += 64) __builtin_prefetch(qb + o, 0, 0);
    if (ks) {  // KS_FLAG: the strip's records (kscales.h), an eighth of one per block
        KS_PREFETCH(g, has_m, d, s, K, b, 0);
        return;
    }
    const int64_t at = (s * nb + b) * per * NS;  // group b * per of strip s (K / g groups a strip)
    for (int64_t o = 0; o < per * NS; o += 16) {
        __builtin_prefetch(d + at + o, 0, 0);
        if (has_m) __builtin_prefetch(m + at + o, 0, 0);
    }
}

#if defined(__AVX512F__)
// acc[i] += d * part[i] (+ m * the group's sum of row i's x, xs[i * ng], where the form has m):
// one group of 32 (or 16) inputs summed over the raw quants, scaled as the dequantizer would
// (gemv_strip, tile_bf16).
// ds, ms: the strip's scales (kscales.h: float32 or KS_FLAG records), gi the group.
static inline __attribute__((always_inline)) void scale_block(const int64_t R, int ks, int g, int has_m,
                                                              const void* ds, const float* ms, int64_t gi,
                                                              const float* xs, int64_t ng, __m512 (*part)[2],
                                                              __m512 (*acc)[2]) {
    for (int64_t h = 0; h < 2; h++) {
        const __m512 dv = scales_d(ks, g, has_m, ds, gi, 16 * h);
        for (int64_t i = 0; i < R; i++) acc[i][h] = _mm512_fmadd_ps(dv, part[i][h], acc[i][h]);
        if (has_m) {
            const __m512 mv = scales_m(ks, g, ds, ms, gi, 16 * h);
            for (int64_t i = 0; i < R; i++) acc[i][h] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[i * ng]), acc[i][h]);
        }
    }
}

// The 6-bit form's quants q = u - 32 of inputs 2p, 2p + 1 of a block (blk: its 768 bytes, blocks.h)
// for features 16h .. 16h + 15, as float32: the low nibbles with their high 2 bits above them (a
// 16-bit shift moves the next byte's bits in too; the mask keeps each byte's own).
// The bytes q = u - 32 of inputs 2p (e) and 2p + 1 (o) for all 32 features of the strip at once
// (then widened 16 at a time: six_pair).
static inline void six_bytes(const uint8_t* blk, int64_t p, __m256i* e, __m256i* o) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + p * NS));
    __m256i hb = _mm256_loadu_si256((const __m256i*)(blk + 16 * NS + (p / 2) * NS));
    if (p & 1) hb = _mm256_srli_epi16(hb, 4);
    *e = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(raw, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top2)), off);
    *o = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4),
                                         _mm256_and_si256(_mm256_slli_epi16(hb, 2), top2)),
                         off);
}
static inline __m512 six_half(__m256i v, int64_t h) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v)));
}
static inline void six_pair(const uint8_t* blk, int64_t p, int64_t h, __m512* even, __m512* odd) {
    __m256i e, o;
    six_bytes(blk, p, &e, &o);
    *even = six_half(e, h);
    *odd = six_half(o, h);
}

// Weights of strip s for inputs [k0, k0 + kn) into wbuf [kn][NS]: d * q (+ m), rounded separately.
static inline void unpack(int bits, int g, int has_m, int ks, const uint8_t* q, const float* d, const float* m,
                          int64_t s, int64_t K, int64_t k0, int64_t kn, float* wbuf) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const int64_t ng = K / g;
    const void* ds = strip_scales(ks, g, has_m, d, s, K);
    const float* ms = has_m && !ks ? m + s * ng * NS : NULL;
    for (int64_t b = k0 / g; b < (k0 + kn) / g; b++) {  // groups of g inputs
        for (int64_t h = 0; h < 2; h++) {  // features 16h .. 16h + 15
            const __m512 dv = scales_d(ks, g, has_m, ds, b, 16 * h);
            const __m512 mv = has_m ? scales_m(ks, g, ds, ms, b, 16 * h) : _mm512_setzero_ps();
            for (int64_t k = b * g; k < b * g + g; k += 2) {
                float* w = wbuf + (k - k0) * NS + 16 * h;
                if (bits == 4) {
                    const __m128i raw = _mm_loadu_si128((const __m128i*)(q + (s * (K / 2) + k / 2) * NS + 16 * h));
                    const __m512 even = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
                    const __m512 odd = _mm512_cvtepi32_ps(
                        _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
                    _mm512_storeu_ps(w, _mm512_add_ps(_mm512_mul_ps(dv, even), mv));
                    _mm512_storeu_ps(w + NS, _mm512_add_ps(_mm512_mul_ps(dv, odd), mv));
                } else {
                    __m512 w0, w1;
                    if (bits == 6) {
                        six_pair(q + (s * (K / 32) + k / 32) * 768, (k % 32) / 2, h, &w0, &w1);
                        w0 = _mm512_mul_ps(dv, w0);
                        w1 = _mm512_mul_ps(dv, w1);
                    } else {
                        const int8_t* qk = (const int8_t*)q + (s * K + k) * NS + 16 * h;
                        w0 = _mm512_mul_ps(
                            dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qk))));
                        w1 = _mm512_mul_ps(
                            dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qk + NS)))));
                    }
                    if (has_m) {
                        w0 = _mm512_add_ps(w0, mv);
                        w1 = _mm512_add_ps(w1, mv);
                    }
                    _mm512_storeu_ps(w, w0);
                    _mm512_storeu_ps(w + NS, w1);
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
    const __mmask16 live0 = strip_mask(left, 0), live1 = strip_mask(left, 1);
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

// y[0 .. R, strip s] = x . W^T for R <= GEMV_ROWS rows, straight from the blocks: per group of 32
// (or 16) inputs the sums x . q over the raw quants, then d * that (+ m * the group's sum of x where
// the form has m): the same dot product with one multiply per group instead of one per weight and
// no trip through wbuf (121 GEMMs of the default model at 1 row 1.36-1.44x, 4 rows 1.23x, 6 rows
// 1.17x on a 2-core Xeon; and closer to float64 than the weight-by-weight sum). bits, g, has_m:
// constants where inlined (gemv_groups).
static inline __attribute__((always_inline)) void gemv_strip(const int64_t R, const int bits, const int g,
                                                             const int has_m, const int ks, const uint8_t* q,
                                                             const float* d, const float* m, int64_t s, int64_t K,
                                                             const float* x, int64_t x_stride, const float* xsum,
                                                             float* y, int64_t y_stride, int64_t N) {
    const int64_t n0 = s * NS, left = N - n0, nb = K / 32, ng = K / g, per = 32 / g;
    const __mmask16 live0 = strip_mask(left, 0), live1 = strip_mask(left, 1);
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const void* ds = strip_scales(ks, g, has_m, d, s, K);
    const float* ms = has_m && !ks ? m + s * ng * NS : NULL;
    __m512 acc[GEMV_ROWS][2];
    for (int64_t i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_block(bits, g, has_m, ks, q, d, m, s, K, b + GEMV_AHEAD);
        for (int64_t sub = 0; sub < per; sub++) {
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
            } else if (bits == 6) {  // inputs 2p, 2p + 1 of the sub-block's g, in order (as bits 8)
                const uint8_t* blk = q + (s * nb + b) * 768;
                for (int64_t p = sub * g / 2; p < (sub + 1) * g / 2; p++) {
                    __m256i e, o;
                    six_bytes(blk, p, &e, &o);
                    for (int64_t h = 0; h < 2; h++) {
                        const __m512 even = six_half(e, h), odd = six_half(o, h);
                        for (int64_t i = 0; i < R; i++) {
                            const float* xr = x + i * x_stride + b * 32 + 2 * p;
                            part[i][h] = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), even, part[i][h]);
                            part[i][h] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), odd, part[i][h]);
                        }
                    }
                }
            } else {
                const int64_t k0 = b * 32 + sub * g;
                const int8_t* qb = (const int8_t*)q + (s * K + k0) * NS;
                for (int64_t k = 0; k < g; k++)
                    for (int64_t h = 0; h < 2; h++) {
                        const __m128i raw = _mm_loadu_si128((const __m128i*)(qb + k * NS + 16 * h));
                        const __m512 qv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
                        for (int64_t i = 0; i < R; i++)
                            part[i][h] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * x_stride + k0 + k]), qv, part[i][h]);
                    }
            }
            scale_block(R, ks, g, has_m, ds, ms, b * per + sub, xsum + b * per + sub, ng, part, acc);
        }
    }
    for (int64_t i = 0; i < R; i++) {
        _mm512_mask_storeu_ps(y + i * y_stride + n0, live0, acc[i][0]);
        _mm512_mask_storeu_ps(y + i * y_stride + n0 + 16, live1, acc[i][1]);
    }
}

#if defined(__AVX512BF16__)
// bfloat16 models (round_bf16) on CPUs with AVX512-BF16 (Q4_1 at any row count, Q8_0 from
// BF16_MIN_ROWS rows on): VDPBF16PS does twice the multiply-adds of a float32 FMA per instruction,
// and the quants are small integers, exact in bfloat16. So x is rounded to bfloat16 once (as a
// bfloat16 model's GEMMs round their inputs) and a row tile sums x . q per block of 32 inputs, then
// scales it by d (+ m times the block's sum of x) in float32 - gemv_strip's order. The weights are
// the checkpoint's exact ones (not bfloat16-rounded). Q4_1 nibbles become bfloat16 pairs in
// registers as they are read (gemv_strip_bf16, up to GEMV_ROWS rows at a time); Q8_0 quants, whose
// conversion costs more, are unpacked into qbuf a KC chunk of a strip at a time (tile_bf16).
#define MB_BF16 6  // rows per register tile: 2 * MB_BF16 accumulators + 2 * MB_BF16 block sums
// From this many rows on a bfloat16 model's Q8_0 GEMMs take the tiles instead of gemv_strip's
// float32 FMAs (4 GEMMs of the default model's layer on a Zen 4: level at 2 rows, 1.2-1.5x at 3-6).
#define BF16_MIN_ROWS 2

// Quants of strip s for inputs [k0, k0 + kn) into qbuf [kn / 2][NS]: 32-bit lane n of pair p holds
// feature n's quants 2p (low half) and 2p + 1 (high half) as bfloat16.
static inline void unpack_quants_bf16(int bits, const uint8_t* q, int64_t s, int64_t K, int64_t k0, int64_t kn,
                                      const __m512i table, uint32_t* qbuf) {
    for (int64_t p = 0; p < kn / 2; p++) {
        const int64_t k = k0 + 2 * p;
        for (int64_t h = 0; h < 2; h++) {
            __m512i w;
            if (bits == 4) {
                const __m128i raw = _mm_loadu_si128((const __m128i*)(q + (s * (K / 2) + k / 2) * NS + 16 * h));
                const __m512i v = _mm512_cvtepu8_epi32(raw);  // lane n: feature n's byte (k low nibble, k + 1 high)
                const __m512i idx = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0x0f)),
                                                    _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0xf0)), 12));
                w = _mm512_permutexvar_epi16(idx, table);
            } else {
                const int8_t* qk = (const int8_t*)q + (s * K + k) * NS + 16 * h;
                const __m512i even = _mm512_cvtepu16_epi32(vcvt_bf16(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qk)))));
                const __m512i odd = _mm512_cvtepu16_epi32(vcvt_bf16(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qk + NS))))));
                w = _mm512_or_si512(even, _mm512_slli_epi32(odd, 16));
            }
            _mm512_store_si512((__m512i*)(qbuf + p * NS + 16 * h), w);
        }
    }
}

// y[0 .. R, strip s] = x . W^T for R <= GEMV_ROWS rows of a bfloat16 model's Q4_1 blocks, straight
// from the blocks: tile_bf16's sums in tile_bf16's order, with each nibble pair turned into a
// bfloat16 pair in registers (VPMOVZXBD, a shift, an OR, one VPERMW) instead of a trip through qbuf.
// More rows run in groups of at most GEMV_ROWS, converting the strip's quants again per group (from
// L1): still faster than the tiles' qbuf at every row count measured (the default model's 120 layer
// GEMMs on a Zen 5, interleaved: 1.06-1.08x at 1 row, 1.2-1.45x at 2-12, 1.03-1.14x at 14-128),
// and one row's output no longer depends on which rows came with it.
static inline __attribute__((always_inline)) void gemv_strip_bf16(const int64_t R, const int ks, const uint8_t* q,
                                                                  const float* d, const float* m, int64_t s,
                                                                  int64_t K, const uint16_t* xb, const float* xsum,
                                                                  const __m512i table, float* y, int64_t y_stride,
                                                                  int64_t N) {
    const int64_t n0 = s * NS, left = N - n0, nb = K / 32;
    const void* ds = strip_scales(ks, 32, 1, d, s, K);
    const float* ms = ks ? NULL : m + s * nb * NS;
    const __mmask16 live0 = strip_mask(left, 0), live1 = strip_mask(left, 1);
    __m512 acc[GEMV_ROWS][2];
    for (int64_t i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 part[GEMV_ROWS][2];
        for (int64_t i = 0; i < R; i++) part[i][0] = part[i][1] = _mm512_setzero_ps();
        const uint8_t* qb = q + (s * (K / 2) + b * 16) * NS;
        prefetch_block(4, 32, 1, ks, q, d, m, s, K, b + GEMV_AHEAD);
        for (int64_t p = 0; p < 16; p++) {
            __m512bh xv[GEMV_ROWS];
            for (int64_t i = 0; i < R; i++) {
                int32_t pair;  // x[k], x[k + 1] as one bfloat16 pair
                memcpy(&pair, xb + i * K + b * 32 + 2 * p, sizeof pair);
                xv[i] = (__m512bh)_mm512_set1_epi32(pair);
            }
            for (int64_t h = 0; h < 2; h++) {
                // lane n: feature n's byte; its low word indexes the table with the byte's low 5
                // bits (the table repeats after 16), its high word with the high nibble
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qb + p * NS + 16 * h)));
                const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), table);
                for (int64_t i = 0; i < R; i++) part[i][h] = _mm512_dpbf16_ps(part[i][h], xv[i], w);
            }
        }
        scale_block(R, ks, 32, 1, ds, ms, b, xsum + b, nb, part, acc);
    }
    for (int64_t i = 0; i < R; i++) {
        _mm512_mask_storeu_ps(y + i * y_stride + n0, live0, acc[i][0]);
        _mm512_mask_storeu_ps(y + i * y_stride + n0 + 16, live1, acc[i][1]);
    }
}

#define GEMV_BF16(RV)                                                                        \
    case RV:                                                                                 \
        if (ks) gemv_strip_bf16(RV, 1, q, d, m, s, K, xg, sg, table, yg, y_stride, N);       \
        else gemv_strip_bf16(RV, 0, q, d, m, s, K, xg, sg, table, yg, y_stride, N);          \
        break;

// y[m0 .. m0 + R, strip s] (+)= x[.., k0 .. k0 + kn] . W^T from qbuf, R <= MB_BF16 rows. xb [M, K]
// bfloat16 (the rounded x), xsum [M, K / 32] its sums per block.
static inline __attribute__((always_inline)) void tile_bf16(const int64_t R, int bits, int ks, const uint16_t* xb,
                                                            int64_t K, const float* xsum, int64_t m0,
                                                            const uint32_t* qbuf, const float* d, const float* m,
                                                            int64_t s, int64_t k0, int64_t kn, float* y,
                                                            int64_t y_stride, int64_t N, int first) {
    const int64_t n0 = s * NS, left = N - n0, nb = K / 32;
    const void* ds = strip_scales(ks, 32, bits == 4, d, s, K);
    const float* ms = bits == 4 && !ks ? m + s * nb * NS : NULL;
    const __mmask16 live0 = strip_mask(left, 0), live1 = strip_mask(left, 1);
    __m512 acc[MB_BF16][2];
    for (int64_t i = 0; i < R; i++) {
        float* yr = y + (m0 + i) * y_stride + n0;
        acc[i][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(live0, yr);
        acc[i][1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(live1, yr + 16);
    }
    for (int64_t b = k0 / 32; b < (k0 + kn) / 32; b++) {
        __m512 part[MB_BF16][2];
        for (int64_t i = 0; i < R; i++) part[i][0] = part[i][1] = _mm512_setzero_ps();
        const uint32_t* qb = qbuf + (b * 32 - k0) / 2 * NS;
        for (int64_t p = 0; p < 16; p++) {
            const __m512bh w0 = (__m512bh)_mm512_load_si512(qb + p * NS);
            const __m512bh w1 = (__m512bh)_mm512_load_si512(qb + p * NS + 16);
            for (int64_t i = 0; i < R; i++) {
                int32_t pair;  // x[k], x[k + 1] as one bfloat16 pair
                memcpy(&pair, xb + (m0 + i) * K + b * 32 + 2 * p, sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                part[i][0] = _mm512_dpbf16_ps(part[i][0], xv, w0);
                part[i][1] = _mm512_dpbf16_ps(part[i][1], xv, w1);
            }
        }
        scale_block(R, ks, 32, bits == 4, ds, ms, b, xsum + m0 * nb + b, nb, part, acc);
    }
    for (int64_t i = 0; i < R; i++) {
        float* yr = y + (m0 + i) * y_stride + n0;
        _mm512_mask_storeu_ps(yr, live0, acc[i][0]);
        _mm512_mask_storeu_ps(yr + 16, live1, acc[i][1]);
    }
}

#define TILE_BF16(RV) \
    case RV: tile_bf16(RV, bits, ks, xb, K, xsum, m0, qbuf, d, m, s, k0, kn, y, y_stride, N, k0 == 0); break;

static void gemm_blocks_bf16(int bits, int ks, const uint8_t* q, const float* d, const float* m, const float* x,
                             int64_t x_stride, float* y, int64_t y_stride, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / 32, strips = (N + NS - 1) / NS;
    uint16_t* xb = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)(M * K));
    float* xsum = (float*)malloc(sizeof(float) * (size_t)(M * nb));
    round_rows_bf16(x, x_stride, M, K, xb);
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < nb; b++) {
            const uint16_t* xr = xb + i * K + b * 32;
            xsum[i * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(vload(xr, 0, 1), vload(xr, 16, 1)));
        }
    uint16_t values[32];  // bfloat16 0 .. 15, twice (see gemv_strip_bf16): what a Q4_1 nibble stands for
    for (int v = 0; v < 32; v++) values[v] = f32_to_bf16((float)(v & 15));
    const __m512i table = _mm512_loadu_si512(values);
    if (bits == 4) {
        const int64_t groups = (M + GEMV_ROWS - 1) / GEMV_ROWS;  // row groups as even as they come
        _Pragma("omp parallel for schedule(static)")
        for (int64_t s = 0; s < strips; s++)
            for (int64_t g = 0, r0 = 0; g < groups; g++) {
                const int64_t rows = M / groups + (g < M % groups);
                const uint16_t* xg = xb + r0 * K;
                const float* sg = xsum + r0 * nb;
                float* yg = y + r0 * y_stride;
                switch (rows) { GEMV_BF16(1) GEMV_BF16(2) GEMV_BF16(3) GEMV_BF16(4) GEMV_BF16(5) GEMV_BF16(6) }
                r0 += rows;
            }
        free(xsum);
        free(xb);
        return;
    }
    // row tiles as even as they come (8 rows: 4 + 4, not 6 + 2: a short tile reloads qbuf for few rows)
    const int64_t n_tiles = (M + MB_BF16 - 1) / MB_BF16;
    _Pragma("omp parallel")
    {
        uint32_t qbuf[KC / 2 * NS] __attribute__((aligned(64)));
        _Pragma("omp for schedule(static)")
        for (int64_t s = 0; s < strips; s++)
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kn = K - k0 < KC ? K - k0 : KC;
                unpack_quants_bf16(bits, q, s, K, k0, kn, table, qbuf);
                for (int64_t t = 0, m0 = 0; t < n_tiles; t++) {
                    const int64_t rows = M / n_tiles + (t < M % n_tiles);
                    switch (rows) {
                        TILE_BF16(1) TILE_BF16(2) TILE_BF16(3) TILE_BF16(4) TILE_BF16(5) TILE_BF16(6)
                    }
                    m0 += rows;
                }
            }
    }
    free(xsum);
    free(xb);
}
#endif
#endif

#if !defined(__AVX512F__)
// The same two paths for every other level, over vec.h's VL lanes (AVX2 + FMA: 8; generic C: 8):
// NV vectors per strip, the same sums in the same order per lane as the AVX-512 code, so every
// level computes each output from the same products (summed in lanes of another width).
#define NV (NS / VL)
#define MB_P TILE_ROWS_MAX  // rows per register tile (float_tile.h)

// acc[i] += d * part[i] (+ m * the group's sum of row i's x, where the form has m), as scale_block.
static inline __attribute__((always_inline)) void scale_block_p(const int64_t R, int ks, int g, int has_m,
                                                                const void* ds, const float* ms, int64_t gi,
                                                                const float* xs, int64_t ng, vf (*part)[NV],
                                                                vf (*acc)[NV]) {
    for (int64_t h = 0; h < NV; h++) {
        const vf dv = scales_d(ks, g, has_m, ds, gi, VL * h);
        for (int64_t i = 0; i < R; i++) acc[i][h] = vf_fma(dv, part[i][h], acc[i][h]);
        if (has_m) {
            const vf mv = scales_m(ks, g, ds, ms, gi, VL * h);
            for (int64_t i = 0; i < R; i++) acc[i][h] = vf_fma(mv, vf_set1(xs[i * ng]), acc[i][h]);
        }
    }
}

// The 6-bit form's quants of inputs 2p, 2p + 1 of a block (blk: its 768 bytes) for features
// VL * h .. VL * h + VL - 1, as floats (AVX-512's six_pair: at AVX2 the same steps on 8 bytes, in
// generic C a byte at a time).
static inline void six_pair(const uint8_t* blk, int64_t p, int64_t h, vf* even, vf* odd) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m128i low4 = _mm_set1_epi8(0x0f), top2 = _mm_set1_epi8(0x30), off = _mm_set1_epi8(32);
    const __m128i raw = _mm_loadl_epi64((const __m128i*)(blk + p * NS + VL * h));
    __m128i hb = _mm_loadl_epi64((const __m128i*)(blk + 16 * NS + (p / 2) * NS + VL * h));
    if (p & 1) hb = _mm_srli_epi16(hb, 4);
    const __m128i e = _mm_or_si128(_mm_and_si128(raw, low4), _mm_and_si128(_mm_slli_epi16(hb, 4), top2));
    const __m128i o = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(_mm_slli_epi16(hb, 2), top2));
    *even = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_sub_epi8(e, off)));
    *odd = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_sub_epi8(o, off)));
#else
    int8_t e[VL], o[VL];
    for (int64_t n = 0; n < VL; n++) {
        e[n] = (int8_t)six_strips_q(blk, 2 * p, VL * h + n);
        o[n] = (int8_t)six_strips_q(blk, 2 * p + 1, VL * h + n);
    }
    *even = vf_from_i8(e);
    *odd = vf_from_i8(o);
#endif
}

static inline __attribute__((always_inline)) void gemv_strip(const int64_t R, const int bits, const int g,
                                                             const int has_m, const int ks, const uint8_t* q,
                                                             const float* d, const float* m, int64_t s, int64_t K,
                                                             const float* x, int64_t x_stride, const float* xsum,
                                                             float* y, int64_t y_stride, int64_t N) {
    const int64_t n0 = s * NS, nb = K / 32, ng = K / g, per = 32 / g;
    const void* ds = strip_scales(ks, g, has_m, d, s, K);
    const float* ms = has_m && !ks ? m + s * ng * NS : NULL;
    vf acc[GEMV_ROWS][NV];
    for (int64_t i = 0; i < R; i++)
        for (int64_t h = 0; h < NV; h++) acc[i][h] = vf_zero();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_block(bits, g, has_m, ks, q, d, m, s, K, b + GEMV_AHEAD);
        for (int64_t sub = 0; sub < per; sub++) {
            vf part[GEMV_ROWS][NV];
            for (int64_t i = 0; i < R; i++)
                for (int64_t h = 0; h < NV; h++) part[i][h] = vf_zero();
            if (bits == 4) {
                const uint8_t* qb = q + (s * (K / 2) + b * 16) * NS;
                for (int64_t p = 0; p < 16; p++) {
                    vf x0[GEMV_ROWS], x1[GEMV_ROWS];
                    for (int64_t i = 0; i < R; i++) {
                        x0[i] = vf_set1(x[i * x_stride + b * 32 + 2 * p]);
                        x1[i] = vf_set1(x[i * x_stride + b * 32 + 2 * p + 1]);
                    }
                    for (int64_t h = 0; h < NV; h++) {
                        vf even, odd;
                        vf_from_nibbles(qb + p * NS + VL * h, &even, &odd);
                        for (int64_t i = 0; i < R; i++) {
                            part[i][h] = vf_fma(x0[i], even, part[i][h]);
                            part[i][h] = vf_fma(x1[i], odd, part[i][h]);
                        }
                    }
                }
            } else if (bits == 6) {  // inputs 2p, 2p + 1 of the sub-block's g, in order (as bits 8)
                const uint8_t* blk = q + (s * nb + b) * 768;
                for (int64_t p = sub * g / 2; p < (sub + 1) * g / 2; p++)
                    for (int64_t h = 0; h < NV; h++) {
                        vf even, odd;
                        six_pair(blk, p, h, &even, &odd);
                        for (int64_t i = 0; i < R; i++) {
                            const float* xr = x + i * x_stride + b * 32 + 2 * p;
                            part[i][h] = vf_fma(vf_set1(xr[0]), even, part[i][h]);
                            part[i][h] = vf_fma(vf_set1(xr[1]), odd, part[i][h]);
                        }
                    }
            } else {
                const int64_t k0 = b * 32 + sub * g;
                const int8_t* qb = (const int8_t*)q + (s * K + k0) * NS;
                for (int64_t k = 0; k < g; k++)
                    for (int64_t h = 0; h < NV; h++) {
                        const vf qv = vf_from_i8(qb + k * NS + VL * h);
                        for (int64_t i = 0; i < R; i++)
                            part[i][h] = vf_fma(vf_set1(x[i * x_stride + k0 + k]), qv, part[i][h]);
                    }
            }
            scale_block_p(R, ks, g, has_m, ds, ms, b * per + sub, xsum + b * per + sub, ng, part, acc);
        }
    }
    for (int64_t i = 0; i < R; i++)
        for (int64_t h = 0; h < NV; h++) store_live(y + i * y_stride + n0 + VL * h, acc[i][h], lanes_live(N - n0, h));
}

// Weights of strip s for inputs [k0, k0 + kn) into wbuf [kn][NS], each d * q (+ m) as unpack.
static inline void unpack(int bits, int g, int has_m, int ks, const uint8_t* q, const float* d, const float* m,
                          int64_t s, int64_t K, int64_t k0, int64_t kn, float* wbuf) {
    const int64_t ng = K / g;
    const void* ds = strip_scales(ks, g, has_m, d, s, K);
    const float* ms = has_m && !ks ? m + s * ng * NS : NULL;
    for (int64_t b = k0 / g; b < (k0 + kn) / g; b++) {  // groups of g inputs
        for (int64_t h = 0; h < NV; h++) {
            const vf dv = scales_d(ks, g, has_m, ds, b, VL * h);
            const vf mv = has_m ? scales_m(ks, g, ds, ms, b, VL * h) : vf_zero();
            for (int64_t k = b * g; k < b * g + g; k += 2) {
                float* w = wbuf + (k - k0) * NS + VL * h;
                if (bits == 4) {
                    vf even, odd;
                    vf_from_nibbles(q + (s * (K / 2) + k / 2) * NS + VL * h, &even, &odd);
                    vf_store(w, vf_add(vf_mul(dv, even), mv));
                    vf_store(w + NS, vf_add(vf_mul(dv, odd), mv));
                } else {
                    vf w0, w1;
                    if (bits == 6) {
                        six_pair(q + (s * (K / 32) + k / 32) * 768, (k % 32) / 2, h, &w0, &w1);
                        w0 = vf_mul(dv, w0);
                        w1 = vf_mul(dv, w1);
                    } else {
                        const int8_t* qk = (const int8_t*)q + (s * K + k) * NS + VL * h;
                        w0 = vf_mul(dv, vf_from_i8(qk));
                        w1 = vf_mul(dv, vf_from_i8(qk + NS));
                    }
                    if (has_m) {
                        w0 = vf_add(w0, mv);
                        w1 = vf_add(w1, mv);
                    }
                    vf_store(w, w0);
                    vf_store(w + NS, w1);
                }
            }
        }
    }
}

#define TILE_ROWS(RV) case RV: float_tile(RV, x, x_stride, m0, wbuf, h0, k0, kn, y, y_stride, n0, N, first); break;

static void tiles(const float* x, int64_t x_stride, int64_t M, const float* wbuf, int64_t k0, int64_t kn, float* y,
                  int64_t y_stride, int64_t n0, int64_t N, int first) {
    for (int64_t h0 = 0; h0 < NV; h0 += 2)
        for (int64_t m0 = 0; m0 < M; m0 += MB_P) {
            switch (M - m0 < MB_P ? M - m0 : MB_P) {
                TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4) TILE_ROWS(5) TILE_ROWS(6)
            }
        }
}
#endif

#define GEMV_CASE(RV) \
    case RV: gemv_strip(RV, bits, g, has_m, ks, q, d, m, s, K, xg, x_stride, sg, yg, y_stride, N); break;

// Strip s's M <= GEMV_GROUPS_MAX_ROWS rows in groups of at most GEMV_ROWS, as even as they come, of one
// form (bits, g, has_m, ks: constants where inlined, so each form's GEMV is compiled for itself).
static inline __attribute__((always_inline)) void gemv_groups(const int bits, const int g, const int has_m,
                                                              const int ks, const uint8_t* q, const float* d,
                                                              const float* m, int64_t s, int64_t K, const float* x,
                                                              int64_t x_stride, const float* xsum, float* y,
                                                              int64_t y_stride, int64_t M, int64_t N) {
    const int64_t groups = (M + GEMV_ROWS - 1) / GEMV_ROWS, ng = K / g;
    for (int64_t t = 0, r0 = 0; t < groups; t++) {
        const int64_t rows = M / groups + (t < M % groups);
        const float* xg = x + r0 * x_stride;
        const float* sg = xsum + r0 * ng;
        float* yg = y + r0 * y_stride;
        switch (rows) { GEMV_CASE(1) GEMV_CASE(2) GEMV_CASE(3) GEMV_CASE(4) GEMV_CASE(5) GEMV_CASE(6) }
        r0 += rows;
    }
}

// form: blocks.h's (bits 4: Q4_1's d, m; 8: Q8_0's d, with MIN_FLAG an m too, with G16_FLAG d and m
// per 16 inputs), | DOT_FLAG for q in gemm_dot.c's layout (its integer dot products). K a multiple of
// 32. Returns 0 where the shape or form is not one it takes (the caller keeps its float path).
// round_bf16: the blocks stand for a bfloat16 model's weights, so their GEMMs (Q8_0: of
// BF16_MIN_ROWS or more rows) may round x to bfloat16 and use VDPBF16PS (gemm_blocks_bf16) where
// this CPU has it; only Q4_1's and Q8_0's forms do (the bfloat16 kernels know no minimum on 8-bit
// quants nor scales per 16): the others keep float32 x and these float32 products, which multiply
// by the same exact weights.
int relay_gemm_blocks(int form, const uint8_t* q, const float* d, const float* m, const float* x, int64_t x_stride,
                      float* y, int64_t y_stride, int64_t M, int64_t N, int64_t K, int round_bf16) {
    if (form & DOT_FLAG) return relay_gemm_dot(form & ~DOT_FLAG, q, d, m, x, x_stride, y, y_stride, M, N, K);
    if (K % 32 || M < 1 || !form_valid(form) || (form_ks(form) && K % QK_K)) return 0;
    const int bits = form_bits(form), g = form_group(form), has_m = form_has_m(form), ks = form_ks(form);
    const int64_t strips = (N + NS - 1) / NS, ng = K / g;
#if defined(__AVX512BF16__)
    if (round_bf16 && g == 32 && bits != 6 && (bits == 4 || !has_m) && (M >= BF16_MIN_ROWS || bits == 4)) {
        gemm_blocks_bf16(bits, ks, q, d, m, x, x_stride, y, y_stride, M, N, K);
        return 1;
    }
#endif
    if (M <= GEMV_GROUPS_MAX_ROWS) {
        float* xsum = (float*)malloc(sizeof(float) * (size_t)(M * ng));  // each row's sum per group (m's term)
        for (int64_t i = 0; i < (has_m ? M : 0); i++)
            for (int64_t b = 0; b < ng; b++) {
                float t = 0.f;
                for (int64_t k = 0; k < g; k++) t += x[i * x_stride + b * g + k];
                xsum[i * ng + b] = t;
            }
        _Pragma("omp parallel for schedule(static)")
        for (int64_t s = 0; s < strips; s++) {
#define GEMV_FORM(B, G, HM, KS) gemv_groups(B, G, HM, KS, q, d, m, s, K, x, x_stride, xsum, y, y_stride, M, N)
            if (ks) {  // each form compiled for itself, with its scales in KS_FLAG records or not
                if (bits == 4) GEMV_FORM(4, 32, 1, 1);
                else if (bits == 6 && g == 32 && !has_m) GEMV_FORM(6, 32, 0, 1);
                else if (bits == 6 && g == 32) GEMV_FORM(6, 32, 1, 1);
                else if (bits == 6 && !has_m) GEMV_FORM(6, 16, 0, 1);
                else if (bits == 6) GEMV_FORM(6, 16, 1, 1);
                else if (g == 32 && !has_m) GEMV_FORM(8, 32, 0, 1);
                else if (g == 32) GEMV_FORM(8, 32, 1, 1);
                else if (!has_m) GEMV_FORM(8, 16, 0, 1);
                else GEMV_FORM(8, 16, 1, 1);
            } else {
                if (bits == 4) GEMV_FORM(4, 32, 1, 0);
                else if (bits == 6 && g == 32 && !has_m) GEMV_FORM(6, 32, 0, 0);
                else if (bits == 6 && g == 32) GEMV_FORM(6, 32, 1, 0);
                else if (bits == 6 && !has_m) GEMV_FORM(6, 16, 0, 0);
                else if (bits == 6) GEMV_FORM(6, 16, 1, 0);
                else if (g == 32 && !has_m) GEMV_FORM(8, 32, 0, 0);
                else if (g == 32) GEMV_FORM(8, 32, 1, 0);
                else if (!has_m) GEMV_FORM(8, 16, 0, 0);
                else GEMV_FORM(8, 16, 1, 0);
            }
#undef GEMV_FORM
        }
        free(xsum);
        return 1;
    }
    _Pragma("omp parallel")
    {
        float wbuf[KC * NS] __attribute__((aligned(64)));
        _Pragma("omp for schedule(static)")
        for (int64_t s = 0; s < strips; s++)
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kn = K - k0 < KC ? K - k0 : KC;
                unpack(bits, g, has_m, ks, q, d, m, s, K, k0, kn, wbuf);
                tiles(x, x_stride, M, wbuf, k0, kn, y, y_stride, s * NS, N, k0 == 0);
            }
    }
    (void)round_bf16;  // used where the CPU has AVX512-BF16
    return 1;
}
