"""SGLang's /generate: the request (one prompt's fields, as a request alone or as one prompt of
a batch, relay.api.generate_batch) and the response; /abort_request's request."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from relay.api import typed_fields
from relay.api.errors import bad, show
from relay.api.json_body import require_object
from relay.api.parsed_request import MAX_N, ParsedRequest
from relay.api.prompt_output import logprob, sglang_input_logprobs
from relay.api.sampling_fields import (
    CONSTRAINT_KEYS,
    FIELD_RULES,
    constraint,
    sampling_kwargs,
    validated,
)
from relay.api.serving import Usage
from relay.api.typed_fields import as_bool, as_dict, as_int, as_token_ids
from relay.outputs import RequestOutput
from relay.sampling_params import MAX_NEW_TOKENS, MAX_TOP_LOGPROBS, SamplingParams

GENERATE_DEFAULT_MAX_TOKENS = 128  # SGLang's default
# SGLang sampling_params key -> SamplingParams field ("n" is handled apart).
_KEYS = {
    "max_new_tokens": "max_new_tokens",
    "min_new_tokens": "min_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "seed": "seed",
    "sampling_seed": "seed",
    "no_stop_trim": "include_stop_str_in_output",
    "logit_bias": "logit_bias",
}
LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num")
# The fields a batch may give as a list of one value per prompt, besides the prompts (SGLang's).
PER_PROMPT = ("sampling_params", "rid", *LOGPROB_FIELDS)
_LISTED = ("text", "input_ids", *PER_PROMPT)  # a batch's prompts are lists too


# ---- parsing -------------------------------------------------------------------------------


class PromptFields:
    """One prompt's fields and the names its 400s give them: the body's own for a request of
    one prompt; in a batch, prompt i's, where its prompts and a PER_PROMPT field given as a
    list give item i, named `field[i]`."""

    def __init__(self, body: dict[str, Any], i: int | None = None):
        self.body, self.i = body, i

    def _listed(self, key: str) -> bool:
        return self.i is not None and key in _LISTED and isinstance(self.body.get(key), list)

    def name(self, key: str) -> str:
        return f"{key}[{self.i}]" if self._listed(key) else key

    def get(self, key: str) -> Any:
        value = self.body.get(key)
        return value[self.i] if self._listed(key) else value

    def opt(self, key: str, default: Any, convert: Callable[[Any, str], Any]) -> Any:
        value = self.get(key)
        return default if value is None else convert(value, self.name(key))


def input_key(body: dict[str, Any]) -> str:
    """The prompt's field: exactly one of text and input_ids."""
    if (body.get("text") is None) == (body.get("input_ids") is None):
        raise bad("text", "give exactly one of 'text' or 'input_ids'")
    return "text" if body.get("text") is not None else "input_ids"


def _input(fields: PromptFields, vocab_size: int | None) -> tuple[str | None, list[int] | None]:
    key = input_key(fields.body)
    name, value = fields.name(key), fields.get(key)
    if key == "input_ids":
        return None, as_token_ids(value, name, allow_empty=False, vocab_size=vocab_size)
    if not isinstance(value, str) or not value:
        raise bad(name, f"'{name}' must be a non-empty string, got {show(value)}")
    return value, None


def _sampling(fields: PromptFields, max_n: int) -> tuple[dict[str, Any], int, dict[str, Any]]:
    name = fields.name("sampling_params")
    sp = fields.opt("sampling_params", {}, as_dict)
    for key in sp:
        if key not in _KEYS and key != "n" and key not in CONSTRAINT_KEYS:
            raise bad(f"{name}.{key}", f"unknown sampling parameter '{name}.{key}'")
    kwargs = sampling_kwargs(sp, _KEYS, FIELD_RULES, f"{name}.")
    n = typed_fields.opt(sp, "n", 1, lambda v, _: as_int(v, f"{name}.n", 1, max_n))
    kwargs.setdefault("max_new_tokens", GENERATE_DEFAULT_MAX_TOKENS)
    return kwargs, n, sp


def _logprobs(fields: PromptFields) -> dict[str, Any]:
    """return_logprob: the output tokens' logprobs, with the top_logprobs_num likeliest; and
    from logprob_start_len on (-1: not) the prompt's (within the prompt: the tokenizer checks)."""
    want = fields.opt("return_logprob", False, as_bool)
    top = fields.opt("top_logprobs_num", 0, lambda v, p: as_int(v, p, 0, MAX_TOP_LOGPROBS))
    start = fields.opt("logprob_start_len", -1, lambda v, p: as_int(v, p, -1, MAX_NEW_TOKENS))
    # SGLang ignores top_logprobs_num and logprob_start_len unless return_logprob is set.
    if not want:
        return {}
    prompt = {"logprob_start_len": start, "prompt_top_logprobs": top} if start >= 0 else {}
    return {"logprobs": True, "top_logprobs": top, **prompt}


