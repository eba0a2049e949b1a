"""OpenAI's /v1/embeddings, served by an --is-embedding server (SGLang's flag; vLLM's pooling
runner): each input's pooled final hidden states (relay.scheduling.pooling).

The inputs of one request are the choices of one ApiRequest: a refusal of any of them
(too long for the context, say) refuses the request. The vector comes back from the scheduler
as float32 bytes; `dimensions` keeps its first N values and normalizes them again (OpenAI's
shortened embeddings); `encoding_format` "base64" sends those bytes as they are.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from relay.api.docs import ERROR_RESPONSES, request_body
from relay.api.errors import ProtocolError, bad, show
from relay.api.json_body import decode_json_body, require_object
from relay.api.openai_common import check_model
from relay.api.parsed_request import MAX_INPUTS, ParsedRequest
from relay.api.serving import EngineClient, error_response, whole
from relay.api.typed_fields import as_int, as_token_ids, opt
from relay.outputs import RequestOutput
from relay.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np

ENCODING_FORMATS = ("float", "base64")
_NOT_EMBEDDING = (
    "this server does not serve embeddings: start it with --is-embedding (on an embedding model)"
)
_INPUT_KINDS = "a string, a list of strings, a list of token ids, or a list of token-id lists"


@dataclass
class EmbeddingsRequest:
    parsed: ParsedRequest
    encoding_format: str = "float"
    dimensions: int | None = None  # keep the first N values (renormalized); None: all


def add_routes(app: FastAPI, client: EngineClient) -> None:
    @app.post("/v1/embeddings", openapi_extra=request_body("embeddings"), responses=ERROR_RESPONSES)
    async def embeddings(request: Request):
        try:
            if not client.server_info.get("is_embedding"):
                raise ProtocolError(400, _NOT_EMBEDDING)
            ask = parse_embeddings(
                decode_json_body(await request.body()),
                client.served_model,
                client.vocab_size,
                client.server_info.get("hidden_size"),
            )
            api = client.submit(ask.parsed, "embedding")
        except ProtocolError as e:
            return error_response(e)
        done = await whole(client, api, request)
        if not isinstance(done, list):
            return done
        return embeddings_response(client.served_model, done, ask)


# ---- parsing -------------------------------------------------------------------------------


def parse_embeddings(
    body: Any, served_model: str, vocab_size: int | None = None, hidden_size: int | None = None
) -> EmbeddingsRequest:
    """POST /v1/embeddings: a 400 naming the field for anything it cannot embed as asked."""
    body = require_object(body)
    check_model(body, served_model)
    if body.get("input") is None:
        raise bad("input", "'input' is required")
    inputs = _inputs(body["input"], vocab_size)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODING_FORMATS:
        raise bad("encoding_format", f"'encoding_format' must be float or base64, got {show(fmt)}")
    top = hidden_size or 2**31 - 1
    dimensions = opt(body, "dimensions", None, lambda v, p: as_int(v, p, 1, top))
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", f"'user' must be a string, got {show(body['user'])}")
    parsed = ParsedRequest(
        params=SamplingParams(max_new_tokens=0, embed=True),
        inputs=inputs,
        n=len(inputs),
        param_names={"prompt": "input"},  # the pipeline's refusals name the prompt
    )
    return EmbeddingsRequest(parsed, fmt, dimensions)


def _inputs(value: Any, vocab_size: int | None) -> list[str | list[int]]:
    """The inputs, one text or token-id list each; OpenAI's four shapes."""
    if isinstance(value, str) or _is_token_ids(value):
        value = [value]
    if not isinstance(value, list):
        raise bad("input", f"'input' must be {_INPUT_KINDS}, got {show(value)}")
    if not value:
        raise bad("input", "'input' must not be empty")
    if len(value) > MAX_INPUTS:
        raise bad("input", f"'input' allows at most {MAX_INPUTS} items, got {len(value)}")
    if len({type(x) for x in value}) > 1:
        raise bad("input", f"'input' must be {_INPUT_KINDS}, not a mix")
    return [_one_input(x, i, vocab_size) for i, x in enumerate(value)]


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _one_input(x: Any, i: int, vocab_size: int | None) -> str | list[int]:
    if isinstance(x, str):
        if not x:
            raise bad("input", f"'input' item {i} is an empty string")
        return x
    if not isinstance(x, list):
        raise bad(
            "input", f"'input' item {i} must be a string or a list of token ids, got {show(x)}"
        )
    try:
        return as_token_ids(x, "input", allow_empty=False, vocab_size=vocab_size)
    except ProtocolError as e:
        raise bad("input", f"'input' item {i}: {e.message}") from None


# ---- the response --------------------------------------------------------------------------


def embeddings_response(
    model: str, outputs: list[RequestOutput], ask: EmbeddingsRequest
) -> dict[str, Any]:
    tokens = sum(r.prompt_tokens for r in outputs)
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": i,
                "embedding": _encoded(vector(r.embedding, ask.dimensions), ask.encoding_format),
            }
            for i, r in enumerate(outputs)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def vector(blob: bytes, dimensions: int | None = None) -> np.ndarray:
    """An embedding from the scheduler's float32 bytes; shortened to `dimensions` values and
    normalized again (L2), as OpenAI shortens embeddings. (numpy is imported here, not with the
    module: only an --is-embedding server's http process needs it.)"""
    import numpy as np

    values = np.frombuffer(blob, dtype="<f4")
    if dimensions is None or dimensions >= len(values):
        return values
    short = values[:dimensions].astype(np.float64)
    return (short / max(float(np.linalg.norm(short)), 1e-12)).astype("<f4")


def _encoded(values: np.ndarray, encoding_format: str) -> list[float] | str:
    """float: a JSON list; base64: the little-endian float32 bytes (as OpenAI's client decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
    return values.tolist()
