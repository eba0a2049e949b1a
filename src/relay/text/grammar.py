"""Grammar-constrained decoding on xgrammar: a request's output matches a JSON schema, a regex,
an EBNF grammar or a structural tag (SamplingParams.json_schema / regex / ebnf /
structural_tag, the last set by the server for forced tool calls in a model's own format).

Two processes take part, and only the scheduler imports xgrammar:
- the scheduler compiles a constraint against the vocabulary (GrammarBackend: a pool of
  COMPILE_WORKERS threads, where xgrammar parses and compiles without the GIL; one compile per
  distinct text, shared by every request that brings it) and admits the request once it is
  compiled. A constraint that does not parse, that no output can match, or that has not
  compiled within --grammar-compile-timeout ends its request with a 400 naming its field. Each
  step the scheduler fills the request's row of the token bitmask (which tokens may come next)
  and advances the request's matcher with every token the request emits. Shipping compiled
  grammars between processes would not pay: deserialising one costs as much as compiling it,
  and a wide object's many times more (see COMPILE_WORKERS);
- the sampler sets disallowed tokens' logits to -inf (apply_token_masks, plain torch, in
  relay.execution.step_sampling).

xgrammar imports torch (and its tvm_ffi tries to), so the scheduler imports it, and with it
torch (~200 MB resident), only when the first constrained request arrives; a server that never
gets one holds no torch outside its model runners. Nothing here imports torch at module level.

No process's main thread parses or compiles: a schema nested 200 deep takes ~2 s to parse
alone, and the tokenizer once did that on its loop, holding up every request behind it.

JSON schemas compile without free whitespace (one space after ':' and ','): a small model
given the freedom fills its token budget with newlines.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from relay.sampling_params import InvalidParam

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

BITS = 32  # tokens per bitmask word
CACHE_ENTRIES = 256  # distinct compiled grammars kept (a schema's is ~100 KB)
# Compiles at once. A compile cannot be interrupted, so one that overruns its timeout holds its
# thread until it ends; the other threads keep compiling meanwhile. More threads than cores only
# share them.
#
# Why not interrupted: xgrammar 0.2.9 has no way to stop a compile under way (GrammarCompiler's
# compile_* take no deadline or cancel token, and its C++ never checks for signals; upstream's
# feature request mlc-ai/xgrammar#298 is open). Only a process can be stopped mid-compile, and a
# compile in a subprocess would have to come back serialized: CompiledGrammar.serialize_json of
# a schema nested 200 deep (0.66 s to compile) is 6.4 MB, 0.24 s to write and 0.10 s to read back,
# half the compile again on every request, beside a pool of processes to keep and restart. Wide
# objects are far worse: it writes every rule's copy of the grammar's automaton, so the JSON grows
# with the square of an object's optional properties (default model, 49k tokens: 200 of them,
# 25 ms to compile, 13 MB, 0.55 s to write, 0.36 s to read; 1,000: 0.72 s to compile, 356 MB, 13 s
# to write, 11 s and +1.9 GB to read; 2,000: the writer ran out of memory), and even a small
# schema (5 ms) would take 17 ms more to read back in the scheduler. Breadth is bounded at the
# door instead (--max-constraint-properties, sampling_params.widest_object). The
# request itself is bounded (--grammar-compile-timeout answers it with a 400; a queued compile
# whose requesters all went is dropped), the threads run niced (COMPILE_NICENESS), and a plain
# request never waits for any of them. What is not bounded is how long an overrunning compile
# holds its thread: --max-constraint-bytes bounds neither a schema's depth, where xgrammar's time
# grows about as depth cubed (on the 2-core box: nested objects 200 deep, 11 KB: 0.66 s; 400:
# 5.6 s; 800, 43 KB: 54 s), nor its breadth (one object of 2,000 optional properties: 13 s;
# ~5,900 in 128 KiB: 404 s), hence --max-constraint-depth and --max-constraint-properties, under
# which the costliest schema we found within 128 KiB compiles in ~6 s. Four such requests hold
# the four threads, and constrained requests meanwhile get the timeout's 400.
COMPILE_WORKERS = 4
# Compile threads run this much nicer than the process (Linux: per thread): where the cores are
# busy, the model runner's steps, which every running request waits for, get them first.
COMPILE_NICENESS = 10
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_JSON_OPTIONS = {"any_whitespace": False, "strict_mode": True}


class Unsatisfiable(ValueError):
    """The grammar matches no output: no token may come first."""


def clean_error(e: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:12: ")."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())


class Constraint:
    """One request's grammar: compiling, then a matcher that follows the request's output."""

    def __init__(
        self,
        kind: str,
        compiled: Future,
        deadline: float,
        timeout: float,
        on_release: Callable[[], None],
    ):
        self.kind = kind
        self._compiled = compiled
        self.deadline = deadline  # on the caller's clock: when to stop waiting for the compile
        self._timeout = timeout  # the seconds before the deadline, for the error message
        self._on_release = on_release
        self.matcher: Any = None
        self.error: str | None = None  # why the compile failed

    def ready(self) -> bool:
        """True once compiled (then `error` says whether that failed)."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        try:
            import xgrammar

            self.matcher = xgrammar.GrammarMatcher(self._compiled.result())
        except Exception as e:
            self.error = clean_error(e)
        return True

    def failure(self, now: float) -> str | None:
        """Why its request must end (a 400 naming `kind`): the grammar failed to compile, or has
        not compiled by the deadline (now is on the deadline's clock; math.inf: no more
        waiting). None while it is compiled fine, or may still compile in time."""
        if self.ready():
            return None if self.error is None else f"invalid {self.kind}: {self.error}"
        if now < self.deadline:
            return None
        return (
            f"{self.kind} did not compile within {self._timeout:g} s (--grammar-compile-timeout): "
            "simplify it, or ask the operator to raise the limit"
        )

    def wait(self, timeout: float) -> None:
        """Block until compiled (or failed), at most timeout seconds."""
        wait([self._compiled], timeout)

    def masks(self, buffer: torch.Tensor, proposals: list[int]) -> bytes:
        """The bitmask of tokens allowed next (filled into buffer [1, words] int32), then one
        after each proposal (which allowed_prefix vetted); the matcher ends where it began."""
        out = []
        for tok in [None, *proposals]:
            if tok is not None:
                self.matcher.accept_token(tok)
            self.matcher.fill_next_token_bitmask(buffer, 0)
            out.append(buffer.numpy().tobytes())
        if proposals:
            self.matcher.rollback(len(proposals))
        return b"".join(out)

    def allows_nothing(self, buffer: torch.Tensor) -> bool:
        """No token may come next: the grammar is at a dead end (buffer as for masks)."""
        self.matcher.fill_next_token_bitmask(buffer, 0)
        return not bool(buffer.any())

    def allowed_prefix(self, proposals: list[int]) -> list[int]:
        """The leading proposals the grammar allows, stopping before one that would complete
        it (nothing is verified past the end of a grammar)."""
        kept = []
        for tok in proposals:
            if not self.matcher.accept_token(tok):
                break
            kept.append(tok)
            if self.matcher.is_terminated():
                kept.pop()
                self.matcher.rollback(1)
                break
        if kept:
            self.matcher.rollback(len(kept))
        return kept

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing may follow."""
        return bool(self.matcher.is_terminated())

    def release(self) -> None:
        if self._on_release is not None:
            self._on_release()
            self._on_release = None
        self.matcher = None


class _Compile:
    """One distinct constraint's compile and how many unreleased constraints wait on it."""

    def __init__(self, future: Future):
        self.future = future
        self.requesters = 0

    @property
    def failed(self) -> bool:
        return self.future.done() and (
            self.future.cancelled() or self.future.exception() is not None
        )


