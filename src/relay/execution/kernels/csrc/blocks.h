// The block forms relay_gemm_blocks (gemm_blocks.c) and relay_gemm_dot (gemm_dot.c) read, all told by
// the one `bits` int they take (weight_blocks.BlockWeight.kernel_bits; the one-call decode step's
// LayerGemm.bits carries it as it is):
//
//   bits & 0xff   4: w = d * q + m, q 0..15 as nibbles (Q4_1, Q4_K); 8: w = d * q (+ m), q int8;
//                 6: w = d * (u - 32) (+ m), u 0..63 in 6 bits (Q6_K, and any 8-bit form whose quants
//                 all lie in -32..31: Q5_K, Q5_1, a fused Q4_K/Q6_K q/k/v), the same weights as the
//                 8-bit form with q = u - 32 in 6.5 bits a weight instead of 8.5 (layouts below)
//   DOT_FLAG      q in gemm_dot.c's layout: integer dot products on x rounded to 8 bits
//   MIN_FLAG      bits 8 (or 6) with a minimum: w = d * q + m (Q5_K, Q5_1, fused weights of mixed types);
//                 without it m is not read (it may be NULL). bits 4 always has one.
//   G16_FLAG      d (and m) per 16 inputs, [strips][K / 16][32], not per 32 (Q6_K, and fused
//                 weights with a Q6_K part); bits 8 or 6 only
//   U5_FLAG       bits 8 quants all in 0..31 (Q5_K, Q5_1, lifted 4-bit ones): the dot products take
//                 them as unsigned bytes as they are (no sign juggling, and without VNNI four units'
//                 VPMADDUBSW pairs add up in 16 bits: 4 * 2 * 31 * 127 = 31,496 < 2^15). A hint:
//                 without it the same quants go the signed way, to the same sums.
//   KS_FLAG       d (and m) not as float32 arrays but in the k-quants' own compact scales: `d` points
//                 to one record per strip and super-block of 256 inputs (K a multiple of 256), `m` is
//                 not read (NULL will do). Any bits / group / minimum above (Q4_K: 4; Q5_K: 8 with m,
//                 per 32; Q6_K: 8 per 16; a fused Q4_K/Q6_K q/k/v: 8 per 16 with m).
//
// A KS_FLAG record, strip s and super-block j at d + (s * K / 256 + j) * ks_record_bytes(g, has_m)
// bytes, features f = 0..31 of the strip minor throughout (16 or 8 of them one vector load), with
// S = 256 / g sub-blocks (8 or 16):
//
//   float16 D[32]        the super-block's float16 scale, as the file has it
//   float16 ND[32]       -Dmin (only where the form has a minimum)
//   int8    sc[S][32]    the sub-blocks' scales (Q4_K / Q5_K 6-bit 0..63, Q6_K int8)
//   int8    mn[S][32]    the sub-blocks' mins, 0..63 (only with a minimum)
//
// and sub-block t's d = D * (float)sc[t], m = ND * (float)mn[t], D and ND widened to float32 (exact:
// f16_to_f32, VCVTPH2PS): float32 products, exactly the
// dequantizer's d * sc and -(dmin * mn) (a product's sign is the XOR of its factors', its magnitude
// the same rounding), so a kernel computing them per sub-block reads the same d and m as the
// float32 arrays hold, bit for bit. Rows without a minimum in a form with one: ND -0.0, mn 0 (m =
// -0.0, as gguf_blocks.common_form has it). 640 bytes per 256 x 32 weights with m per 32 (0.625 bits
// a weight), 576 for Q6_K (0.5625), 1,152 per 16 with m (1.125).
//
// The 6-bit form's quants, u = q + 32 in 0..63, as a 4-bit plane (u's low nibbles, laid out as bits
// 4's) and a 2-bit plane (u >> 4), per block of 32 inputs of a strip's features:
//   strips (gemm_blocks.c): block b of strip s at q + (s * K / 32 + b) * 768: [16][32] bytes, byte
//     n of row p feature n's inputs 2p (low nibble), 2p + 1 (high), as bits 4's; then [8][32]
//     bytes, byte n of row r feature n's inputs 4r + j's high 2 bits at bits 2j (j = 0..3)
//   dot (gemm_dot.c): per group of 8 features and block, 192 bytes: bits 4's 4 units, then two
//     32-byte high units H0, H1, byte 4f + j of H_t holding at bits 4v + 2h the high 2 bits of
//     the input unit 2t + v's low (h = 0) or high (h = 1) nibble of byte 4f + j stands for
#pragma once
#include <stdint.h>
#include <string.h>

