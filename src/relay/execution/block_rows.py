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
# scripts/measure_block_rows.py on a quiet 2-core Xeon with AMX, each level held with RELAY_CPU_ISA
# (2026-12-04; the runs agreed exactly where int8, within 64-192 rows where float). Blocks times int8
# activations beat the float GEMMs at every size tried where VNNI or AVX2's products carry them, to
# 48 rows against AVX-512 float32 GEMMs without VNNI; bfloat16 blocks beat oneDNN's bfloat16 and
# AMX GEMMs at one row only; plain C blocks (generic) never beat the float path.
MEASURED: dict[tuple[str, torch.dtype, bool], int] = {
    ("generic", torch.float32, False): 0,
    ("avx2", torch.float32, True): ALL_ROWS,
    ("avx2", torch.float32, False): 96,
    ("avx512", torch.float32, True): 48,
    ("avx512", torch.float32, False): 128,
    ("avx512bf16", torch.float32, True): ALL_ROWS,
    ("avx512bf16", torch.float32, False): 128,
    ("avx512bf16", torch.bfloat16, False): 1,
    ("amx", torch.float32, True): ALL_ROWS,
    ("amx", torch.bfloat16, False): 1,
}


def block_rows(level: str, dtype: torch.dtype, int8_activations: bool) -> int:
    """The rows up to which GEMMs read the blocks at this level (see MEASURED); a combination
    not measured takes its activations' rule at the nearest measured level below."""
    for lower in reversed(LEVELS[: LEVELS.index(level) + 1]):
        rows = MEASURED.get((lower, dtype, int8_activations))
        if rows is not None:
            return rows
    return ALL_ROWS if int8_activations else 0
