// The small per-layer ops of a decoder layer, fused, for CPUs: each replaces several torch ops
// (and their dispatch), which at small batch cost as much as the layer's GEMMs read.
//
//   relay_rms_norm   residual += x (optional), then out = rms_norm(residual or x) * w
//   relay_rope       neox rotary embedding of q and k in place, inside a fused qkv row
//   relay_head_norm  rms_norm of each q and k head in place, inside a fused qkv row
//   relay_silu_mul   out = silu(gate) * up from a fused gate_up row
//   relay_gelu_tanh_mul  out = gelu_tanh(gate) * up (Gemma's GeGLU)
//
// Activations are float32 or bfloat16 (is_bf16); math in float32, one rounding per stored value.
// One source for every instruction-set level (vec.h: VL lanes).
#include "vec.h"

static inline float ld(const void* p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline void st(void* p, int64_t i, float f, int bf16) {
    if (bf16) ((uint16_t*)p)[i] = f32_to_bf16(f);
    else ((float*)p)[i] = f;
}

// One row of relay_rms_norm: the H values from element o on of x (and residual, and out).
static inline void norm_row(const void* x, void* residual, const void* w, void* out, int64_t o, int64_t H, float eps,
                            int bf16) {
    float row[H];
    float ss = 0.f;
    int64_t h = 0;
    vf acc = vf_zero();
    for (; h + VL <= H; h += VL) {
        vf v = vf_load_act(x, o + h, bf16);
        if (residual) {  // the sum rounded as a separate add would leave it
            vf_store_act(residual, o + h, vf_add(v, vf_load_act(residual, o + h, bf16)), bf16);
            v = vf_load_act(residual, o + h, bf16);
        }
        vf_store(row + h, v);
        acc = vf_fma(v, v, acc);
    }
    ss = vf_sum(acc);
    for (; h < H; h++) {
        float v = ld(x, o + h, bf16);
        if (residual) {
            st(residual, o + h, v + ld(residual, o + h, bf16), bf16);
            v = ld(residual, o + h, bf16);
        }
        row[h] = v;
        ss += v * v;
    }
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
    h = 0;
    for (; h + VL <= H; h += VL)
        vf_store_act(out, o + h, vf_mul(vf_mul(vf_load(row + h), vf_set1(inv)), vf_load_act(w, h, bf16)), bf16);
    for (; h < H; h++) st(out, o + h, row[h] * inv * ld(w, h, bf16), bf16);
}

// x, out [T, H] (out may be x); residual [T, H] or NULL; w [H] in the activations' dtype.
void relay_rms_norm(const void* x, void* residual, const void* w, void* out, int64_t T, int64_t H, float eps,
                    int bf16) {
    _Pragma("omp parallel for schedule(static) if (T > 4)")
    for (int64_t t = 0; t < T; t++) norm_row(x, residual, w, out, t * H, H, eps, bf16);
}

// Qwen3's and Gemma 3's q/k norms: each q head [D] at the start of a qkv row [T, stride]
// normalised in place by qw [D], each k head after them by kw [D] (rms_norm per head).
void relay_head_norm(void* qkv, const void* qw, const void* kw, int64_t T, int64_t stride, int64_t nq, int64_t nk,
                     int64_t D, float eps, int bf16) {
    _Pragma("omp parallel for schedule(static) if (T > 4)")
    for (int64_t t = 0; t < T; t++)
        for (int64_t hd = 0; hd < nq + nk; hd++)
            norm_row(qkv, NULL, hd < nq ? qw : kw, qkv, t * stride + hd * D, D, eps, bf16);
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
            if (half % VL == 0) {  // both halves in whole vectors: x1' = x1 c1 + x2 s1, x2' = x2 c2 + x1 s2
                for (int64_t i = 0; i < half; i += VL) {
                    const vf x1 = vf_load_act(qkv, base + i, bf16), x2 = vf_load_act(qkv, base + half + i, bf16);
                    vf_store_act(qkv, base + i, vf_fma(x1, vf_load(c + i), vf_mul(x2, vf_load(s + i))), bf16);
                    vf_store_act(qkv, base + half + i,
                                 vf_fma(x2, vf_load(c + half + i), vf_mul(x1, vf_load(s + half + i))), bf16);
                }
                continue;
            }
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
        for (; i + VL <= I; i += VL) {
            const vf g = vf_load_act(gate_up, t * 2 * I + i, bf16), u = vf_load_act(gate_up, t * 2 * I + I + i, bf16);
            const vf sig = vf_div(vf_set1(1.f), vf_add(vf_set1(1.f), vf_exp(vf_sub(vf_zero(), g))));
            vf_store_act(out, t * I + i, vf_mul(vf_mul(g, sig), u), bf16);
        }
        for (; i < I; i++) {
            const float g = ld(gate_up, t * 2 * I + i, bf16), u = ld(gate_up, t * 2 * I + I + i, bf16);
            st(out, t * I + i, g / (1.f + expf(-g)) * u, bf16);
        }
    }
}

// gate_up [T, 2 * I] (gate then up); out [T, I] = gelu(gate) * up, gelu's tanh approximation
// (transformers' gelu_pytorch_tanh): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))). The tail
// takes the vector path too, masked, so every feature is the same function.
static inline vf gelu_tanh_mul(vf g, vf u) {
    const vf inner = vf_mul(vf_set1(0.7978845608028654f), vf_fma(vf_mul(vf_set1(0.044715f), g), vf_mul(g, g), g));
    return vf_mul(vf_mul(vf_mul(vf_set1(0.5f), g), vf_add(vf_set1(1.f), vf_tanh(inner))), u);
}

void relay_gelu_tanh_mul(const void* gate_up, void* out, int64_t T, int64_t I, int bf16) {
    _Pragma("omp parallel for schedule(static) if (T * I > 65536)")
    for (int64_t t = 0; t < T; t++) {
        int64_t i = 0;
        for (; i + VL <= I; i += VL) {
            const vf g = vf_load_act(gate_up, t * 2 * I + i, bf16), u = vf_load_act(gate_up, t * 2 * I + I + i, bf16);
            vf_store_act(out, t * I + i, gelu_tanh_mul(g, u), bf16);
        }
        if (i < I) {
            float g[VL] = {0}, u[VL] = {0}, r[VL];
            for (int64_t j = 0; i + j < I; j++) g[j] = ld(gate_up, t * 2 * I + i + j, bf16), u[j] = ld(gate_up, t * 2 * I + I + i + j, bf16);
            vf_store(r, gelu_tanh_mul(vf_load(g), vf_load(u)));
            for (int64_t j = 0; i + j < I; j++) st(out, t * I + i + j, r[j], bf16);
        }
    }
}
