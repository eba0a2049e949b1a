"""What does a mixture-of-experts decode step cost on this CPU? Times Relay's decode step (all layers,
attention over a 64-token context, LM head) at batch 1 and 32 for:

  - moe:        a Mixtral-shaped model (random weights), experts grouped: one GEMM per expert with tokens;
  - moe-loop:   the same model, each token's k experts run one at a time (the naive per-token loop);
  - dense:      a Llama model of the same shapes whose MLP is as wide as the k active experts together
                (the same active parameters per token).

The three models sit in memory together and are timed in turn, round after round (medians), so
drift in the machine's load touches all alike.

    python scripts/bench_moe.py                      # bfloat16, 1 thread
    python scripts/bench_moe.py --dtype float32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from relay.config import EngineConfig, ModelConfig  # noqa: E402
from relay.execution.model_runner import ModelRunner  # noqa: E402
from relay.execution.models.moe import SparseMoeBlock  # noqa: E402
from relay.step import BatchInput  # noqa: E402

PROMPT = 64


def write_config(path: str, args, moe: bool) -> str:
    cfg = dict(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        vocab_size=args.vocab,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    if moe:
        cfg.update(
            architectures=["MixtralForCausalLM"],
            intermediate_size=args.moe_inter,
            num_local_experts=args.experts,
            num_experts_per_tok=args.top_k,
        )
    else:
        cfg.update(
            architectures=["LlamaForCausalLM"], intermediate_size=args.top_k * args.moe_inter
        )
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def per_token_experts_output(block: SparseMoeBlock):
    """The naive loop: every (token, slot) runs its expert on that one row."""

    def experts_output(
        x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(x)
        for t, (ws, es) in enumerate(zip(weights, experts.tolist())):
            for w, e in zip(ws, es):
                out[t] += (block.experts[e](x[t : t + 1])[0] * w).to(out.dtype)
        return out

    return experts_output


def decode_batches(batch: int) -> tuple[BatchInput, BatchInput, list[list[int]]]:
    """A prompt step of `batch` requests of PROMPT tokens, a decode step after it, and their page tables."""
    pages = -(-(PROMPT + 1) // 32)
    tables = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(batch)]
    ids = torch.randint(
        10, 1000, (batch * PROMPT,), generator=torch.Generator().manual_seed(batch)
    ).tolist()
    prompt = BatchInput(
        0,
        list(range(batch)),
        ids,
        [0] * batch,
        [PROMPT] * batch,
        [0] * batch,
        tables,
        [True] * batch,
        [0] * batch,
    )
    decode = BatchInput(
        1,
        list(range(batch)),
        [7] * batch,
        [PROMPT] * batch,
        [1] * batch,
        [pages] * batch,
        [[]] * batch,
        [True] * batch,
        [1] * batch,
    )
    return prompt, decode, tables


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-inter", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=5, help="decode steps per timing")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="bench-moe-")
    cfg = EngineConfig(
        dtype=args.dtype,
        load_format="dummy",
        num_threads=args.threads,
        kv_cache_gb=0.25,
        page_size=32,
    )
    runners = {}
    for name, moe in (("moe", True), ("dense", False)):
        path = write_config(os.path.join(tmp, name), args, moe)
        runners[name] = ModelRunner(cfg, path, ModelConfig.from_dir(path))
    blocks = [m for m in runners["moe"].model.modules() if isinstance(m, SparseMoeBlock)]
    grouped = [b.experts_output for b in blocks]
    looped = [per_token_experts_output(b) for b in blocks]

    def use(outputs) -> None:
        for b, f in zip(blocks, outputs):
            b.experts_output = f

    variants = {
        "moe": (runners["moe"], grouped),
        "moe-loop": (runners["moe"], looped),
        "dense": (runners["dense"], None),
    }
    mc = runners["moe"].model.config
    active = mc.num_layers * 3 * mc.hidden_size * mc.active_intermediate_size()
    print(
        f"{args.dtype}, {args.threads} thread(s); {mc.num_layers} layers, hidden {mc.hidden_size}, "
        f"{mc.num_experts} experts x {mc.moe_intermediate_size} top-{mc.num_experts_per_tok} "
        f"(dense MLP {args.top_k * args.moe_inter}); FFN weights per token {active / 1e6:.0f} M both, "
        f"{mc.num_layers * 3 * mc.hidden_size * mc.moe_intermediate_size * mc.num_experts / 1e6:.0f} M "
        "in all experts; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    with torch.inference_mode():
        for batch in args.batches:
            prompt, decode, tables = decode_batches(batch)
            for runner in runners.values():
                runner.step_logits(prompt, tables)  # the context's keys and values
            times: dict[str, list[float]] = {k: [] for k in variants}
            for _ in range(args.rounds):
                for name, (runner, outputs) in variants.items():
                    if outputs is not None:
                        use(outputs)
                    runner.step_logits(decode, tables)  # warm
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        runner.step_logits(decode, tables)
                    times[name].append((time.perf_counter() - start) / args.steps * 1e3)
            use(grouped)
            med = {k: statistics.median(v) for k, v in times.items()}
            print(
                f"batch {batch:3d}: "
                + ", ".join(
                    f"{k} {v:.2f} ms/step ({batch / v * 1e3:.0f} tok/s)" for k, v in med.items()
                )
                + f"; moe/dense {med['moe'] / med['dense']:.2f}x, loop/grouped {med['moe-loop'] / med['moe']:.2f}x"
            )


if __name__ == "__main__":
    main()