def as_rid(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise bad(
            param,
            f"'{param}' must be a non-empty string of at most 256 characters, got {show(value)}",
        )
    return value


def parse_prompt(
    fields: PromptFields,
    max_n: int = MAX_N,
    vocab_size: int | None = None,
    max_constraint_bytes: int | None = None,
    max_constraint_depth: int | None = None,
    max_constraint_properties: int | None = None,
) -> ParsedRequest:
    """One prompt's request (its rid, stream and priority are the caller's). Its param_names
    name the prompt's fields as its request gives them, for what the pipeline refuses."""
    text, input_ids = _input(fields, vocab_size)
    kwargs, n, sp = _sampling(fields, max_n)
    kwargs.update(_logprobs(fields))
    sampling = fields.name("sampling_params")
    grammar, constraint_names = constraint(sp, f"{sampling}.")
    top = fields.name("top_logprobs_num")
    # This prompt's names for the fields that the parser, the tokenizer (which calls the prompt
    # and its budget as the OpenAI routes do) and the submit refuse.
    own = constraint_names | {
        "prompt": fields.name(input_key(fields.body)),
        "max_tokens": f"{sampling}.max_new_tokens",
        "top_logprobs": top,
        "prompt_top_logprobs": top,
        "logprob_start_len": fields.name("logprob_start_len"),
        "rid": fields.name("rid"),
    }
    params = validated(
        SamplingParams(**kwargs, **grammar),
        {f: f"{sampling}.{f}" for f in FIELD_RULES} | own,
        vocab_size,
        max_constraint_bytes,
        max_constraint_depth,
        max_constraint_properties,
    )
    return ParsedRequest(params=params, text=text, input_ids=input_ids, n=n, param_names=own)


def request_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The fields that hold for the whole request, however many prompts it has."""
    return {
        "stream": typed_fields.opt(body, "stream", False, as_bool),
        "priority": typed_fields.priority(body),
    }


def parse_generate(body: Any, **limits: Any) -> ParsedRequest:
    """POST /generate with one prompt (a batch: relay.api.generate_batch). limits: the
    keywords of parse_prompt (max_n, vocab_size, max_constraint_*)."""
    body = require_object(body)
    parsed = parse_prompt(PromptFields(body), **limits)
    rid = typed_fields.opt(body, "rid", None, as_rid)
    return dataclasses.replace(parsed, rid=rid, **request_fields(body))


def parse_abort(body: Any) -> str:
    """POST /abort_request: the request id to end."""
    rid = require_object(body).get("rid")
    if not isinstance(rid, str) or not rid:
        raise bad("rid", "'rid' must be a non-empty string")
    return rid


# ---- responses -------------------------------------------------------------------------------


def _finish(r: RequestOutput) -> dict[str, Any] | None:
    if r.finish_reason is None:
        return None
    if r.finish_reason == "length":
        return {"type": "length", "length": r.completion_tokens}
    if r.finish_reason == "stop":
        return {"type": "stop", "matched": r.matched_stop}
    return {
        "type": str(getattr(r.finish_reason, "value", r.finish_reason)),
        "message": r.matched_stop,
    }


def generate_response(rid: str, r: RequestOutput) -> dict[str, Any]:
    """SGLang's /generate shape for one choice's output so far."""
    usage = Usage.of([r])
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish(r),
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": usage.cached_tokens,
    }
    if r.logprobs is not None:
        # SGLang orders each entry (logprob, token_id, text).
        texts = r.token_texts or [""] * len(r.token_ids)
        meta["output_token_logprobs"] = [
            [logprob(lp), t, s] for t, s, lp in zip(r.token_ids, texts, r.logprobs)
        ]
        if r.top_logprobs is not None and any(top is not None for top in r.top_logprobs):
            meta["output_top_logprobs"] = [
                [[logprob(lp), t, s] for t, s, lp in zip(top[0], names or [], top[1])]
                if top
                else []
                for top, names in zip(r.top_logprobs, r.top_texts or [None] * len(r.top_logprobs))
            ]
    if r.prompt_logprobs is not None:
        tokens, tops = sglang_input_logprobs(r.prompt_logprobs)
        meta["input_token_logprobs"] = tokens
        if any(top for top in tops):
            meta["input_top_logprobs"] = tops
    return {"text": r.text, "output_ids": list(r.token_ids), "meta_info": meta}
