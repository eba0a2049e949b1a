// Paged decode attention for CPUs: one query token per request over its KV pages.
//
// Reads each cached key and value once, straight from the paged cache (no gathered copy),
// for all query heads that share a kv head (GQA). Built at first use with the system C
// compiler and loaded with ctypes (relay/attention/cpu_kernels.py); OpenMP resolves to the
// runtime torch already loaded (same soname), so torch's thread count and pool are shared.
//
// Layouts: q, out [B, H, D]; k, v caches "HND" [HKV, S, D] (S = all slots); slots [B, W]
// (slot of token l of request b at slots[b * W + l]); lens [B].
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define DEFINE_DECODE(NAME, T, LOAD)                                                              \
void NAME(const float* q, const T* k, const T* v, const int64_t* slots, const int64_t* lens,        \
          float* out, int64_t B, int64_t H, int64_t HKV, int64_t D, int64_t S, int64_t W,          \
          float scale) {                                                                          \
    const int64_t G = H / HKV;                                                                    \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1)")                                  \
    for (int64_t b = 0; b < B; b++) {                                                             \
        for (int64_t h = 0; h < HKV; h++) {                                                       \
            const int64_t len = lens[b];                                                          \
            const int64_t* sl = slots + b * W;                                                    \
            const T* kh = k + h * S * D;                                                          \
            const T* vh = v + h * S * D;                                                          \
            const float* qh = q + (b * H + h * G) * D;                                            \
            float* p = (float*)malloc(sizeof(float) * G * len);                                   \
            float* kf = (float*)malloc(sizeof(float) * D);                                        \
            for (int64_t l = 0; l < len; l++) {                                                   \
                const T* kr = kh + sl[l] * D;                                                     \
                for (int64_t d = 0; d < D; d++) kf[d] = LOAD(kr[d]);                              \
                for (int64_t g = 0; g < G; g++) {                                                 \
                    const float* qg = qh + g * D;                                                 \
                    float acc = 0.f;                                                              \
                    _Pragma("omp simd reduction(+:acc)")                                          \
                    for (int64_t d = 0; d < D; d++) acc += qg[d] * kf[d];                         \
                    p[g * len + l] = acc * scale;                                                 \
                }                                                                                 \
            }                                                                                     \
            for (int64_t g = 0; g < G; g++) {                                                     \
                float* pg = p + g * len;                                                          \
                float m = -INFINITY, sum = 0.f;                                                   \
                for (int64_t l = 0; l < len; l++) m = pg[l] > m ? pg[l] : m;                      \
                for (int64_t l = 0; l < len; l++) { pg[l] = expf(pg[l] - m); sum += pg[l]; }      \
                const float inv = 1.f / sum;                                                      \
                for (int64_t l = 0; l < len; l++) pg[l] *= inv;                                   \
            }                                                                                     \
            float* o = out + (b * H + h * G) * D;                                                 \
            memset(o, 0, sizeof(float) * G * D);                                                  \
            for (int64_t l = 0; l < len; l++) {                                                   \
                const T* vr = vh + sl[l] * D;                                                     \
                for (int64_t d = 0; d < D; d++) kf[d] = LOAD(vr[d]);                              \
                for (int64_t g = 0; g < G; g++) {                                                 \
                    const float w = p[g * len + l];                                               \
                    float* og = o + g * D;                                                        \
                    _Pragma("omp simd")                                                           \
                    for (int64_t d = 0; d < D; d++) og[d] += w * kf[d];                           \
                }                                                                                 \
            }                                                                                     \
            free(kf);                                                                             \
            free(p);                                                                              \
        }                                                                                         \
    }                                                                                             \
}

#define LOAD_F32(x) (x)
DEFINE_DECODE(decode_attention_f32, float, LOAD_F32)
DEFINE_DECODE(decode_attention_bf16, uint16_t, bf16_to_f32)
