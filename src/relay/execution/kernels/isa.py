"""Which instruction-set level Relay's CPU kernels run at: found from the CPU's flags, or held
lower with RELAY_CPU_ISA so that any machine can run (and test) what a smaller CPU runs.

Levels, lowest first: generic (plain C, any CPU, aarch64 included), avx2 (AVX2 + FMA), avx512
(F/BW/CD/DQ/VL), avx512bf16 (+ AVX512-BF16: bfloat16 dot products), amx (+ AMX-BF16 tiles).
Each level compiles the kernel library for itself (compile_flags), and a held level holds torch
too: ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS (torch_env), set for
every process before torch loads (launch.serve does it for the whole server), so a held server
runs as that CPU would.
"""

from __future__ import annotations

import os
import platform

LEVELS = ("generic", "avx2", "avx512", "avx512bf16", "amx")
ENV = "RELAY_CPU_ISA"
# The /proc/cpuinfo flags each level needs beyond the one below it
_NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
    "avx512bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16"),
}
_MARCH = {"generic": "x86-64", "avx2": "x86-64-v3", "avx512": "x86-64-v4"}
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
# torch's own dispatch (ATen kernels) and oneDNN's GEMMs, per level
_ATEN = {
    "generic": "default",
    "avx2": "avx2",
    "avx512": "avx512",
    "avx512bf16": "avx512",
    "amx": "avx512",
}
_ONEDNN = {
    "generic": "SSE41",
    "avx2": "AVX2",
    "avx512": "AVX512_CORE",
    "avx512bf16": "AVX512_CORE_BF16",
    "amx": "AVX512_CORE_AMX",
}
# MKL's own dispatch (torch's float32 GEMMs where oneDNN does not take them): the newest set MKL may
# use, in MKL_ENABLE_INSTRUCTIONS' names: AVX512 is F/CD/BW/DQ/VL, AVX512_E1 adds VNNI, AVX512_E3
# VNNI + BF16, AVX512_E4 AMX (Intel processors only: MKL ignores it on others).
_MKL = {
    "generic": "SSE4_2",
    "avx2": "AVX2",
    "avx512": "AVX512",
    "avx512bf16": "AVX512_E3",
    "amx": "AVX512_E4",
}


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def detected_level(flags: str | None = None) -> str:
    """The highest level whose flags this CPU lists (generic off x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "generic"
    have = set((cpu_flags() if flags is None else flags).split())
    level = "generic"
    for candidate in LEVELS[1:]:
        if not set(_NEEDS[candidate]) <= have:
            break
        level = candidate
    return level


def level(env: dict[str, str] | None = None) -> str:
    """The level the kernels run at: RELAY_CPU_ISA where set (at most the detected one), else the
    detected one. Raises ValueError naming the variable for a level unknown or above this CPU's."""
    env = os.environ if env is None else env
    found = detected_level()
    wanted = env.get(ENV, "").strip().lower()
    if not wanted:
        return found
    if wanted not in LEVELS:
        raise ValueError(f"{ENV}={wanted!r}: want one of {', '.join(LEVELS)}")
    if LEVELS.index(wanted) > LEVELS.index(found):
        raise ValueError(f"{ENV}={wanted!r}: this CPU reaches {found!r} at most")
    return wanted


def describe(current: str | None = None) -> str:
    """The level for a log line: whether it is this CPU's own or held lower, and by what."""
    current = current or level()
    found = detected_level()
    return current if current == found else f"{current} (held by {ENV}; this CPU reaches {found})"


def at_least(name: str, current: str | None = None) -> bool:
    return LEVELS.index(current or level()) >= LEVELS.index(name)


def int8_dot_products(current: str | None = None) -> bool:
    """Whether int8 GEMMs (torch._int_mm through oneDNN: --quantization w8a8) have VNNI dot products
    at this level: every avx512bf16 CPU has AVX512-VNNI, and an avx512 one where it lists it and is
    not held lower. Without them oneDNN runs a reference int8 GEMM: [128 x 576] x [576 x 1536] held
    to AVX2 on a Xeon took 19.8 ms against 0.08 ms with VNNI, slower than float32 by far."""
    current = current or level()
    if at_least("avx512bf16", current):
        return True
    return current == "avx512" == detected_level() and "avx512_vnni" in cpu_flags().split()


def compile_flags(current: str | None = None) -> list[str]:
    """gcc flags that build the kernels for this level: the CPU's own set at its own level (and at
    the AMX levels), the x86-64 microarchitecture levels when held below it (tuned for this CPU
    either way)."""
    current = current or level()
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["-mcpu=native"] if platform.machine() in ("aarch64", "arm64") else []
    if current == "amx":
        return ["-march=native"]
    if current == "avx512bf16":
        return ["-march=native", *_NO_AMX]
    if current == "avx512" == detected_level():
        return [
            "-march=native"
        ]  # the CPU's own extras too: AVX512-VNNI's VPDPBUSD on a Cascade/Ice Lake
    return [f"-march={_MARCH[current]}", "-mtune=native"]


def torch_env(current: str | None = None) -> dict[str, str]:
    """The variables that hold torch (ATen's dispatch, oneDNN) to a level below the CPU's; none
    where the level is the CPU's own, so an unheld server runs torch as it comes."""
    current = current or level()
    if current == detected_level():
        return {}
    return {
        "ATEN_CPU_CAPABILITY": _ATEN[current],
        "ONEDNN_MAX_CPU_ISA": _ONEDNN[current],
        "MKL_ENABLE_INSTRUCTIONS": _MKL[current],
    }
