"""The Scheduler and overlap policy of a model, as the server's scheduler process
(procs/scheduler.py) and the offline Engine (relay.engine) both build them."""

from __future__ import annotations

from collections.abc import Callable

from relay.config import EngineConfig, ModelConfig
from relay.scheduling.overlap import OverlapPolicy
from relay.scheduling.pooling import Pooling
from relay.scheduling.request import Req
from relay.scheduling.scheduler import Scheduler
from relay.text.grammar import make_backend


def make_scheduler(
    cfg: EngineConfig,
    mc: ModelConfig,
    model_dir: str,
    eos: list[int],
    num_pages: int,
    context_len: int,
    kv_window: int | None,
    on_finish: Callable[[Req], None] | None = None,
) -> Scheduler:
    """A Scheduler over the runner's KV pool (num_pages, context_len and kv_window as the
    runner resolved them; cfg with the runner's page size and step budget). Its grammar
    backend loads nothing until the first constrained request: xgrammar imports torch, which
    the scheduler process otherwise never holds (relay.text.grammar)."""
    grammars = make_backend(cfg.tokenizer_path or model_dir, mc.vocab_size, eos)
    return Scheduler(
        cfg,
        num_pages,
        context_len,
        eos,
        on_finish=on_finish,
        attention_break_even=mc.attention_break_even(),
        grammars=grammars,
        long_rope_after=mc.long_rope_after,
        pooling=Pooling.from_dir(model_dir) if cfg.is_embedding else None,
        kv_window=kv_window,
    )


def overlap_policy(cfg: EngineConfig) -> OverlapPolicy:
    """When the step loop builds the next step while one runs (relay.scheduling.overlap)."""
    return OverlapPolicy(not cfg.disable_overlap_schedule, cfg.overlap_min_share)
