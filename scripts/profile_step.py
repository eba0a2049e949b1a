#!/usr/bin/env python3
"""Where a model step's time goes: the default model's decode step at several batch sizes and a
prompt chunk, timed whole and broken down per op with torch.profiler.

Builds the real ModelRunner (the server's, with its kernels and weight formats), fills the KV of
B requests of --context tokens, then times decode steps (one token per request, logits and
sampling included) and one --prefill-token chunk. The breakdown sorts each op's self time into
GEMM, attention, sampler and small per-layer ops; what the ops do not account for is Python and
dispatch overhead.

    python scripts/profile_step.py                         # the server's defaults for this CPU
    python scripts/profile_step.py --dtype float32 --batch 1,32
    python scripts/profile_step.py --quantization int8
    python scripts/profile_step.py --kv-cache-dtype bfloat16       # float32 weights, half the KV bytes
    python scripts/profile_step.py --prefill-over 1024             # the chunk over a cached prefix
    python scripts/profile_step.py --ab /path/to/relay_cpu-OLD.so  # this checkout's kernels vs another build's

--ab times the server's path with this checkout's kernel library and with another build of it
(another checkout's: `python -c "from relay.execution.kernels import cpu; print(cpu.build())"` there prints
its path), alternating step by step in one process: on a host whose speed drifts between runs
only such a comparison shows a few per cent. Both builds must take the same arguments. Where the
other checkout measured another blocks crossover at start-up (its server log says "GEMMs of up to
N rows read those"), --ab-blocks-rows N gives its steps that one.

--ab-float-scales times the same runner's k-quant weights (a GGUF file's Q4_K/Q5_K/Q6_K) in their
compact scales (KSCALES_FLAG) against the same blocks with float32 d and m, step by step in turn:

    python scripts/profile_step.py --model-path model.Q4_K_M.gguf --batch 1 --ab-float-scales

--ab-six-bits the same for the weights kept in 6 bits (a GGUF file's Q6_K, Q5_K) against the same
blocks in the 8-bit form (--prefill 0: decode steps only):

    python scripts/profile_step.py --model-path model.Q4_K_M.gguf --batch 1,4 --ab-six-bits --prefill 0
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]

import torch  # noqa: E402

from relay.config import EngineConfig, ModelConfig  # noqa: E402
from relay.execution.model_files import resolve_model_dir  # noqa: E402
from relay.execution.model_runner import ModelRunner  # noqa: E402
from relay.sampling_params import SamplingParams  # noqa: E402
from relay.step import BatchInput, SamplingSpec  # noqa: E402

CATEGORIES = [  # (name, substrings of op names), first match wins
    ("gemm", ("linear", "mm", "addmm", "matmul", "_weight_int", "relay::gemm")),
    ("attention", ("scaled_dot_product", "decode_attention", "relay::attn", "bmm", "softmax")),
    ("sampler", ("argmax", "sort", "topk", "searchsorted", "multinomial", "log_softmax")),
]


def category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "small ops"


class Steps:
    """B requests with `context` tokens of KV each, decoding one token per step."""

    def __init__(
        self,
        runner: ModelRunner,
        batch: int,
        context: int,
        shared: int = 0,
        group: int = 16,
        steps: int = 64,
    ):
        """shared: the first `shared` tokens' pages are common to each group of `group` requests
        (a cached system prompt); steps: how many decode steps the pages must hold."""
        self.runner, self.b, self.ps = runner, batch, runner.page_size
        shared_pages = shared // self.ps
        pages_each = -(-(context + steps) // self.ps) - shared_pages
        first = 1 + batch * pages_each
        self.tables = [
            list(
                range(first + (i // group) * shared_pages, first + (i // group + 1) * shared_pages)
            )
            + list(range(1 + i * pages_each, 1 + (i + 1) * pages_each))
            for i in range(batch)
        ]
        self.lens = [context] * batch
        self.step = 0
        specs = [SamplingSpec(sid, SamplingParams(temperature=0), [2]) for sid in range(batch)]
        self.run(
            BatchInput(
                self._next(),
                list(range(batch)),
                [17] * (context * batch),
                [0] * batch,
                [context] * batch,
                [0] * batch,
                [t[: -(-context // self.ps)] for t in self.tables],
                [True] * batch,
                [0] * batch,
                specs,
            )
        )

    def _next(self) -> int:
        self.step += 1
        return self.step

    def run(self, batch: BatchInput):
        return self.runner.forward(batch)

    def decode(self):
        prefix = list(self.lens)
        starts = [p // self.ps for p in prefix]
        new = [
            t[s : s + 1] if p % self.ps == 0 else [] for t, s, p in zip(self.tables, starts, prefix)
        ]
        batch = BatchInput(
            self._next(),
            list(range(self.b)),
            [17] * self.b,
            prefix,
            [1] * self.b,
            [
                s if n else len(t[: -(-p // self.ps)])
                for s, n, t, p in zip(starts, new, self.tables, prefix)
            ],
            new,
            [True] * self.b,
            [1] * self.b,
        )
        self.lens = [n + 1 for n in self.lens]
        return self.run(batch)


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def ab_medians(
    runner: ModelRunner, other, fn, reps: int, their_blocks_rows: int | None = None
) -> tuple[float, float]:
    """Medians (ms) of fn with this checkout's kernel library and with `other`, alternating;
    their_blocks_rows: the other build's GEMMs read the weight blocks up to this many rows (the
    crossover its checkout measured), ours up to what this runner measured."""
    from relay.execution.kernels import cpu as cpu_kernels

    ours = cpu_kernels.load()
    our_rows = next(
        (m.blocks.max_rows for m in runner.model.gemm_modules() if m.blocks is not None), None
    )

    def use(lib, rows) -> None:
        cpu_kernels.use(lib)
        runner.attn.kernel = lib if runner.attn.kernel is not None else None
        if their_blocks_rows is not None and our_rows is not None:
            runner.model.limit_weight_blocks(rows)
            runner.model.use_decode_layers(runner.attn)  # its C structs copy the rows

    times: tuple[list[float], list[float]] = ([], [])
    for rep in range(reps + 1):
        for lib, rows, out in ((ours, our_rows, times[0]), (other, their_blocks_rows, times[1])):
            use(lib, rows)
            t0 = time.perf_counter()
            fn()
            if rep:  # the first of each: warm-up
                out.append((time.perf_counter() - t0) * 1000)
    use(ours, our_rows)
    return statistics.median(times[0]), statistics.median(times[1])


def ab(runner: ModelRunner, args) -> None:
    from relay.execution.kernels import cpu as cpu_kernels

    other = cpu_kernels.bind(args.ab)
    print(
        f"\n| step | this checkout ms | {os.path.basename(args.ab)} ms | theirs / ours |\n|---|---|---|---|"
    )
    for b in [int(x) for x in args.batch.split(",")]:
        steps = Steps(runner, b, args.context, args.shared_prefix, steps=4 * args.reps + 8)
        ours, theirs = ab_medians(runner, other, steps.decode, args.reps, args.ab_blocks_rows)
        print(f"| decode b={b} | {ours:.1f} | {theirs:.1f} | {theirs / ours:.3f} |")
        runner.forward(BatchInput(0, [], [], [], [], [], [], [], [], released_sids=list(range(b))))
    if not args.prefill:  # --prefill 0: decode steps only
        return
    ours, theirs = ab_medians(
        runner,
        other,
        prefill_chunk(runner, args.prefill, args.prefill_over),
        max(3, args.reps // 4),
        args.ab_blocks_rows,
    )
    print(
        f"| prefill {args.prefill}{over(args)} | {ours:.1f} | {theirs:.1f} | {theirs / ours:.3f} |"
    )


def ab_float_scales(runner: ModelRunner, args) -> None:
    """Decode steps and a prompt chunk on the k-quant weights' compact scales and on the same
    blocks with float32 d and m (BlockWeight.with_float_scales), alternating step by step (outputs
    are the same bit for bit: only the bytes read differ)."""
    modules = [m for m in runner.model.gemm_modules() if m.blocks is not None and m.blocks.kscales]
    if not modules:
        raise SystemExit("no weight here has compact k-quant scales")
    compact = [m.blocks for m in modules]
    ab_blocks(
        runner,
        args,
        modules,
        (compact, [b.with_float_scales() for b in compact]),
        ("compact", "float32 scales"),
    )


def ab_six_bits(runner: ModelRunner, args) -> None:
    """Decode steps and a prompt chunk on the weights kept in 6 bits (gguf_weights.SIX_BIT_QUANTS:
    a GGUF file's Q6_K, Q5_K, ...) and on the same blocks in the 8-bit form before it
    (BlockWeight.to_eight_bits), alternating step by step (the same outputs bit for bit)."""
    modules = [
        m for m in runner.model.gemm_modules() if m.blocks is not None and m.blocks.bits == 6
    ]
    if not modules:
        raise SystemExit("no weight here is in the 6-bit form")
    six = [m.blocks for m in modules]
    libs = None
    if (
        args.ab_six_bits_lib
    ):  # the 8-bit form's steps on another build (the commit before the 6-bit form)
        from relay.execution.kernels import cpu as cpu_kernels

        libs = (cpu_kernels.load(), cpu_kernels.bind(args.ab_six_bits_lib))
    eight = "8-bit" + (f" ({os.path.basename(args.ab_six_bits_lib)})" if libs else "")
    ab_blocks(
        runner, args, modules, (six, [b.to_eight_bits() for b in six]), ("6-bit", eight), libs
    )


def ab_blocks(runner: ModelRunner, args, modules, forms, names, libs=None) -> None:
    """Steps with modules' blocks in each of two forms (the same outputs), alternating; libs: each
    form's kernel library (None: this checkout's for both)."""
    from relay.execution.kernels import cpu as cpu_kernels

    model = runner.model
    ways = []
    for blocks in forms:
        for m, b in zip(modules, blocks):
            m.blocks = b
        one_call = model.decode_layers
        if one_call is not None:  # its C structs point at the blocks: one per form
            model.use_decode_layers(runner.attn)
            model.decode_layers[1].max_rows = one_call[1].max_rows
            one_call = model.decode_layers
        ways.append((blocks, one_call))
    everything = [m.blocks for m in model.gemm_modules() if m.blocks is not None]
    others = sum(b.bytes_per_weight * b.out_features * b.in_features for b in everything)
    others -= sum(b.bytes_per_weight * b.out_features * b.in_features for b in forms[-1])
    gb = [sum(b.bytes_per_weight * b.out_features * b.in_features for b in w) / 1e9 for w in forms]
    print(
        f"{len(modules)} weights: {gb[0]:.3f} GB read per step {names[0]}, {gb[1]:.3f} {names[1]};"
        f" every GEMM weight: {(others / 1e9 + gb[0]):.3f} GB vs {(others / 1e9 + gb[1]):.3f} GB"
    )

    def medians(fn, reps: int) -> tuple[float, float]:
        times: tuple[list[float], list[float]] = ([], [])
        for rep in range(reps + 1):
            for i, ((blocks, one_call), out) in enumerate(zip(ways, times)):
                for m, b in zip(modules, blocks):
                    m.blocks = b
                model.decode_layers = one_call
                if libs is not None:
                    cpu_kernels.use(libs[i])
                    runner.attn.kernel = libs[i] if runner.attn.kernel is not None else None
                t0 = time.perf_counter()
                fn()
                if rep:  # the first of each: warm-up
                    out.append((time.perf_counter() - t0) * 1000)
        if libs is not None:
            cpu_kernels.use(libs[0])
            runner.attn.kernel = libs[0] if runner.attn.kernel is not None else None
        return statistics.median(times[0]), statistics.median(times[1])

    print(
        f"\n| step | {names[0]} ms | {names[1]} ms | {names[1]} / {names[0]} |\n|---|---|---|---|"
    )
    for b in [int(x) for x in args.batch.split(",")]:
        steps = Steps(runner, b, args.context, args.shared_prefix, steps=4 * args.reps + 8)
        ours, theirs = medians(steps.decode, args.reps)
        print(f"| decode b={b} | {ours:.1f} | {theirs:.1f} | {theirs / ours:.3f} |")
        runner.forward(BatchInput(0, [], [], [], [], [], [], [], [], released_sids=list(range(b))))
    if args.prefill:
        ours, theirs = medians(
            prefill_chunk(runner, args.prefill, args.prefill_over), max(3, args.reps // 4)
        )
        print(
            f"| prefill {args.prefill}{over(args)} | {ours:.1f} | {theirs:.1f} | {theirs / ours:.3f} |"
        )
    print(f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")


def over(args) -> str:
    return f" over {args.prefill_over}" if args.prefill_over else ""


def prefill_row(runner: ModelRunner, args) -> tuple:
    """The prompt chunk's row of the table: its median, tok/s and a layer-by-layer breakdown."""
    n = args.prefill
    chunk = prefill_chunk(runner, n, args.prefill_over)
    ms = timed(chunk, max(3, args.reps // 4))
    with layer_by_layer(runner):
        layered = timed(chunk, max(3, args.reps // 4))
        cats = {"layer by layer": layered, **breakdown(chunk, args.top)}
    return f"prefill {n}{over(args)}", ms, n / ms * 1000, cats


def prefill_chunk(runner: ModelRunner, n: int, prefix: int = 0):
    """One n-token prompt chunk over `prefix` cached tokens (filled once; a shared system prompt's
    case), to time again and again."""
    ps = runner.page_size
    pages = list(range(1, -(-(prefix + n) // ps) + 1))
    spec = [SamplingSpec(900, SamplingParams(temperature=0), [2])]
    if prefix:
        runner.forward(
            BatchInput(
                0,
                [901],
                [17] * prefix,
                [0],
                [prefix],
                [0],
                [pages[: -(-prefix // ps)]],
                [False],
                [0],
                [],
                [901],
            )
        )

    def chunk():
        return runner.forward(
            BatchInput(0, [900], [17] * n, [prefix], [n], [0], [pages], [True], [0], spec, [900])
        )

    return chunk


def label_c_kernels() -> None:
    """Relay's C kernels are called through ctypes, out of the profiler's sight: label them."""
    from relay.execution.kernels import cpu_attention, cpu_gemm, cpu_ops

    labels = {
        (cpu_attention, "decode_attention"): "relay::attn_decode",
        (cpu_attention, "extend_attention"): "relay::attn_extend",
        (cpu_gemm, "gemm_bf16"): "relay::gemm_bf16",
        (cpu_gemm, "gemm_panels"): "relay::gemm_panels",
        (cpu_gemm, "gemm_blocks"): "relay::gemm_blocks",
        (cpu_ops, "rms_norm"): "relay::rms_norm",
        (cpu_ops, "rope"): "relay::rope",
        (cpu_ops, "silu_mul"): "relay::silu_mul",
    }
    for (module, name), label in labels.items():
        plain = getattr(module, name, None)
        if plain is None:  # an older checkout, for A/B runs
            continue

        def labelled(*args, _plain=plain, _label=label, **kwargs):
            with torch.profiler.record_function(_label):
                return _plain(*args, **kwargs)

        setattr(module, name, labelled)


@contextlib.contextmanager
def layer_by_layer(runner: ModelRunner):
    """Steps through the Python layers, each kernel its own call (the profiler sees the ops),
    instead of the server's single C call for all layers where the model has it."""
    model = runner.model
    fast = model.decode_layers, model.prompt_layers
    model.decode_layers = model.prompt_layers = None
    try:
        yield
    finally:
        model.decode_layers, model.prompt_layers = fast


def breakdown(fn, top: int = 0) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]):
        fn()  # the profiler's own start-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = (time.perf_counter() - t0) * 1000
    cats: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.key.startswith("ProfilerStep") or ev.self_cpu_time_total <= 0:
            continue
        # A labelled range's self time is its C kernel's (the torch ops inside count apart).
        cats[category(ev.key)] = cats.get(category(ev.key), 0.0) + ev.self_cpu_time_total / 1000
    ops = sum(cats.values())
    if top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    cats["python/dispatch (rest)"] = max(0.0, wall - ops)
    cats["total (profiled)"] = wall
    return cats


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model-path", default=None, help="as the server's (default: the default model)"
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument(
        "--block-activations", default="auto", help="int8, float or auto (EngineConfig)"
    )
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument(
        "--context", type=int, default=256, help="KV tokens per request before decoding"
    )
    ap.add_argument("--prefill", type=int, default=256, help="tokens of the prompt chunk timed")
    ap.add_argument(
        "--prefill-over", type=int, default=0, help="cached tokens the prompt chunk attends over"
    )
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens of --context that each group of 16 requests shares (page-aligned)",
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--top", type=int, default=0, help="also print the N ops with the most self time, per step"
    )
    ap.add_argument(
        "--ab", metavar="LIB", help="compare this checkout's kernel library with this build of it"
    )
    ap.add_argument(
        "--ab-blocks-rows",
        type=int,
        metavar="N",
        help="with --ab: the other build's GEMMs read the weight blocks up to N rows (the crossover "
        "its checkout measured at start-up; this one's runner measures its own)",
    )
    ap.add_argument(
        "--ab-six-bits",
        action="store_true",
        help="compare the weights kept in 6 bits with the same blocks in 8 bits, step by step",
    )
    ap.add_argument(
        "--ab-six-bits-lib",
        metavar="LIB",
        help="with --ab-six-bits: the 8-bit steps on this build of the kernel library (the commit"
        " before the 6-bit form's: before and after in one process)",
    )
    ap.add_argument(
        "--ab-float-scales",
        action="store_true",
        help="compare the k-quant weights' compact scales with float32 d and m, step by step",
    )
    args = ap.parse_args()
    if not args.ab and not args.ab_float_scales and not args.ab_six_bits:
        label_c_kernels()
    model_dir = resolve_model_dir(args.model_path)
    cfg = EngineConfig(
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        block_activations=args.block_activations,
        kv_cache_gb=1.0,
    )
    runner = ModelRunner(cfg, model_dir, ModelConfig.from_dir(model_dir))
    print(
        f"dtype {runner.dtype}, kv {runner.kv_dtype}, quantization {args.quantization}, "
        f"threads {torch.get_num_threads()}"
    )
    if args.ab:
        return ab(runner, args)
    if args.ab_float_scales:
        return ab_float_scales(runner, args)
    if args.ab_six_bits:
        return ab_six_bits(runner, args)
    rows = []
    for b in [int(x) for x in args.batch.split(",")]:
        steps = Steps(runner, b, args.context, args.shared_prefix, steps=2 * args.reps + 8)
        ms = timed(steps.decode, args.reps)
        label = f"decode b={b}" + (f" ({args.shared_prefix} shared)" if args.shared_prefix else "")
        with layer_by_layer(runner):
            layered = timed(steps.decode, args.reps)
            rows.append(
                (
                    label,
                    ms,
                    b / ms * 1000,
                    {"layer by layer": layered, **breakdown(steps.decode, args.top)},
                )
            )
        runner.forward(BatchInput(0, [], [], [], [], [], [], [], [], released_sids=list(range(b))))
    if args.prefill:  # --prefill 0: decode steps only
        rows.append(prefill_row(runner, args))
    cats = ["layer by layer", "gemm", "attention", "small ops", "sampler", "python/dispatch (rest)"]
    print("\n| step | ms (median) | tok/s | " + " | ".join(cats) + " |")
    print("|" + "---|" * (3 + len(cats)))
    for name, ms, tps, cat in rows:
        print(
            f"| {name} | {ms:.1f} | {tps:.0f} | "
            + " | ".join(f"{cat[c]:.1f}" if c in cat else "–" for c in cats)
            + " |"
        )
    print(
        "\nms (median): the server's path (a step's layers in one C call where the model has it);"
        "\nlayer by layer: the median with each kernel called from Python; the breakdown columns are ms of"
        "\none profiled layer-by-layer step (profiling adds overhead; the medians are unprofiled)"
    )


if __name__ == "__main__":
    main()
