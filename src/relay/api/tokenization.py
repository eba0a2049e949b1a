"""vLLM's /tokenize and /detokenize.

The http process only parses and checks the body; the work is the tokenizer process's
(relay.text.tokenizer.PromptPreparer), asked through EngineClient.tokenizer_call, so a long text or
a chat template never runs on the event loop that serves every other request.

POST /tokenize {model?, prompt | messages, add_special_tokens?, add_generation_prompt?,
                continue_final_message?, chat_template_kwargs?, tools?, return_token_strs?}
    -> {count, max_model_len, tokens, token_strs}
POST /detokenize {model?, tokens} -> {prompt}
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from relay.api import tool_calls as T
from relay.api.chat_messages import chat_template_kwargs, parse_messages
from relay.api.docs import ERROR_RESPONSES, request_body
from relay.api.errors import ProtocolError, bad, show
from relay.api.json_body import decode_json_body, require_object
from relay.api.openai_common import check_model
from relay.api.serving import EngineClient, error_response
from relay.api.typed_fields import as_bool, as_token_ids, opt
from relay.text.tokenize_query import TokenizeQuery


def add_routes(app: FastAPI, client: EngineClient) -> None:
    @app.post("/tokenize", openapi_extra=request_body("tokenize"), responses=ERROR_RESPONSES)
    async def tokenize(request: Request):
        try:
            query = parse_tokenize(decode_json_body(await request.body()), client.served_model)
            out = await client.tokenizer_call(query)
        except ProtocolError as e:
            return error_response(e)
        return {
            "count": len(out["tokens"]),
            "max_model_len": client.context_len,
            "tokens": out["tokens"],
            "token_strs": out.get("token_strs"),
        }

    @app.post("/detokenize", openapi_extra=request_body("detokenize"), responses=ERROR_RESPONSES)
    async def detokenize(request: Request):
        try:
            query = parse_detokenize(
                decode_json_body(await request.body()),
                client.served_model,
                client.vocab_size,
                client.context_len,
            )
            out = await client.tokenizer_call(query)
        except ProtocolError as e:
            return error_response(e)
        return {"prompt": out["prompt"]}


def parse_tokenize(body: Any, served_model: str) -> TokenizeQuery:
    """A text (`prompt`) or a chat (`messages`, rendered with the model's template as
    /v1/chat/completions renders it). Special tokens are added to a text by default and not
    to a chat, whose template places its own (vLLM's defaults)."""
    body = require_object(body)
    check_model(body, served_model)
    strs = opt(body, "return_token_strs", False, as_bool)
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise bad("prompt", "give exactly one of 'prompt' or 'messages'")
    if body.get("prompt") is not None:
        text = body["prompt"]
        if not isinstance(text, str):
            raise bad("prompt", f"'prompt' must be a string, got {show(text)}")
        return TokenizeQuery(
            "tokenize",
            text=text,
            add_special_tokens=opt(body, "add_special_tokens", True, as_bool),
            return_token_strs=strs,
        )
    kwargs = chat_template_kwargs(body)
    if opt(body, "continue_final_message", False, as_bool):
        if body.get("add_generation_prompt") is True:
            raise bad(
                "continue_final_message",
                "'continue_final_message' and 'add_generation_prompt' cannot both be true",
            )
        kwargs.update(continue_final_message=True, add_generation_prompt=False)
    tools = T.parse_tool_calling(body)
    if tools is not None:
        kwargs["tools"] = tools.template_tools()
    return TokenizeQuery(
        "tokenize",
        messages=parse_messages(body.get("messages")),
        chat_kwargs=kwargs,
        add_special_tokens=opt(body, "add_special_tokens", False, as_bool),
        return_token_strs=strs,
    )


def parse_detokenize(
    body: Any, served_model: str, vocab_size: int | None, max_tokens: int
) -> TokenizeQuery:
    """Token ids to text; at most a context's worth of them (no prompt or output is longer)."""
    body = require_object(body)
    check_model(body, served_model)
    if body.get("tokens") is None:
        raise bad("tokens", "'tokens' is required")
    ids = as_token_ids(body["tokens"], "tokens", allow_empty=True, vocab_size=vocab_size)
    if max_tokens and len(ids) > max_tokens:
        raise bad(
            "tokens",
            f"'tokens' allows at most {max_tokens} ids (this model's context), got {len(ids)}",
        )
    return TokenizeQuery("detokenize", tokens=list(ids))
