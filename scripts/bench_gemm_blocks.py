#!/usr/bin/env python3
"""A decode step's GEMMs on the default model's own weights: GGUF blocks vs the dense paths.

Loads SmolLM2-135M's float32 weights (Relay's conversion of the shipped Q4_1 GGUF), fuses them as
Relay does (qkv, gate_up; 30 layers plus the 49152 x 576 LM head, every one distinct so they
stream from memory as in a real step), recovers their GGUF blocks (relay/execution/weight_blocks.py) and
times all of one step's GEMMs at each row count with:
  blocks  Relay's kernel on the Q4_1/Q8_0 blocks (csrc/gemm_blocks.c; --dtype bfloat16: VDPBF16PS
          from 2 rows on, as for a bfloat16 model),
  linear  torch's F.linear on the dense weights,
  packed  oneDNN on a prepacked copy,
  panels  (--dtype bfloat16, AVX512-BF16 CPUs) Relay's kernel on bf16 panels (csrc/gemm_bf16.c).

    python scripts/bench_gemm_blocks.py
    python scripts/bench_gemm_blocks.py --dtype bfloat16 --rows 4,8,16,32,64,256
    python scripts/bench_gemm_blocks.py --dtype bfloat16 --ab /path/to/relay_cpu-OLD.so   # two builds' blocks
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]

import torch  # noqa: E402

from relay.execution.kernels import cpu as cpu_kernels  # noqa: E402
from relay.execution.kernels import cpu_gemm  # noqa: E402
from relay.execution.model_files import load_transformers_model, resolve_model_dir  # noqa: E402
from relay.execution.weight_blocks import recover  # noqa: E402


def step_weights() -> list[torch.Tensor]:
    sd = load_transformers_model(resolve_model_dir(None), torch.float32).state_dict()
    out = []
    layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("model.layers."))
    for i in range(layers):

        def g(part: str) -> torch.Tensor:
            return sd[f"model.layers.{i}.{part}.weight"]

        out += [
            torch.cat([g("self_attn.q_proj"), g("self_attn.k_proj"), g("self_attn.v_proj")]),
            g("self_attn.o_proj"),
            torch.cat([g("mlp.gate_proj"), g("mlp.up_proj")]),
            g("mlp.down_proj"),
        ]
    out.append(sd["model.embed_tokens.weight"])  # the tied LM head
    return out


def medians_ms(fns, repeats: int) -> list[float]:
    """Each fn's median time in ms, the fns taking turns within every repeat: this host's speed
    drifts by tens of percent within minutes, and one path timed after another would carry it."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) * 1000 for ts in times]


def blocks_with(lib, x: torch.Tensor, w) -> torch.Tensor:
    """cpu_gemm.gemm_blocks through another build of the library."""
    y = torch.empty(x.shape[0], w.out_features)
    lib.relay_gemm_blocks(
        w.bits,
        w.q.data_ptr(),
        w.d.data_ptr(),
        w.m.data_ptr(),
        x.data_ptr(),
        x.stride(0),
        y.data_ptr(),
        y.stride(0),
        x.shape[0],
        w.out_features,
        w.in_features,
        int(w.round_bf16),
    )
    return y


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--ab",
        metavar="LIB",
        help="also time the blocks with this other build of Relay's kernel "
        "library (another checkout's), alternating with this one's",
    )
    args = ap.parse_args()
    if not cpu_gemm.gemm_blocks_available():
        sys.exit("the block GEMM needs AVX-512 and a C compiler")
    dtype = getattr(torch, args.dtype)
    exact = step_weights()
    blocks = [recover(w) for w in exact]
    if any(b is None for b in blocks):
        sys.exit("these weights are not exact GGUF blocks")
    for b in blocks:
        b.round_bf16 = dtype == torch.bfloat16
    weights = [w.to(dtype) for w in exact]
    del exact
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    paths = {
        "blocks": lambda xs: [cpu_gemm.gemm_blocks(xs[b.in_features].float(), b) for b in blocks],
        "linear": lambda xs: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
        "packed": lambda xs: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
            for w, p in zip(weights, packed)
        ],
    }
    if args.ab:
        other = cpu_kernels.bind(args.ab)
        paths["blocks (--ab)"] = lambda xs: [
            blocks_with(other, xs[b.in_features].float(), b) for b in blocks
        ]
    if dtype == torch.bfloat16 and cpu_gemm.gemm_bf16_available():
        panels = [cpu_gemm.pack_panels(w) for w in weights]
        paths["panels"] = lambda xs: [cpu_gemm.gemm_panels(xs[p.in_features], p) for p in panels]
    flags = cpu_kernels.cpu_flags().split()
    print(
        f"{args.dtype}, threads {torch.get_num_threads()}, "
        + " ".join(f for f in flags if f.startswith(("avx512", "amx")))
    )
    print(
        "| rows | "
        + " | ".join(f"{name} ms" for name in paths)
        + " | fastest |\n|---|"
        + "---|" * (len(paths) + 1)
    )
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {w.shape[1]: torch.randn(m, w.shape[1]).to(dtype) for w in weights}
        times = medians_ms([lambda f=f: f(xs) for f in paths.values()], args.repeats)
        fastest = min(zip(times, paths), key=lambda tn: tn[0])[1]
        print(f"| {m} | " + " | ".join(f"{t:.2f}" for t in times) + f" | {fastest} |")


if __name__ == "__main__":
    main()
