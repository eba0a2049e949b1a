// GEMMs on GGUF blocks in 8-bit integer dot products, as llama.cpp runs them: y[M, N] = x[M, K] . W^T
// with x rounded to 8 bits per block of 32 (one float scale a block), then integer sums of quant
// products and one float multiply-add per block. gemm_blocks.c's float path turns every weight into a
// float before its FMA; here a 32-byte load feeds 64 multiply-adds in two VPMADDUBSW (AVX2) or two
// VPDPBUSD (AVX512-VNNI), and AVX-512 pairs two such loads in one register, so a decode step's GEMVs
// do a third of the instructions (a sixth at AVX-512) and come near the speed of reading the weights (docs/benchmarks.md). The cost is x's rounding: ~0.4 % of a block's
// largest value (BlockWeight.dot, chosen per server with --block-activations).
//
// Layout ("dot", relay/execution/weight_blocks.py dot_layout), per strip s of 32 output features: 4 groups g of 8
// features, then the K / 32 blocks, then per block 32-byte units of 8 features x 4 bytes (feature
// f's bytes 4f .. 4f + 3):
//   Q4_1: 4 units per block; unit o byte 4f + j = q[f][8o + j] | q[f][8o + 4 + j] << 4
//   Q8_0: 8 units per block; unit o byte 4f + j = q[f][4o + j] (int8)
// so one unit's low nibbles (or its bytes) are the quants of 4 consecutive inputs for each of 8
// features: VPMADDUBSW + VPMADDWD (or VPDPBUSD) against those 4 inputs of x broadcast gives 8 int32
// sums. d and m stay as gemm_blocks.c has them: float32 [s][K / g][32], g the group (blocks.h), or
// with KS_FLAG the k-quants' compact records (blocks.h: per strip and super-block of 256 the float16
// D and -Dmin and int8 sub-block scales and mins), from which each group's d = D * sc and
// m = -Dmin * mn are computed in registers (kscales.h), the same float32 values the arrays hold.
//
// The k-quants' forms (blocks.h) take the 8-bit layout as it is: with scales per 16 inputs (Q6_K)
// units 0-3 of a block are its first 16 inputs, units 4-7 the next 16, each half's integer sum
// scaled by its own d; with a minimum (Q5_K, Q5_1, mixed fused weights) m times the exact float
// sum of x over its group is added, as for Q4_1. x is rounded per 32 inputs whatever the group.
// Quants in 0..31 (U5_FLAG) are multiplied as unsigned bytes directly; signed ones (Q6_K's -32..31,
// Q8_0's) as |q| times x with q's sign, as Q8_0.
//
// The 6-bit form (blocks.h: u = q + 32 in 0..63, Q6_K's quants as the file has them) takes bits 4's
// 4 units per block for u's low nibbles and two 32-byte units H0, H1 after them for the high 2 bits
// (the 2-bit fields of unit o's low and high nibbles at bits 4 (o % 2) and 4 (o % 2) + 2 of H[o / 2]'s
// bytes): per unit a shift and two masks put them above the nibbles, and the unsigned 0..63 bytes
// go into VPDPBUSD (or VPMADDUBSW: 2 * 63 * 127 = 16,002, two of them 32,004 < 2^15 in 16 bits) as
// they are; a group's integer sum then loses 32 times the group's sum of qx (an exact integer,
// quantize_rows'), so it is the 8-bit form's sum of q . qx: the same outputs bit for bit, from
// 6 bits a quant instead of 8.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "kscales.h"
#include "vec.h"

#define NS 32  // output features per strip
#define FG 8  // features per group (one 8 x int32 accumulator)
#ifndef DOT_AHEAD
#define DOT_AHEAD 8  // blocks ahead the units (and d, m) are prefetched
#endif
#ifndef YMM_MAX_K
#define YMM_MAX_K 2048  // AVX-512: single rows this short (in inputs) run 8 features a pass
#endif

