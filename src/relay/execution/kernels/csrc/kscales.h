// The scales of a block form as the kernels' vectors read them (vec.h's vf: VL features at a time),
// from float32 arrays or from KS_FLAG's compact records (blocks.h), so that each kernel's loop is
// written once for both: `ds` is a strip's scales (strip_scales: its first float of d, or its first
// record), `ms` its minima (float32 forms with one; unread with KS_FLAG), `gi` a group of g inputs
// counted along K, `f` the first of the VL features within the strip's 32.
#pragma once
#include <stdint.h>

#include "blocks.h"
#include "vec.h"

// sub-block gi's d (KS_FLAG): D * sc, one float32 product per lane (the float16 D widened exactly),
// the dequantizer's
static inline vf ks_d(const void* rec, int g, int has_m, int64_t gi, int64_t f) {
    const uint8_t* r = ks_record((const uint8_t*)rec, g, has_m, gi);
    return vf_mul(vf_from_f16((const uint16_t*)r + f), vf_from_i8((const int8_t*)r + ks_sc_at(has_m) + (gi % (QK_K / g)) * 32 + f));
}
// and its m: -Dmin * mn
static inline vf ks_m(const void* rec, int g, int64_t gi, int64_t f) {
    const uint8_t* r = ks_record((const uint8_t*)rec, g, 1, gi);
    return vf_mul(vf_from_f16((const uint16_t*)r + 32 + f), vf_from_i8((const int8_t*)r + ks_mn_at(g) + (gi % (QK_K / g)) * 32 + f));
}
// strip s's d: its float32 [K / g][32] or its K / 256 records
static inline const void* strip_scales(int ks, int g, int has_m, const float* d, int64_t s, int64_t K) {
    if (ks) return (const uint8_t*)d + s * (K / QK_K) * ks_record_bytes(g, has_m);
    return d + s * (K / g) * 32;
}
static inline vf scales_d(int ks, int g, int has_m, const void* ds, int64_t gi, int64_t f) {
    return ks ? ks_d(ds, g, has_m, gi, f) : vf_load((const float*)ds + gi * 32 + f);
}
static inline vf scales_m(int ks, int g, const void* ds, const float* ms, int64_t gi, int64_t f) {
    return ks ? ks_m(ds, g, gi, f) : vf_load(ms + gi * 32 + f);
}
// scalar ones (feature f), for code that runs per feature
static inline float scale_d1(int ks, int g, int has_m, const void* ds, int64_t gi, int64_t f) {
    return ks ? ks_d1((const uint8_t*)ds, g, has_m, gi, f) : ((const float*)ds)[gi * 32 + f];
}
static inline float scale_m1(int ks, int g, const void* ds, const float* ms, int64_t gi, int64_t f) {
    return ks ? ks_m1((const uint8_t*)ds, g, gi, f) : ms[gi * 32 + f];
}
// Strip s's records for block b (32 inputs) on their way into the caches: a record covers 8 blocks,
// so each block asks for its eighth of the record stream (which runs on from strip to strip); LOC:
// __builtin_prefetch's locality, the kernel's own for its other streams.
#define KS_PREFETCH(g, has_m, d, s, K, b, LOC)                                                              \
    do {                                                                                                     \
        const int64_t share_ = ks_record_bytes(g, has_m) / 8;                                               \
        const char* r_ = (const char*)strip_scales(1, g, has_m, d, s, K) + (b) * share_;                   \
        for (int64_t o_ = 0; o_ < share_; o_ += 64) __builtin_prefetch(r_ + o_, 0, LOC);                     \
        __builtin_prefetch(r_ + share_ - 1, 0, LOC);                                                         \
    } while (0)
