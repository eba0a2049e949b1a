"""SGLang's native API: /generate and /abort_request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request

from relay.api import fields as F
from relay.api.docs import ERROR_RESPONSES, request_body
from relay.api.fields import ParsedRequest, ProtocolError, bad, show
from relay.api.prompt_output import logprob, sglang_input_logprobs
from relay.api.serving import (
    SSE_DONE,
    Choice,
    EngineClient,
    Usage,
    error_response,
    refuse_if_embedding,
    sse,
    streamed,
    whole,
)
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


def add_routes(app: FastAPI, client: EngineClient) -> None:
    @app.post("/generate", openapi_extra=request_body("generate"), responses=ERROR_RESPONSES)
    async def generate(request: Request):
        try:
            refuse_if_embedding(client)
            parsed = parse_generate(
                F.decode_json_body(await request.body()),
                vocab_size=client.vocab_size,
                max_constraint_bytes=client.max_constraint_bytes,
                max_constraint_depth=client.max_constraint_depth,
                max_constraint_properties=client.max_constraint_properties,
            )
            api = client.submit(parsed, "generate")
        except ProtocolError as e:
            return error_response(e)
        if parsed.stream:
            return await streamed(client, api, request, lambda outs: _events(outs, api.rids))
        done = await whole(client, api, request)
        if not isinstance(done, list):
            return done
        outs = [generate_response(api.rids[i], c) for i, c in enumerate(done)]
        return outs[0] if parsed.n == 1 else outs

    @app.post("/abort_request", openapi_extra=request_body("abort"), responses=ERROR_RESPONSES)
    async def abort_request(request: Request):
        try:
            rid = parse_abort(F.decode_json_body(await request.body()))
        except ProtocolError as e:
            return error_response(e)
        return {"success": True, "found": client.abort(rid)}


async def _events(outs: AsyncIterator[Choice], rids: list[str]) -> AsyncIterator[bytes]:
    """SGLang streams each choice's whole output so far in every chunk, not a delta."""
    so_far: dict[int, RequestOutput] = {}
    async for index, r in outs:
        if r.error is not None:
            yield sse(F.error_body(r.status, r.error, r.param))
            return
        acc = so_far.setdefault(index, RequestOutput(r.rid))
        acc.extend(r)
        yield sse(generate_response(rids[index], acc))
    yield SSE_DONE


# ---- parsing -------------------------------------------------------------------------------


def _input(body: dict[str, Any], vocab_size: int | None) -> tuple[str | None, list[int] | None]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad("text", "give exactly one of 'text' or 'input_ids'")
    if text is not None:
        if isinstance(text, list):
            raise bad("text", "batched 'text' is not supported; send separate requests")
        if not isinstance(text, str) or not text:
            raise bad("text", f"'text' must be a non-empty string, got {show(text)}")
        return text, None
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        raise bad("input_ids", "batched 'input_ids' are not supported; send separate requests")
    return None, F.as_token_ids(ids, "input_ids", allow_empty=False, vocab_size=vocab_size)


def _sampling(raw: Any, max_n: int) -> tuple[dict[str, Any], int, dict[str, Any]]:
    sp = {} if raw is None else F.as_dict(raw, "sampling_params")
    for key in sp:
        if key not in _KEYS and key != "n" and key not in F.CONSTRAINT_KEYS:
            raise bad(
                f"sampling_params.{key}", f"unknown sampling parameter 'sampling_params.{key}'"
            )
    kwargs = F.sampling_kwargs(sp, _KEYS, F.FIELD_RULES, "sampling_params.")
    n = F.opt(sp, "n", 1, lambda v, _: F.as_int(v, "sampling_params.n", 1, max_n))
    kwargs.setdefault("max_new_tokens", GENERATE_DEFAULT_MAX_TOKENS)
    return kwargs, n, sp


def _logprobs(body: dict[str, Any]) -> dict[str, Any]:
    """return_logprob: the output tokens' logprobs, with the top_logprobs_num likeliest; and
    from logprob_start_len on (-1: not) the prompt's (within the prompt: the tokenizer checks)."""
    want = F.opt(body, "return_logprob", False, F.as_bool)
    top = F.opt(body, "top_logprobs_num", 0, lambda v, p: F.as_int(v, p, 0, MAX_TOP_LOGPROBS))
    start = F.opt(body, "logprob_start_len", -1, lambda v, p: F.as_int(v, p, -1, MAX_NEW_TOKENS))
    # SGLang ignores top_logprobs_num and logprob_start_len unless return_logprob is set.
    if not want:
        return {}
    prompt = {"logprob_start_len": start, "prompt_top_logprobs": top} if start >= 0 else {}
    return {"logprobs": True, "top_logprobs": top, **prompt}


def _rid(body: dict[str, Any]) -> str | None:
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 256):
        raise bad(
            "rid", f"'rid' must be a non-empty string of at most 256 characters, got {show(rid)}"
        )
    return rid


def parse_generate(
    body: Any,
    max_n: int = F.MAX_N,
    vocab_size: int | None = None,
    max_constraint_bytes: int | None = None,
    max_constraint_depth: int | None = None,
    max_constraint_properties: int | None = None,
) -> ParsedRequest:
    """POST /generate (single request; no batches)."""
    body = F.require_object(body)
    text, input_ids = _input(body, vocab_size)
    kwargs, n, sp = _sampling(body.get("sampling_params"), max_n)
    kwargs.update(_logprobs(body))
    grammar, param_names = F.constraint(sp, "sampling_params.")
    names = (
        {f: f"sampling_params.{f}" for f in F.FIELD_RULES}
        | {"top_logprobs": "top_logprobs_num", "prompt_top_logprobs": "top_logprobs_num"}
        | param_names
    )
    params = F.validated(
        SamplingParams(**kwargs, **grammar),
        names,
        vocab_size,
        max_constraint_bytes,
        max_constraint_depth,
        max_constraint_properties,
    )
    return ParsedRequest(
        params=params,
        text=text,
        input_ids=input_ids,
        n=n,
        param_names=param_names,
        stream=F.opt(body, "stream", False, F.as_bool),
        priority=F.priority(body),
        rid=_rid(body),
    )


def parse_abort(body: Any) -> str:
    """POST /abort_request: the request id to end."""
    rid = F.require_object(body).get("rid")
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
