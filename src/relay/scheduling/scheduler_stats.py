"""What the scheduler reports: its counters (/metrics, /get_server_info) and a line per step."""

from __future__ import annotations

from dataclasses import dataclass

from relay.step import BatchInput


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_total_tokens: int
    kv_free_tokens: int
    kv_locked_tokens: int  # pages running requests hold (privately or through the tree)
    kv_cached_tokens: int  # pages only the prefix cache holds (evictable)
    prompt_tokens_total: int
    cached_prompt_tokens_total: int
    num_retractions_total: int
    spec: dict | None = None  # SpecStats.to_dict() while speculative decoding is on
    adaptive: dict | None = None  # AdaptiveLimits.to_dict() while adaptive batching is on
    grammar: dict | None = None  # constrained decoding's counters, where the server has xgrammar

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens_total / max(1, self.prompt_tokens_total)


def step_log_line(batch: BatchInput, seconds: float, stats: SchedulerStats) -> str:
    """One line about a processed step (--log-steps): what it computed and what it cost, so a slow
    step can be told apart from a long queue: prompt chunks with their tokens and the cached
    tokens they attend over, decode rows (and proposals verified), the load, KV use, the time."""
    decode = {
        i
        for i, (n, out) in enumerate(zip(batch.extend_lens, batch.output_lens))
        if n == 1 and out > 0
    }
    prompt = [i for i in range(len(batch.sids)) if i not in decode]
    tokens = sum(batch.extend_lens[i] for i in prompt)
    cached = sum(batch.prefix_lens[i] for i in prompt)
    proposed = sum(batch.spec_lens) if batch.spec_lens else 0
    # What running requests hold, as /metrics counts it: evictable cached pages are free for the taking.
    used = stats.kv_locked_tokens / max(1, stats.kv_total_tokens)
    return (
        f"step {batch.step}: prompt chunks {len(prompt)} ({tokens} tokens over {cached} cached), "
        f"decodes {len(decode)}"
        + (f" (+{proposed} proposed)" if proposed else "")
        + f", running {stats.num_running}, waiting {stats.num_waiting}, KV {used:.1%} used, "
        f"{seconds * 1000:.1f} ms"
    )
