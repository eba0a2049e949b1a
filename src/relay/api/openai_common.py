"""What /v1/completions and /v1/chat/completions share: the request fields both read (model,
stream and stream_options, n, priority, the max-tokens keys, the sampling keys and their
ranges), refusing a field whose effect would be dropped, and a token's top alternatives in a
response's logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relay.api import typed_fields
from relay.api.errors import ProtocolError, bad, show
from relay.api.sampling_fields import FIELD_RULES
from relay.api.serving import Usage
from relay.api.typed_fields import as_bool, as_dict, as_int, opt, ranged
from relay.outputs import RequestOutput
from relay.sampling_params import Range

# OpenAI caps temperature at 2 (SGLang's native API does not).
OPENAI_RULES = {**FIELD_RULES, "temperature": ranged("temperature", Range(0, 2))}
# OpenAI body key -> SamplingParams field (max_tokens and logprobs are handled apart).
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "stop": "stop",
    # vLLM/SGLang extras that OpenAI SDKs pass through via extra_body
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "stop_token_ids": "stop_token_ids",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "logit_bias": "logit_bias",
}


def check_model(body: dict[str, Any], served_model: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad("model", f"'model' must be a string, got {show(model)}")
    if model != served_model:
        raise ProtocolError(
            404,
            f"The model `{model[:100]}` does not exist; this server serves `{served_model}`.",
            "model",
            "not_found_error",
        )


def reject_unsupported(body: dict[str, Any], unsupported: dict[str, Callable[[Any], bool]]) -> None:
    """Refuse fields whose effect we would silently drop; each field's test says which of its
    values ask for nothing (and pass); absent or null always passes."""
    for key, is_noop in unsupported.items():
        value = body.get(key)
        if value is not None and not is_noop(value):
            raise bad(key, f"'{key}' is not supported by this server")


def _stream_fields(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = opt(body, "stream", False, as_bool)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    return stream, opt(
        as_dict(options, "stream_options"),
        "include_usage",
        False,
        lambda v, _: as_bool(v, "stream_options.include_usage"),
    )


def common_fields(body: dict[str, Any], served_model: str, max_n: int) -> dict[str, Any]:
    """Fields the two endpoints share, as ParsedRequest keyword arguments."""
    check_model(body, served_model)
    stream, include_usage = _stream_fields(body)
    return {
        "stream": stream,
        "include_usage": include_usage,
        "priority": typed_fields.priority(body),
        "n": opt(body, "n", 1, lambda v, p: as_int(v, p, 1, max_n)),
    }


def max_tokens_field(
    body: dict[str, Any], keys: tuple[str, ...], rule: Callable[[Any, str], Any]
) -> tuple[str, int | None]:
    """The first of `keys` that is set, and its value; every set key is checked by rule."""
    given = [(k, rule(body[k], k)) for k in keys if body.get(k) is not None]
    return given[0] if given else (keys[0], None)


def top_alternatives(r: RequestOutput, k: int) -> list[tuple[int, str, float]]:
    """The k-th token's alternatives as (id, text, logprob)."""
    if r.top_logprobs is None or r.top_logprobs[k] is None:
        return []
    ids, lps = r.top_logprobs[k]
    return list(zip(ids, r.top_texts[k], lps))


def usage_chunk(kind: str, rid: str, created: int, model: str, usage: Usage) -> dict[str, Any]:
    """The last streamed chunk when stream_options.include_usage is set; kind "completion" | "chat"."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.to_openai(),
    }
