"""The steps of scripts/gpu_check.sh (one subcommand each); results go to a JSON-lines file.

    python scripts/gpu_check.py env          --results R
    python scripts/gpu_check.py build        --results R --out MODEL_DIR
    python scripts/gpu_check.py correctness  --results R --model MODEL_DIR
    python scripts/gpu_check.py decode-speed --results R --model MODEL_DIR
    python scripts/gpu_check.py profile      --results R --model MODEL_DIR [--backends triton]
    python scripts/gpu_check.py table        --results R [--bench-json B] [--md OUT.md]

The model is Qwen3-0.6B-shaped with random weights. Roofline numbers are for an H200-class
card: ~4.3 TB/s of HBM bandwidth actually reachable, ~790 TFLOP/s dense bf16.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]

HBM_BYTES_S = 4.3e12
BF16_FLOP_S = 790e12
QWEN3_0_6B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    eos_token_id=151645,
    bos_token_id=151643,
)


def record(results_file: str, /, **row) -> None:
    print(json.dumps(row), flush=True)
    with open(results_file, "a") as f:
        f.write(json.dumps(row) + "\n")


DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")  # "cpu" only to dry-run this script's plumbing
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def backends_available() -> list[str]:
    import importlib.util

    return ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])


def wanted(backends: str) -> list[str]:
    """The listed backends that can run here (torch only when listed: dry runs)."""
    return [b for b in backends.split(",") if b in backends_available() or b == "torch"]


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def free_cuda() -> None:
    import torch

    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- env --------------------------------------------------------------------------------------
def cmd_env(args) -> None:
    import importlib.metadata as md

    import torch

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "-"

    missing = []
    for mod in ("numpy", "transformers", "tokenizers", "safetensors", "tqdm", "triton"):
        try:
            __import__(mod)
        except ImportError as e:
            missing.append(f"{mod} ({e})")
    if missing:
        print("MISSING python modules: " + ", ".join(missing), file=sys.stderr)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)
    record(
        args.results,
        section="env",
        python=sys.version.split()[0],
        torch=torch.__version__,
        cuda=torch.version.cuda,
        gpu=gpu,
        gpus=torch.cuda.device_count(),
        free_gib=round(free / 2**30, 1),
        total_gib=round(total / 2**30, 1),
        triton=version("triton"),
        flashinfer=version("flashinfer-python")
        if version("flashinfer-python") != "-"
        else version("flashinfer"),
        transformers=version("transformers"),
        backends=backends_available(),
        missing=missing,
    )
    if not torch.cuda.is_available() and DEVICE == "cuda":
        sys.exit("no CUDA device")


# ---- build ------------------------------------------------------------------------------------
def cmd_build(args) -> None:
    import torch
    from transformers import Qwen3Config

    from scripts.random_model import save_random_model

    t0 = time.perf_counter()
    if os.path.exists(os.path.join(args.out, "model.safetensors")):
        record(args.results, section="build", path=args.out, reused=True)
        return
    cfg = Qwen3Config(**(TINY if os.environ.get("GPU_CHECK_TINY") else QWEN3_0_6B))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    save_random_model(args.out, cfg, device=device, dtype=torch.bfloat16)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    record(
        args.results,
        section="build",
        path=args.out,
        reused=False,
        gib=round(size / 2**30, 2),
        seconds=round(time.perf_counter() - t0, 1),
        tokenizer=sorted(f for f in os.listdir(args.out) if f.startswith("tokenizer")),
    )


# ---- correctness --------------------------------------------------------------------------------
def make_runner(model_dir: str, **kw):
    from relay.config import EngineConfig, ModelConfig
    from relay.execution.model_runner import ModelRunner

    cfg = EngineConfig(model_path=model_dir, device=DEVICE, **{"kv_cache_gb": 4.0, **kw})
    return ModelRunner(cfg, model_dir, ModelConfig.from_dir(model_dir))


def cmd_correctness(args) -> None:
    import torch

    from scripts.runner_steps import run_greedy

    rng = random.Random(0)
    lengths = [5, 17, 64, 100, 129, 250, 333, 400][: args.prompts]
    prompts = [[rng.randrange(100, 150000) for _ in range(n)] for n in lengths]
    steps = args.steps

    t0 = time.perf_counter()
    ref = make_runner(args.model, dtype="bfloat16", attention_backend="torch")
    ref_tokens, ref_logits = run_greedy(ref, prompts, steps)
    del ref
    free_cuda()
    # The bf16 noise floor: the same reference in float32, teacher-forced on the bf16 tokens.
    f32 = make_runner(args.model, dtype="float32", attention_backend="torch")
    _, f32_logits = run_greedy(f32, prompts, steps, forced=[t[:-1] for t in ref_tokens])
    del f32
    free_cuda()
    noise = max((a - b).abs().max().item() for a, b in zip(ref_logits, f32_logits))
    scale = max(x.abs().max().item() for x in ref_logits)
    record(
        args.results,
        section="correctness",
        backend="torch",
        reference=True,
        noise=noise,
        logit_scale=scale,
        seconds=round(time.perf_counter() - t0, 1),
    )

    ref_all = torch.stack(ref_logits)  # [steps+1, prompts, vocab]
    top2 = ref_all.topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    for name in wanted(args.backends):
        t0 = time.perf_counter()
        try:
            runner = make_runner(
                args.model, dtype="bfloat16", attention_backend=name, cuda_graph_max_bs=args.prompts
            )
            tokens, _ = run_greedy(runner, prompts, steps)
            _, logits = run_greedy(runner, prompts, steps, forced=[t[:-1] for t in ref_tokens])
            replays = runner.cuda_graphs.replays if runner.cuda_graphs is not None else 0
            del runner
            free_cuda()
        except Exception as e:  # record and go on to the next backend
            record(
                args.results,
                section="correctness",
                backend=name,
                error=f"{type(e).__name__}: {e}"[:300],
            )
            continue
        got = torch.stack(logits)
        diff = (got - ref_all).abs().max().item()
        agree = got.argmax(-1) == ref_all.argmax(-1)
        decisive = gap > 2 * max(diff, noise)
        prefix_match = [
            next((j for j, (a, b) in enumerate(zip(t, r)) if a != b), len(r))
            for t, r in zip(tokens, ref_tokens)
        ]
        record(
            args.results,
            section="correctness",
            backend=name,
            max_diff=diff,
            noise=noise,
            identical=sum(t == r for t, r in zip(tokens, ref_tokens)),
            prompts=len(prompts),
            matching_prefix_tokens=sum(prefix_match),
            total_tokens=sum(len(r) for r in ref_tokens),
            argmax_agree=int(agree.sum()),
            positions=agree.numel(),
            decisive_agree=int((agree & decisive).sum()),
            decisive=int(decisive.sum()),
            graph_replays=replays,
            seconds=round(time.perf_counter() - t0, 1),
        )


# ---- decode speed ---------------------------------------------------------------------------------
def weight_bytes(mc) -> int:
    """Bytes of weights one decode step reads (bf16): every layer, the LM head; the input
    embedding only reads the batch's rows (ignored)."""
    h, d = mc.hidden_size, mc.head_dim
    layer = (
        h * (mc.num_heads + 2 * mc.num_kv_heads) * d
        + mc.num_heads * d * h
        + 3 * h * mc.intermediate_size
    )
    return 2 * (mc.num_layers * layer + mc.vocab_size * h)


