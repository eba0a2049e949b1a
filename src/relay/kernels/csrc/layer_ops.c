// The small per-layer ops of a decoder layer, fused, for CPUs: each replaces several torch ops
// (and their dispatch), which at small batch cost as much as the layer's GEMMs read.
//
//   relay_rms_norm   residual += x (optional), then out = rms_norm(residual or x) * w
//   relay_rope       neox rotary embedding of q and k in place, inside a fused qkv row
//   relay_silu_mul   out = silu(gate) * up from a fused gate_up row
//
// Activations are float32 or bfloat16 (is_bf16); math in float32, one rounding per stored value.
#include "simd.h"

static inline float ld(const void* p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline void st(void* p, int64_t i, float f, int bf16) {
    if (bf16) ((uint16_t*)p)[i] = f32_to_bf16(f);
    else ((float*)p)[i] = f;
}

#if defined(__AVX512F__)
static inline __m512 vld(const void* p, int64_t i, int bf16) { return vload(p, i, bf16); }

static inline void vst(void* p, int64_t i, __m512 v, int bf16) {
    if (bf16) _mm256_storeu_si256((__m256i*)((uint16_t*)p + i), vcvt_bf16(v));
    else _mm512_storeu_ps((float*)p + i, v);
}

// e^x for |x| <= 87 (clamped): 2^(x log2 e).
static inline __m512 vexp(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(87.f));
    return vexp2(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)));
}
#endif

// x, out [T, H] (out may be x); residual [T, H] or NULL; w [H] in the activations' dtype.
void relay_rms_norm(const void* x, void* residual, const void* w, void* out, int64_t T, int64_t H, float eps,
                    int bf16) {
    _Pragma("omp parallel for schedule(static) if (T > 4)")
    for (int64_t t = 0; t < T; t++) {
        float row[H];
        float ss = 0.f;
        int64_t h = 0;
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        for (; h + 16 <= H; h += 16) {
            __m512 v = vld(x, t * H + h, bf16);
            if (residual) {  // the sum rounded as a separate add would leave it
                vst(residual, t * H + h, _mm512_add_ps(v, vld(residual, t * H + h, bf16)), bf16);
                v = vld(residual, t * H + h, bf16);
            }
            _mm512_storeu_ps(row + h, v);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
#endif
        for (; h < H; h++) {
            float v = ld(x, t * H + h, bf16);
            if (residual) {
                st(residual, t * H + h, v + ld(residual, t * H + h, bf16), bf16);
                v = ld(residual, t * H + h, bf16);
            }
            row[h] = v;
            ss += v * v;
        }
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        h = 0;
#if defined(__AVX512F__)
        for (; h + 16 <= H; h += 16)
            vst(out, t * H + h, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(row + h), _mm512_set1_ps(inv)),
                                              vld(w, h, bf16)), bf16);
#endif
        for (; h < H; h++) st(out, t * H + h, row[h] * inv * ld(w, h, bf16), bf16);
    }
}

// qkv [T, stride]: q heads [nq, D] then k heads [nk, D] at the start of each row, rotated in
// place by the float32 tables cos/sin [positions, D] (sin signed for the swapped halves:
// x' = x * cos + swap_halves(x) * sin) at positions[t].
void relay_rope(void* qkv, const float* cos, const float* sin, const int64_t* positions, int64_t T, int64_t stride,
                int64_t nq, int64_t nk, int64_t D, int bf16) {
    const int64_t half = D / 2;
    _Pragma("omp parallel for schedule(static) if (T > 4)")
    for (int64_t t = 0; t < T; t++) {
        const float* c = cos + positions[t] * D;
        const float* s = sin + positions[t] * D;
        for (int64_t hd = 0; hd < nq + nk; hd++) {
            const int64_t base = t * stride + hd * D;
#if defined(__AVX512F__)
            if (half % 16 == 0) {  // both halves in 16-lane pieces: x1' = x1 c1 + x2 s1, x2' = x2 c2 + x1 s2
                for (int64_t i = 0; i < half; i += 16) {
                    const __m512 x1 = vld(qkv, base + i, bf16), x2 = vld(qkv, base + half + i, bf16);
                    vst(qkv, base + i, _mm512_fmadd_ps(x1, _mm512_loadu_ps(c + i),
                                                       _mm512_mul_ps(x2, _mm512_loadu_ps(s + i))), bf16);
                    vst(qkv, base + half + i, _mm512_fmadd_ps(x2, _mm512_loadu_ps(c + half + i),
                                                              _mm512_mul_ps(x1, _mm512_loadu_ps(s + half + i))), bf16);
                }
                continue;
            }
#endif
            float x[D];
            for (int64_t i = 0; i < D; i++) x[i] = ld(qkv, base + i, bf16);
            for (int64_t i = 0; i < D; i++) {
                const float swapped = x[i < half ? i + half : i - half];
                st(qkv, base + i, x[i] * c[i] + swapped * s[i], bf16);
            }
        }
    }
}

// gate_up [T, 2 * I] (gate then up); out [T, I].
void relay_silu_mul(const void* gate_up, void* out, int64_t T, int64_t I, int bf16) {
    _Pragma("omp parallel for schedule(static) if (T * I > 65536)")
    for (int64_t t = 0; t < T; t++) {
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= I; i += 16) {
            const __m512 g = vld(gate_up, t * 2 * I + i, bf16), u = vld(gate_up, t * 2 * I + I + i, bf16);
            const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.f),
                                             _mm512_add_ps(_mm512_set1_ps(1.f), vexp(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            vst(out, t * I + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), u), bf16);
        }
#endif
        for (; i < I; i++) {
            const float g = ld(gate_up, t * 2 * I + i, bf16), u = ld(gate_up, t * 2 * I + I + i, bf16);
            st(out, t * I + i, g / (1.f + expf(-g)) * u, bf16);
        }
    }
}
