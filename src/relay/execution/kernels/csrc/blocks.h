// The block forms relay_gemm_blocks (gemm_blocks.c) and relay_gemm_dot (gemm_dot.c) read, all told by
// the one `bits` int they take (weight_blocks.BlockWeight.kernel_bits; the one-call decode step's
// LayerGemm.bits carries it as it is):
//
//   bits & 0xff   4: w = d * q + m, q 0..15 as nibbles (Q4_1, Q4_K); 8: w = d * q (+ m), q int8
//   DOT_FLAG      q in gemm_dot.c's layout: integer dot products on x rounded to 8 bits
//   MIN_FLAG      bits 8 with a minimum: w = d * q + m (Q5_K, Q5_1, fused weights of mixed types);
//                 without it m is not read (it may be NULL). bits 4 always has one.
//   G16_FLAG      d (and m) per 16 inputs, [strips][K / 16][32], not per 32 (Q6_K, and fused
//                 weights with a Q6_K part); bits 8 only
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
//   float32 D[32]        the super-block's float16 scale, as a float32
//   float32 ND[32]       -Dmin (only where the form has a minimum)
//   int8    sc[S][32]    the sub-blocks' scales (Q4_K / Q5_K 6-bit 0..63, Q6_K int8)
//   int8    mn[S][32]    the sub-blocks' mins, 0..63 (only with a minimum)
//
// and sub-block t's d = D * (float)sc[t], m = ND * (float)mn[t]: float32 products, exactly the
// dequantizer's d * sc and -(dmin * mn) (a product's sign is the XOR of its factors', its magnitude
// the same rounding), so a kernel computing them per sub-block reads the same d and m as the
// float32 arrays hold, bit for bit. Rows without a minimum in a form with one: ND -0.0, mn 0 (m =
// -0.0, as gguf_blocks.common_form has it). 768 bytes per 256 x 32 weights with m per 32 (0.75 bits
// a weight), 640 for Q6_K (0.625), 1,280 per 16 with m (1.25).
#pragma once
#include <stdint.h>
#include <string.h>

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
// whether the kernels take this form: 4 (group 32, with m) or 8 (any group, m or not)
static inline int form_valid(int form) {
    return form_bits(form) == 8 || (form_bits(form) == 4 && !(form & G16_FLAG));
}
// a KS_FLAG record's bytes, and where in it the sub-block scales and mins start
static inline int64_t ks_record_bytes(int g, int has_m) { return (has_m ? 2 : 1) * (4 * 32 + (QK_K / g) * 32); }
static inline int64_t ks_sc_at(int has_m) { return has_m ? 256 : 128; }
static inline int64_t ks_mn_at(int g) { return 256 + (QK_K / g) * 32; }

// Sub-block gi's (g inputs, counted along K) scale and minimum of feature f from strip s's records
// (rec: the strip's first): the float32 products above (scalar; the kernels' vectors do the same).
static inline const uint8_t* ks_record(const uint8_t* rec, int g, int has_m, int64_t gi) {
    return rec + (gi / (QK_K / g)) * ks_record_bytes(g, has_m);
}
static inline float ks_d1(const uint8_t* rec, int g, int has_m, int64_t gi, int64_t f) {
    const uint8_t* r = ks_record(rec, g, has_m, gi);
    float dv;
    memcpy(&dv, r + 4 * f, sizeof dv);
    return dv * (float)(int8_t)r[ks_sc_at(has_m) + (gi % (QK_K / g)) * 32 + f];
}
static inline float ks_m1(const uint8_t* rec, int g, int64_t gi, int64_t f) {
    const uint8_t* r = ks_record(rec, g, 1, gi);
    float nd;
    memcpy(&nd, r + 128 + 4 * f, sizeof nd);
    return nd * (float)(int8_t)r[ks_mn_at(g) + (gi % (QK_K / g)) * 32 + f];
}
