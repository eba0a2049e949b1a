"""Decode speed of the defaults against `--deterministic`, offline, at this process's CPU level.

Both engines of the default model in one process, taken in turn (ABBA) for 4 rounds: tokens/s of
1 request decoding 64 tokens and of 8 at once decoding 32 (each less a 1-token run of the same
prompts' length, so that prefill drops out); medians. Hold a lower level with RELAY_CPU_ISA (and
relay.execution.kernels.isa.torch_env's variables):

    python scripts/default_speed.py
    RELAY_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python scripts/default_speed.py
"""

from __future__ import annotations

import os
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    from relay import Engine, SamplingParams
    from relay.execution.kernels import isa

    words = open(os.path.join(ROOT, "scripts", "quality_text.md")).read().split()
    engines = {
        "defaults": Engine(kv_cache_gb=0.3),
        "--deterministic": Engine(kv_cache_gb=0.3, deterministic=True),
    }

    def run(engine, prompts, n):
        t = time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    speeds = {name: {"c=1": [], "c=8": []} for name in engines}
    k = 0
    for rnd in range(4):
        order = list(engines.items())
        for name, engine in order if rnd % 2 == 0 else order[::-1]:
            k += 1  # fresh prompts (under a page each): nothing from the prefix cache
            prompts = [" ".join(words[(k * 8 + i) * 7 :][:12]) for i in range(9)]
            one = (run(engine, prompts[:1], 65) - run(engine, [prompts[1] + " x"], 1)) / 64
            eight = (
                run(engine, prompts[1:], 33) - run(engine, [p + " y" for p in prompts[1:]], 1)
            ) / 32
            speeds[name]["c=1"].append(1 / one)
            speeds[name]["c=8"].append(8 / eight)
    print(f"level {isa.level()}, load average {os.getloadavg()[0]:.2f}")
    for name, s in speeds.items():
        medians = {c: round(statistics.median(v), 1) for c, v in s.items()}
        print(name, "decode tok/s (medians):", medians, "rounds:", s)


if __name__ == "__main__":
    main()