// x's rows in 8 bits: per block of 32, dx = max |x| / 127, qx = round(x / dx); xs the float sums of
// x per group of g inputs (32, or 16: the m term uses them exactly, as gemm_blocks.c does). Called
// inside the GEMM's parallel region: a prompt's rows split over the threads (single-threaded scalar
// code here was a third of a 256-token chunk's GEMM time at AVX2).
// The sum of a group of 32 or 16 in one fixed order whatever the level's vector width (8 lanes of
// 4 or 2, then pairs), so that every level gives the same output bit for bit.
static inline float group_sum(const float* xb, int64_t g) {
    float part[8];
    for (int j = 0; j < 8; j++) {
        part[j] = xb[j];
        for (int64_t r = 8; r < g; r += 8) part[j] += xb[r + j];
    }
    return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

// qs (NULL: not wanted): the integer sums of qx per group of g (the 6-bit form's offset term).
static void quantize_rows(const float* x, int64_t x_stride, int64_t M, int64_t K, int64_t g, int8_t* qx, float* dx,
                          float* xs, int32_t* qs) {
    const int64_t nb = K / 32, ng = K / g;
    _Pragma("omp for schedule(static)")
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float* xb = x + i * x_stride + b * 32;
            vf amax = vf_zero();
            for (int64_t k = 0; k < 32; k += VL) {
                const vf v = vf_load(xb + k);
                amax = vf_max(amax, vf_max(v, vf_sub(vf_zero(), v)));
            }
            const float top = vf_hmax(amax), inv = top > 0.f ? 127.f / top : 0.f;
            for (int64_t k = 0; k < 32; k += VL) vf_store_i8(qx + i * K + b * 32 + k, vf_mul(vf_load(xb + k), vf_set1(inv)));
            dx[i * nb + b] = top / 127.f;
            for (int64_t h = 0; h < 32 / g; h++) xs[i * ng + b * (32 / g) + h] = group_sum(xb + h * g, g);
            for (int64_t h = 0; h < (qs ? 32 / g : 0); h++) {
                int32_t t = 0;
                for (int64_t k = 0; k < g; k++) t += qx[i * K + b * 32 + h * g + k];
                qs[i * ng + b * (32 / g) + h] = t;
            }
        }
}

static inline int32_t load4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

