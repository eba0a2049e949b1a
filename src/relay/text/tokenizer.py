"""Tokenizer loading, chat templates, and incremental (streaming) detokenization.

`DecodeStream` turns a request's generated token ids into text deltas: UTF-8 safe across
token boundaries (a character split over tokens is held until complete), stop strings
applied, and text that might be the start of a stop string held back until it is not.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import functools
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relay.sampling_params import (
    InvalidParam,
    SamplingParams,
    check_logprob_start,
    check_prompt_length,
)

if TYPE_CHECKING:
    from relay.config import ModelConfig

logger = logging.getLogger(__name__)

# Prompt tokens kept as left context so the first output token decodes with the right
# leading space (SentencePiece-style tokenizers drop it at the start of a text).
PROMPT_CONTEXT_TOKENS = 5


class Tokenizer:
    def __init__(self, path: str, chat_template: str | None = None, without_torch: bool = False):
        """chat_template: a Jinja file that replaces the tokenizer's own template (or gives a
        model without one, such as a base model, a chat format). without_torch: for a process that
        never runs a model (load_hf_tokenizer)."""
        self.hf = load_hf_tokenizer(path, without_torch)
        if chat_template is not None:
            self.hf.chat_template = read_chat_template(chat_template)
        self.raw = getattr(
            self.hf, "backend_tokenizer", None
        )  # the Rust tokenizer: no Python layers
        self.vocab_size = len(self.hf)
        self.eos_token_id = self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's vocabulary entry (byte-level pieces as the vocabulary spells them, 'Ġthe')."""
        return [t if t is not None else "" for t in self.hf.convert_ids_to_tokens(ids)]

    def warm_up(self) -> None:
        """Build what is otherwise built on first use (the byte table, max_token_chars: ~0.1 s for
        a 49k vocabulary), so that the first request after start-up does not pay for it."""
        _ = self.max_token_chars  # a cached property: reading it builds it
        self.decode(self.encode("warm up"))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """The chat's token ids as its template renders it; add_special_tokens adds the tokenizer's
        own (a BOS) on top of those the template writes, as vLLM's /tokenize does."""
        if not self.hf.chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template; use /v1/completions, or start "
                "the server with --chat-template FILE"
            )
        if add_special_tokens:
            text = self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
            return self.encode(text, add_special_tokens=True)
        out = self.hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, **kwargs
        )
        if isinstance(out, dict) or hasattr(
            out, "keys"
        ):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.raw is not None:
            return self.raw.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters any one token stands for: len(text) / this is a lower bound
        on the tokens of any text."""
        table = self.byte_table()
        if table is not None:  # bytes >= characters
            return max(1, max(len(b) for b in table.token_bytes))
        return max(1, max(len(self.decode([i], False)) for i in range(self.vocab_size)))

    def byte_table(self) -> ByteTable | None:
        """Each token's bytes, for byte-level BPE tokenizers (GPT-2 style: SmolLM2, Llama 3,
        Qwen); None for others. Built once, on first use."""
        if not hasattr(self, "_byte_table"):
            self._byte_table = ByteTable.build(self.raw) if self.raw is not None else None
        return self._byte_table


def load_hf_tokenizer(path: str, without_torch: bool = False) -> Any:
    """transformers.AutoTokenizer.from_pretrained(path). With without_torch (the tokenizer,
    detokenizer and scheduler processes: they never run a model), loaded as transformers loads it
    where torch is not installed, so that this process never imports torch (~200 MB resident,
    libtorch mapped: AutoTokenizer reads the model's config, and transformers' config module
    imports torch whenever it is installed). The tokenizer is the same: AutoTokenizer picks its
    class by the same rules either way (loading the class tokenizer_config.json names instead
    would not be: AutoTokenizer overrides that name for some model types and for Llama-named
    byte-level vocabularies, and those classes tokenize differently); torch only serves tensor
    outputs, which Relay never asks for. The rest of this process's transformers then acts as
    without torch too. A tokenizer that cannot load so is loaded again with torch, and says so."""
    if not without_torch or "torch" in sys.modules:
        return _auto_tokenizer(path)
    try:
        with _torch_hidden():
            return _auto_tokenizer(path)
    except ImportError as e:
        logger.warning(
            "loading the tokenizer without torch failed (%s): loading it again with torch, which "
            "this process then holds (~200 MB)",
            e,
        )
    from transformers.utils import import_utils

    clear = getattr(import_utils.is_torch_available, "cache_clear", None)
    if clear is not None:  # transformers 5 caches its answer: torch is there after all
        clear()
    return _auto_tokenizer(path)


def _auto_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def _torch_hidden() -> Iterator[None]:
    """While inside, torch looks uninstalled: `import torch` raises ImportError and
    importlib.util.find_spec("torch") (what transformers asks) is None. Afterwards torch imports
    as usual (a scheduler that compiles a grammar needs it), but transformers keeps its answer."""
    quiet = _NoTorchAdvice()
    logging.getLogger("transformers").addFilter(quiet)
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
        logging.getLogger("transformers").removeFilter(quiet)


class _NoTorchAdvice(logging.Filter):
    """Drops transformers' "PyTorch was not found" advice, logged when it is imported without."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


