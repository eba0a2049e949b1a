"""The quantized-at-load tests' skip mark where the CPU block kernels are not built. A module of
its own: the mark loads (and may build) the kernel library when it is imported, which only the
modules that use it should do at collection."""

from __future__ import annotations

import pytest

from relay.execution.kernels import cpu_gemm

needs_blocks = pytest.mark.skipif(
    not cpu_gemm.gemm_blocks_available(), reason="the block kernels are not built here"
)
