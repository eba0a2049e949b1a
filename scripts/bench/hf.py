"""hf: the transformers static-batching baseline, on the same workload as the serving subcommand's random dataset.

The same --seed / lengths give the same prompts and output lengths as `serving --dataset-name random` (both
build them with workloads.build_random_dataset). Requests are taken in order in batches of --batch-size,
left-padded, and each batch runs `model.generate(max_new_tokens = the batch's longest requested output,
ignore EOS)`, so the batch's shorter requests waste decode steps: that waste is what static batching costs.

Output throughput counts only useful tokens: each request's requested output length (not the padded steps, not
the tokens a request generated past its own length). The report also gives the raw generated-token throughput.

  python -m scripts.bench hf --num-prompts 128 --random-input-len 512 --random-output-len 256 \\
      --random-input-range-ratio 0.125 --random-output-range-ratio 0.25 --batch-size 16 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time

from scripts.bench.results import ResultFile, args_record
from scripts.bench.workloads import build_random_dataset, default_tokenizer_path, load_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="transformers static-batching baseline",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model-path",
        default=None,
        help="HF model dir (default: Relay's converted default model, as the server loads it)",
    )
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir (default: the model dir)")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--random-input-len", type=int, default=512)
    p.add_argument("--random-output-len", type=int, default=256)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-input-range-ratio", type=float, default=None)
    p.add_argument("--random-output-range-ratio", type=float, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument(
        "--warmup",
        action="store_true",
        default=True,
        help="one short untimed generate first (default on; --no-warmup to skip)",
    )
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument(
        "--output-json", default=None, help="append one JSON line with the metrics + the args"
    )
    p.add_argument("--label", default=None)
    return p.parse_args(argv)


def run(args: argparse.Namespace, tokenizer=None) -> dict:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    model_dir = args.model_path or default_tokenizer_path()
    if tokenizer is None:
        tokenizer = load_tokenizer(args.tokenizer or model_dir)
    ratio = args.random_range_ratio
    rows = build_random_dataset(
        tokenizer,
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        ratio if args.random_input_range_ratio is None else args.random_input_range_ratio,
        ratio if args.random_output_range_ratio is None else args.random_output_range_ratio,
        args.seed,
    )

    dtype = getattr(torch, args.dtype)
    from relay.execution.model_files import load_transformers_model

    model = load_transformers_model(model_dir, dtype)
    model.eval()
    tokenizer.padding_side = "left"
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    def generate(prompt_ids: list[list[int]], max_new: int):
        width = max(len(x) for x in prompt_ids)
        ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for i, x in enumerate(prompt_ids):
            ids[i, width - len(x) :] = torch.tensor(x)
            mask[i, width - len(x) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_id,
            )
        return out.shape[1] - width

    # The exact prompt token ids the servers see (the dataset's text re-encoded, no BOS).
    encoded = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in rows]
    if args.warmup:
        generate([encoded[0][:16]], 4)

    batches = []
    useful = generated = 0
    t_start = time.perf_counter()
    for b in range(0, len(rows), args.batch_size):
        chunk = rows[b : b + args.batch_size]
        ids = encoded[b : b + args.batch_size]
        max_new = max(r.output_len for r in chunk)
        t0 = time.perf_counter()
        n_new = generate(ids, max_new)
        dt = time.perf_counter() - t0
        u = sum(r.output_len for r in chunk)
        useful += u
        generated += n_new * len(chunk)
        batches.append(
            {
                "size": len(chunk),
                "max_new_tokens": max_new,
                "useful_tokens": u,
                "seconds": dt,
                "prompt_width": max(len(x) for x in ids),
            }
        )
        print(
            f"batch {len(batches):3d}: {len(chunk)} x (prompt <= {batches[-1]['prompt_width']}, "
            f"{max_new} new) {dt:7.2f} s  {u / dt:7.1f} useful tok/s",
            flush=True,
        )
    total = time.perf_counter() - t_start
    total_input = sum(r.prompt_len for r in rows)
    m = {
        "engine": "hf-static",
        "label": args.label,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "duration": total,
        "completed": len(rows),
        "total_input_tokens": total_input,
        "total_output_tokens": useful,
        "total_generated_tokens": generated,
        "request_throughput": len(rows) / total,
        "input_throughput": total_input / total,
        "output_throughput": useful / total,
        "generated_throughput": generated / total,
        "total_throughput": (total_input + useful) / total,
        "batches": batches,
        "args": args_record(args),
    }
    print("\n{s:{c}^{n}}".format(s=" HF static batching baseline ", n=50, c="="))
    for label, key, fmt in (
        ("Requests:", "completed", "{}"),
        ("Batch size / dtype:", None, None),
        ("Total time (s):", "duration", "{:.2f}"),
        ("Total input tokens:", "total_input_tokens", "{}"),
        ("Useful output tokens:", "total_output_tokens", "{}"),
        ("Generated tokens (incl. padding steps):", "total_generated_tokens", "{}"),
        ("Request throughput (req/s):", "request_throughput", "{:.2f}"),
        ("Output token throughput (tok/s):", "output_throughput", "{:.2f}"),
        ("Generated token throughput (tok/s):", "generated_throughput", "{:.2f}"),
        ("Total token throughput (tok/s):", "total_throughput", "{:.2f}"),
    ):
        value = f"{args.batch_size} / {args.dtype}" if key is None else fmt.format(m[key])
        print(f"{label:<41}{value}")
    print("=" * 50, flush=True)
    return ResultFile(args.output_json, "hf").add(m)


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
