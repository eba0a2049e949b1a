"""Grammar-constrained decoding on xgrammar: a request's output matches a JSON schema, a regex
or an EBNF grammar (SamplingParams.json_schema / regex / ebnf).

Three processes take part, and only the first two import xgrammar:
- the tokenizer checks a constraint's syntax (check_constraint: a parse, no vocabulary,
  well under a millisecond for a schema), so a bad one is a 400 naming its field before the
  request queues;
- the scheduler compiles it against the vocabulary (GrammarBackend: on a worker thread, where
  xgrammar's compiler runs without the GIL; one compile per distinct text, shared by every
  request that brings it) and admits the request once it is compiled. Each step it fills the
  request's row of the token bitmask (which tokens may come next) and advances the request's
  matcher with every token the request emits. Shipping compiled grammars between processes
  would not pay: deserialising one costs as much as compiling it;
- the sampler sets disallowed tokens' logits to -inf (apply_token_masks: plain torch).

JSON schemas compile without free whitespace (one space after ':' and ','): a small model
given the freedom fills its token budget with newlines.
"""
from __future__ import annotations

import importlib.util
import re
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from relay.sampling_params import InvalidParam, SamplingParams

BITS = 32  # tokens per bitmask word
CACHE_ENTRIES = 256  # distinct compiled grammars kept (a schema's is ~100 KB)
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_JSON_OPTIONS = {"any_whitespace": False, "strict_mode": True}


def check_constraint(params: SamplingParams) -> None:
    """Raise InvalidParam naming the field if params' constraint does not parse."""
    constraint = params.constraint
    if constraint is None:
        return
    kind, text = constraint
    try:
        import xgrammar
    except ImportError:
        raise InvalidParam(kind, f"{kind} needs the xgrammar package, which this server lacks") from None
    parse = {"json_schema": lambda t: xgrammar.Grammar.from_json_schema(t, **_JSON_OPTIONS),
             "regex": xgrammar.Grammar.from_regex, "ebnf": xgrammar.Grammar.from_ebnf}[kind]
    try:
        parse(text)
    except Exception as e:  # xgrammar raises RuntimeError, ValueError or its own JSON error
        raise InvalidParam(kind, f"invalid {kind}: {clean_error(e)}") from None


def warm_up_constraints() -> None:
    """Import xgrammar now (~0.3 s), where it is installed, rather than in the first
    constrained request."""
    if importlib.util.find_spec("xgrammar") is not None:
        check_constraint(SamplingParams(regex="a"))


def clean_error(e: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:12: ")."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())


class Constraint:
    """One request's grammar: compiling, then a matcher that follows the request's output."""

    def __init__(self, compiled: Future, on_release: Callable[[], None]):
        self._compiled = compiled
        self._on_release = on_release
        self.matcher: Any = None
        self.error: str | None = None

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

    def wait(self) -> None:
        self._compiled.exception()  # blocks until compiled (or failed)

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


class GrammarBackend:
    """Compiles constraints for one vocabulary off the caller's thread, cached by text, and
    counts what a server reports: compiles, cache hits, compile seconds, live matchers."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int], preload: bool = False):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.words = (vocab_size + BITS - 1) // BITS
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="relay-grammar")
        self._compiler: Any = None  # built on the pool's thread, before any compile
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._buffer = torch.full((1, self.words), -1, dtype=torch.int32)
        self.compiles = 0
        self.cache_hits = 0
        self.compile_counts = [0] * (len(COMPILE_BUCKETS) + 1)  # per bucket, the last one +Inf
        self.compile_seconds = 0.0
        self.live = 0  # constraints handed out and not yet released
        # Loading the vocabulary (importing xgrammar and transformers, an HF tokenizer) takes
        # ~2-5 s of CPU: a server does it while its model loads and waits for it before
        # announcing ready, so neither the first constrained request nor the first steps after
        # ready (which would share the cores with it) pay for it.
        self._loading = self._pool.submit(self._get_compiler) if preload else None

    def wait_loaded(self) -> BaseException | None:
        """Block until the preload ends; its error, if it failed (each constrained request
        then fails with it, not the server)."""
        return None if self._loading is None else self._loading.exception()

    @property
    def loaded(self) -> bool:
        """Whether the vocabulary is in (constraints then only compile)."""
        return self._compiler is not None

    def start(self, kind: str, text: str) -> Constraint:
        key = (kind, text)
        compiled = self._cache.get(key)
        if compiled is None or (compiled.done() and compiled.exception() is not None):
            compiled = self._pool.submit(self._compile, kind, text)
            self._cache[key] = compiled
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self.cache_hits += 1
            self._cache.move_to_end(key)
        self.live += 1
        return Constraint(compiled, self._released)

    def masks(self, constraint: Constraint, proposals: list[int]) -> bytes:
        return constraint.masks(self._buffer, proposals)

    def _released(self) -> None:
        self.live -= 1

    def _compile(self, kind: str, text: str) -> Any:
        compiler = self._get_compiler()
        start = time.perf_counter()
        if kind == "json_schema":
            out = compiler.compile_json_schema(text, **_JSON_OPTIONS)
        elif kind == "regex":
            out = compiler.compile_regex(text)
        else:
            out = compiler.compile_grammar(text)
        seconds = time.perf_counter() - start
        self.compiles += 1
        self.compile_seconds += seconds
        self.compile_counts[sum(seconds > b for b in COMPILE_BUCKETS)] += 1
        return out

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.tokenizer_path)
            info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.stop_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def stats(self) -> dict[str, Any]:
        return {"compiles": self.compiles, "cache_hits": self.cache_hits, "live_matchers": self.live,
                "compile_seconds_sum": self.compile_seconds, "compile_seconds_counts": list(self.compile_counts),
                "compile_seconds_buckets": list(COMPILE_BUCKETS)}


def make_backend(tokenizer_path: str, vocab_size: int, stop_token_ids: list[int], preload: bool = False
                 ) -> GrammarBackend | None:
    """The backend, or None where xgrammar is not installed (constrained requests are then
    refused with a 400). With preload, the vocabulary starts loading now on the backend's thread
    (a server: see GrammarBackend.wait_loaded); otherwise on the first constraint (an offline
    engine that may never see one)."""
    if importlib.util.find_spec("xgrammar") is None:
        return None
    return GrammarBackend(tokenizer_path, vocab_size, stop_token_ids, preload)


def apply_token_masks(logits: torch.Tensor, rows: list[int], masks: list[bytes]) -> None:
    """Set logits[rows[i], t] to -inf for every token t that masks[i] (xgrammar's bitmask:
    bit t % 32 of int32 word t // 32) disallows. Tokens past the mask's width are disallowed."""
    from relay.kernels import cpu as cpu_kernels

    blob = bytearray(b"".join(masks))
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1
            and cpu_kernels.load() is not None):
        words = torch.frombuffer(blob, dtype=torch.int32).view(len(rows), -1)
        cpu_kernels.apply_bitmask(logits, torch.tensor(rows, dtype=torch.int64), words)
        return
    bits = np.unpackbits(np.frombuffer(blob, dtype=np.uint8).reshape(len(rows), -1), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits).to(logits.device).bool()
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab], float("-inf"))
