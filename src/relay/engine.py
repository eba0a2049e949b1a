"""The offline engine: scheduler, model runner and detokenizer in one process.

    from relay import Engine, SamplingParams
    engine = Engine()  # the default model
    outs = engine.generate(["The capital of France is"], SamplingParams(temperature=0))

It runs the same step loop (relay.scheduling.step_loop) as the server's scheduler process over
the objects the server puts in separate processes: the PromptPreparer, the Scheduler, the
ModelRunner and the Detokenizer, and merges each request's RequestOutput records into one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Union

from relay.config import EngineConfig, ModelConfig
from relay.execution.model_files import resolve_model_dir
from relay.execution.model_runner import ModelRunner
from relay.outputs import RequestOutput
from relay.sampling_params import InvalidParam, SamplingParams
from relay.scheduling.factory import make_scheduler, overlap_policy
from relay.scheduling.request import Req
from relay.scheduling.step_loop import InProcessRunner, StepLoop
from relay.text.detokenizer import Detokenizer, DetokenizeSpec
from relay.text.tokenizer import PromptPreparer, Tokenizer, eos_ids

Prompt = Union[str, Sequence[int]]  # noqa: UP007 (a runtime alias: `|` on typing.Sequence needs 3.10 generics)


class Engine:
    def __init__(self, model_path: str | None = None, **config):
        self.config = EngineConfig(model_path=model_path, **config)
        if self.config.tp_size != 1:
            raise ValueError(
                "the offline Engine runs tp_size=1; serve with `python -m launch.serve --tp N`"
            )
        if self.config.load_format == "dummy-null":
            raise ValueError(
                "load_format dummy-null only exists in the server (it measures the pipeline)"
            )
        model_dir = resolve_model_dir(model_path)
        self.model_config = mc = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer(
            self.config.tokenizer_path or model_dir, self.config.chat_template
        )
        self.runner = ModelRunner(self.config, model_dir, mc)
        self.prompts = PromptPreparer(self.tokenizer, self.runner.context_len, mc.vocab_size)
        eos = eos_ids(mc, self.tokenizer)
        self.scheduler = make_scheduler(
            self.runner.cfg,
            mc,
            model_dir,
            eos,
            self.runner.num_pages,
            self.runner.context_len,
            self.runner.kv_window,
        )
        self.detokenizer = Detokenizer(self.tokenizer)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """Run prompts (strings or token id lists) to completion; one merged RequestOutput
        per prompt (text, token_ids, finish_reason, counts, logprobs when asked)."""
        prompts = _as_list(prompts)
        params = _broadcast(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _broadcast(priority, len(prompts), "priority")
        results: dict[str, RequestOutput] = {}
        for p in params:
            p.validate(
                self.tokenizer.vocab_size,
                self.config.max_constraint_bytes,
                self.config.max_constraint_depth,
                self.config.max_constraint_properties,
            )
        self._check_constraints(params)
        for prompt, p, prio in zip(prompts, params, priorities):
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
            ids = self.prompts.prompt_ids(text, ids)
            p = self.prompts.fit_context(p, len(ids))
            rid = f"offline-{next(self._ids)}"
            self.detokenizer.start(DetokenizeSpec.of(rid, ids, p))
            self.scheduler.add_request(Req(rid, ids, p, priority=prio))
            results[rid] = RequestOutput(rid)
        loop = StepLoop(
            self.scheduler,
            InProcessRunner(self.runner),
            # Here the runner runs in this thread, so the policy keeps lockstep unless
            # overlap_min_share is 0 (which tests use to run that path).
            overlap_policy(self.config),
            lambda records: self._publish(records, results),
        )
        while loop.busy:
            if not loop.step():
                if self.scheduler.grammar_waits.compiling:
                    self.scheduler.grammar_waits.wait()
                elif not loop.outputs:
                    raise RuntimeError("scheduler has work but scheduled nothing")
            loop.flush()
        return list(results.values())

    def _publish(self, records: list[RequestOutput], results: dict[str, RequestOutput]) -> None:
        """Detokenize the records into the merged results; stop the requests a stop string ended."""
        shown, stops = self.detokenizer.process(records)
        for stop in stops:
            self.scheduler.stop(stop.rid, stop.matched)
        for record in shown:
            results[record.rid].extend(record)

    def _check_constraints(self, params: list[SamplingParams]) -> None:
        """Compile the output constraints now and raise InvalidParam naming the field of one that
        fails (it does not parse, matches nothing, or does not compile in time), before any
        request queues."""
        constraints = [
            (*p.constraint, p.reasoning_tags) for p in params if p.constraint is not None
        ]
        if not constraints:
            return
        grammars = self.scheduler.grammars
        if grammars is None:
            kind = constraints[0][0]
            raise InvalidParam(kind, f"{kind} needs xgrammar, which is not installed")
        grammars.check(constraints, self.config.grammar_compile_timeout)

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
