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
#pragma once

#define DOT_FLAG 0x100
#define MIN_FLAG 0x200
#define G16_FLAG 0x400
#define U5_FLAG 0x800

static inline int form_bits(int form) { return form & 0xff; }
static inline int form_group(int form) { return form & G16_FLAG ? 16 : 32; }
static inline int form_has_m(int form) { return form_bits(form) == 4 || (form & MIN_FLAG) != 0; }
// whether the kernels take this form: 4 (group 32, with m) or 8 (any group, m or not)
static inline int form_valid(int form) {
    return form_bits(form) == 8 || (form_bits(form) == 4 && !(form & G16_FLAG));
}