class GrammarBackend:
    """Compiles constraints for one vocabulary on a pool of threads, cached by text, and counts
    what a server reports: compiles, cache hits, compile seconds, live matchers. Its methods are
    called from one thread (the scheduler's); only _compile runs on the pool."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.words = (vocab_size + BITS - 1) // BITS
        self._pool = ThreadPoolExecutor(
            COMPILE_WORKERS, thread_name_prefix="relay-grammar", initializer=_lower_thread_priority
        )
        self._compiler: Any = None  # built on a pool thread, before any compile
        self._compiler_lock = (
            threading.Lock()
        )  # one thread loads the vocabulary; the others wait for it
        self._cache: OrderedDict[tuple, _Compile] = OrderedDict()  # (kind, text, reasoning tags)
        self._buffer: torch.Tensor | None = None  # [1, words] int32: made with the compiler
        self._stats_lock = threading.Lock()  # the counters below that pool threads update
        self.compiles = 0
        self.cache_hits = 0
        self.compile_counts = [0] * (len(COMPILE_BUCKETS) + 1)  # per bucket, the last one +Inf
        self.compile_seconds = 0.0
        self.cancelled = 0  # compiles dropped before they started: every requester had gone
        self.live = 0  # constraints handed out and not yet released
        self._load_failed = False  # the vocabulary failed to load: said once in the log

    @property
    def loaded(self) -> bool:
        """Whether the vocabulary is in (constraints then only compile)."""
        return self._compiler is not None

    def start(
        self,
        kind: str,
        text: str,
        now: float = 0.0,
        timeout: float = math.inf,
        reasoning: tuple[str, str] | None = None,
    ) -> Constraint:
        """The constraint for (kind, text), compiling on the pool unless its compile is cached
        or under way (a failed one is tried again); it must have compiled timeout seconds after
        now (the caller's clock). reasoning: (open, close) of a reasoning block the output may
        run through freely before the constraint applies (SamplingParams.reasoning_tags)."""
        key = (kind, text, reasoning)
        entry = self._cache.get(key)
        if entry is None or entry.failed:
            entry = _Compile(self._pool.submit(self._compile, kind, text, reasoning))
            self._cache[key] = entry
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)  # its requesters keep their future
        else:
            self.cache_hits += 1
            self._cache.move_to_end(key)
        entry.requesters += 1
        self.live += 1
        return Constraint(
            kind, entry.future, now + timeout, timeout, lambda: self._released(key, entry)
        )

    def check(self, constraints: list[tuple], timeout: float) -> None:
        """Compile constraints, each (kind, text) or (kind, text, reasoning tags), together on the
        pool, and raise InvalidParam naming the field of the first that fails or does not compile
        within timeout seconds. The offline engine refuses a bad request this way before anything
        queues; the compiles stay cached for it."""
        started = [
            self.start(kind, text, time.monotonic(), timeout, *reasoning)
            for kind, text, *reasoning in dict.fromkeys(constraints)
        ]
        try:
            for constraint in started:
                constraint.wait(max(0.0, constraint.deadline - time.monotonic()))
                error = constraint.failure(math.inf)
                if error is not None:
                    raise InvalidParam(constraint.kind, error)
        finally:
            for constraint in started:
                constraint.release()

    def wait_for_any(self, constraints: list[Constraint], timeout: float) -> None:
        """Block until one of constraints has compiled (or failed), at most timeout seconds."""
        wait([c._compiled for c in constraints], timeout, return_when=FIRST_COMPLETED)

    def masks(self, constraint: Constraint, proposals: list[int]) -> bytes:
        return constraint.masks(self._mask_buffer(), proposals)

    def allows_nothing(self, constraint: Constraint) -> bool:
        return constraint.allows_nothing(self._mask_buffer())

    def _mask_buffer(self) -> torch.Tensor:
        """The bitmask row masks and allows_nothing fill (a constraint's matcher exists, so
        xgrammar, and with it torch, is imported by now)."""
        if self._buffer is None:
            import torch

            self._buffer = torch.full((1, self.words), -1, dtype=torch.int32)
        return self._buffer

    def _released(self, key: tuple, entry: _Compile) -> None:
        self.live -= 1
        entry.requesters -= 1
        # Nobody waits for it any more: a compile still queued is dropped. One under way cannot
        # be stopped (see COMPILE_WORKERS); it ends in the cache, where the next request with its
        # text finds it.
        if entry.requesters == 0 and entry.future.cancel():
            self.cancelled += 1
            if self._cache.get(key) is entry:
                del self._cache[key]

    def _compile(self, kind: str, text: str, reasoning: tuple[str, str] | None = None) -> Any:
        """On a pool thread: compile, and refuse a grammar no output can match."""
        compiler = self._get_compiler()
        start = time.perf_counter()
        if reasoning is not None:
            out = compiler.compile_structural_tag(after_reasoning(kind, text, *reasoning))
        elif kind == "json_schema":
            out = compiler.compile_json_schema(text, **_JSON_OPTIONS)
        elif kind == "regex":
            out = compiler.compile_regex(text)
        elif kind == "structural_tag":
            out = compiler.compile_structural_tag(text)
        else:
            out = compiler.compile_grammar(text)
        self._check_satisfiable(out)
        seconds = time.perf_counter() - start
        with self._stats_lock:
            self.compiles += 1
            self.compile_seconds += seconds
            self.compile_counts[sum(seconds > b for b in COMPILE_BUCKETS)] += 1
        return out

    def _check_satisfiable(self, compiled: Any) -> None:
        """Raise Unsatisfiable if no token may come first (e.g. `root ::= root`): such a request
        would otherwise run, sample from a row of -inf logits and fail on its first token."""
        import torch
        import xgrammar

        mask = torch.zeros((1, self.words), dtype=torch.int32)
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 0)
        if not bool(mask.any()):
            raise Unsatisfiable("no output can match it: it allows no first token")

    def _get_compiler(self) -> Any:
        """The compiler for this vocabulary, loaded by the first compile (importing xgrammar,
        torch and the tokenizer: ~2-5 s of CPU, on this niced pool thread, counted in that
        request's --grammar-compile-timeout). A vocabulary that fails to load fails each
        constrained request with its error, not the server."""
        with self._compiler_lock:
            if self._compiler is None:
                try:
                    self._compiler = self._load_compiler()
                except Exception as e:
                    if not self._load_failed:
                        self._load_failed = True
                        logger.error(
                            "structured output is unavailable: loading the vocabulary failed: %s", e
                        )
                    raise
            return self._compiler

    def _load_compiler(self) -> Any:
        import xgrammar

        from relay.text.tokenizer import load_hf_tokenizer

        tok = load_hf_tokenizer(self.tokenizer_path)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tok, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        # No cache inside xgrammar: ours (CACHE_ENTRIES) is the one, and xgrammar's own is
        # unbounded by default.
        return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            return {
                "compiles": self.compiles,
                "cache_hits": self.cache_hits,
                "live_matchers": self.live,
                "compiles_cancelled": self.cancelled,
                "compile_seconds_sum": self.compile_seconds,
                "compile_seconds_counts": list(self.compile_counts),
                "compile_seconds_buckets": list(COMPILE_BUCKETS),
            }


# Whitespace a reasoning model puts between its reasoning's close tag and its answer (Qwen3:
# "</think>\n\n"). Bounded: a small model given free whitespace fills its budget with it.
_AFTER_REASONING_SPACE = r"[ \t\r\n]{0,4}"


def after_reasoning(kind: str, text: str, open_tag: str, close_tag: str) -> str:
    """An xgrammar structural tag (JSON text): free reasoning up to close_tag, a little
    whitespace, then the constraint (kind, text). open_tag "": the output begins inside the
    reasoning; otherwise the reasoning block is optional and begins with open_tag. The
    constraint goes in as the EBNF of its own grammar, so it keeps its exact options (JSON
    without free whitespace)."""
    import json

    import xgrammar

    if kind == "structural_tag":  # formats nest: the tag's own goes in as it is
        answer = json.loads(text)["format"]
    else:
        if kind == "json_schema":
            inner = xgrammar.Grammar.from_json_schema(text, **_JSON_OPTIONS)
        elif kind == "regex":
            inner = xgrammar.Grammar.from_regex(text)
        else:
            inner = xgrammar.Grammar.from_ebnf(text)
        answer = {"type": "grammar", "grammar": str(inner)}
    reasoning = {
        "type": "sequence",
        "elements": [
            {"type": "tag", "begin": open_tag, "content": {"type": "any_text"}, "end": close_tag},
            {"type": "regex", "pattern": _AFTER_REASONING_SPACE},
            answer,
        ],
    }
    fmt = reasoning if not open_tag else {"type": "or", "elements": [reasoning, answer]}
    return json.dumps({"type": "structural_tag", "format": fmt})


def _lower_thread_priority() -> None:
    """Make the calling thread yield the CPU to the process's other threads (Linux only: there
    a thread id is a process id to setpriority; elsewhere it would renice the whole process)."""
    if sys.platform == "linux":
        try:
            tid = threading.get_native_id()
            os.setpriority(
                os.PRIO_PROCESS,
                tid,
                min(19, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICENESS),
            )
        except OSError:  # a container may forbid it: compile at the usual priority
            pass


def make_backend(
    tokenizer_path: str, vocab_size: int, stop_token_ids: list[int]
) -> GrammarBackend | None:
    """The backend, or None where xgrammar is not installed (constrained requests are then
    refused with a 400). Nothing is imported or loaded until the first constraint."""
    if importlib.util.find_spec("xgrammar") is None:
        return None
    return GrammarBackend(tokenizer_path, vocab_size, stop_token_ids)
