"""Turning a request's records into text: the detokenizer's logic, for the relay::detok
process and the offline Engine alike.

The detokenizer owns stop strings. When one appears, it ends the request's output there
(finish_reason "stop") and reports the request as stopped, so its owner tells the scheduler
to stop generating it; the scheduler answers nothing back, and the tokens it produced
meanwhile are dropped here.

It learns about a request from a DetokenizeSpec, which the tokenizer sends it directly; a
record that arrives before its spec waits for it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from relay.lifecycle import Tombstones
from relay.outputs import FinishReason, PromptLogprobs, RequestOutput
from relay.sampling_params import SamplingParams
from relay.text.tokenizer import PROMPT_CONTEXT_TOKENS, DecodeStream, Tokenizer

logger = logging.getLogger(__name__)
# How long a stopped request's late records, or a record waiting for its spec, are kept.
STRAY_SECONDS = 60.0


@dataclass
class DetokenizeSpec:
    """What the detokenizer needs to know about one request (tokenizer -> detokenizer)."""

    rid: str
    prompt_tail: list[int]
    skip_special_tokens: bool
    stop: list[str]
    include_stop_str_in_output: bool

    @classmethod
    def of(cls, rid: str, prompt_ids: list[int], params: SamplingParams) -> DetokenizeSpec:
        return cls(
            rid,
            prompt_ids[-PROMPT_CONTEXT_TOKENS:],
            params.skip_special_tokens,
            list(params.stop),
            params.include_stop_str_in_output,
        )


@dataclass
class Stopped:
    """A request whose output ended here: the scheduler must stop generating it. matched is
    the stop string, or None when detokenizing it failed."""

    rid: str
    matched: str | None


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.streams: dict[str, DecodeStream] = {}
        self.stopped = Tombstones(STRAY_SECONDS)  # rids ended here by a stop string
        self.early: dict[
            str, tuple[float, list[RequestOutput]]
        ] = {}  # records that came before their spec

    def start(self, spec: DetokenizeSpec) -> tuple[list[RequestOutput], list[Stopped]]:
        """Begin a request's stream; returns what records that waited for it produce."""
        params = SamplingParams(
            stop=spec.stop,
            skip_special_tokens=spec.skip_special_tokens,
            include_stop_str_in_output=spec.include_stop_str_in_output,
        )
        self.streams[spec.rid] = DecodeStream(self.tok, spec.prompt_tail, params)
        self.stopped.discard(spec.rid)  # a new request reusing the id
        _, waiting = self.early.pop(spec.rid, (0.0, []))
        return self.process(waiting)

    def process(self, records: list[RequestOutput]) -> tuple[list[RequestOutput], list[Stopped]]:
        """Fill in text; returns the records to show and the requests stop strings ended."""
        out: list[RequestOutput] = []
        stops: list[Stopped] = []
        for r in records:
            stream = self.streams.get(r.rid)
            if stream is None:
                self._stray(r)
                continue
            try:
                self._fill(r, stream, stops)
            except Exception as e:  # this request's failure only: end it, keep the others going
                logger.exception("detokenizing request %s failed", r.rid)
                self.streams.pop(r.rid, None)
                stops.append(Stopped(r.rid, None))
                self.stopped.add(r.rid)
                r = RequestOutput(
                    r.rid,
                    finish_reason=FinishReason.ABORT,
                    prompt_tokens=r.prompt_tokens,
                    completion_tokens=r.completion_tokens,
                    cached_tokens=r.cached_tokens,
                    error=f"detokenization failed: {type(e).__name__}: {e}",
                )
            out.append(r)
        return out, stops

    def _fill(self, r: RequestOutput, stream: DecodeStream, stops: list[Stopped]) -> None:
        r.text = stream.add(r.token_ids, finished=r.finished)
        if r.logprobs is not None:
            r.token_texts = [self.tok.decode([t], False) for t in r.token_ids]
            if r.top_logprobs is not None:
                r.top_texts = [
                    None if top is None else [self.tok.decode([t], False) for t in top[0]]
                    for top in r.top_logprobs
                ]
        if r.prompt_logprobs is not None:
            self._fill_prompt(r.prompt_logprobs)
        if stream.stopped is not None and r.finish_reason in (None, FinishReason.LENGTH):
            if r.finish_reason is None:  # the scheduler is still generating it
                stops.append(Stopped(r.rid, stream.stopped))
                self.stopped.add(r.rid)
            r.finish_reason, r.matched_stop = FinishReason.STOP, stream.stopped
        if r.finished:
            del self.streams[r.rid]

    def _fill_prompt(self, lp: PromptLogprobs) -> None:
        """Each prompt token's own text and its top tokens' (as for output tokens)."""
        lp.texts = [self.tok.decode([t], False) for t in lp.token_ids]
        lp.top_texts = [
            None if top is None else [self.tok.decode([t], False) for t in top[0]] for top in lp.top
        ]

    def _stray(self, r: RequestOutput) -> None:
        """A record with no stream: late tokens of a stopped request (dropped), or early
        ones of a request whose spec is still on its way (kept until it comes)."""
        if r.rid in self.stopped:
            return
        now = time.monotonic()
        for rid in [rid for rid, (t, _) in self.early.items() if now - t > STRAY_SECONDS]:
            logger.error("records for request %s never got a detokenize spec; dropped", rid)
            del self.early[rid]
        self.early.setdefault(r.rid, (now, []))[1].append(r)
