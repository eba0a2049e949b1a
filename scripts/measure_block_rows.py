#!/usr/bin/env python3
"""Measure, per CPU level, up to how many rows GEMMs run faster from the default model's GGUF
blocks than from its float weights: the numbers behind relay/execution/block_rows.py's MEASURED.

Each level runs in its own process held with RELAY_CPU_ISA (torch and oneDNN held too), loads the
default model as the server would (its dtype for that level, its block activations) and times its
first layer's GEMMs with layers.blocks_crossover_rows, --times times. Run it on a quiet machine.

    python scripts/measure_block_rows.py                     # every level this CPU has
    python scripts/measure_block_rows.py --levels avx2,amx --times 5
    python scripts/measure_block_rows.py --levels avx512bf16,amx --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]


def measure_here(times: int, dtype: str, activations: str) -> dict:
    """In a process already held to its level: the model's dtype, its activations, the rows."""
    from relay.engine import Engine
    from relay.execution import layers
    from relay.execution.block_rows import ALL_ROWS
    from relay.execution.kernels import isa

    # every block kept for the timing; dtype "auto" is the server's default for this level
    engine = Engine(None, weight_block_rows=ALL_ROWS, dtype=dtype, block_activations=activations)
    model = engine.runner.model
    # the first decoder layer's GEMMs: the LM head (listed first where it is the tied embedding)
    # sees a row per sampled sequence only, and its 49,152 x 576 GEMM would outweigh the layer's
    blocks = [
        m
        for m in model.gemm_modules()
        if getattr(m, "blocks", None) is not None and m is not model.lm_head
    ]
    sample = blocks[:4]
    rows = [layers.blocks_crossover_rows(sample) for _ in range(times)]
    return {
        "level": isa.level(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "int8_activations": bool(sample and sample[0].blocks.dot),
        "rows": rows,
        "median": statistics.median(rows) if rows else None,
        "load": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", help="comma-separated (default: every level this CPU has)")
    ap.add_argument("--times", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="the model's dtype (default: the server's)")
    ap.add_argument("--block-activations", default="auto", help="auto, int8 or float")
    ap.add_argument("--here", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.here:
        print(json.dumps(measure_here(args.times, args.dtype, args.block_activations)), flush=True)
        return
    from relay.execution.kernels import isa

    have = isa.LEVELS[: isa.LEVELS.index(isa.detected_level()) + 1]
    levels = args.levels.split(",") if args.levels else list(have)
    for level in levels:
        env = {**os.environ, isa.ENV: level, **isa.torch_env(level)}
        cmd = [
            sys.executable,
            __file__,
            "--here",
            "--times",
            str(args.times),
            "--dtype",
            args.dtype,
        ]
        cmd += ["--block-activations", args.block_activations]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith("{")), None)
        print(line or f'{{"level": "{level}", "error": {json.dumps(out.stderr[-500:])}}}')


if __name__ == "__main__":
    main()