// An integer vector over the same lanes as vec.h's vf: one int32 sum per output feature. A kernel
// pass covers FEATS features: one group of 8 (AVX2), or two adjacent groups (AVX-512), whose units
// lie group_bytes apart, so the same layout feeds both widths.
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(VEC_YMM)
#define FEATS 16
#if defined(__AVX512VNNI__)
#define DOT_ROWS 8  // 32 registers: 8 int32 + 8 float accumulators + temporaries
#else
// without VNNI the multiplies' temporaries (VPMADDUBSW, VPMADDWD, 16-bit sums) need more: 8 rows in
// one group ran 1.3-1.6x slower than two groups of 4 (Zen 4 held at x86-64-v4)
#define DOT_ROWS 6
#endif
typedef __m512i vi;
static inline vi units_load(const uint8_t* p, int64_t group_bytes) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p)),
                              _mm256_loadu_si256((const __m256i*)(p + group_bytes)), 1);
}
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline vi vi_low4(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
static inline vi vi_high4(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
static inline vi vi_abs8(vi v) { return _mm512_abs_epi8(v); }
// x negated where w is negative (AVX-512 has no VPSIGNB; where w is 0 the product is 0 either way)
static inline vi vi_sign8(vi x, vi w) { return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), vi_zero(), x); }
static inline vf vi_to_vf(vi v) { return _mm512_cvtepi32_ps(v); }
// acc += w . x per 32-bit lane, w unsigned, x signed
static inline vi dot_u8s8(vi acc, vi w, vi x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
}
static inline vi add_u4s8_16(vi acc16, vi w, vi x) { return _mm512_add_epi16(acc16, _mm512_maddubs_epi16(w, x)); }
static inline vi widen16(vi acc16) { return _mm512_madd_epi16(acc16, _mm512_set1_epi16(1)); }
static inline vi vi_add32(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_sub32(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vi vi_srli4(vi v) { return _mm512_srli_epi16(v, 4); }
// the 6-bit form's u of a unit's low (six_lo) and high (six_hi) nibbles, hs its H unit shifted so that
// the unit's fields are at bits 0-1 (low) and 2-3 (high) of each byte
static inline vi six_lo(vi raw, vi hs) {
    return _mm512_or_si512(vi_low4(raw), _mm512_and_si512(_mm512_slli_epi16(hs, 4), _mm512_set1_epi8(0x30)));
}
static inline vi six_hi(vi raw, vi hs) {
    return _mm512_or_si512(vi_high4(raw), _mm512_and_si512(_mm512_slli_epi16(hs, 2), _mm512_set1_epi8(0x30)));
}
#elif defined(__AVX2__)
#define FEATS 8
#define DOT_ROWS 6  // 16 registers: 6 int32 + 6 float accumulators + temporaries
typedef __m256i vi;
static inline vi units_load(const uint8_t* p, int64_t group_bytes) {
    (void)group_bytes;
    return _mm256_loadu_si256((const __m256i*)p);
}
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_set1(int32_t v) { return _mm256_set1_epi32(v); }
static inline vi vi_low4(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
static inline vi vi_high4(vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }
static inline vi vi_abs8(vi v) { return _mm256_abs_epi8(v); }
static inline vi vi_sign8(vi x, vi w) { return _mm256_sign_epi8(x, w); }
static inline vf vi_to_vf(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vi dot_u8s8(vi acc, vi w, vi x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, x);
#else
    // pairs of products: 2 * 15 * 127 < 2^15, so VPMADDUBSW never saturates here
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}
static inline vi add_u4s8_16(vi acc16, vi w, vi x) { return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, x)); }
static inline vi widen16(vi acc16) { return _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)); }
static inline vi vi_add32(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi vi_sub32(vi a, vi b) { return _mm256_sub_epi32(a, b); }
static inline vi vi_srli4(vi v) { return _mm256_srli_epi16(v, 4); }
static inline vi six_lo(vi raw, vi hs) {
    return _mm256_or_si256(vi_low4(raw), _mm256_and_si256(_mm256_slli_epi16(hs, 4), _mm256_set1_epi8(0x30)));
}
static inline vi six_hi(vi raw, vi hs) {
    return _mm256_or_si256(vi_high4(raw), _mm256_and_si256(_mm256_slli_epi16(hs, 2), _mm256_set1_epi8(0x30)));
}
#endif

#if defined(__AVX2__)
// Without VNNI a Q4 block's 8 VPMADDUBSW outputs per row add up in 16 bits (each at most
// 2 * 15 * 127 = 3,810 in magnitude, 8 of them 30,480 < 2^15: never saturating) and widen to 32 bits
// once per block: one VPMADDWD instead of eight, on the same two ports as the multiplies; quants in
// 0..31 (U5_FLAG) the same per 4 units (4 * 2 * 31 * 127 = 31,496 < 2^15).
#if defined(__AVX512VNNI__)
#define SUM16 0
#else
#define SUM16 1
#endif
// y[0 .. R, features n0 .. n0 + FEATS] = x . W^T for R <= DOT_ROWS rows, from the units wq (and, at
// AVX-512, the next group's at wq + group_bytes). bits, g, has_m, u5: the form (blocks.h), constants
// where inlined (dot_form), so that each form is compiled for itself.
static inline __attribute__((always_inline)) void dot_features(const int64_t R, const int bits, const int g,
                                                               const int has_m, const int u5, const int ks,
                                                               const uint8_t* wq, int64_t group_bytes, const void* ds,
                                                               const float* ms, int64_t fo, const float* d, int64_t s,
                                                               const int8_t* qx, const float* dx, const float* xs,
                                                               const int32_t* qs, int64_t K, float* y, int64_t y_stride,
                                                               int64_t live) {
    // units: 32-byte units of quants per block (bits 6: its nibbles'; the 2 high units follow them)
    const int64_t nb = K / 32, ng = K / g, per = 32 / g, units = bits == 8 ? 8 : 4, sub_units = units / per;
    const int64_t block_bytes = form_block_bytes(bits) / 4;  // per group of 8 features
    vf acc[DOT_ROWS];
    for (int64_t i = 0; i < R; i++) acc[i] = vf_zero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* ub = wq + b * block_bytes;
        // block b + DOT_AHEAD's units, past the unit's end the next unit's (at AVX2 the same bytes:
        // its one stream runs on into the next; at AVX-512 the next unit's second stream starts
        // group_bytes on: 1.1-1.2x at 1-8 rows on 2048-input Q4_K weights, Zen 4)
        const int64_t ahead = b + DOT_AHEAD;
        const uint8_t* pb = ahead < nb ? wq + ahead * block_bytes
                                       : wq + (FEATS / FG) * group_bytes + (ahead - nb) * block_bytes;
        for (int64_t o = 0; o < block_bytes; o += 64) {  // (past the weight's end: no fault)
            _mm_prefetch((const char*)(pb + o), _MM_HINT_T0);
            if (FEATS > FG) _mm_prefetch((const char*)(pb + group_bytes + o), _MM_HINT_T0);
        }
        if (ks) KS_PREFETCH(g, has_m, d, s, K, b + DOT_AHEAD, 3);  // its share of the strip's records
        else
            for (int64_t h = 0; h < per; h++) {  // and its d (and m): FEATS floats per group
                _mm_prefetch((const char*)((const float*)ds + ((b + DOT_AHEAD) * per + h) * NS + fo), _MM_HINT_T0);
                if (has_m) _mm_prefetch((const char*)(ms + ((b + DOT_AHEAD) * per + h) * NS + fo), _MM_HINT_T0);
            }
        for (int64_t h = 0; h < per; h++) {  // groups of g inputs in the block: units h * sub_units on
            vi isum[DOT_ROWS];
            for (int64_t i = 0; i < R; i++) isum[i] = vi_zero();
            if (bits == 4) {
                for (int64_t o = 0; o < units; o++) {
                    const vi raw = units_load(ub + o * 32, group_bytes);
                    const vi lo = vi_low4(raw), hi = vi_high4(raw);
                    for (int64_t i = 0; i < R; i++) {
                        const int8_t* xr = qx + i * K + b * 32 + 8 * o;
#if SUM16
                        isum[i] = add_u4s8_16(isum[i], lo, vi_set1(load4(xr)));
                        isum[i] = add_u4s8_16(isum[i], hi, vi_set1(load4(xr + 4)));
#else
                        isum[i] = dot_u8s8(isum[i], lo, vi_set1(load4(xr)));
                        isum[i] = dot_u8s8(isum[i], hi, vi_set1(load4(xr + 4)));
#endif
                    }
                }
#if SUM16
                for (int64_t i = 0; i < R; i++) isum[i] = widen16(isum[i]);
#endif
            } else if (bits == 6) {  // u in 0..63 unsigned, a pair of units per H unit; then - 32 sum(qx)
                for (int64_t o0 = h * sub_units; o0 < (h + 1) * sub_units; o0 += 2) {
                    const vi hv = units_load(ub + 128 + (o0 / 2) * 32, group_bytes);
                    for (int64_t v = 0; v < 2; v++) {
                        const int64_t o = o0 + v;
                        const vi raw = units_load(ub + o * 32, group_bytes), hs = v ? vi_srli4(hv) : hv;
                        const vi lo = six_lo(raw, hs), hi = six_hi(raw, hs);
                        for (int64_t i = 0; i < R; i++) {
                            const int8_t* xr = qx + i * K + b * 32 + 8 * o;
#if SUM16
                            const vi t = add_u4s8_16(add_u4s8_16(vi_zero(), lo, vi_set1(load4(xr))), hi,
                                                     vi_set1(load4(xr + 4)));
                            isum[i] = vi_add32(isum[i], widen16(t));
#else
                            isum[i] = dot_u8s8(isum[i], lo, vi_set1(load4(xr)));
                            isum[i] = dot_u8s8(isum[i], hi, vi_set1(load4(xr + 4)));
#endif
                        }
                    }
                }
                for (int64_t i = 0; i < R; i++) isum[i] = vi_sub32(isum[i], vi_set1(32 * qs[i * ng + b * per + h]));
            } else if (u5 && SUM16) {  // unsigned quants 0..31: 4 units' pairs add up in 16 bits, then widen
                for (int64_t o0 = h * sub_units; o0 < (h + 1) * sub_units; o0 += 4) {
                    vi raw[4];
                    for (int64_t o = 0; o < 4; o++) raw[o] = units_load(ub + (o0 + o) * 32, group_bytes);
                    for (int64_t i = 0; i < R; i++) {
                        const int8_t* xr = qx + i * K + b * 32 + 4 * o0;
                        vi t = vi_zero();
                        for (int64_t o = 0; o < 4; o++) t = add_u4s8_16(t, raw[o], vi_set1(load4(xr + 4 * o)));
                        isum[i] = vi_add32(isum[i], widen16(t));
                    }
                }
            } else {
                for (int64_t o = h * sub_units; o < (h + 1) * sub_units; o++) {
                    const vi raw = units_load(ub + o * 32, group_bytes);
                    if (u5) {  // unsigned quants: as they are (VPDPBUSD)
                        for (int64_t i = 0; i < R; i++)
                            isum[i] = dot_u8s8(isum[i], raw, vi_set1(load4(qx + i * K + b * 32 + 4 * o)));
                    } else {  // signed weights: |w| times x with w's sign (q8 is never -128)
                        const vi aw = vi_abs8(raw);
                        for (int64_t i = 0; i < R; i++)
                            isum[i] = dot_u8s8(isum[i], aw, vi_sign8(vi_set1(load4(qx + i * K + b * 32 + 4 * o)), raw));
                    }
                }
            }
            const int64_t gi = b * per + h;
            const vf dv = scales_d(ks, g, has_m, ds, gi, fo);
            const vf mv = has_m ? scales_m(ks, g, ds, ms, gi, fo) : vf_zero();
            for (int64_t i = 0; i < R; i++) {
                acc[i] = vf_fma(vf_mul(dv, vf_set1(dx[i * nb + b])), vi_to_vf(isum[i]), acc[i]);
                if (has_m) acc[i] = vf_fma(mv, vf_set1(xs[i * ng + gi]), acc[i]);
            }
        }
    }
    for (int64_t i = 0; i < R; i++) {
        if (live == FEATS) vf_store(y + i * y_stride, acc[i]);
        else vf_store_n(y + i * y_stride, acc[i], live);
    }
}
#else
#define FEATS 8
#define DOT_ROWS 6
// The same sums in plain C (any CPU): integer products summed exactly, then the same float steps.
static inline void dot_features(const int64_t R, const int bits, const int g, const int has_m, const int u5,
                                const int ks, const uint8_t* wq, int64_t group_bytes, const void* ds, const float* ms,
                                int64_t fo, const float* d, int64_t s, const int8_t* qx, const float* dx,
                                const float* xs, const int32_t* qs, int64_t K, float* y, int64_t y_stride,
                                int64_t live) {
    (void)group_bytes;
    (void)d;
    (void)s;
    (void)u5;  // (the sums are the same, signed or not)
    (void)qs;  // (q = u - 32 taken as it is)
    const int64_t nb = K / 32, ng = K / g, per = 32 / g, units = bits == 8 ? 8 : 4, sub_units = units / per;
    const int64_t block_bytes = form_block_bytes(bits) / 4;
    float acc[DOT_ROWS][FG] = {{0}};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* ub = wq + b * block_bytes;
        for (int64_t h = 0; h < per; h++) {
            int32_t isum[DOT_ROWS][FG] = {{0}};
            for (int64_t o = h * sub_units; o < (h + 1) * sub_units; o++)
                for (int64_t f = 0; f < FG; f++)
                    for (int64_t j = 0; j < 4; j++) {
                        const uint8_t byte = ub[o * 32 + 4 * f + j];
                        for (int64_t i = 0; i < R; i++) {
                            const int8_t* xr = qx + i * K + b * 32;
                            if (bits == 4)
                                isum[i][f] += (byte & 15) * xr[8 * o + j] + (byte >> 4) * xr[8 * o + 4 + j];
                            else if (bits == 6)
                                isum[i][f] += six_dot_q(ub, o, f, j, 0) * xr[8 * o + j] +
                                              six_dot_q(ub, o, f, j, 1) * xr[8 * o + 4 + j];
                            else
                                isum[i][f] += (int8_t)byte * xr[4 * o + j];
                        }
                    }
            const int64_t gi = b * per + h;
            for (int64_t i = 0; i < R; i++)
                for (int64_t f = 0; f < FG; f++) {
                    const float scale = scale_d1(ks, g, has_m, ds, gi, fo + f) * dx[i * nb + b];
                    acc[i][f] = fmaf(scale, (float)isum[i][f], acc[i][f]);
                    if (has_m) acc[i][f] = fmaf(scale_m1(ks, g, ds, ms, gi, fo + f), xs[i * ng + gi], acc[i][f]);
                }
        }
    }
    for (int64_t i = 0; i < R; i++) memcpy(y + i * y_stride, acc[i], sizeof(float) * (size_t)live);
}
#endif

