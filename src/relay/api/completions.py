"""/v1/completions: the request (a prompt as text or token ids, echo, logprobs, vLLM's
prompt_logprobs) and the response, whole or as streamed chunks (with echo, the prompt first:
its text, and its tokens first in logprobs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relay.api import sampling_fields
from relay.api.errors import ProtocolError, bad, show
from relay.api.json_body import require_object
from relay.api.openai_common import (
    OPENAI_RULES,
    SAMPLING_KEYS,
    common_fields,
    max_tokens_field,
    reject_unsupported,
    top_alternatives,
)
from relay.api.parsed_request import MAX_N, MAX_PROMPTS, ParsedRequest, Prompt
from relay.api.prompt_output import (
    PromptView,
    echo_logprobs,
    legacy_top,
    logprob,
    vllm_prompt_logprobs,
)
from relay.api.sampling_fields import FIELD_RULES, sampling_kwargs, validated
from relay.api.serving import EngineClient, Usage
from relay.api.typed_fields import as_bool, as_int, as_token_ids, opt
from relay.outputs import RequestOutput
from relay.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from relay.text.tokenize_query import TokenizeQuery

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


def parse_prompts(value: Any, vocab_size: int | None) -> list[Prompt]:
    """`prompt`: a string or a list of token ids, or a list of up to MAX_PROMPTS of them; a bad
    one is a 400 naming it (`prompt[2]`)."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) > MAX_PROMPTS:
            raise bad(
                "prompt", f"'prompt' may hold at most {MAX_PROMPTS} prompts, got {len(value)}"
            )
        return [_prompt(v, f"prompt[{i}]", vocab_size) for i, v in enumerate(value)]
    return [_prompt(value, "prompt", vocab_size)]


def _prompt(value: Any, param: str, vocab_size: int | None) -> Prompt:
    if isinstance(value, str):
        if not value:
            raise bad(param, f"'{param}' must not be empty")
        return Prompt(value, None)
    if isinstance(value, list):
        return Prompt(None, as_token_ids(value, param, allow_empty=False, vocab_size=vocab_size))
    raise bad(param, f"'{param}' must be a string or a list of token ids, got {show(value)}")


async def prompt_view(client: EngineClient, parsed: ParsedRequest) -> PromptView:
    """What a completion shows of its prompt; a token-id prompt's text for echo comes from the
    tokenizer process (special tokens included, as /detokenize gives it)."""
    text = parsed.text
    if parsed.echo and text is None:
        try:
            out = await client.tokenizer_call(TokenizeQuery("detokenize", tokens=parsed.input_ids))
        except ProtocolError as e:
            # The parser checked the ids; a refusal now is about their number: the prompt's.
            raise ProtocolError(e.status, e.message, e.param and "prompt", e.type) from None
        text = out["prompt"]
    return PromptView(
        echo_text=text if parsed.echo else None,
        echo_logprobs=parsed.params.top_logprobs
        if parsed.echo and parsed.params.logprobs
        else None,
        prompt_logprobs=parsed.prompt_logprobs,
    )


def _completion_logprobs(body: dict[str, Any], echo: bool) -> dict[str, Any]:
    """logprobs N: the output tokens' (and with echo the prompt's) with the N likeliest;
    vLLM's prompt_logprobs M: the prompt's with the M likeliest. The prompt's are computed
    once, with the larger top list."""
    k = opt(body, "logprobs", None, lambda v, p: as_int(v, p, 0, MAX_TOP_LOGPROBS))
    m = opt(body, "prompt_logprobs", None, lambda v, p: as_int(v, p, 0, MAX_TOP_LOGPROBS))
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
    max_n: int = MAX_N,
    vocab_size: int | None = None,
    max_constraint_bytes: int | None = None,
    max_constraint_depth: int | None = None,
    max_constraint_properties: int | None = None,
) -> ParsedRequest:
    """POST /v1/completions. Token ids (prompt, stop_token_ids) are checked against
    vocab_size when it is given, an output constraint's size, nesting and breadth against
    max_constraint_bytes, max_constraint_depth and max_constraint_properties."""
    body = require_object(body)
    common = common_fields(body, served_model, max_n)
    reject_unsupported(body, {**_COMPLETION_UNSUPPORTED, "best_of": lambda v: v == common["n"]})
    if body.get("prompt") is None:
        raise bad("prompt", "'prompt' is required")
    prompts = parse_prompts(body["prompt"], vocab_size)
    _, max_tokens = max_tokens_field(body, ("max_tokens",), FIELD_RULES["max_new_tokens"])
    kwargs = sampling_kwargs(body, SAMPLING_KEYS, OPENAI_RULES)
    kwargs["max_new_tokens"] = COMPLETION_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    echo = opt(body, "echo", False, as_bool)
    kwargs.update(_completion_logprobs(body, echo))
    grammar, param_names = sampling_fields.constraint(body, response_format=True)
    params = validated(
        SamplingParams(**kwargs, **grammar),
        _COMPLETION_NAMES | param_names,
        vocab_size,
        max_constraint_bytes,
        max_constraint_depth,
        max_constraint_properties,
    )
    return ParsedRequest(
        params=params,
        text=prompts[0].text,
        input_ids=prompts[0].input_ids,
        prompts=prompts if len(prompts) > 1 else None,
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
    lps = r.logprobs or []
    body = {
        "tokens": texts,
        "token_logprobs": [logprob(x) for x in lps],
        "top_logprobs": [
            legacy_top(top_alternatives(r, k), r.token_ids[k], texts[k], lps[k])
            for k in range(len(texts))
        ],
    }
    if echoed:
        prompt = echo_logprobs(r.prompt_logprobs, view.echo_logprobs)
        body = {key: prompt[key] + body[key] for key in body}
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
