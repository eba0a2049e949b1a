"""What the CPU kernel tests share: the kernel library, built or skipped for a reason."""
from __future__ import annotations

import ctypes
import os

import pytest

from relay.kernels import cpu


def cpu_kernels_or_skip() -> ctypes.CDLL:
    """Relay's CPU kernel library. Skips where it is off (RELAY_CPU_KERNELS=0) or this machine
    has no C compiler; fails where a compiler exists and the sources do not build, which a skip
    would hide (every kernel test would pass by not running)."""
    lib = cpu.load()
    if lib is not None:
        return lib
    if os.environ.get("RELAY_CPU_KERNELS", "1") == "0" or cpu.compiler() is None:
        pytest.skip("no C compiler (or RELAY_CPU_KERNELS=0): Relay's CPU kernels are unavailable here")
    try:
        cpu._build()
    except RuntimeError as e:
        pytest.fail(f"Relay's CPU kernels do not build with {cpu.compiler()}: {e}")
    pytest.fail("Relay's CPU kernels built but did not load (see the log)")
