// gemm_dot.c's kernels 8 features a pass (AVX2's code, with AVX512-VNNI's 256-bit dot products where
// the CPU has them) at the AVX-512 levels, as relay_gemm_dot_ymm: relay_gemm_dot takes it for single
// rows over short groups, where one stream of quants is faster than AVX-512's two (see there).
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VEC_YMM
#define relay_gemm_dot relay_gemm_dot_ymm
#include "gemm_dot.c"
#endif
