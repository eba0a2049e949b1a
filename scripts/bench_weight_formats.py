"""What would another weight format buy? Time a decode step's GEMMs with float32, bfloat16 and int8 weights.

Builds random weights with the default model's shapes (SmolLM2-135M: 30 layers of qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536, plus the 49152x576 LM head), every layer distinct so that the weights
stream from memory as in a real step, and times:
  - all GEMMs of one step at batch 1 (the weights are read once per step: the roofline term), and
  - one gate_up GEMM at several batch sizes (where int8's kernel stops paying).
int8 is torch's weight-only kernel (`aten._weight_int8pack_mm`: int8 weights, per-row scales, bfloat16
activations). Relay does not use int8 yet; this measures whether it should.

    python scripts/bench_weight_formats.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD_SHAPE = (49152, 576)


def make_weight(shape: tuple[int, int], fmt: str):
    if fmt == "int8":
        return torch.randint(-127, 128, shape, dtype=torch.int8), torch.rand(shape[0]).bfloat16()
    return torch.randn(shape).to(getattr(torch, fmt))


def matmul(x: torch.Tensor, w, fmt: str) -> torch.Tensor:
    if fmt == "int8":
        return torch.ops.aten._weight_int8pack_mm(x, w[0], w[1])
    return torch.nn.functional.linear(x, w)


def act_dtype(fmt: str) -> torch.dtype:
    return torch.float32 if fmt == "float32" else torch.bfloat16


def step_ms(fmt: str, layers: int, repeats: int) -> float:
    weights = [[make_weight(s, fmt) for s in LAYER_SHAPES] for _ in range(layers)] + [
        [make_weight(HEAD_SHAPE, fmt)]
    ]
    shapes = [LAYER_SHAPES] * layers + [[HEAD_SHAPE]]
    inputs = {k: torch.randn(1, k, dtype=act_dtype(fmt)) for k in (576, 1536)}

    def step() -> None:
        for layer_shapes, layer in zip(shapes, weights):
            for (_, k), w in zip(layer_shapes, layer):
                matmul(inputs[k], w, fmt)

    return median_ms(step, repeats)


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    formats = ("float32", "bfloat16", "int8")

    print(
        f"all GEMMs of one batch-1 decode step ({args.layers} layers + LM head), median of {args.repeats}:\n"
    )
    print("| weights | MB read | ms/step | GB/s |")
    print("|---|---|---|---|")
    params = args.layers * sum(n * k for n, k in LAYER_SHAPES) + HEAD_SHAPE[0] * HEAD_SHAPE[1]
    for fmt in formats:
        ms = step_ms(fmt, args.layers, args.repeats)
        mb = params * {"float32": 4, "bfloat16": 2, "int8": 1}[fmt] / 1e6
        print(f"| {fmt} | {mb:.0f} | {ms:.2f} | {mb / ms:.1f} |")

    n, k = LAYER_SHAPES[2]
    weights = {fmt: make_weight((n, k), fmt) for fmt in formats}
    print(f"\none {n}x{k} GEMM by batch rows, ms (median of {args.repeats}):\n")
    print("| rows | " + " | ".join(formats) + " |")
    print("|---|" + "---|" * len(formats))
    for rows in (1, 4, 8, 16, 32, 256):
        cells = []
        for fmt in formats:
            x = torch.randn(rows, k, dtype=act_dtype(fmt))
            cells.append(f"{median_ms(lambda: matmul(x, weights[fmt], fmt), args.repeats):.3f}")
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
