"""What the CPU kernel tests share: the kernel library, built or skipped for a reason."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

import pytest

from relay.execution.kernels import cpu, isa


def cpu_kernels_or_skip() -> ctypes.CDLL:
    """Relay's CPU kernel library. Skips where it is off (RELAY_CPU_KERNELS=0) or this machine
    has no C compiler; fails where a compiler exists and the sources do not build, which a skip
    would hide (every kernel test would pass by not running)."""
    lib = cpu.load()
    if lib is not None:
        return lib
    if os.environ.get("RELAY_CPU_KERNELS", "1") == "0" or cpu.compiler() is None:
        pytest.skip(
            "no C compiler (or RELAY_CPU_KERNELS=0): Relay's CPU kernels are unavailable here"
        )
    try:
        cpu.build()
    except RuntimeError as e:
        pytest.fail(f"Relay's CPU kernels do not build with {cpu.compiler()}: {e}")
    pytest.fail("Relay's CPU kernels built but did not load (see the log)")


def levels_here() -> list[str]:
    """Every instruction-set level this CPU (or RELAY_CPU_ISA) reaches, lowest first: the kernel
    tests run at each, so the AVX2 and generic paths are tested on every machine."""
    return [level for level in isa.LEVELS if isa.at_least(level)]


@contextlib.contextmanager
def held_at(level: str) -> Iterator[ctypes.CDLL]:
    """The kernel library built for `level`, swapped in for every kernel call until the block ends."""
    cpu_kernels_or_skip()
    previous = cpu.use(cpu.build_level(level))
    try:
        yield cpu.load()
    finally:
        cpu.use(previous)


@pytest.fixture(params=levels_here())
def kernel_level(request) -> Iterator[str]:
    """Each level this CPU reaches, its library in use for the test (import this fixture)."""
    with held_at(request.param):
        yield request.param


def decode_rounding(io, kv, d: int, group: int, level: str) -> tuple[bool, float]:
    """(rounded, tolerance) of the C decode attention against a float reference: the VDPBF16PS
    kernel (AVX512-BF16; head_dim 64 or 128, at most 8 query heads per kv head) takes a bfloat16
    cache's queries in bfloat16, as a bfloat16 model has them (rounded: the reference should
    round them too); bfloat16 outputs or caches are compared at their precision."""
    import torch

    rounded = (
        kv == torch.bfloat16 and isa.at_least("avx512bf16", level) and d in (64, 128) and group <= 8
    )
    if io == kv == torch.float32:
        return rounded, 1e-5
    return rounded, 2e-2 if io == torch.bfloat16 else (5e-3 if rounded else 2e-3)


@pytest.fixture(params=["amx", "avx512bf16"])
def bf16_level(request) -> Iterator[ctypes.CDLL]:
    """The kernels with AMX tiles (GEMMs on panels, prompt-chunk and shared-prefix attention) where
    this CPU has them, and held to VDPBF16PS: the library built for each level, swapped in for the
    test (on a CPU below avx512bf16 the kernels under test are not built: skipped)."""
    cpu_kernels_or_skip()
    if not isa.at_least(request.param):
        pytest.skip(f"this CPU (or RELAY_CPU_ISA) does not reach {request.param}")
    held = cpu.build_level(request.param)
    if request.param == "amx" and not held.relay_gemm_amx_available():
        pytest.skip("Linux refused AMX's tile state")
    previous = cpu.use(held)
    yield held
    cpu.use(previous)
