// bfloat16 GEMMs on AMX tiles, over the same weight panels as relay_gemm_bf16_panels (gemm_bf16.c),
// which calls relay_gemm_amx_panels first where this CPU has AMX-BF16 and the kernel may use it.
//
// The panels' layout is already what a TDPBF16PS B operand wants: a panel is [K / 2][NR] 32-bit pairs
// (lane n of pair p: feature n's weights 2p and 2p + 1), so 16 consecutive pairs of 16 features are
// one B tile (16 rows of 64 bytes, NR * 4 bytes apart). A thread takes (panel, tile of up to 16 rows)
// items: per 32 values of K it loads the rows' A tile once and the panel's three B tiles, and runs
// three TDPBF16PS into three C tiles that stay in tile registers for the whole of K; then the C tiles
// go through a small buffer to y with the bias (and to bfloat16 where y is). One tile shape per row
// count: a thread loads a new tile configuration only when its item's row count changes (the last
// tile of M). K must be a multiple of 32 (every model dimension Relay meets is); otherwise the
// caller's VDPBF16PS kernel runs.
//
// Linux hands AMX's tile state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM); the
// first call asks, and a refusal leaves AMX off for the process.
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "simd.h"

#if HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define AMX_NR 48  // gemm_bf16.c's NR: the panel width, three 16-feature B tiles
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state = -1;  // -1 not asked yet, 0 refused, 1 granted

static int amx_permitted(void) {
#if HAVE_AMX
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_state;
#else
    return 0;
#endif
}

// 1 where the build (the amx level: relay/execution/kernels/isa.py) and Linux allow AMX tiles (asking on
// the first call).
int relay_gemm_amx_available(void) { return amx_permitted(); }

#if HAVE_AMX
// tmm0-2: C (rows x 16 floats), tmm3: A (rows x 32 bf16), tmm4-6: B (16 pairs x 16 features)
static void configure(int rows) { amx_configure(7, 4, rows); }

static void store_rows(const float* c, int rows, int h, const uint16_t* bias, void* y, int64_t y_stride, int y_f32,
                       int64_t n0, int64_t N) {
    const __mmask16 live = strip_mask(N - n0, h);
    if (!live) return;
    const int64_t n = n0 + 16 * h;
    __m512 b = _mm512_setzero_ps();
    if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, bias + n)), 16));
    for (int i = 0; i < rows; i++) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + 16 * i), b);
        if (y_f32) _mm512_mask_storeu_ps((float*)y + i * y_stride + n, live, v);
        else _mm256_mask_storeu_epi16((uint16_t*)y + i * y_stride + n, live, vcvt_bf16(v));
    }
}

// rows (1-16) of x (bf16, x_stride elements apart) times one panel: y's features n0 .. n0 + 47
static void panel_item(const uint16_t* x, int64_t x_stride, int rows, const uint32_t* panel, int64_t K,
                       const uint16_t* bias, void* y, int64_t y_stride, int y_f32, int64_t n0, int64_t N) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    const int64_t b_stride = AMX_NR * 4;
    for (int64_t k = 0; k < K; k += 32) {
        const uint32_t* b = panel + (k / 2) * AMX_NR;
        _tile_loadd(3, x + k, x_stride * 2);
        _tile_loadd(4, b, b_stride);
        _tile_loadd(5, b + 16, b_stride);
        _tile_loadd(6, b + 32, b_stride);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
    }
    float c[16 * 16];
    _tile_stored(0, c, 64);
    store_rows(c, rows, 0, bias, y, y_stride, y_f32, n0, N);
    _tile_stored(1, c, 64);
    store_rows(c, rows, 1, bias, y, y_stride, y_f32, n0, N);
    _tile_stored(2, c, 64);
    store_rows(c, rows, 2, bias, y, y_stride, y_f32, n0, N);
}
#endif

// x [M, K] bfloat16 rows x_stride elements apart; panels as in gemm_bf16.c ([N, K] weight, NR = 48);
// bias [N] bfloat16 or NULL; y [M, N] rows y_stride apart, float32 (y_f32) or bfloat16. Returns 0
// (nothing done) where AMX is not available here or K is not a multiple of 32.
int relay_gemm_amx_panels(const uint16_t* x, int64_t x_stride, const uint32_t* panels, const uint16_t* bias, void* y,
                          int64_t y_stride, int y_f32, int64_t M, int64_t N, int64_t K) {
#if HAVE_AMX
    if (K % 32 || M < 1 || !relay_gemm_amx_available()) return 0;
    const int64_t n_panels = (N + AMX_NR - 1) / AMX_NR, tiles = (M + 15) / 16, pairs = K / 2;
    _Pragma("omp parallel")
    {
        int configured = 0;
        _Pragma("omp for collapse(2) schedule(static)")
        for (int64_t p = 0; p < n_panels; p++)
            for (int64_t t = 0; t < tiles; t++) {
                const int rows = (int)(M - 16 * t < 16 ? M - 16 * t : 16);
                if (rows != configured) {
                    configure(rows);
                    configured = rows;
                }
                void* yt = y_f32 ? (void*)((float*)y + 16 * t * y_stride) : (void*)((uint16_t*)y + 16 * t * y_stride);
                panel_item(x + 16 * t * x_stride, x_stride, rows, panels + p * pairs * AMX_NR, K, bias, yt, y_stride,
                           y_f32, p * AMX_NR, N);
            }
        if (configured) _tile_release();
    }
    return 1;
#else
    (void)x; (void)x_stride; (void)panels; (void)bias; (void)y; (void)y_stride; (void)y_f32; (void)M; (void)N; (void)K;
    return 0;
#endif
}