def roofline_step_s(mc, bs: int, context: int) -> float:
    """max(weights + KV read at the HBM bandwidth, matmul FLOPs at the bf16 peak)."""
    byts = weight_bytes(mc) + bs * context * mc.kv_bytes_per_token(2)
    flops = 2 * bs * weight_bytes(mc) / 2
    return max(byts / HBM_BYTES_S, flops / BF16_FLOP_S)


def decode_runner(model: str, backend: str, max_bs: int, kv_cache_gb: float):
    """A bf16 runner on dummy weights with CUDA graphs up to max_bs: what decode timings run on."""
    return make_runner(
        model,
        dtype="bfloat16",
        attention_backend=backend,
        load_format="dummy",
        kv_cache_gb=kv_cache_gb,
        cuda_graph_max_bs=max_bs,
    )


def cmd_decode_speed(args) -> None:
    from relay.config import ModelConfig
    from relay.sampling_params import SamplingParams
    from relay.step import SamplingSpec
    from scripts.runner_steps import Sequences

    mc = ModelConfig.from_dir(args.model)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=1 << 20, ignore_eos=True)
    for name in wanted(args.backends):
        try:
            t0 = time.perf_counter()
            runner = decode_runner(args.model, name, max(sizes), kv_cache_gb=16.0)
            setup = time.perf_counter() - t0
            graphs = runner.cuda_graphs
            rng = random.Random(1)
            for bs in sizes:
                prompts = [
                    [rng.randrange(100, 150000) for _ in range(args.context)] for _ in range(bs)
                ]
                seqs = Sequences(prompts, runner.page_size)
                sids = list(range(bs))  # Sequences' handles; released again below
                first = True
                row = dict(
                    section="decode",
                    backend=name,
                    bs=bs,
                    context=args.context,
                    graphs=graphs is not None,
                    roofline_ms=roofline_step_s(mc, bs, args.context) * 1e3,
                    setup_s=round(setup, 1),
                )
                for mode in ("graph", "eager"):
                    runner.cuda_graphs = graphs if mode == "graph" else None
                    times = []
                    for _ in range(args.warmup + args.steps + (1 if first else 0)):
                        batch = seqs.batch()
                        if first:
                            batch.new_specs = [SamplingSpec(s, greedy, []) for s in sids]
                        sync()
                        t = time.perf_counter()
                        out = runner.forward(
                            batch
                        )  # samples on the GPU, tokens come back to the host
                        times.append(time.perf_counter() - t)
                        seqs.done(batch)
                        seqs.append(out.next_token_ids)
                        first = False
                    ms = 1e3 * sum(times[-args.steps :]) / args.steps
                    row[f"{mode}_ms"] = ms
                    row[f"{mode}_tok_s"] = bs / ms * 1e3
                runner.cuda_graphs = graphs
                runner.sampler.update(sids, [])  # release these requests' sampling state
                record(args.results, **row)
            del runner, graphs
            free_cuda()
        except Exception as e:
            record(
                args.results, section="decode", backend=name, error=f"{type(e).__name__}: {e}"[:300]
            )