#include "simd.h"  // f16_to_f32

#define DOT_FLAG 0x100
#define MIN_FLAG 0x200
#define G16_FLAG 0x400
#define U5_FLAG 0x800
#define KS_FLAG 0x1000
#define QK_K 256  // inputs per k-quant super-block (a KS_FLAG record)

static inline int form_bits(int form) { return form & 0xff; }
static inline int form_group(int form) { return form & G16_FLAG ? 16 : 32; }
static inline int form_has_m(int form) { return form_bits(form) == 4 || (form & MIN_FLAG) != 0; }
static inline int form_ks(int form) { return (form & KS_FLAG) != 0; }
// whether the kernels take this form: 4 (group 32, with m) or 8 or 6 (any group, m or not)
static inline int form_valid(int form) {
    return form_bits(form) == 8 || form_bits(form) == 6 || (form_bits(form) == 4 && !(form & G16_FLAG));
}
// bytes of a block of 32 inputs x 32 features (a strip's) in a form's quants, either layout
static inline int64_t form_block_bytes(int bits) { return bits == 4 ? 512 : bits == 6 ? 768 : 1024; }
// a KS_FLAG record's bytes, and where in it the sub-block scales and mins start
static inline int64_t ks_record_bytes(int g, int has_m) { return (has_m ? 2 : 1) * (2 * 32 + (QK_K / g) * 32); }
static inline int64_t ks_sc_at(int has_m) { return has_m ? 128 : 64; }
static inline int64_t ks_mn_at(int g) { return 128 + (QK_K / g) * 32; }

// Sub-block gi's (g inputs, counted along K) scale and minimum of feature f from strip s's records
// (rec: the strip's first): the float32 products above (scalar; the kernels' vectors do the same).
static inline const uint8_t* ks_record(const uint8_t* rec, int g, int has_m, int64_t gi) {
    return rec + (gi / (QK_K / g)) * ks_record_bytes(g, has_m);
}
static inline float ks_d1(const uint8_t* rec, int g, int has_m, int64_t gi, int64_t f) {
    const uint8_t* r = ks_record(rec, g, has_m, gi);
    uint16_t h;
    memcpy(&h, r + 2 * f, sizeof h);
    return f16_to_f32(h) * (float)(int8_t)r[ks_sc_at(has_m) + (gi % (QK_K / g)) * 32 + f];
}
static inline float ks_m1(const uint8_t* rec, int g, int64_t gi, int64_t f) {
    const uint8_t* r = ks_record(rec, g, 1, gi);
    uint16_t h;
    memcpy(&h, r + 64 + 2 * f, sizeof h);
    return f16_to_f32(h) * (float)(int8_t)r[ks_mn_at(g) + (gi % (QK_K / g)) * 32 + f];
}

// The 6-bit form's quant q = u - 32 (scalar: the generic code's, and the reference for the vectors'):
// strips layout, input k (0..31) of feature n of a block (blk: its 768 bytes)
static inline int six_strips_q(const uint8_t* blk, int64_t k, int64_t n) {
    const int lo = (blk[(k / 2) * 32 + n] >> (4 * (k & 1))) & 15;
    const int hi = (blk[512 + (k / 4) * 32 + n] >> (2 * (k & 3))) & 3;
    return (lo | hi << 4) - 32;
}
// dot layout, unit o's byte 4f + j, its low (h = 0) or high (h = 1) nibble's input (8o + 4h + j) of
// a group of 8 features' block (blk: its 192 bytes)
static inline int six_dot_q(const uint8_t* blk, int64_t o, int64_t f, int64_t j, int64_t h) {
    const int lo = (blk[o * 32 + 4 * f + j] >> (4 * h)) & 15;
    const int hi = (blk[128 + (o / 2) * 32 + 4 * f + j] >> (4 * (o & 1) + 2 * h)) & 3;
    return (lo | hi << 4) - 32;
}
