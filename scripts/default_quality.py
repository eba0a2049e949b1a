"""What Relay's defaults give up against `--deterministic`, on Relay's own kernels, per CPU level.

For each instruction-set level this CPU reaches (or `--levels`), and each mode there (the defaults;
`--block-activations float` where the default dtype is bfloat16; float32 with int8 block activations;
`--deterministic`, i.e. float32 with float block activations), one offline Engine of the default
model, in a process of its own held to that level (`RELAY_CPU_ISA`, torch held too), measures:

- on a fixed text (`scripts/quality_text.md`: docs/architecture.md as of d902f8c, its first 2,048
  tokens), teacher-forced through the prompt's log-probabilities: top-1 agreement of each
  position's likeliest next token with transformers' float32 model, and perplexity (transformers'
  float32: the first row);
- greedy output of 10 prompts, 24 tokens each (`ignore_eos`), against transformers' float32
  `generate`: how many are identical token for token;
- speed, offline (no HTTP): decode tokens/s of 1 request and of 8 at once (128 and 64 new tokens),
  and a 1,024-token prompt's prefill time. A shared host moves these: compare rows of one run.

    python scripts/default_quality.py                        # every level this CPU reaches
    python scripts/default_quality.py --levels avx2 --no-speed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "scripts", "quality_text.md")
LEVELS = ("avx2", "avx512", "avx512bf16", "amx")
NEW_TOKENS = 24
PROMPTS = [
    "The three largest cities in Germany are",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "def is_prime(n):\n",
    "The French Revolution began in",
    "Here is a short story about a robot who learns to paint:",
    "The main difference between a virus and a bacterium is",
    "SELECT name, age FROM users WHERE",
    "Water boils at 100 degrees Celsius because",
    "My favourite book is",
]
# (label, Engine options): the defaults, then what each default changes, then the exact path.
MODES = {
    "defaults": {},
    "float block activations": {"block_activations": "float"},
    "float32, int8 block activations": {"dtype": "float32", "block_activations": "int8"},
    "--deterministic": {"deterministic": True},
}


def modes_at(level: str) -> list[str]:
    """The modes that differ at this level: where float32 is the default dtype, the defaults
    are float32 on int8 block activations, and float block activations are --deterministic."""
    from relay.execution.kernels import isa

    if isa.at_least("avx512bf16", level):
        return list(MODES)
    return ["defaults", "--deterministic"]


def reference(model_dir: str, ids: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # full-length outputs, as ignore_eos
    model.generation_config.pad_token_id = 0
    tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        prompts = [tok(p).input_ids for p in PROMPTS]
        greedy = [
            model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    target = torch.tensor(ids[1:])
    nll = -logp[:-1].gather(1, target[:, None]).mean().item()
    return {
        "top1": logp[:-1].argmax(-1).tolist(),
        "ppl": float(torch.tensor(nll).exp()),
        "prompts": prompts,
        "greedy": greedy,
    }


def child(spec_path: str) -> None:
    """One Engine in this process (held to its level by the parent's environment)."""
    from relay import Engine, SamplingParams
    from relay.execution.kernels import isa

    spec = json.load(open(spec_path))
    ids, prompts = spec["ids"], spec["prompts"]
    engine = Engine(kv_cache_gb=0.5, **MODES[spec["mode"]])
    dtype = str(engine.runner.place.dtype).removeprefix("torch.")
    scored = engine.generate(
        [ids],
        SamplingParams(temperature=0, max_new_tokens=1, logprob_start_len=0, prompt_top_logprobs=1),
    )[0].prompt_logprobs
    top1 = [t[0][0] for t in scored.top[1:]]
    logprobs = scored.logprobs[1:]
    greedy = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    out = {
        "level": isa.level(),
        "dtype": dtype,
        "top1": top1,
        "logprobs": logprobs,
        "greedy": [o.token_ids for o in engine.generate(prompts, greedy)],
    }
    if spec["speed"]:
        out["speed"] = speed(engine, ids)
    json.dump(out, open(spec_path + ".out", "w"))


def speed(engine, ids: list[int]) -> dict:
    """Offline decode tokens/s at 1 and 8 requests, and a 1,024-token prompt's prefill (best of
    two each; the prompts differ, so nothing comes from the prefix cache)."""
    from relay import SamplingParams

    def timed(prompts, n):
        t = time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    result = {}
    for trial in range(2):
        short = [(ids * 2)[97 * (8 * trial + i) % len(ids) :][:16] for i in range(8)]
        prefill = timed([ids[5 + 3 * trial :][:1024]], 1)  # no prefix-cache hit
        one = (timed([short[0]], 129) - timed([short[1]], 1)) / 128
        eight = (timed(short, 65) - timed([s[::-1] for s in short], 1)) / 64
        for key, value in (
            ("prefill_1024_s", prefill),
            ("c1_tok_s", 1 / one),
            ("c8_tok_s", 8 / eight),
        ):
            best = max if key.endswith("tok_s") else min
            result[key] = best(result.get(key, value), value)
    return result


def reachable_levels() -> list[str]:
    from relay.execution.kernels import isa

    top = isa.detected_level()
    return [lv for lv in LEVELS if isa.at_least(lv, top)]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--levels", default=None, help="comma-separated (default: all this CPU reaches)")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--no-speed", action="store_true", help="quality only")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child)

    from transformers import AutoTokenizer

    from relay.execution.kernels import isa
    from relay.execution.model_files import resolve_model_dir

    model_dir = resolve_model_dir(None)
    ids = AutoTokenizer.from_pretrained(model_dir)(open(TEXT).read()).input_ids[: args.max_tokens]
    ref = reference(model_dir, ids)
    levels = args.levels.split(",") if args.levels else reachable_levels()
    flags = open("/proc/cpuinfo").read().split("flags\t\t: ", 1)[1].split("\n", 1)[0].split()
    shown = [f for f in flags if f.startswith(("avx2", "avx512", "amx", "fma"))]
    print(f"{len(ids)} tokens of {os.path.relpath(TEXT, ROOT)}; CPU flags: {' '.join(shown)}")
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    print(
        "| level | mode | dtype | top-1 agreement | perplexity | greedy = transformers' "
        "| c=1 tok/s | c=8 tok/s | 1,024-token prompt |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| - | transformers float32 | float32 | - | {ref['ppl']:.3f} | - | | | |")
    for level in levels:
        for mode in modes_at(level):
            with tempfile.TemporaryDirectory() as tmp:
                spec = os.path.join(tmp, "spec.json")
                json.dump(
                    {
                        "ids": ids,
                        "prompts": ref["prompts"],
                        "mode": mode,
                        "speed": not args.no_speed,
                    },
                    open(spec, "w"),
                )
                env = {**os.environ, "RELAY_CPU_ISA": level, **isa.torch_env(level)}
                subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--child", spec],
                    env=env,
                    check=True,
                    cwd=ROOT,
                )
                got = json.load(open(spec + ".out"))
            n = len(ref["top1"])
            agree = sum(a == b for a, b in zip(got["top1"], ref["top1"])) / n
            ppl = float(2.718281828459045 ** (-sum(got["logprobs"]) / n))
            same = sum(a == b for a, b in zip(got["greedy"], ref["greedy"]))
            s = got.get("speed", {})
            speeds = (
                f"{s['c1_tok_s']:.1f} | {s['c8_tok_s']:.1f} | {s['prefill_1024_s'] * 1000:.0f} ms"
                if s
                else " | | "
            )
            print(
                f"| {got['level']} | {mode} | {got['dtype']} | {agree:.2%} | {ppl:.3f} "
                f"| {same}/{len(PROMPTS)} | {speeds} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