# ---- profile: where a graph decode step's time goes -------------------------------------------------
def cmd_profile(args) -> None:
    """torch.profiler over graph decode steps at each batch size: wall ms per step beside the GPU's
    busy ms per step (the rest is host work around the graph), then the top host-side ops."""
    from torch.profiler import ProfilerActivity, profile

    from relay.sampling_params import SamplingParams
    from relay.step import SamplingSpec
    from scripts.runner_steps import Sequences

    greedy = SamplingParams(temperature=0.0, max_new_tokens=1 << 20, ignore_eos=True)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    backend = args.backends.split(",")[0]
    runner = decode_runner(args.model, backend, max(sizes), kv_cache_gb=8.0)
    rng = random.Random(2)
    for bs in sizes:
        prompts = [[rng.randrange(100, 150000) for _ in range(args.context)] for _ in range(bs)]
        seqs = Sequences(prompts, runner.page_size)
        sids = list(range(bs))

        def step(first=False):
            batch = seqs.batch()
            if first:
                batch.new_specs = [SamplingSpec(s, greedy, []) for s in sids]
            out = runner.forward(batch)
            seqs.done(batch)
            seqs.append(out.next_token_ids)

        step(first=True)
        for _ in range(args.warmup):
            step()
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync()
            wall = (time.perf_counter() - t0) / args.steps
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events) / args.steps
        record(
            args.results,
            section="profile",
            backend=backend,
            bs=bs,
            wall_ms=round(wall * 1e3, 3),
            gpu_busy_ms=round(gpu_us / 1e3, 3),
        )
        print(
            events.table(
                sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60
            )
        )
        print(
            events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60)
        )
        # The host's Python (plans, sampling, bookkeeping) is invisible to the op table: cProfile
        import cProfile
        import pstats

        py = cProfile.Profile()
        py.runcall(lambda: [step() for _ in range(args.steps)])
        pstats.Stats(py).sort_stats("tottime").print_stats(args.rows)
        runner.sampler.update(sids, [])


