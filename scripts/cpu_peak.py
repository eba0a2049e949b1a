#!/usr/bin/env python3
"""This CPU's arithmetic peaks: what a kernel's GFLOP/s should be judged against.

Compiles a register-only loop with the system C compiler (12 independent chains of AVX-512
instructions, no memory traffic) and runs it on 1 and on N threads (default: all cores):
  fp32 FMA      VFMADD231PS, 16 multiply-adds per instruction (float32 GEMMs and attention)
  int16 VNNI    VPDPWSSD, 32 per instruction (int16 activations x int16 weights)
  int8 VNNI     VPDPBUSD, 64 per instruction (--quantization w8a8)
  bf16 dot      VDPBF16PS, 32 per instruction (a bfloat16 model's GEMMs and attention)
and reports instructions per ns and GFLOP/s (2 FLOPs per multiply-add). Needs AVX-512 (and
AVX512-VNNI for the VNNI rows, AVX512-BF16 for the bf16 row, each skipped without it).

    python scripts/cpu_peak.py
    python scripts/cpu_peak.py --threads 1,2 --seconds 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>
#define CHAINS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
// Each chain starts from its own value (one chain's result cannot be reused for another) and the
// sum is printed (the loop cannot be dropped).
#define RUN(NAME, T, INIT, STEP, SUM)                                                        \
  static double NAME(long iters) {                                                           \
    double t0 = 0, t1 = 0; volatile float sink = 0;                                          \
    _Pragma("omp parallel reduction(+: sink)") {                                             \
      _Pragma("omp barrier") _Pragma("omp master") t0 = now();                               \
      int seed = omp_get_thread_num() + (int)(sink * 0);                                     \
      T b = INIT(3 + seed), c = INIT(5);                                                     \
      _Pragma("GCC diagnostic ignored \"-Wunused-variable\"")                                \
      T a0 = INIT(seed), a1 = INIT(seed + 1), a2 = INIT(seed + 2), a3 = INIT(seed + 3),      \
        a4 = INIT(seed + 4), a5 = INIT(seed + 5), a6 = INIT(seed + 6), a7 = INIT(seed + 7),  \
        a8 = INIT(seed + 8), a9 = INIT(seed + 9), a10 = INIT(seed + 10), a11 = INIT(seed + 11); \
      for (long n = 0; n < iters; n++) {                                                     \
        CHAINS(STEP)                                                                         \
      }                                                                                      \
      sink += SUM(a0) + SUM(a1) + SUM(a2) + SUM(a3) + SUM(a4) + SUM(a5) + SUM(a6) + SUM(a7) +  \
              SUM(a8) + SUM(a9) + SUM(a10) + SUM(a11);                                       \
      _Pragma("omp barrier") _Pragma("omp master") t1 = now();                               \
    }                                                                                        \
    if (sink == 1234.5f) puts("");                                                           \
    return t1 - t0;                                                                          \
  }
#define PSET(x) _mm512_set1_ps((float)(x) * 1e-3f)
#define FMA(i) a##i = _mm512_fmadd_ps(a##i, b, c);
#define PSUM(x) _mm512_reduce_add_ps(x)
RUN(fma_f32, __m512, PSET, FMA, PSUM)
#ifdef __AVX512VNNI__
#define ISET(x) _mm512_set1_epi32(x)
#define DPW(i) a##i = _mm512_dpwssd_epi32(a##i, b, c);
#define DPB(i) a##i = _mm512_dpbusd_epi32(a##i, b, c);
#define ISUM(x) (float)_mm512_reduce_add_epi32(x)
RUN(vnni_i16, __m512i, ISET, DPW, ISUM)
RUN(vnni_i8, __m512i, ISET, DPB, ISUM)
#endif
#ifdef __AVX512BF16__
#define DPBF(i) a##i = _mm512_dpbf16_ps(a##i, (__m512bh)b, (__m512bh)c);
RUN(dp_bf16, __m512, PSET, DPBF, PSUM)
#endif
int main(int argc, char** argv) {
  long iters = atol(argv[1]);
  const double per = 12.0 * iters * omp_get_max_threads();  // instructions in all threads
  printf("fp32_fma %.4f 16\n", per / fma_f32(iters) / 1e9);
#ifdef __AVX512VNNI__
  printf("int16_vnni %.4f 32\n", per / vnni_i16(iters) / 1e9);
  printf("int8_vnni %.4f 64\n", per / vnni_i8(iters) / 1e9);
#endif
#ifdef __AVX512BF16__
  printf("bf16_dot %.4f 32\n", per / dp_bf16(iters) / 1e9);
#endif
  return 0;
}
"""


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def build(workdir: str, flags: set[str]) -> str:
    src, exe = os.path.join(workdir, "peak.c"), os.path.join(workdir, "peak")
    with open(src, "w") as f:
        f.write(SOURCE)
    isa = (
        ["-mavx512f", "-mavx512bw"]
        + (["-mavx512vnni"] if "avx512_vnni" in flags else [])
        + (["-mavx512bf16"] if "avx512_bf16" in flags else [])
    )
    subprocess.run(
        [os.environ.get("CC", "cc"), "-O2", "-fopenmp", *isa, src, "-o", exe], check=True
    )
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", default=f"1,{os.cpu_count()}")
    ap.add_argument(
        "--iters",
        type=int,
        default=100_000_000,
        help="loop trips per thread (12 instructions each)",
    )
    args = ap.parse_args()
    flags = cpu_flags()
    if "avx512f" not in flags:
        raise SystemExit("no AVX-512 here: nothing to measure")
    print("CPU flags:", " ".join(sorted(f for f in flags if f.startswith(("avx512", "amx")))))
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tmp, flags)
        for threads in [int(t) for t in args.threads.split(",")]:
            out = subprocess.run(
                [exe, str(args.iters)],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": str(threads)},
            ).stdout
            for line in out.split("\n"):
                if line:
                    name, per_ns, macs = line.split()
                    print(
                        f"{threads} thread(s)  {name:<11} {float(per_ns):6.2f} instr/ns  "
                        f"{float(per_ns) * int(macs) * 2:7.1f} GFLOP/s (GOP/s)"
                    )


if __name__ == "__main__":
    main()
