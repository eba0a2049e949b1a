"""offline: offline throughput, Relay's Engine vs transformers `generate` on the same prompts.

The nano-vllm workload scaled for a small CPU: N sequences of random token ids, random
input and output lengths, ignore_eos, all submitted at once. Also batch-1 decode speed.

    python -m scripts.bench offline                      # default model, both engines
    python -m scripts.bench offline --no-hf --num-seqs 256 --device cuda --load-format dummy \
        --model-path /path/to/model_dir
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from scripts.bench.results import ResultFile, args_record
from scripts.bench.table import markdown


def make_workload(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [
        [
            rng.randrange(100, vocab - 100)
            for _ in range(rng.randint(args.min_input, args.max_input))
        ]
        for _ in range(args.num_seqs)
    ]
    outputs = [rng.randint(args.min_output, args.max_output) for _ in range(args.num_seqs)]
    return prompts, outputs


def bench_relay(args, prompts, out_lens) -> dict:
    from relay import Engine, SamplingParams

    kw = dict(
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        quantization=args.quantization,
    )
    if args.kv_cache_gb:
        kw["kv_cache_gb"] = args.kv_cache_gb
    if args.chunked_prefill_size:
        kw["chunked_prefill_size"] = args.chunked_prefill_size
    engine = Engine(args.model_path, **kw)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in out_lens]
    engine.generate(prompts[:2], [SamplingParams(max_new_tokens=4, ignore_eos=True)] * 2)  # warm-up
    engine.scheduler.kv.cache.reset()
    _sync(args)
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    _sync(args)
    elapsed = time.perf_counter() - t
    generated = sum(len(o.token_ids) for o in outs)
    assert generated == sum(out_lens)
    engine.generate([prompts[0]], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
    _sync(args)
    t = time.perf_counter()
    engine.generate(
        [prompts[1][:64]], SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True)
    )
    _sync(args)
    b1 = 128 / (time.perf_counter() - t)
    weights = str(engine.runner.dtype).replace("torch.", "") + (
        f" + {args.quantization}" if args.quantization else ""
    )
    return {
        "engine": "relay",
        "dtype": weights,
        "seconds": elapsed,
        "output_tokens": generated,
        "output_tok_s": generated / elapsed,
        "total_tok_s": (generated + sum(map(len, prompts))) / elapsed,
        "batch1_decode_tok_s": b1,
    }


def bench_hf(args, prompts, out_lens) -> dict:
    from relay.execution.model_files import load_transformers_model, resolve_model_dir

    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    model = load_transformers_model(resolve_model_dir(args.model_path), dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch_size):
            batch, lens = prompts[i : i + args.hf_batch_size], out_lens[i : i + args.hf_batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False)
    elapsed = time.perf_counter() - t
    with torch.inference_mode():
        ids = torch.tensor([prompts[1][:64]])
        model.generate(ids, max_new_tokens=8, do_sample=False)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=64, do_sample=False)
        b1 = 64 / (time.perf_counter() - t)
    useful = sum(out_lens)
    return {
        "engine": f"transformers (static batch {args.hf_batch_size})",
        "dtype": str(dtype).replace("torch.", ""),
        "seconds": elapsed,
        "output_tokens": useful,
        "output_tok_s": useful / elapsed,
        "total_tok_s": (useful + sum(map(len, prompts))) / elapsed,
        "batch1_decode_tok_s": b1,
    }


def _sync(args) -> None:
    if torch.cuda.is_available() and args.device != "cpu":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", default=None)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--min-input", type=int, default=64)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--min-output", type=int, default=64)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--quantization", default=None, choices=["int8"], help="Relay's weight-only int8 (CPU)"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--output-json", default=None, help="append one JSON line per engine (results.py's format)"
    )
    args = p.parse_args(argv)

    from relay.config import ModelConfig
    from relay.execution.model_files import resolve_model_dir

    vocab = ModelConfig.from_dir(resolve_model_dir(args.model_path)).vocab_size
    prompts, out_lens = make_workload(args, vocab)
    print(
        f"workload: {len(prompts)} seqs, input {sum(map(len, prompts))} tokens, output {sum(out_lens)} tokens",
        file=sys.stderr,
    )
    out = ResultFile(args.output_json, "offline", args=args_record(args))
    results = [out.add(bench_relay(args, prompts, out_lens))]
    if not args.no_hf:
        results.append(out.add(bench_hf(args, prompts, out_lens)))
    print(
        markdown(
            results,
            [
                ("engine", "engine"),
                ("dtype", "dtype"),
                ("time (s)", "seconds"),
                ("output tok/s", "output_tok_s"),
                ("total tok/s", "total_tok_s"),
                ("batch-1 decode tok/s", "batch1_decode_tok_s"),
            ],
        )
    )
    if len(results) == 2:
        ratio = results[0]["output_tok_s"] / results[1]["output_tok_s"]
        print(f"\nRelay / transformers output throughput: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
