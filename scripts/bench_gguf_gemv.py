#!/usr/bin/env python3
"""A GGUF file's own GEMM weights, loaded as the server loads them (gguf_weights.read_blocks), timed
as decode-step GEMVs: per kind of weight (a layer's fused q/k/v, o, gate/up, down, and the LM head;
layers whose parts have other types apart), each form the loader can give it - the 6-bit form of
Q6_K / Q5_K quants and the 8-bit one before it (gguf_weights.SIX_BIT_QUANTS False) - at each
instruction-set level, every case in turn in each of --rounds rounds (a shared host's drift spread
over all), each call on the next layer's weight (up to --layers of them) so that the weights come
from memory as in a decode step, not from the last-level cache.

    python scripts/bench_gguf_gemv.py model.Q4_K_M.gguf
    python scripts/bench_gguf_gemv.py model.Q4_K_M.gguf --levels avx2,avx512,avx512bf16 --rows 1,4,8
    python scripts/bench_gguf_gemv.py model.Q4_K_M.gguf --activations float
    python scripts/bench_gguf_gemv.py model.Q4_K_M.gguf --levels avx512bf16 --lib old=/path/relay_cpu-old.so

On one thread (the default) the time is the calling thread's CPU time (the kernel runs on it alone;
on a shared host wall time also counts other processes' turns on the core); GB/s is the bytes one
call reads (quants and scales) over the median time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import torch

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "src")]  # this checkout's relay, not an installed one

from relay.execution.gguf_weights import GgufFile, Part, read_blocks  # noqa: E402
from relay.execution.kernels import cpu, cpu_gemm  # noqa: E402
from relay.execution.weight_blocks import BlockWeight  # noqa: E402

# a decode step's GEMM weights per layer: name -> the GGUF tensors fused into it, in order
LAYER_WEIGHTS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}


def type_names(file: GgufFile, names: list[str]) -> str:
    from gguf import GGMLQuantizationType

    return "+".join(GGMLQuantizationType(file.tensors[n].qtype).name for n in names)


def weight_groups(file: GgufFile, max_layers: int) -> dict[tuple[str, str], list[list[Part]]]:
    """(weight, its parts' types) -> up to max_layers layers' parts of it; and the LM head."""
    groups: dict[tuple[str, str], list[list[Part]]] = defaultdict(list)
    layer = 0
    while f"blk.{layer}.attn_q.weight" in file:
        for weight, tensors in LAYER_WEIGHTS.items():
            names = [f"blk.{layer}.{t}.weight" for t in tensors]
            key = (weight, type_names(file, names))
            if len(groups[key]) < max_layers:
                groups[key].append([Part(n, np.arange(file.tensors[n].shape[0])) for n in names])
        layer += 1
    head = "output.weight" if "output.weight" in file else "token_embd.weight"
    groups["lm_head", type_names(file, [head])].append(
        [Part(head, np.arange(file.tensors[head].shape[0]))]
    )
    return groups


def read_bytes(w: BlockWeight) -> int:
    return sum(t.numel() * t.element_size() for t in (w.q, w.d, w.m))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("gguf")
    ap.add_argument("--levels", default="avx2,avx512bf16", help="instruction-set levels, in turn")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--activations", default="int8", choices=["int8", "float"])
    ap.add_argument("--layers", type=int, default=8, help="layers' weights per kind, in turn")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="calls timed per case and round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--lib",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="also another build of the kernel library (another checkout's, other -D flags), in turn"
        " with the levels (it must take the forms timed: a build without the 6-bit form returns"
        " without computing on them)",
    )
    ap.add_argument(
        "--weights", default=None, help="only these weights (qkv,o,gate_up,down,lm_head)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    libs = {level: cpu.build_level(level) for level in args.levels.split(",") if level}
    libs |= {label: cpu.bind(path) for label, path in (lib.split("=", 1) for lib in args.lib)}
    file = GgufFile.read(args.gguf)
    dot = args.activations == "int8"
    wanted = None if args.weights is None else set(args.weights.split(","))
    cases = {}  # (weight, types, form label) -> (weights, bytes per call, kernel_bits)
    t0 = time.perf_counter()
    for (weight, types), layers in weight_groups(file, args.layers).items():
        if wanted is not None and weight not in wanted:
            continue
        for six in (False, True):
            ws = [read_blocks(file, parts, dot, six_bits=six) for parts in layers]
            if six and ws[0].bits != 6:
                continue  # no quants here narrow: one form only
            label = f"{ws[0].bits}-bit"
            cases[weight, types, label] = (ws, read_bytes(ws[0]), ws[0].kernel_bits)
    print(f"loaded {len(cases)} cases in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rows = [int(r) for r in args.rows.split(",")]
    xs = {
        (m, k): torch.randn(m, k)
        for m in rows
        for k in {w[0].in_features for w, _, _ in cases.values()}
    }
    times: dict[tuple, list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        for level, lib in libs.items():
            cpu.use(lib)
            for key, (ws, _, _) in cases.items():
                for m in rows:
                    x = xs[m, ws[0].in_features]
                    for w in ws:  # warm: this level's code, and the weights on their way
                        cpu_gemm.gemm_blocks(x, w)
                    for r in range(args.reps):
                        w = ws[r % len(ws)]
                        start = clock()
                        cpu_gemm.gemm_blocks(x, w)
                        times[key, level, m].append(clock() - start)
    load_avg = os.getloadavg()
    print(
        f"{os.path.basename(args.gguf)}, {args.activations} activations, {args.threads} thread(s),"
        f" {args.rounds} rounds x {args.reps} calls per case, load average {load_avg[0]:.1f}"
        f" {load_avg[1]:.1f} {load_avg[2]:.1f}; us at the median call, GB/s of its reads"
    )
    print("| weight | types | N x K | form | bits / weight | level | rows | us | GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (weight, types, label), (ws, size, bits) in cases.items():
        n, k = ws[0].out_features, ws[0].in_features
        for level in libs:
            for m in rows:
                med = statistics.median(times[(weight, types, label), level, m])
                print(
                    f"| {weight} | {types} | {n} x {k} | {label} {hex(bits)} |"
                    f" {8 * size / (n * k):.4f} | {level} | {m} | {med * 1e6:.0f} |"
                    f" {size / med / 1e9:.1f} |"
                )


if __name__ == "__main__":
    main()
