// The two ends of an int8 x int8 GEMM (--quantization w8a8) for CPUs: activations quantized per
// row (token) when they reach a layer, and the int32 products scaled back. The GEMM between them
// is torch's (_int_mm: AVX512-VNNI where the CPU has it), 1.5-1.9x bfloat16's rate on a Zen 4.
//
//   relay_quantize_rows    q = round(x / s) with s = max|x| / 127 per row (s = 1 for a zero row)
//   relay_dequantize_rows  out = acc * sx[row] * sw[col] (+ bias[col])
//
// x, bias and out are float32 or bfloat16 (the *_bf16 flags); rounding is to nearest even.
#include "simd.h"

#include <math.h>

static inline float ldf(const void* p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

// x [rows, cols] -> q [rows, cols] int8, scale [rows].
void relay_quantize_rows(const void* x, int64_t rows, int64_t cols, int bf16, int8_t* q, float* scale) {
    _Pragma("omp parallel for schedule(static) if (rows * cols >= 65536)")
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * cols;
        float amax = 0.f;
        int64_t c = 0;
#if defined(__AVX512F__)
        __m512 m = _mm512_setzero_ps();
        for (; c + 16 <= cols; c += 16) m = _mm512_max_ps(m, _mm512_abs_ps(vload(x, base + c, bf16)));
        amax = _mm512_reduce_max_ps(m);
#endif
        for (; c < cols; c++) amax = fmaxf(amax, fabsf(ldf(x, base + c, bf16)));
        const float s = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s;
        scale[r] = s;
        c = 0;
#if defined(__AVX512F__)
        for (; c + 16 <= cols; c += 16) {  // |x| * inv <= 127 (+ rounding): the narrowing saturates anyway
            const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(vload(x, base + c, bf16), _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i*)(q + base + c), _mm512_cvtsepi32_epi8(v));
        }
#endif
        for (; c < cols; c++) {
            const float v = nearbyintf(ldf(x, base + c, bf16) * inv);
            q[base + c] = (int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
        }
    }
}

// acc [rows, cols] int32 -> out [rows, cols]; sx [rows], sw [cols] float32; bias [cols] or NULL.
void relay_dequantize_rows(const int32_t* acc, int64_t rows, int64_t cols, const float* sx, const float* sw,
                           const void* bias, int bias_bf16, void* out, int out_bf16) {
    _Pragma("omp parallel for schedule(static) if (rows * cols >= 65536)")
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * cols;
        int64_t c = 0;
#if defined(__AVX512F__)
        const __m512 s = _mm512_set1_ps(sx[r]);
        for (; c + 16 <= cols; c += 16) {
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + base + c)), s),
                                     _mm512_loadu_ps(sw + c));
            if (bias) v = _mm512_add_ps(v, vload(bias, c, bias_bf16));
            if (out_bf16) _mm256_storeu_si256((__m256i*)((uint16_t*)out + base + c), vcvt_bf16(v));
            else _mm512_storeu_ps((float*)out + base + c, v);
        }
#endif
        for (; c < cols; c++) {
            float v = (float)acc[base + c] * sx[r] * sw[c];
            if (bias) v += ldf(bias, c, bias_bf16);
            if (out_bf16) ((uint16_t*)out)[base + c] = f32_to_bf16(v);
            else ((float*)out)[base + c] = v;
        }
    }
}