# ---- the table --------------------------------------------------------------------------------------
def cmd_table(args) -> None:
    rows = []
    if os.path.exists(args.results):
        with open(args.results) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    env = next((r for r in rows if r.get("section") == "env"), {})
    steps = [r for r in rows if r.get("section") == "step"]
    from relay.config import ModelConfig

    mc = None
    if args.model and os.path.exists(os.path.join(args.model, "config.json")):
        mc = ModelConfig.from_dir(args.model)
    lines = [
        f"## Relay GPU check: {env.get('gpu', '?')}",
        f"python {env.get('python', '?')}, torch {env.get('torch', '?')} (CUDA {env.get('cuda', '?')}), "
        f"triton {env.get('triton', '?')}, flashinfer {env.get('flashinfer', '?')}; "
        f"model: Qwen3-0.6B-shaped, random weights, bf16",
        *([f"MISSING modules: {', '.join(env['missing'])}"] if env.get("missing") else []),
        "",
        "| check | what | result | reference / roofline | status |",
        "|---|---|---|---|---|",
    ]

    ref = next((r for r in rows if r.get("section") == "correctness" and r.get("reference")), None)
    for r in rows:
        if r.get("section") != "correctness" or r.get("reference"):
            continue
        if "error" in r:
            lines.append(f"| correctness | {r['backend']} vs torch | {r['error']} | | FAIL |")
            continue
        ok = r["decisive_agree"] == r["decisive"] and r["max_diff"] <= 3 * r["noise"] + 1e-3
        lines.append(
            f"| correctness | {r['backend']} vs torch, bf16, {r['prompts']} prompts | greedy: {r['identical']}/"
            f"{r['prompts']} prompts identical ({r['matching_prefix_tokens']}/{r['total_tokens']} tokens before "
            f"divergence); teacher-forced argmax {r['argmax_agree']}/{r['positions']}, decisive "
            f"{r['decisive_agree']}/{r['decisive']}; max abs logit diff {r['max_diff']:.3f} | bf16 noise "
            f"(torch bf16 vs fp32) {r['noise']:.3f}; {r['graph_replays']} graph replays | "
            f"{'PASS' if ok else 'CHECK'} |"
        )
    if ref is None:
        lines.append("| correctness | torch reference | did not run | | FAIL |")
    for r in rows:
        if r.get("section") != "decode":
            continue
        if "error" in r:
            lines.append(f"| decode | {r['backend']} | {r['error']} | | FAIL |")
            continue
        roof = r["roofline_ms"]
        lines.append(
            f"| decode bs={r['bs']} | {r['backend']}, ctx {r['context']} | "
            f"{'graph' if r.get('graphs') else 'NO GRAPHS'} {r['graph_ms']:.2f} ms/step "
            f"({r['graph_tok_s']:.0f} tok/s); eager {r['eager_ms']:.2f} ms ({r['eager_tok_s']:.0f} tok/s); "
            f"graph speed-up {r['eager_ms'] / r['graph_ms']:.1f}x | roofline {roof:.3f} ms/step "
            f"({r['bs'] / roof * 1e3:.0f} tok/s) | {100 * roof / r['graph_ms']:.0f}% of roofline |"
        )
    bench = []
    if args.bench_json and os.path.exists(args.bench_json):
        with open(args.bench_json) as f:
            bench = [r for r in map(json.loads, filter(str.strip, f)) if r.get("engine") == "relay"]
    if bench:
        b = bench[-1]
        a = b["args"]
        roof = ""
        if mc is not None:
            per_token = weight_bytes(mc)  # 2 FLOP per weight per token = bytes of bf16 weights
            roof = f"compute roofline {BF16_FLOP_S / per_token:,.0f} tok/s (2 FLOP/param/token at 790 TFLOP/s)"
        lines.append(
            f"| throughput | bench offline: {a['num_seqs']} seqs, in {a['min_input']}-{a['max_input']}, out "
            f"{a['min_output']}-{a['max_output']} | {b['output_tok_s']:,.0f} output tok/s, {b['total_tok_s']:,.0f} "
            f"total tok/s in {b['seconds']:.1f} s; batch-1 decode {b['batch1_decode_tok_s']:.0f} tok/s | {roof} | |"
        )
    else:
        lines.append("| throughput | bench offline | did not run | | FAIL |")
    for s in steps:
        if s["rc"] != 0:
            lines.append(
                f"| step | {s['name']} | exit {s['rc']}{' (timeout)' if s['rc'] in (124, 137) else ''} "
                f"after {s['seconds']} s | | FAIL |"
            )
    total = sum(s["seconds"] for s in steps)
    lines += [
        "",
        "steps: "
        + ", ".join(f"{s['name'].split(' ')[0]} {s['seconds']}s" for s in steps)
        + f"; total {total} s",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "command", choices=["env", "build", "correctness", "decode-speed", "profile", "table"]
    )
    p.add_argument("--results", required=True)
    p.add_argument("--out")
    p.add_argument("--model")
    p.add_argument("--backends", default="triton,flashinfer")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--bench-json")
    p.add_argument("--md")
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    if args.command == "decode-speed":
        args.steps = 30 if args.steps == 32 else args.steps
    {
        "env": cmd_env,
        "build": cmd_build,
        "correctness": cmd_correctness,
        "decode-speed": cmd_decode_speed,
        "profile": cmd_profile,
        "table": cmd_table,
    }[args.command](args)


if __name__ == "__main__":
    main()
