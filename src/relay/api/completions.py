"""/v1/completions: the request (a prompt as text or token ids, echo, logprobs, vLLM's
prompt_logprobs) and the response, whole or as streamed chunks (with echo, the prompt first:
its text, and its tokens first in logprobs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relay.api import fields as F
from relay.api.fields import ParsedRequest, bad, show
from relay.api.openai_common import (
    OPENAI_RULES,
    SAMPLING_KEYS,
    common_fields,
    max_tokens_field,
    reject_unsupported,
    top_alternatives,
)
from relay.api.prompt_output import PromptView, echo_logprobs, logprob, vllm_prompt_logprobs
from relay.api.serving import Usage
from relay.outputs import RequestOutput
from relay.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


def _prompt(value: Any, vocab_size: int | None) -> tuple[str | None, list[int] | None]:
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) > 1:
            raise bad(
                "prompt", "batched prompts are not supported; use 'n' or send separate requests"
            )
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise bad("prompt", "'prompt' must not be empty")
        return value, None
    if isinstance(value, list):
        return None, F.as_token_ids(value, "prompt", allow_empty=False, vocab_size=vocab_size)
    raise bad("prompt", f"'prompt' must be a string or a list of token ids, got {show(value)}")


def _completion_logprobs(body: dict[str, Any], echo: bool) -> dict[str, Any]:
    """logprobs N: the output tokens' (and with echo the prompt's) with the N likeliest;
    vLLM's prompt_logprobs M: the prompt's with the M likeliest. The prompt's are computed
    once, with the larger top list."""
    k = F.opt(body, "logprobs", None, lambda v, p: F.as_int(v, p, 0, MAX_TOP_LOGPROBS))
    m = F.opt(body, "prompt_logprobs", None, lambda v, p: F.as_int(v, p, 0, MAX_TOP_LOGPROBS))
    out: dict[str, Any] = {} if k is None else {"logprobs": True, "top_logprobs": k}
    prompt_tops = [n for n in (k if echo else None, m) if n is not None]
    if prompt_tops:
        out.update(logprob_start_len=0, prompt_top_logprobs=max(prompt_tops))
    return out


_COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {"suffix": lambda v: v == ""}
_COMPLETION_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "top_logprobs": "logprobs",
    "prompt_top_logprobs": "prompt_logprobs",
}


def parse_completion(
    body: Any,
    served_model: str,
    max_n: int = F.MAX_N,
    vocab_size: int | None = None,
    max_constraint_bytes: int | None = None,
    max_constraint_depth: int | None = None,
    max_constraint_properties: int | None = None,
) -> ParsedRequest:
    """POST /v1/completions. Token ids (prompt, stop_token_ids) are checked against
    vocab_size when it is given, an output constraint's size, nesting and breadth against
    max_constraint_bytes, max_constraint_depth and max_constraint_properties."""
    body = F.require_object(body)
    common = common_fields(body, served_model, max_n)
    reject_unsupported(body, {**_COMPLETION_UNSUPPORTED, "best_of": lambda v: v == common["n"]})
    if body.get("prompt") is None:
        raise bad("prompt", "'prompt' is required")
    text, input_ids = _prompt(body["prompt"], vocab_size)
    _, max_tokens = max_tokens_field(body, ("max_tokens",), F.FIELD_RULES["max_new_tokens"])
    kwargs = F.sampling_kwargs(body, SAMPLING_KEYS, OPENAI_RULES)
    kwargs["max_new_tokens"] = COMPLETION_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    echo = F.opt(body, "echo", False, F.as_bool)
    kwargs.update(_completion_logprobs(body, echo))
    grammar, param_names = F.constraint(body, response_format=True)
    params = F.validated(
        SamplingParams(**kwargs, **grammar),
        _COMPLETION_NAMES | param_names,
        vocab_size,
        max_constraint_bytes,
        max_constraint_depth,
        max_constraint_properties,
    )
    return ParsedRequest(
        params=params,
        text=text,
        input_ids=input_ids,
        param_names=param_names,
        echo=echo,
        prompt_logprobs=body.get("prompt_logprobs"),
        **common,
    )


# ---- the response ----------------------------------------------------------------------------


def _completion_logprobs_body(
    r: RequestOutput, offset: int, view: PromptView | None
) -> dict[str, Any] | None:
    """Legacy completions' logprobs: the output tokens', after the prompt's with echo."""
    echoed = view is not None and view.echo_logprobs is not None
    if r.logprobs is None and not echoed:
        return None
    texts = r.token_texts or []
    tops = None
    if r.top_logprobs is not None and any(t is not None for t in r.top_logprobs):
        # Legacy completions key alternatives by text; keep the likelier one on a text clash.
        tops = [
            {t: logprob(lp) for _, t, lp in reversed(top_alternatives(r, k))}
            for k in range(len(texts))
        ]
    body = {
        "tokens": texts,
        "token_logprobs": [logprob(x) for x in r.logprobs or []],
        "top_logprobs": tops,
    }
    if echoed:
        prompt = echo_logprobs(r.prompt_logprobs, view.echo_logprobs)
        body = {
            "tokens": prompt["tokens"] + body["tokens"],
            "token_logprobs": prompt["token_logprobs"] + body["token_logprobs"],
            "top_logprobs": prompt["top_logprobs"] + (tops or [None] * len(texts))
            if view.echo_logprobs
            else None,
        }
    offsets, pos = [], offset
    for text in body["tokens"]:
        offsets.append(pos)
        pos += len(text)
    return {**body, "text_offset": offsets}


def _completion_choice(
    index: int, r: RequestOutput, offset: int = 0, view: PromptView | None = None
) -> dict[str, Any]:
    """A choice; with a view (a request's first record only) the prompt as it asked."""
    echo = view.echo_text if view is not None and view.echo_text is not None else ""
    choice = {
        "index": index,
        "text": echo + r.text,
        "logprobs": _completion_logprobs_body(r, offset, view),
        "finish_reason": r.finish_reason,
    }
    if view is not None and view.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(r.prompt_logprobs, view.prompt_logprobs)
    return choice


def completion_response(
    rid: str,
    created: int,
    model: str,
    choices: list[RequestOutput],
    view: PromptView | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_completion_choice(i, c, 0, view) for i, c in enumerate(choices)],
        "usage": Usage.of(choices).to_openai(),
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    delta: RequestOutput,
    text_offset: int = 0,
    view: PromptView | None = None,
) -> dict[str, Any]:
    """A streamed completions delta; text_offset is how many characters this choice already
    streamed, so logprobs' text_offset keeps counting across chunks. A choice's first chunk
    has the view: the prompt comes first in it."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_completion_choice(index, delta, text_offset, view)],
    }
