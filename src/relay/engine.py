"""The offline engine: scheduler, model runner and detokenizer in one process.

    from relay import Engine, SamplingParams
    engine = Engine()  # the default model
    outs = engine.generate(["The capital of France is"], SamplingParams(temperature=0))

It drives the same scheduler and runner objects the server puts in separate processes.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence, Union

from relay.config import EngineConfig, ModelConfig
from relay.model_files import resolve_model_dir
from relay.model_runner import ModelRunner
from relay.request import Req, TokenEvent
from relay.sampling_params import SamplingParams
from relay.scheduler import Scheduler
from relay.tokenizer import DecodeStream, Tokenizer

Prompt = Union[str, Sequence[int]]


@dataclass
class RequestOutput:
    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    matched_stop: int | str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[list[float]]] | None = None
    error: str | None = None


@dataclass
class _Tracked:
    req: Req
    stream: DecodeStream
    text: list[str] = field(default_factory=list)


def eos_ids(mc: ModelConfig, tokenizer: Tokenizer) -> list[int]:
    ids = set(mc.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


class Engine:
    def __init__(self, model_path: str | None = None, **config):
        self.config = EngineConfig(model_path=model_path, **config)
        if self.config.tp_size != 1:
            raise ValueError("the offline Engine runs tp_size=1; serve with `python -m launch.serve --tp N`")
        if self.config.load_format == "dummy-null":
            raise ValueError("load_format dummy-null only exists in the server (it measures the pipeline)")
        model_dir = resolve_model_dir(model_path)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer(self.config.tokenizer_path or model_dir)
        self.runner = ModelRunner(self.config, model_dir, self.model_config)
        self.scheduler = Scheduler(self.config, self.runner.num_pages, self.runner.context_len,
                                   eos_ids(self.model_config, self.tokenizer),
                                   attention_break_even=self.model_config.attention_break_even())
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """Run prompts (strings or token id lists) to completion; one output per prompt."""
        prompts = _as_list(prompts)
        params = _broadcast(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _broadcast(priority, len(prompts), "priority")
        tracked: dict[str, _Tracked] = {}
        for prompt, p, prio in zip(prompts, params, priorities):
            p.validate(self.tokenizer.vocab_size)
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            req = Req(f"offline-{next(self._ids)}", ids, p, priority=prio)
            self.scheduler.add_request(req)
            tracked[req.rid] = _Tracked(req, DecodeStream(self.tokenizer, ids, p))
        while self.scheduler.has_work:
            batch = self.scheduler.schedule()
            if batch is None:
                raise RuntimeError("scheduler has work but scheduled nothing")
            out = self.runner.forward(batch)
            for event in self.scheduler.process_output(batch, out):
                self._on_event(tracked[event.rid], event)
        return [self._output(t) for t in tracked.values()]

    def _on_event(self, t: _Tracked, event: TokenEvent) -> None:
        new = [event.token_id] if event.token_id is not None else []
        t.text.append(t.stream.add(new, finished=event.finish_reason is not None))
        if t.stream.stopped is not None and not t.req.finished:
            self.scheduler.finish(t.req.rid, "stop", t.stream.stopped)

    def _output(self, t: _Tracked) -> RequestOutput:
        r = t.req
        reason, matched = r.finish_reason, r.matched_stop
        if t.stream.stopped is not None and reason == "length":  # the last token completed a stop string
            reason, matched = "stop", t.stream.stopped
        return RequestOutput(
            rid=r.rid, text="".join(t.text), token_ids=list(r.output_ids), finish_reason=reason,
            prompt_tokens=len(r.prompt_ids), cached_tokens=r.cached_tokens, matched_stop=matched,
            logprobs=list(r.logprobs) if r.params.logprobs else None,
            top_logprobs=list(r.top_logprobs) if r.params.top_logprobs else None, error=r.error)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def check(self) -> None:
        """KV accounting invariants (every page free, held or cached exactly once)."""
        self.scheduler.check()


def _as_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]
    return list(prompts)


def _broadcast(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
