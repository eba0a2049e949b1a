"""Up to how many rows a GEMM reads its weight's GGUF blocks rather than the float weight: a fixed
rule per CPU level, model dtype and block activations, measured (scripts/measure_block_rows.py),
not timed at start-up. A start-up timing moved with the host's load, and with it which GEMMs
rounded their activations to 8 bits: the same server on the same machine answered a greedy
request differently after a restart (measured: crossovers 0/4/32/256 rows put the first token
that differs from transformers at 16/16/2/5). EngineConfig.weight_block_rows overrides the rule.
"""

from __future__ import annotations

import torch

from relay.execution.kernels.isa import LEVELS

# The rows of a CPU prompt chunk (the default --chunked-prefill-size on CPU): "every GEMM".
ALL_ROWS = 256

# (level, model dtype, int8 block activations) -> rows: the medians of three runs of
# scripts/measure_block_rows.py (the first decoder layer's four GEMMs) on a quiet 2-core Xeon with
# AMX, each level held with RELAY_CPU_ISA (2026-12-04, after the int8 kernel's quantizer was
# vectorised and parallel). Blocks times int8 activations beat every float GEMM at every size tried,
# to 256 rows, at every level but AMX's, whose bfloat16 tiles win from 6 rows; with float
# activations the blocks win to 160-192 rows in float32 and at 1-2 rows in bfloat16; plain C blocks
# (generic) never beat the float path.
# AMX with int8 activations (the default there) still takes the blocks for every GEMM: a float path
# from 6 rows rounds a request's activations differently in a crowded step than alone, which broke
# the defaults' reproducible greedy output (README), and kept a float copy of every GEMM weight
# beside its blocks. What that costs a prompt: docs/benchmarks.md (AMX Xeon, 2026-12-06).
MEASURED: dict[tuple[str, torch.dtype, bool], int] = {
    ("generic", torch.float32, False): 0,
    ("avx2", torch.float32, True): ALL_ROWS,
    ("avx2", torch.float32, False): 160,
    ("avx512", torch.float32, True): ALL_ROWS,
    ("avx512", torch.float32, False): 192,
    ("avx512bf16", torch.float32, True): ALL_ROWS,
    ("avx512bf16", torch.float32, False): 192,
    ("avx512bf16", torch.bfloat16, True): ALL_ROWS,
    ("avx512bf16", torch.bfloat16, False): 2,
    ("amx", torch.float32, True): ALL_ROWS,
    ("amx", torch.bfloat16, True): ALL_ROWS,
    ("amx", torch.bfloat16, False): 2,
}


def block_rows(level: str, dtype: torch.dtype, int8_activations: bool) -> int:
    """The rows up to which GEMMs read the blocks at this level (see MEASURED); a combination
    not measured takes its activations' rule at the nearest measured level below."""
    for lower in reversed(LEVELS[: LEVELS.index(level) + 1]):
        rows = MEASURED.get((lower, dtype, int8_activations))
        if rows is not None:
            return rows
    return ALL_ROWS if int8_activations else 0