#define DOT_CASE(RV)                                                                                               \
    case RV:                                                                                                       \
        dot_features(RV, bits, g, has_m, u5, ks, wq, group_bytes, ds, ms, fo, d, s, qx + r0 * K, dx + r0 * nb,      \
                     xs + r0 * ng, qs ? qs + r0 * ng : NULL, K, y + r0 * y_stride + n0, y_stride, live);           \
        break;

// M rows over one work unit (FEATS features of strip s) of one form (constants where inlined), in
// row groups of at most DOT_ROWS, as even as they come (the units read again from L1/L2 per group).
static inline __attribute__((always_inline)) void dot_form(const int bits, const int g, const int has_m, const int u5,
                                                           const int ks, const uint8_t* wq, int64_t group_bytes,
                                                           const float* d, const float* m, int64_t s,
                                                           const int8_t* qx, const float* dx, const float* xs,
                                                           const int32_t* qs, int64_t M, int64_t K, float* y,
                                                           int64_t y_stride, int64_t n0, int64_t live) {
    const int64_t nb = K / 32, ng = K / g, row_groups = (M + DOT_ROWS - 1) / DOT_ROWS, fo = n0 - s * NS;
    const void* ds = strip_scales(ks, g, has_m, d, s, K);  // strip s's scales (kscales.h)
    const float* ms = has_m && !ks ? m + s * ng * NS : NULL;
    for (int64_t t = 0, r0 = 0; t < row_groups; t++) {
        const int64_t rows = M / row_groups + (t < M % row_groups);
        switch (rows) {
            DOT_CASE(1) DOT_CASE(2) DOT_CASE(3) DOT_CASE(4) DOT_CASE(5) DOT_CASE(6)
#if DOT_ROWS > 6
            DOT_CASE(7) DOT_CASE(8)
#endif
        }
        r0 += rows;
    }
}

