"""Resident weight bytes, runner RSS and batch-1 decode step time of a bfloat16 checkpoint served
at this process's instruction-set level (RELAY_CPU_ISA), for the bfloat16-weights-on-AVX2 work.

    RELAY_CPU_ISA=avx2 python scripts/measure_bf16_weights.py DIR [--make tiny|1b] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time

from relay.execution.kernels import isa

os.environ.update(isa.torch_env())  # before torch loads: hold torch to the level too

import psutil  # noqa: E402
import torch  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=8192),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=49152),
}  # fmt: skip


def make(path: str, shape: str) -> None:
    """A random bfloat16 Llama checkpoint (save_pretrained) with a tokenizer."""
    from transformers import LlamaConfig

    from scripts.random_model import save_random_model

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=2048, tie_word_embeddings=True)
    save_random_model(path, cfg, dtype=torch.bfloat16)


def step_ms(runner, steps: int, prompt: int) -> tuple[float, float]:
    """The prompt step's time and the median batch-1 decode step's after it (ms)."""
    from scripts.runner_steps import Sequences

    seqs = Sequences([list(range(2, 2 + prompt))], runner.page_size)
    times = []
    for _ in range(steps + 1):
        batch = seqs.batch()
        start = time.perf_counter()
        logits = runner.step_logits(batch, batch.new_pages)
        times.append(time.perf_counter() - start)
        seqs.done(batch)
        seqs.append([int(logits.argmax(-1)[0])])
    return 1e3 * times[0], 1e3 * sorted(times[1:])[len(times[1:]) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--make", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=32, help="the prompt's tokens")
    args = ap.parse_args()
    if args.make and not os.path.exists(os.path.join(args.dir, "config.json")):
        make(args.dir, args.make)
    from relay.config import EngineConfig, ModelConfig
    from relay.execution.model_loading import weight_bytes
    from relay.execution.model_runner import ModelRunner

    cfg = EngineConfig(num_threads=args.threads, kv_cache_gb=0.05, context_length=256)
    runner = ModelRunner(cfg, args.dir, ModelConfig.from_dir(args.dir))
    w = weight_bytes(runner.model)
    # oneDNN-packed copies: counted by weight_bytes since this change, missed by it before
    packed = sum(
        m.packed.numel() * m.packed.element_size()
        for m in runner.model.gemm_modules()
        if isinstance(m.packed, torch.Tensor) and m.packed.is_mkldnn
    )
    rss = psutil.Process().memory_info().rss
    prompt_ms, ms = step_ms(runner, args.steps, args.prompt)
    print(
        f"level {isa.level()} dtype {runner.model.dtype} weight_bytes {w / 2**20:.1f} MiB "
        f"(oneDNN-packed among or beside them {packed / 2**20:.1f} MiB) "
        f"rss {rss / 2**20:.1f} MiB prompt({args.prompt}) {prompt_ms:.1f} ms decode(b=1) {ms:.2f} ms"
    )


if __name__ == "__main__":
    main()