def read_chat_template(path: str) -> str:
    """The text of a Jinja chat template file, checked to parse (with jinja2, which transformers
    renders templates with); ValueError naming --chat-template and the file otherwise, at start-up
    rather than at the first chat request."""
    import jinja2

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"--chat-template {path!r} cannot be read: {getattr(e, 'strerror', None) or e}"
        ) from None
    if not text.strip():
        raise ValueError(f"--chat-template {path!r} is empty")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(
            f"--chat-template {path!r} is not a valid Jinja template: line {e.lineno}: {e.message}"
        ) from None
    return text


@dataclass
class ByteTable:
    token_bytes: list[bytes]
    special: frozenset[int]

    @classmethod
    def build(cls, raw) -> ByteTable | None:
        spec = json.loads(raw.to_str())
        if (spec.get("decoder") or {}).get("type") != "ByteLevel":
            return None
        byte_of = {ch: b for b, ch in _byte_level_alphabet().items()}
        added = {a["id"]: a for a in spec.get("added_tokens", [])}
        table = []
        for i in range(raw.get_vocab_size(with_added_tokens=True)):
            if i in added:
                table.append(added[i]["content"].encode())
                continue
            piece = raw.id_to_token(i)
            try:
                table.append(bytes(byte_of[c] for c in piece) if piece is not None else b"")
            except KeyError:  # not a byte-level piece after all: use the slow, exact path
                return None
        return cls(table, frozenset(i for i, a in added.items() if a.get("special")))


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE vocabularies use."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(0xA1, 0xAC + 1))
        + list(range(0xAE, 0xFF + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class PromptPreparer:
    """Tokenizes a request and checks it against the vocabulary and the context length.

    Raises InvalidParam naming the API field at fault (prompt, messages, max_tokens). A
    prompt too long for the context is refused after tokenizing about one context's worth
    of it, however long it is: a 10 MB prompt costs what a full-context one does."""

    def __init__(self, tokenizer: Tokenizer, context_len: int, vocab_size: int | None = None):
        self.tok = tokenizer
        self.context_len = context_len
        # The model's vocabulary, which may be smaller than the tokenizer's.
        self.vocab_size = vocab_size or tokenizer.vocab_size

    def prompt_ids(
        self,
        text: str | None = None,
        input_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        chat_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        field = "messages" if messages is not None else "prompt"
        ids = (
            list(input_ids) if input_ids is not None else self.tokenize(text, messages, chat_kwargs)
        )
        if not ids:
            raise InvalidParam(field, "the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise InvalidParam(
                field, f"token id {bad} is outside this model's vocabulary [0, {self.vocab_size})"
            )
        check_prompt_length(len(ids), self.context_len, field)
        return ids

    def tokenize(
        self,
        text: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        chat_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        """A text's or a chat's token ids, under the prompt's limits: InvalidParam naming the field
        when it cannot fit the context. add_special_tokens (None: the default for the kind, as
        generation uses it) adds the tokenizer's special tokens: by default to a text and not to
        a chat, whose template writes its own."""
        field = "messages" if messages is not None else "prompt"
        if messages is not None:
            contents = [m.get("content") for m in messages if isinstance(m, dict)]
            self._refuse_if_too_long([c for c in contents if isinstance(c, str)], field)
            try:
                ids = self.tok.apply_chat_template(
                    messages, add_special_tokens=bool(add_special_tokens), **(chat_kwargs or {})
                )
            except Exception as e:  # a template that fails on these messages is the request's fault
                raise InvalidParam(
                    field, f"the chat template failed on these messages: {e}"
                ) from None
        else:
            self._refuse_if_too_long([text or ""], field)
            ids = self.tok.encode(text or "", add_special_tokens is not False)
        check_prompt_length(len(ids), self.context_len, field)
        return ids

    def _refuse_if_too_long(self, texts: list[str], field: str) -> None:
        """Raise if these texts (tokenized apart, as a chat template's parts) cannot fit the
        context: first by length alone, then by tokenizing growing prefixes of the long ones."""
        check_prompt_length(
            sum(len(t) for t in texts) // self.tok.max_token_chars,
            self.context_len,
            field,
            at_least=True,
        )
        probe = 4 * self.context_len  # characters: ~one context of ordinary text
        if all(len(t) <= probe for t in texts):
            return  # tokenizing it whole costs no more than probing would
        tokens = 0
        for text in sorted(texts, key=len, reverse=True):
            tokens += self._tokens_at_least(text, probe, self.context_len - tokens)
            check_prompt_length(tokens, self.context_len, field, at_least=True)

    def _tokens_at_least(self, text: str, probe: int, enough: int) -> int:
        """A lower bound on len(encode(text)), found by tokenizing prefixes of doubling length
        until they hold `enough` tokens or the text is exhausted. Each prefix ends before a
        whitespace character, where a word ends in the whole text too, and the last word's
        tokens are not counted, so the bound holds however a tokenizer splits words."""
        n = 0
        while probe < len(text):
            cut = text.rfind(" ", probe // 2, probe)
            prefix = text[: cut if cut > 0 else probe]
            n = max(0, len(self.tok.encode(prefix)) - _PROBE_MARGIN)
            if n >= enough:
                return n
            probe *= 2
        return n

    def fit_context(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """The params with max_new_tokens resolved (None: the room the prompt leaves);
        InvalidParam if the budget does not fit the context, or logprob_start_len the prompt."""
        check_logprob_start(params, prompt_len)
        room = self.context_len - prompt_len
        if params.max_new_tokens is not None and params.max_new_tokens > room:
            raise InvalidParam(
                "max_tokens",
                f"max_tokens {params.max_new_tokens} plus the prompt's {prompt_len} "
                f"tokens exceed this model's context of {self.context_len}",
            )
        budget = room if params.max_new_tokens is None else params.max_new_tokens
        return dataclasses.replace(
            params, max_new_tokens=budget, min_new_tokens=min(params.min_new_tokens, budget)
        )

    def detokenize(self, ids: list[int]) -> str:
        """Token ids as text, special tokens included (vLLM's /detokenize): tokenize's inverse.
        InvalidParam naming `tokens` for an id outside the model's vocabulary."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidParam(
                "tokens",
                f"token id {bad} is outside this model's vocabulary [0, {self.vocab_size})",
            )
        if len(ids) > self.context_len:  # no prompt or output is longer
            raise InvalidParam(
                "tokens",
                f"tokens allows at most {self.context_len} ids (this model's context), "
                f"got {len(ids)}",
            )
        return self.tok.decode(ids, skip_special_tokens=False)


# Tokens a prefix may hold beyond the same stretch of the whole text (its last word may
# split differently, special tokens at the start): never counted towards a refusal.
_PROBE_MARGIN = 16


class DecodeStream:
    """Incremental detokenization of one request's output."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.tok = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all output text decoded so far (cut at a stop string, if one hit)
        self.sent = 0  # characters of text already handed out
        self.stopped: str | None = None
        # Byte-level vocabularies decode token by token from a byte table (~20x cheaper than
        # re-decoding a window); the incremental UTF-8 decoder holds split characters.
        self.bytes = tokenizer.byte_table()
        if self.bytes is not None:
            self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_ids: list[int], finished: bool) -> str:
        """Feed new tokens; returns the text that may be shown now. Once a stop string is
        found, `stopped` names it and later tokens are ignored. At finish, a character cut
        short is handed out as U+FFFD, so the text equals the tokenizer's decode of all ids."""
        if self.stopped is None:
            if self.bytes is not None:
                self._add_bytes(token_ids, finished)
            else:
                self._add_windowed(token_ids, finished)
        end = (
            len(self.text)
            if (finished or self.stopped is not None)
            else max(self.sent, len(self.text) - self.hold)
        )
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def _add_bytes(self, token_ids: list[int], finished: bool) -> None:
        table, special = self.bytes.token_bytes, self.bytes.special
        for t in token_ids:
            if self.skip_special and t in special:
                continue
            delta = self.utf8.decode(table[t] if 0 <= t < len(table) else b"")
            if delta and self._append(delta):
                return
        if finished:
            self._append(self.utf8.decode(b"", final=True))

    def _add_windowed(self, token_ids: list[int], finished: bool) -> None:
        for t in token_ids:
            self.ids.append(t)
            delta = self._decode_tail()
            if delta and self._append(delta):
                return
        if finished and self.read_offset < len(self.ids):
            self._append(self._decode_tail(force=True))

    def _decode_tail(self, force: bool = False) -> str:
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip_special)
        if not force and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def _append(self, delta: str) -> bool:
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        hits = [(i, stop) for stop in self.stops if (i := self.text.find(stop, start)) != -1]
        if not hits:
            return False
        i, stop = min(hits)
        self.text = self.text[: i + len(stop)] if self.include_stop else self.text[:i]
        self.stopped = stop
        return True


def eos_ids(mc: ModelConfig, tokenizer: Tokenizer) -> list[int]:
    """The ids that end generation: the model config's and the tokenizer's EOS."""
    ids = set(mc.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