// form: blocks.h's (bits 4: Q4_1's d, m; 8: Q8_0's d, with MIN_FLAG an m, with G16_FLAG d and m per
// 16 inputs, with U5_FLAG quants in 0..31), q in the dot layout above, K a multiple of 32. Every row
// count: rows go in groups of at most DOT_ROWS over each FEATS features.
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(VEC_YMM)
int relay_gemm_dot_ymm(int form, const uint8_t* q, const float* d, const float* m, const float* x, int64_t x_stride,
                       float* y, int64_t y_stride, int64_t M, int64_t N, int64_t K);  // gemm_dot_ymm.c
#endif

int relay_gemm_dot(int form, const uint8_t* q, const float* d, const float* m, const float* x, int64_t x_stride,
                   float* y, int64_t y_stride, int64_t M, int64_t N, int64_t K) {
    if (K % 32 || M < 1 || !form_valid(form) || (form_ks(form) && K % QK_K)) return 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(VEC_YMM)
    // One row over short rows (YMM_MAX_K inputs or fewer) runs 8 features a pass, as AVX2 does (with
    // VNNI where the CPU has it): the same bits. Two groups a pass read two streams of quants, which
    // on a 2-core Zen 4 at 1 row streamed 2048-input weights 1.2-1.4x slower than one stream (Q4_K,
    // 6- and 8-bit Q6_K alike; better prefetching of the second stream did not close it), while
    // longer rows and 4 rows and more are 1.2-2x faster with two. The rule is the row's length, not
    // the streams' distance: 4096-input Q4_K weights (an 8B model's q/k/v, o, gate/up), 16 KiB apart
    // as 2048-input 8-bit ones are, ran 1.22x faster with two (one thread, Zen 4).
    if (M == 1 && K <= YMM_MAX_K)
        return relay_gemm_dot_ymm(form, q, d, m, x, x_stride, y, y_stride, M, N, K);
#endif
    const int bits = form_bits(form), g = form_group(form), has_m = form_has_m(form), ks = form_ks(form);
    const int u5 = bits == 8 && (form & U5_FLAG);
    const int64_t nb = K / 32, ng = K / g, strips = (N + NS - 1) / NS, group_bytes = nb * form_block_bytes(bits) / 4;
    int8_t* qx = (int8_t*)malloc((size_t)(M * K));
    float* dx = (float*)malloc(sizeof(float) * (size_t)(M * nb));
    float* xs = (float*)malloc(sizeof(float) * (size_t)(M * ng));
    int32_t* qs = bits == 6 ? (int32_t*)malloc(sizeof(int32_t) * (size_t)(M * ng)) : NULL;
    const int64_t per_strip = NS / FEATS;
    _Pragma("omp parallel")
    {
    quantize_rows(x, x_stride, M, K, g, qx, dx, xs, qs);  // (its omp for ends in a barrier)
    _Pragma("omp for schedule(static)")
    for (int64_t u = 0; u < strips * per_strip; u++) {
        const int64_t s = u / per_strip, n0 = s * NS + (u % per_strip) * FEATS;
        const int64_t live = N - n0 >= FEATS ? FEATS : N - n0 > 0 ? N - n0 : 0;
        if (!live) continue;
        const uint8_t* wq = q + u * (FEATS / FG) * group_bytes;
        // each form compiled for itself (U5_FLAG taken where the quants are Q5_K's or Q5_1's, with
        // a minimum and scales per 32: elsewhere the quants go the signed way, to the same sums),
        // with its scales as float32 arrays or KS_FLAG records
#define DOT_FORM(B, G, HM, U, KS) \
    dot_form(B, G, HM, U, KS, wq, group_bytes, d, m, s, qx, dx, xs, qs, M, K, y, y_stride, n0, live)
        if (ks) {
            if (bits == 4) DOT_FORM(4, 32, 1, 0, 1);
            else if (bits == 6 && g == 32 && !has_m) DOT_FORM(6, 32, 0, 0, 1);
            else if (bits == 6 && g == 32) DOT_FORM(6, 32, 1, 0, 1);
            else if (bits == 6 && !has_m) DOT_FORM(6, 16, 0, 0, 1);
            else if (bits == 6) DOT_FORM(6, 16, 1, 0, 1);
            else if (g == 32 && !has_m) DOT_FORM(8, 32, 0, 0, 1);
            else if (g == 32 && u5) DOT_FORM(8, 32, 1, 1, 1);
            else if (g == 32) DOT_FORM(8, 32, 1, 0, 1);
            else if (!has_m) DOT_FORM(8, 16, 0, 0, 1);
            else DOT_FORM(8, 16, 1, 0, 1);
        } else {
            if (bits == 4) DOT_FORM(4, 32, 1, 0, 0);
            else if (bits == 6 && g == 32 && !has_m) DOT_FORM(6, 32, 0, 0, 0);
            else if (bits == 6 && g == 32) DOT_FORM(6, 32, 1, 0, 0);
            else if (bits == 6 && !has_m) DOT_FORM(6, 16, 0, 0, 0);
            else if (bits == 6) DOT_FORM(6, 16, 1, 0, 0);
            else if (g == 32 && !has_m) DOT_FORM(8, 32, 0, 0, 0);
            else if (g == 32 && u5) DOT_FORM(8, 32, 1, 1, 0);
            else if (g == 32) DOT_FORM(8, 32, 1, 0, 0);
            else if (!has_m) DOT_FORM(8, 16, 0, 0, 0);
            else DOT_FORM(8, 16, 1, 0, 0);
        }
#undef DOT_FORM
    }
    }
    free(qs);
    free(xs);
    free(dx);
    free(qx);
    return 1;
}
