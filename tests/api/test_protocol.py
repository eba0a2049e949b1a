"""Request parsing and response shapes of relay.api (pure functions, no server)."""

from __future__ import annotations

import asyncio
import json
import math
import random

import httpx
import jinja2
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from relay.api.batched_prompts import PromptBatch
from relay.api.chat import chat_chunk, chat_response, parse_chat, parsed_chat_chunks
from relay.api.chat_output import ChatOutput
from relay.api.completions import completion_chunk, completion_response, parse_completion
from relay.api.errors import ProtocolError, error_body
from relay.api.generate import generate_response, parse_abort, parse_generate
from relay.api.generate_batch import is_batch, parse_batch
from relay.api.json_body import MAX_JSON_DEPTH, decode_json_body
from relay.api.openai_common import usage_chunk
from relay.api.parsed_request import ParsedRequest
from relay.api.serving import SSE_DONE, ApiRequest, Usage, sse
from relay.api.tool_output import CallStart, OutputStream, assemble, parse_output
from relay.outputs import RequestOutput

MODEL = "tiny-model"


def comp(**kw):
    return {"model": MODEL, "prompt": "Hello", **kw}


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **kw}


def gen(**kw):
    return {"text": "Hello", **kw}


PARSERS = {
    "completion": lambda body: parse_completion(body, MODEL, max_n=8),
    "chat": lambda body: parse_chat(body, MODEL, max_n=8),
    "generate": lambda body: parse_generate_body(body, max_n=8),
}


def parse_generate_body(body, **limits):
    """A /generate body as the route reads it: a batch (a list of prompts) or one prompt."""
    if isinstance(body, dict) and is_batch(body):
        return parse_batch(body, **limits)
    return parse_generate(body, **limits)


BAD_REQUESTS = [
    # (parser, body, status, param)
    ("completion", ["not", "an", "object"], 400, None),
    ("completion", "prompt", 400, None),
    ("chat", None, 400, None),
    ("generate", 42, 400, None),
    ("completion", comp(max_tokens="10"), 400, "max_tokens"),
    ("completion", comp(max_tokens=True), 400, "max_tokens"),
    ("completion", comp(max_tokens=10.0), 400, "max_tokens"),
    ("completion", comp(max_tokens=-5), 400, "max_tokens"),
    ("completion", comp(max_tokens=10**9), 400, "max_tokens"),
    ("completion", comp(temperature="hot"), 400, "temperature"),
    ("completion", comp(temperature=-0.1), 400, "temperature"),
    ("completion", comp(temperature=2.5), 400, "temperature"),
    ("completion", comp(temperature=float("nan")), 400, "temperature"),
    ("completion", comp(top_p=0), 400, "top_p"),
    ("completion", comp(top_p=1.5), 400, "top_p"),
    ("completion", comp(prompt=""), 400, "prompt"),
    ("completion", comp(prompt=[]), 400, "prompt"),
    ("completion", comp(prompt=[""]), 400, "prompt[0]"),
    ("completion", comp(prompt=[[]]), 400, "prompt[0]"),
    # a list of prompts: the bad one is named
    ("completion", comp(prompt=["a", "b", ""]), 400, "prompt[2]"),
    ("completion", comp(prompt=["a", 5]), 400, "prompt[1]"),
    ("completion", comp(prompt=["a", ["b"]]), 400, "prompt[1]"),
    ("completion", comp(prompt=[[1, 2], [3, -1]]), 400, "prompt[1]"),
    ("completion", comp(prompt=[[1, 2], []]), 400, "prompt[1]"),
    ("completion", comp(prompt=["a"] * 257), 400, "prompt"),
    ("completion", comp(prompt=[1, -2, 3]), 400, "prompt"),
    ("completion", comp(prompt=[1, True]), 400, "prompt"),
    ("completion", comp(prompt=12), 400, "prompt"),
    ("completion", {"model": MODEL}, 400, "prompt"),
    ("completion", comp(model="gpt-4"), 404, "model"),
    ("chat", chat(model="gpt-4"), 404, "model"),
    ("completion", comp(model=3), 400, "model"),
    ("completion", comp(n=0), 400, "n"),
    ("completion", comp(n=9), 400, "n"),
    ("chat", chat(n=100), 400, "n"),
    ("completion", comp(stop=5), 400, "stop"),
    ("completion", comp(stop={"a": 1}), 400, "stop"),
    ("completion", comp(stop=["ok", 3]), 400, "stop"),
    ("completion", comp(stop=[""]), 400, "stop"),
    ("completion", comp(stop=["x"] * 17), 400, "stop"),
    ("completion", comp(logprobs=21), 400, "logprobs"),
    ("completion", comp(logprobs=-1), 400, "logprobs"),
    ("completion", comp(logprobs=True), 400, "logprobs"),
    ("completion", comp(stream_options={"include_usage": True}), 400, "stream_options"),
    (
        "completion",
        comp(stream=False, stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    (
        "completion",
        comp(stream=True, stream_options={"include_usage": "yes"}),
        400,
        "stream_options.include_usage",
    ),
    ("completion", comp(stream="true"), 400, "stream"),
    ("completion", comp(suffix="tail"), 400, "suffix"),
    ("completion", comp(best_of=3), 400, "best_of"),
    ("completion", comp(seed="1"), 400, "seed"),
    ("completion", comp(seed=2**70), 400, "seed"),
    ("completion", comp(presence_penalty=3), 400, "presence_penalty"),
    ("completion", comp(frequency_penalty=-2.5), 400, "frequency_penalty"),
    ("completion", comp(top_k=-2), 400, "top_k"),
    ("completion", comp(top_k=1.5), 400, "top_k"),
    ("completion", comp(min_p=1.5), 400, "min_p"),
    ("completion", comp(repetition_penalty=0), 400, "repetition_penalty"),
    ("completion", comp(min_tokens=-1), 400, "min_tokens"),
    ("completion", comp(min_tokens=20, max_tokens=5), 400, "min_tokens"),
    ("completion", comp(ignore_eos=1), 400, "ignore_eos"),
    ("completion", comp(stop_token_ids=[1, -1]), 400, "stop_token_ids"),
    ("completion", comp(stop_token_ids=7), 400, "stop_token_ids"),
    ("completion", comp(priority="high"), 400, "priority"),
    ("chat", {"model": MODEL}, 400, "messages"),
    ("chat", chat(messages=[]), 400, "messages"),
    ("chat", chat(messages="Hi"), 400, "messages"),
    ("chat", chat(messages=["Hi"]), 400, "messages.0"),
    ("chat", chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role"),
    ("chat", chat(messages=[{"content": "x"}]), 400, "messages.0.role"),
    (
        "chat",
        chat(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": 5}]),
        400,
        "messages.1.content",
    ),
    ("chat", chat(messages=[{"role": "user"}]), 400, "messages.0.content"),
    (
        "chat",
        chat(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
        400,
        "messages.0.content",
    ),
    (
        "chat",
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]),
        400,
        "messages.0.content",
    ),
    ("chat", chat(tools={"type": "function", "function": {"name": "f"}}), 400, "tools"),
    ("chat", chat(tools=["f"]), 400, "tools.0"),
    ("chat", chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), 400, "tools.0.type"),
    ("chat", chat(tools=[{"type": "function"}]), 400, "tools.0.function"),
    (
        "chat",
        chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
        400,
        "tools.0.function.name",
    ),
    (
        "chat",
        chat(tools=[{"type": "function", "function": {"description": "no name"}}]),
        400,
        "tools.0.function.name",
    ),
    (
        "chat",
        chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2),
        400,
        "tools.1.function.name",
    ),
    (
        "chat",
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
        400,
        "tools.0.function.parameters",
    ),
    (
        "chat",
        chat(
            tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"maximum": 2**70}}}
            ]
        ),
        400,
        "tools.0.function.parameters",
    ),
    (
        "chat",
        chat(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]),
        400,
        "tools.0.function.description",
    ),
    (
        "chat",
        chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]),
        400,
        "tools",
    ),
    ("chat", chat(tool_choice="required"), 400, "tool_choice"),
    (
        "chat",
        chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="always"),
        400,
        "tool_choice",
    ),
    (
        "chat",
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function"},
        ),
        400,
        "tool_choice.function",
    ),
    (
        "chat",
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice.function.name",
    ),
    (
        "chat",
        chat(tool_choice={"type": "function", "function": {"name": "f"}}),
        400,
        "tool_choice.function.name",
    ),
    (
        "chat",
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice="required",
            response_format={"type": "json_object"},
        ),
        400,
        "response_format",
    ),
    (
        "chat",
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            regex="a+",
            tool_choice={"type": "function", "function": {"name": "f"}},
        ),
        400,
        "regex",
    ),
    ("chat", chat(functions=[{"name": "f"}]), 400, "functions"),
    ("chat", chat(function_call={"name": "f"}), 400, "function_call"),
    (
        "chat",
        chat(function_call="auto"),
        400,
        "function_call",
    ),  # the legacy pair is refused in any form
    ("chat", chat(function_call="none"), 400, "function_call"),
    ("chat", chat(functions=[]), 400, "functions"),
    ("chat", chat(echo=True), 400, "echo"),
    ("chat", chat(logit_bias=[5, 1]), 400, "logit_bias"),
    ("chat", chat(logit_bias={"5": 101}), 400, "logit_bias"),
    ("chat", chat(logit_bias={"5": -100.5}), 400, "logit_bias"),
    ("chat", chat(logit_bias={"5": "1"}), 400, "logit_bias"),
    ("chat", chat(logit_bias={"5": True}), 400, "logit_bias"),
    ("completion", comp(logit_bias={"-1": 1}), 400, "logit_bias"),
    ("completion", comp(logit_bias={"five": 1}), 400, "logit_bias"),
    ("completion", comp(logit_bias={" 5": 1}), 400, "logit_bias"),
    ("completion", comp(logit_bias={str(i): 1 for i in range(1025)}), 400, "logit_bias"),
    (
        "generate",
        gen(sampling_params={"logit_bias": {"5": 200}}),
        400,
        "sampling_params.logit_bias",
    ),
    ("completion", comp(echo="yes"), 400, "echo"),
    (
        "chat",
        chat(messages=[{"role": "assistant", "content": None, "tool_calls": "f()"}]),
        400,
        "messages.0.tool_calls",
    ),
    (
        "chat",
        chat(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]),
        400,
        "messages.0.tool_calls.0.function.name",
    ),
    (
        "chat",
        chat(
            messages=[
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}
            ]
        ),
        400,
        "messages.0.tool_calls.0.function.arguments",
    ),
    ("chat", chat(response_format={"type": "xml"}), 400, "response_format.type"),
    ("chat", chat(response_format="json"), 400, "response_format"),
    ("chat", chat(response_format={"type": "json_schema"}), 400, "response_format.json_schema"),
    (
        "chat",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}),
        400,
        "response_format.json_schema.schema",
    ),
    (
        "completion",
        comp(response_format={"type": "json_object"}, regex="a+"),
        400,
        "response_format",
    ),
    ("completion", comp(regex=""), 400, "regex"),
    ("completion", comp(ebnf=7), 400, "ebnf"),
    ("completion", comp(json_schema=[1]), 400, "json_schema"),
    ("generate", gen(sampling_params={"regex": 5}), 400, "sampling_params.regex"),
    (
        "generate",
        gen(sampling_params={"regex": "a", "ebnf": 'root ::= "a"'}),
        400,
        "sampling_params.ebnf",
    ),
    ("chat", chat(logprobs="yes"), 400, "logprobs"),
    ("chat", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("chat", chat(top_logprobs=3), 400, "top_logprobs"),
    ("chat", chat(max_tokens=0), 400, "max_tokens"),
    ("chat", chat(max_completion_tokens="5"), 400, "max_completion_tokens"),
    ("chat", chat(min_tokens=10, max_completion_tokens=5), 400, "min_tokens"),
    ("chat", chat(temperature="hot"), 400, "temperature"),
    ("chat", chat(chat_template_kwargs="x"), 400, "chat_template_kwargs"),
    (
        "chat",
        chat(chat_template_kwargs={"chat_template": "{{ evil }}"}),
        400,
        "chat_template_kwargs.chat_template",
    ),
    ("chat", chat(add_generation_prompt="no"), 400, "add_generation_prompt"),
    ("generate", {"text": "a", "input_ids": [1, 2]}, 400, "text"),
    ("generate", {"sampling_params": {}}, 400, "text"),
    ("generate", {"text": ""}, 400, "text"),
    ("generate", {"input_ids": []}, 400, "input_ids"),
    ("generate", {"input_ids": [1, -1]}, 400, "input_ids"),
    ("generate", {"input_ids": [1, [2]]}, 400, "input_ids"),
    ("generate", gen(sampling_params={"max_tokens": 5}), 400, "sampling_params.max_tokens"),
    ("generate", gen(sampling_params={"temprature": 0.5}), 400, "sampling_params.temprature"),
    ("generate", gen(sampling_params=[1]), 400, "sampling_params"),
    (
        "generate",
        gen(sampling_params={"max_new_tokens": "5"}),
        400,
        "sampling_params.max_new_tokens",
    ),
    (
        "generate",
        gen(sampling_params={"max_new_tokens": -1}),
        400,
        "sampling_params.max_new_tokens",
    ),
    ("generate", gen(sampling_params={"temperature": 101}), 400, "sampling_params.temperature"),
    ("generate", gen(sampling_params={"n": 0}), 400, "sampling_params.n"),
    (
        "generate",
        gen(sampling_params={"min_new_tokens": 200}),
        400,
        "sampling_params.min_new_tokens",
    ),
    ("generate", gen(stream=1), 400, "stream"),
    ("generate", gen(return_logprob="yes"), 400, "return_logprob"),
    ("generate", gen(return_logprob=True, top_logprobs_num=50), 400, "top_logprobs_num"),
    ("generate", gen(rid=5), 400, "rid"),
    ("generate", gen(rid=["a"]), 400, "rid"),
    ("generate", gen(return_logprob=[True]), 400, "return_logprob"),
    # a batch (SGLang's): each bad prompt or per-prompt value named by its index
    ("generate", {"text": []}, 400, "text"),
    ("generate", {"text": ["a"] * 257}, 400, "text"),
    ("generate", {"text": ["a", ""]}, 400, "text[1]"),
    ("generate", {"text": ["a", 5]}, 400, "text[1]"),
    ("generate", {"text": ["a"], "input_ids": [[1]]}, 400, "text"),
    ("generate", {"input_ids": [[1], []]}, 400, "input_ids[1]"),
    ("generate", {"input_ids": [[1], [2, -1]]}, 400, "input_ids[1]"),
    ("generate", {"input_ids": [[1], 2]}, 400, "input_ids[1]"),
    ("generate", gen(text=["a", "b"], stream="yes"), 400, "stream"),
    ("generate", gen(text=["a", "b"], sampling_params=[{}]), 400, "sampling_params"),
    ("generate", gen(text=["a", "b"], sampling_params=[{}, 5]), 400, "sampling_params[1]"),
    (
        "generate",
        gen(text=["a", "b"], sampling_params=[{}, {"temperature": -1}]),
        400,
        "sampling_params[1].temperature",
    ),
    (
        "generate",
        gen(text=["a", "b"], sampling_params=[{}, {"temprature": 1}]),
        400,
        "sampling_params[1].temprature",
    ),
    (
        "generate",
        gen(text=["a", "b"], sampling_params=[{}, {"regex": 5}]),
        400,
        "sampling_params[1].regex",
    ),
    (
        "generate",
        gen(text=["a", "b"], sampling_params={"temperature": -1}),
        400,
        "sampling_params.temperature",
    ),
    ("generate", gen(text=["a", "b"], sampling_params=[{}, {"n": 2}]), 400, "sampling_params[1].n"),
    ("generate", gen(text=["a", "b"], rid=["x"]), 400, "rid"),
    ("generate", gen(text=["a", "b"], rid=["x", "x"]), 400, "rid[1]"),
    ("generate", gen(text=["a", "b"], rid=["x", ""]), 400, "rid[1]"),
    ("generate", gen(text=["a", "b"], rid=["x", None]), 400, "rid[1]"),
    ("generate", gen(text=["a", "b"], return_logprob=[True, "no"]), 400, "return_logprob[1]"),
    ("generate", gen(text=["a", "b"], top_logprobs_num=[1, 2, 3]), 400, "top_logprobs_num"),
    ("generate", gen(text=["a", "b"], top_logprobs_num=[1, 21]), 400, "top_logprobs_num[1]"),
    ("generate", gen(text=["a", "b"], logprob_start_len=[0, -2]), 400, "logprob_start_len[1]"),
    (
        "generate",
        gen(text=["a", "b"], return_logprob=[True, False], sampling_params={"n": 2}),
        400,
        "return_logprob",
    ),
]


@pytest.mark.parametrize(
    "kind,body,status,param",
    BAD_REQUESTS,
    ids=[f"{i}-{case[0]}-{case[3]}" for i, case in enumerate(BAD_REQUESTS)],
)
def test_bad_requests(kind, body, status, param):
    with pytest.raises(ProtocolError) as info:
        PARSERS[kind](body)
    err = info.value
    assert (err.status, err.param) == (status, param), err.message
    assert err.type == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:  # the message names the field so a human can fix the request
        assert param.split(".")[-1] in err.message or param in err.message
    assert len(err.message) < 300


def test_error_body_shape():
    body = error_body(400, "'n' must be ...", "n")
    assert body == {
        "object": "error",
        "error": {
            "message": "'n' must be ...",
            "type": "invalid_request_error",
            "param": "n",
            "code": 400,
        },
    }
    assert error_body(404, "no")["error"]["type"] == "not_found_error"
    assert error_body(401, "no")["error"]["type"] == "authentication_error"
    assert ProtocolError(400, "m", "x", "custom").body()["error"]["type"] == "custom"


def test_openai_client_raises_with_our_error_body():
    def handler(request: httpx.Request) -> httpx.Response:
        try:
            parse_completion(json.loads(request.content), MODEL)
        except ProtocolError as e:
            return httpx.Response(e.status, json=e.body())
        raise AssertionError("expected a rejection")

    client = openai.OpenAI(
        api_key="x",
        base_url="http://relay/v1",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert "max_tokens" in bad.value.message and bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")


# ---------------------------------------------------------------- good paths -------------


def test_completion_defaults():
    req = parse_completion({"prompt": "Hello"}, MODEL)  # model may be omitted
    assert isinstance(req, ParsedRequest)
    assert (req.text, req.input_ids, req.messages) == ("Hello", None, None)
    assert (req.n, req.stream, req.include_usage, req.priority) == (1, False, False, 0)
    p = req.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.logprobs, p.top_logprobs) == (
        16,
        1.0,
        1.0,
        -1,
        False,
        0,
    )
    assert p.stop == [] and p.seed is None


def test_completion_nulls_mean_defaults():
    req = parse_completion(
        comp(
            max_tokens=None,
            temperature=None,
            stop=None,
            n=None,
            logprobs=None,
            echo=None,
            stream=None,
            stream_options=None,
            suffix=None,
            user=None,
        ),
        MODEL,
    )
    assert req.params.max_new_tokens == 16 and req.params.stop == [] and req.n == 1


@pytest.mark.parametrize(
    "prompt,text,ids",
    [
        ("abc", "abc", None),
        (["abc"], "abc", None),
        ([5, 0, 7], None, [5, 0, 7]),
        ([[5, 6]], None, [5, 6]),
    ],
)
def test_completion_prompt_forms(prompt, text, ids):
    req = parse_completion(comp(prompt=prompt), MODEL)
    assert (req.text, req.input_ids, req.prompts) == (text, ids, None)


def test_completion_prompt_lists_keep_every_prompt_in_order():
    """Strings and token-id lists, mixed as OpenAI's schema allows each element; up to 256."""
    req = parse_completion(comp(prompt=["a", [5, 6], "b"], n=2), MODEL)
    assert req.prompts == [("a", None), (None, [5, 6]), ("b", None)]
    assert (req.text, req.input_ids, req.n) == ("a", None, 2)
    assert len(parse_completion(comp(prompt=[[1]] * 256), MODEL).prompts) == 256


def soon(awaitable):
    """A take that must return now (a failing one must not hang the run)."""
    return asyncio.wait_for(awaitable, 10)


async def _blocked(task: asyncio.Future) -> bool:
    """Whether the task is still waiting once the loop has run everything that was ready."""
    for _ in range(5):
        await asyncio.sleep(0)
    return not task.done()


def test_a_prompt_batch_numbers_choices_across_prompts_and_starts_once_all_are_heard():
    """Choice j of prompt i is i * n + j; the first take waits until every prompt has a record,
    or one failed (so a refused prompt answers a stream with its status); later takes return
    whatever came."""

    async def run():
        parts = [ApiRequest("b-0", 2), ApiRequest("b-1", 2)]
        batch = PromptBatch("b", parts)
        assert batch.rids == ["b-0-0", "b-0-1", "b-1-0", "b-1-1"]
        parts[0].put(1, RequestOutput("b-0-1", [5]))
        first = asyncio.ensure_future(batch.take())
        assert await _blocked(first)
        parts[1].put(0, RequestOutput("b-1-0", [6]))
        assert [(i, r.token_ids) for i, r in await soon(first)] == [(1, [5]), (2, [6])]
        parts[1].put(1, RequestOutput("b-1-1", [7]))
        assert [(i, r.token_ids) for i, r in await soon(batch.take())] == [(3, [7])]

        refused = [ApiRequest("c-0", 1), ApiRequest("c-1", 1), ApiRequest("c-2", 1)]
        batch = PromptBatch("c", refused)
        refused[0].put(0, RequestOutput("c-0", [5]))
        first = asyncio.ensure_future(batch.take())
        assert await _blocked(first)
        refused[2].put(0, RequestOutput("c-2", error="too long", status=400, param="prompt[2]"))
        assert [(i, r.error) for i, r in await soon(first)] == [(0, None), (2, "too long")]

    asyncio.run(run())


def test_completion_fields_and_extras():
    req = parse_completion(
        comp(
            max_tokens=32,
            temperature=0,
            top_p=0.9,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
            stop="\n",
            seed=7,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            logprobs=3,
            user="bob",
            some_unknown_field=[1],
            top_k=40,
            min_p=0.05,
            repetition_penalty=1.1,
            min_tokens=4,
            ignore_eos=True,
            skip_special_tokens=False,
            stop_token_ids=[2, 3],
            priority=-5,
            include_stop_str_in_output=True,
            best_of=3,
        ),
        MODEL,
        max_n=8,
    )
    p = req.params
    assert (req.n, req.stream, req.include_usage, req.priority) == (3, True, True, -5)
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (
        32,
        4,
        0.0,
        0.9,
        40,
        0.05,
    )
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.seed) == (
        1.1,
        0.5,
        -0.5,
        7,
    )
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.skip_special_tokens) == (
        ["\n"],
        [2, 3],
        True,
        False,
    )
    assert p.include_stop_str_in_output and p.logprobs and p.top_logprobs == 3
    assert p.greedy and isinstance(p.temperature, float)


def test_completion_top_k_zero_is_off_and_logprobs_zero_keeps_chosen():
    p = parse_completion(comp(top_k=0, logprobs=0), MODEL).params
    assert p.top_k == -1 and p.logprobs and p.top_logprobs == 0


def test_chat_defaults_and_content_parts():
    req = parse_chat(
        {
            "model": MODEL,
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Hello"},
                        {"type": "text", "text": "world"},
                    ],
                },
                {"role": "assistant", "content": None},
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ],
        },
        MODEL,
    )
    assert req.text is None and req.input_ids is None
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello\nworld"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert req.params.max_new_tokens is None  # until the context is full: the tokenizer resolves it
    assert req.chat_kwargs == {"add_generation_prompt": True}
    assert not req.params.logprobs


def test_chat_fields():
    req = parse_chat(
        chat(
            max_tokens=10,
            max_completion_tokens=20,
            logprobs=True,
            top_logprobs=5,
            chat_template_kwargs={"enable_thinking": False},
            add_generation_prompt=False,
            tools=[],
            tool_choice="none",
            response_format={"type": "text"},
            top_k=5,
            min_p=0.1,
            repetition_penalty=1.2,
            ignore_eos=True,
            priority=3,
        ),
        MODEL,
    )
    p = req.params
    assert p.max_new_tokens == 20  # max_completion_tokens wins
    assert p.logprobs and p.top_logprobs == 5
    assert req.chat_kwargs == {"enable_thinking": False, "add_generation_prompt": False}
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos, req.priority) == (
        5,
        0.1,
        1.2,
        True,
        3,
    )
    assert parse_chat(chat(max_tokens=7), MODEL).params.max_new_tokens == 7


def test_output_constraints():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_chat(
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": True},
            }
        ),
        MODEL,
    )
    assert json.loads(req.params.json_schema) == schema
    assert req.param_names == {"json_schema": "response_format.json_schema.schema"}
    assert json.loads(
        parse_chat(chat(response_format={"type": "json_object"}), MODEL).params.json_schema
    ) == {"type": "object"}
    assert parse_completion(comp(regex=r"\d+"), MODEL).params.constraint == ("regex", r"\d+")
    assert (
        parse_completion(comp(guided_grammar='root ::= "a"'), MODEL).params.ebnf == 'root ::= "a"'
    )
    req = parse_generate(gen(sampling_params={"json_schema": schema}))
    assert json.loads(req.params.json_schema) == schema
    assert req.param_names["json_schema"] == "sampling_params.json_schema"
    assert parse_chat(chat(response_format={"type": "text"}), MODEL).params.constraint is None


def test_constraint_size_limit_names_the_field():
    """--max-constraint-bytes: a larger constraint is a 400 naming the API field it came from,
    a forced tool call's schema included; one of exactly the limit passes."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    size = len(json.dumps(schema))
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    cases = [
        (
            lambda limit: parse_completion(
                comp(json_schema=schema), MODEL, max_constraint_bytes=limit
            ),
            "json_schema",
        ),
        (
            lambda limit: parse_chat(
                chat(
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": schema},
                    }
                ),
                MODEL,
                max_constraint_bytes=limit,
            ),
            "response_format.json_schema.schema",
        ),
        (
            lambda limit: parse_chat(
                chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}}),
                MODEL,
                max_constraint_bytes=limit,
            ),
            "tools.0.function.parameters",
        ),
        (
            lambda limit: parse_generate(
                gen(sampling_params={"regex": "a" * (size % 2) + "é" * (size // 2)}),
                max_constraint_bytes=limit,
            ),
            "sampling_params.regex",
        ),  # bytes: 2 per é
    ]
    for parse, param in cases:
        assert parse(size).params.constraint is not None
        with pytest.raises(ProtocolError) as info:
            parse(size - 1)
        assert (info.value.status, info.value.param) == (400, param)
        assert info.value.message.startswith(
            f"{param} must be at most {size - 1} bytes (--max-constraint-bytes)"
        )


def test_generate():
    req = parse_generate(
        {
            "input_ids": [1, 2, 3],
            "rid": "abc",
            "stream": True,
            "priority": 2,
            "return_logprob": True,
            "top_logprobs_num": 4,
            "logprob_start_len": 0,
            "sampling_params": {
                "max_new_tokens": 8,
                "temperature": 0,
                "sampling_seed": 9,
                "top_k": 1,
                "stop": "x",
                "n": 2,
                "ignore_eos": None,
            },
        }
    )
    p = req.params
    assert (req.input_ids, req.text, req.rid, req.stream, req.priority, req.n) == (
        [1, 2, 3],
        None,
        "abc",
        True,
        2,
        2,
    )
    assert (
        p.max_new_tokens,
        p.temperature,
        p.seed,
        p.top_k,
        p.stop,
        p.logprobs,
        p.top_logprobs,
    ) == (8, 0.0, 9, 1, ["x"], True, 4)
    default = parse_generate({"text": "hi"})
    assert (
        default.params.max_new_tokens == 128 and default.rid is None and not default.params.logprobs
    )
    assert (
        parse_generate(gen(top_logprobs_num=3)).params.top_logprobs == 0
    )  # ignored without return_logprob


def test_generate_batch_gives_each_prompt_its_values_and_names():
    """A list-valued field is one value per prompt, a single value every prompt's; each prompt's
    pipeline refusals (the tokenizer's `prompt`, a grammar's field) name its own item."""
    batch = parse_generate_body(
        {
            "text": ["a", "b"],
            "sampling_params": [{"temperature": 0, "regex": "x+"}, {"max_new_tokens": 3}],
            "return_logprob": [True, False],
            "top_logprobs_num": 2,
            "rid": ["r0", "r1"],
            "priority": 4,
            "stream": True,
        }
    )
    first, second = batch.prompts
    assert (first.text, second.text) == ("a", "b")
    assert (first.params.temperature, second.params.temperature) == (0.0, 1.0)
    assert (first.params.max_new_tokens, second.params.max_new_tokens) == (128, 3)
    assert (first.params.top_logprobs, first.params.logprobs, second.params.logprobs) == (
        2,
        True,
        False,
    )
    assert (first.rid, second.rid, batch.own_rids, batch.rid, batch.stream) == (
        "r0",
        "r1",
        True,
        None,
        True,
    )
    assert first.priority == second.priority == 4
    assert first.param_names["regex"] == "sampling_params[0].regex"
    assert (second.param_names["prompt"], second.param_names["rid"]) == ("text[1]", "rid[1]")
    assert second.param_names["max_tokens"] == "sampling_params[1].max_new_tokens"

    shared = parse_generate_body(
        {"input_ids": [[1, 2], [3]], "sampling_params": {"n": 2, "top_k": 1}, "rid": "b"}
    )
    assert [p.input_ids for p in shared.prompts] == [[1, 2], [3]]
    assert [(p.n, p.params.top_k, p.rid) for p in shared.prompts] == [(2, 1, None)] * 2
    assert (shared.rid, shared.own_rids) == ("b", False)
    assert shared.prompts[1].param_names["prompt"] == "input_ids[1]"
    assert shared.prompts[1].param_names["max_tokens"] == "sampling_params.max_new_tokens"
    alone = parse_generate_body({"text": "a"})
    assert (alone.param_names["prompt"], alone.param_names["max_tokens"]) == (
        "text",
        "sampling_params.max_new_tokens",
    )


# ---------------------------------------------------------------- responses --------------

LOGPROBS = [
    [11, "Hel", -0.5, [[11, "Hel", -0.5], [12, "He", -1.5]]],
    [13, "lo", -float("inf"), [[13, "lo", -0.1], [14, "lo", -2.0]]],
]


def out(
    text: str,
    ids: list[int],
    finish: str | None = None,
    matched=None,
    logprobs=None,
    prompt: int = 0,
    completion: int | None = None,
    cached: int = 0,
) -> RequestOutput:
    """A detokenized record; logprobs as [id, text, logprob, [[id, text, logprob], ...]] entries."""
    r = RequestOutput(
        "r",
        list(ids),
        finish_reason=finish,
        matched_stop=matched,
        prompt_tokens=prompt,
        completion_tokens=len(ids) if completion is None else completion,
        cached_tokens=cached,
        text=text,
    )
    if logprobs is not None:
        r.logprobs = [e[2] for e in logprobs]
        r.token_texts = [e[1] for e in logprobs]
        r.top_logprobs = [[[t[0] for t in e[3]], [t[2] for t in e[3]]] for e in logprobs]
        r.top_texts = [[t[1] for t in e[3]] for e in logprobs]
    return r


def test_completion_response_shape_and_openai_model():
    choices = [
        out("Hello", [11, 13], "stop", "\n", LOGPROBS, prompt=5, completion=2, cached=2),
        out("Hi", [15], "length", prompt=5),
    ]
    body = completion_response("cmpl-1", 1700000000, MODEL, choices)
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "text_completion"
    assert set(body["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hel", "lo"] and lp["text_offset"] == [0, 3]
    assert lp["token_logprobs"] == [-0.5, -9999.0]  # -inf is not JSON
    assert lp["top_logprobs"][1] == {"lo": -0.1}  # on a text clash the likelier one stays
    assert body["choices"][1]["logprobs"] is None
    json.loads(json.dumps(body, allow_nan=False))
    parsed = Completion.model_validate(body)
    assert parsed.choices[0].text == "Hello" and parsed.usage.total_tokens == 8
    assert parsed.usage.prompt_tokens_details.cached_tokens == 2


def test_completion_chunks_and_usage_chunk():
    first = completion_chunk("cmpl-1", 1, MODEL, 0, out("Hel", [11], logprobs=LOGPROBS[:1]))
    last = completion_chunk(
        "cmpl-1", 1, MODEL, 0, out("lo", [13], "length", logprobs=LOGPROBS[1:]), text_offset=3
    )
    assert first["object"] == "text_completion" and first["choices"][0]["finish_reason"] is None
    assert last["choices"][0]["logprobs"]["text_offset"] == [3]
    Completion.model_validate(last)
    usage = usage_chunk("completion", "cmpl-1", 1, MODEL, Usage(4, 2))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 6
    Completion.model_validate(usage)


def test_chat_response_shape_and_openai_model():
    body = chat_response(
        "chatcmpl-1", 2, MODEL, [out("Hello", [11, 13], "stop", None, LOGPROBS, prompt=7)]
    )
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
    assert choice["message"] == {"role": "assistant", "content": "Hello"}
    entry = choice["logprobs"]["content"][0]
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert entry["bytes"] == list(b"Hel") and len(entry["top_logprobs"]) == 2
    assert choice["logprobs"]["content"][1]["logprob"] == -9999.0
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "Hello" and parsed.usage.total_tokens == 9
    plain = chat_response("c", 2, MODEL, [out("x", [], "length", prompt=1, completion=1)])
    assert plain["choices"][0]["logprobs"] is None
    ChatCompletion.model_validate(plain)


def test_chat_chunks():
    first = chat_chunk("c", 3, MODEL, 0, out("He", [1]), first=True)
    mid = chat_chunk("c", 3, MODEL, 0, out("llo", [2], logprobs=LOGPROBS[1:]), first=False)
    end = chat_chunk("c", 3, MODEL, 0, out("", [], "stop"), first=False)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert mid["choices"][0]["delta"] == {"content": "llo"}
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    for chunk in (first, mid, end, usage_chunk("chat", "c", 3, MODEL, Usage(1, 2))):
        ChatCompletionChunk.model_validate(chunk)


def test_openai_client_reads_our_stream():
    chunks = [
        chat_chunk("c", 3, MODEL, 0, out("Hé", [1]), first=True),
        chat_chunk("c", 3, MODEL, 0, out("llo", [2], "stop"), first=False),
        usage_chunk("chat", "c", 3, MODEL, Usage(4, 2, 1)),
    ]
    payload = b"".join(sse(c) for c in chunks) + SSE_DONE

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=payload, headers={"content-type": "text/event-stream"})

    client = openai.OpenAI(
        api_key="x",
        base_url="http://relay/v1",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    got = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == "Héllo"
    assert (
        got[-1].usage.total_tokens == 6 and got[-1].usage.prompt_tokens_details.cached_tokens == 1
    )


def test_generate_response():
    body = generate_response(
        "r1", out("Hello", [11, 13], "stop", "\n", LOGPROBS, prompt=5, cached=1)
    )
    assert body["text"] == "Hello" and body["output_ids"] == [11, 13]
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": "\n"}
    assert (
        meta["id"],
        meta["prompt_tokens"],
        meta["completion_tokens"],
        meta["cached_tokens"],
    ) == ("r1", 5, 2, 1)
    assert meta["output_token_logprobs"] == [[-0.5, 11, "Hel"], [-9999.0, 13, "lo"]]
    assert meta["output_top_logprobs"][0] == [[-0.5, 11, "Hel"], [-1.5, 12, "He"]]
    running = generate_response("r1", out("He", [11], prompt=5))["meta_info"]
    assert running["finish_reason"] is None and "output_token_logprobs" not in running
    length = generate_response("r1", out("x", [1, 2], "length", prompt=5))["meta_info"]
    assert length["finish_reason"] == {"type": "length", "length": 2}
    abort = generate_response("r1", out("", [], "abort", prompt=5))["meta_info"]
    assert abort["finish_reason"]["type"] == "abort"


def test_abort_finish_reason_passes_through():
    body = completion_response("c", 1, MODEL, [out("", [], "abort", prompt=1)])
    assert body["choices"][0]["finish_reason"] == "abort"


def test_usage_of_choices():
    """The shared prompt counts once and completions add up."""
    u = Usage.of(
        [out("", [1, 2, 3], prompt=10, cached=4), out("", [4] * 5, prompt=10, cached=8), None]
    )
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (10, 8, 8)
    assert u.to_openai()["total_tokens"] == 18


def test_records_merge_with_extend():
    """The one merge rule: later tokens, text and logprobs follow; the finish and counts of
    the later record win."""
    a = out("Hel", [11], logprobs=LOGPROBS[:1], prompt=5, completion=1)
    a.extend(out("lo", [13], "stop", "\n", LOGPROBS[1:], prompt=5, completion=2))
    assert (a.text, a.token_ids, a.finish_reason, a.matched_stop, a.completion_tokens) == (
        "Hello",
        [11, 13],
        "stop",
        "\n",
        2,
    )
    assert (
        a.token_texts == ["Hel", "lo"]
        and a.logprobs == [-0.5, -float("inf")]
        and len(a.top_logprobs) == 2
    )


def test_sse():
    frame = sse({"text": "é", "n": 1})
    assert frame == 'data: {"text":"é","n":1}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert math.isclose(json.loads(frame[6:])["n"], 1)


# ---------------------------------------------------------------- hardening --------------

VOCAB = 1000
VOCAB_PARSERS = {
    "completion": lambda body: parse_completion(body, MODEL, vocab_size=VOCAB),
    "chat": lambda body: parse_chat(body, MODEL, vocab_size=VOCAB),
    "generate": lambda body: parse_generate(body, vocab_size=VOCAB),
}


@pytest.mark.parametrize(
    "kind, body, param",
    [
        ("completion", comp(stop_token_ids=[1, 10**9], min_tokens=2), "stop_token_ids"),
        ("completion", comp(prompt=[1, VOCAB]), "prompt"),
        ("chat", chat(stop_token_ids=[VOCAB]), "stop_token_ids"),
        ("generate", {"input_ids": [VOCAB + 5]}, "input_ids"),
        (
            "generate",
            gen(sampling_params={"stop_token_ids": [VOCAB]}),
            "sampling_params.stop_token_ids",
        ),
        ("completion", comp(logit_bias={str(VOCAB): 5}), "logit_bias"),
        ("chat", chat(logit_bias={"0": 1, str(VOCAB + 7): -5}), "logit_bias"),
        (
            "generate",
            gen(sampling_params={"logit_bias": {str(VOCAB): 1}}),
            "sampling_params.logit_bias",
        ),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_at_the_door(kind, body, param):
    """An out-of-vocabulary stop id once reached the sampler and failed every request in the
    batch (and with --tp 2 killed the server)."""
    with pytest.raises(ProtocolError) as e:
        VOCAB_PARSERS[kind](body)
    assert (e.value.status, e.value.param) == (400, param)


def test_logit_bias_parses_to_token_ids_and_names_the_id_outside_the_vocabulary():
    for parsed in (
        parse_completion(
            comp(logit_bias={"0": -100, str(VOCAB - 1): 100, "7": 2.5}), MODEL, vocab_size=VOCAB
        ),
        parse_chat(
            chat(logit_bias={"0": -100, str(VOCAB - 1): 100, "7": 2.5}), MODEL, vocab_size=VOCAB
        ),
        parse_generate(
            gen(sampling_params={"logit_bias": {"0": -100, str(VOCAB - 1): 100, "7": 2.5}}),
            vocab_size=VOCAB,
        ),
    ):
        assert parsed.params.logit_bias == {0: -100.0, VOCAB - 1: 100.0, 7: 2.5}
    assert parse_chat(chat(logit_bias={}), MODEL).params.logit_bias == {}
    with pytest.raises(ProtocolError) as e:
        parse_chat(chat(logit_bias={"99999": 1}), MODEL, vocab_size=49152)
    assert e.value.message == "logit_bias: token id 99999 is outside the vocabulary (49152)"


def test_token_ids_inside_the_vocabulary_pass():
    assert parse_completion(
        comp(prompt=[0, VOCAB - 1], stop_token_ids=[VOCAB - 1]), MODEL, vocab_size=VOCAB
    ).input_ids == [0, VOCAB - 1]
    assert parse_generate(
        {"input_ids": [VOCAB - 1], "sampling_params": {"stop_token_ids": [0]}}, vocab_size=VOCAB
    ).params.stop_token_ids == [0]


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"prompt": "\\ud800"}', "prompt"),
        (b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages.0.content"),
        (b'{"prompt": "x", "stop": ["ok", "\\ud83d"]}', "stop.1"),
        (b'{"text": "x", "rid": "\\ud800"}', "rid"),
        (b'{"\\ud800": 1}', None),
    ],
)
def test_text_that_is_not_valid_unicode_is_refused_naming_the_field(raw, param):
    with pytest.raises(ProtocolError) as e:
        decode_json_body(raw)
    assert (e.value.status, e.value.param) == (400, param)
    assert decode_json_body(b'{"prompt": "\\ud83d\\ude00 ok"}') == {"prompt": "\U0001f600 ok"}


@pytest.mark.parametrize(
    "raw,param",
    [
        (
            b'{"messages": [], "chat_template_kwargs": {"x": 1180591620717411303424}}',
            "chat_template_kwargs.x",
        ),
        (b'{"prompt": "x", "seed": -9223372036854775809}', "seed"),
        (
            b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
            None,
        ),  # past Python's 4,300-digit limit
    ],
)
def test_integers_the_wire_cannot_carry_are_refused_naming_the_field(raw, param):
    """msgpack carries 64-bit integers: a larger one in a field passed through whole was a 500."""
    with pytest.raises(ProtocolError) as e:
        decode_json_body(raw)
    assert (e.value.status, e.value.param) == (400, param)
    assert decode_json_body(b'{"seed": 18446744073709551615, "x": -9223372036854775808}')


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 100_000])
def test_deeply_nested_json_is_a_400_not_a_crash(depth):
    with pytest.raises(ProtocolError) as e:
        decode_json_body(b"[" * depth + b"]" * depth)
    assert e.value.status == 400 and "deeper" in e.value.message
    assert decode_json_body(b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1))


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"{not json", b""])
def test_undecodable_bodies_are_400(raw):
    with pytest.raises(ProtocolError) as e:
        decode_json_body(raw)
    assert e.value.status == 400


@pytest.mark.parametrize("body", [[1, 2], "rid", None, {"rid": ""}, {"rid": 5}, {}])
def test_abort_request_body_must_name_a_rid(body):
    with pytest.raises(ProtocolError) as e:
        parse_abort(body)
    assert e.value.status == 400
    assert parse_abort({"rid": "abc"}) == "abc"


# ---------------------------------------------------------------- tool calls -------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}  # no parameters


def test_tools_reach_the_template_and_tool_choice_picks_the_mode():
    req = parse_chat(chat(tools=[WEATHER, CLOCK]), MODEL)
    assert (req.tools.mode, req.tools.named) == ("auto", None)  # auto is the default with tools
    assert req.chat_kwargs["tools"] == [WEATHER, CLOCK]
    assert req.params.constraint is None and req.param_names == {}
    for none in (
        chat(tools=[WEATHER], tool_choice="none"),
        chat(tools=[]),
        chat(tool_choice="auto"),
    ):
        req = parse_chat(none, MODEL)
        assert (
            req.tools is None and "tools" not in req.chat_kwargs and req.params.constraint is None
        )
    # auto leaves a client's own constraint in charge (its output is content)
    req = parse_chat(chat(tools=[WEATHER], response_format={"type": "json_object"}), MODEL)
    assert req.tools.mode == "auto" and req.params.json_schema == '{"type": "object"}'


def test_required_tool_choice_constrains_to_a_list_of_calls():
    req = parse_chat(chat(tools=[WEATHER, CLOCK], tool_choice="required"), MODEL)
    assert req.tools.mode == "required" and req.param_names == {"json_schema": "tools"}
    call = {"type": "object", "required": ["name", "parameters"], "additionalProperties": False}
    assert json.loads(req.params.json_schema) == {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    **call,
                    "properties": {
                        "name": {"const": "get_weather"},
                        "parameters": WEATHER["function"]["parameters"],
                    },
                },
                {
                    **call,
                    "properties": {"name": {"const": "now"}, "parameters": {"type": "object"}},
                },
            ]
        },
    }
    one = parse_chat(chat(tools=[CLOCK], tool_choice="required"), MODEL)
    assert json.loads(one.params.json_schema)["items"]["properties"]["name"] == {"const": "now"}


def test_named_tool_choice_constrains_to_its_parameters():
    named = {"type": "function", "function": {"name": "get_weather"}}
    req = parse_chat(chat(tools=[CLOCK, WEATHER], tool_choice=named), MODEL)
    assert (req.tools.mode, req.tools.named) == ("named", "get_weather")
    assert json.loads(req.params.json_schema) == WEATHER["function"]["parameters"]
    assert req.param_names == {"json_schema": "tools.1.function.parameters"}
    clock = parse_chat(
        chat(tools=[CLOCK], tool_choice={"type": "function", "function": {"name": "now"}}), MODEL
    )
    assert json.loads(clock.params.json_schema) == {"type": "object"}


def test_tool_call_history_reaches_the_template_in_hf_shape():
    req = parse_chat(
        chat(
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        },
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "now", "arguments": "not json"},
                        },
                    ],
                },
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
            ],
            tools=[WEATHER, CLOCK],
        ),
        MODEL,
    )
    assistant = req.messages[1]
    assert assistant["content"] == ""
    assert assistant["tool_calls"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            "id": "call_1",
        },
        {"type": "function", "function": {"name": "now", "arguments": "not json"}, "id": "call_2"},
    ]
    assert req.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    # Qwen2.5-style templates write `arguments | tojson`: a dict renders as the JSON it was sent as
    template = jinja2.Environment().from_string(
        '{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
        "{% endfor %}"
    )
    assert template.render(m=assistant).startswith(
        '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    )


QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
AUTO_OUTPUTS = [
    # (text, finish, content, [(name, arguments)], finish_reason)
    (QWEN_CALL, "stop", None, [("get_weather", '{"city": "Paris", "unit": "c"}')], "tool_calls"),
    (
        "Let me look that up.\n\n" + QWEN_CALL,
        "stop",
        "Let me look that up.",
        [("get_weather", '{"city": "Paris", "unit": "c"}')],
        "tool_calls",
    ),
    (
        QWEN_CALL + "\n" + '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        "stop",
        None,
        [("get_weather", '{"city": "Paris", "unit": "c"}'), ("now", "{}")],
        "tool_calls",
    ),
    (
        "A\n" + QWEN_CALL + "\nB",
        "stop",
        "A\n\nB",
        [("get_weather", '{"city": "Paris", "unit": "c"}')],
        "tool_calls",
    ),
    (
        'Write <tool_call>{"name": oops}</tool_call> to call.',
        "stop",
        'Write <tool_call>{"name": oops}</tool_call> to call.',
        [],
        "stop",
    ),
    (
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        "stop",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        [],
        "stop",
    ),
    (
        'Cut: <tool_call>\n{"name": "get_weather", "argu',
        "length",
        'Cut: <tool_call>\n{"name": "get_weather", "argu',
        [],
        "length",
    ),
    (
        QWEN_CALL + '\n<tool_call>\n{"name"',
        "length",
        '<tool_call>\n{"name"',
        [("get_weather", '{"city": "Paris", "unit": "c"}')],
        "length",
    ),
    (
        '<tool_call>{"name": "f", "arguments": "{\\"q\\": \\"é\\"}"}</tool_call>',
        "stop",
        None,
        [("f", '{"q": "é"}')],
        "tool_calls",
    ),
    ("  The answer is 4 <tool> a < b\n", "stop", "The answer is 4 <tool> a < b", [], "stop"),
    ("ends in a partial tag <tool_ca", "stop", "ends in a partial tag <tool_ca", [], "stop"),
    ("\n \n", "stop", None, [], "stop"),
]


def _auto():
    return parse_chat(chat(tools=[WEATHER, CLOCK]), MODEL).tools


@pytest.mark.parametrize("text,finish,content,calls,reason", AUTO_OUTPUTS)
def test_auto_mode_parses_tagged_calls_out_of_the_text(text, finish, content, calls, reason):
    out = parse_output(_auto(), text, finish)
    assert out.content == content
    assert [(c.name, c.arguments) for c in out.tool_calls] == calls
    assert out.finish_reason == reason
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in out.tool_calls)


@pytest.mark.parametrize("text,finish,content,calls,reason", AUTO_OUTPUTS)
def test_the_stream_parser_fed_random_pieces_agrees_with_the_whole_text_parser(
    text, finish, content, calls, reason
):
    rng = random.Random(len(text))
    for _ in range(20):
        stream, pieces, at = OutputStream(_auto()), [], 0
        while at < len(text):
            step = rng.randint(1, 8)
            pieces += stream.feed(text[at : at + step])
            at += step
        rest, got_reason = stream.finish(finish)
        pieces += rest
        got_content, got_calls = assemble(pieces)
        assert (got_content or None) == content and got_reason == reason
        assert [(c.name, c.arguments) for c in got_calls] == calls
        assert [p.index for p in pieces if isinstance(p, CallStart)] == list(range(len(calls)))


def test_auto_stream_holds_back_only_what_may_open_a_block():
    stream = OutputStream(_auto())
    assert stream.feed("Hello wor") == ["Hello wor"]
    assert stream.feed("ld <tool") == ["ld"]  # the space waits for what follows it
    assert stream.feed("s are fun") == [" <tools are fun"]


def test_constrained_outputs_parse_into_calls_or_stay_content():
    required = parse_chat(chat(tools=[WEATHER, CLOCK], tool_choice="required"), MODEL).tools
    out = parse_output(
        required,
        '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": '
        '{"city": "Oslo"}}]',
        "stop",
    )
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("now", "{}"),
        ("get_weather", '{"city": "Oslo"}'),
    ]
    assert (out.content, out.finish_reason) == (None, "tool_calls")
    cut = parse_output(required, '[{"name": "get_weather", "parameters": {"ci', "length")
    assert (cut.content, cut.tool_calls, cut.finish_reason) == (
        '[{"name": "get_weather", "parameters": {"ci',
        [],
        "length",
    )
    named = parse_chat(
        chat(
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
        ),
        MODEL,
    ).tools
    out = parse_output(named, '{"city": "Zürich", "unit": "c"}', "stop")
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", '{"city": "Zürich", "unit": "c"}')
    ]
    assert out.finish_reason == "tool_calls"


def _stream_records(texts: list[str], finish: str) -> list[RequestOutput]:
    return [out(t, [i], finish if i == len(texts) - 1 else None) for i, t in enumerate(texts)]


@pytest.mark.parametrize(
    "tool_choice,texts",
    [
        (
            "auto",
            [
                "I will check. <tool",
                '_call>\n{"name": "get_weather", ',
                '"arguments": {"city": "Paris"}}',
                '\n</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>',
            ],
        ),
        (
            "required",
            [
                '[{"name": "get_weather", ',
                '"parameters": {"city": "Paris"}}, ',
                '{"name": "now", "parameters": {}}]',
            ],
        ),
    ],
)
def test_openai_client_reassembles_streamed_tool_calls_like_the_whole_response(tool_choice, texts):
    tools = parse_chat(chat(tools=[WEATHER, CLOCK], tool_choice=tool_choice), MODEL).tools
    stream, chunks = ChatOutput(tools, None), []
    for i, r in enumerate(_stream_records(texts, "stop")):
        chunks += parsed_chat_chunks("c", 3, MODEL, 0, r, stream, first=i == 0)
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    streamed = state.get_final_completion().choices[0]
    whole = ChatCompletion.model_validate(
        chat_response("c", 3, MODEL, [out("".join(texts), [1], "stop")], tools)
    )
    whole_choice = whole.choices[0]
    assert streamed.finish_reason == whole_choice.finish_reason == "tool_calls"
    assert (
        [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls]
        == [(c.function.name, c.function.arguments) for c in whole_choice.message.tool_calls]
        == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    )
    assert (streamed.message.content or None) == whole_choice.message.content
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("tool_calls") == 1


# ---- /tokenize, /detokenize --------------------------------------------------------------------
from relay.api.tokenization import TokenizeQuery, parse_detokenize, parse_tokenize  # noqa: E402


def test_tokenize_parses_vllms_text_and_chat_requests():
    assert parse_tokenize({"model": MODEL, "prompt": "Hi"}, MODEL) == TokenizeQuery(
        "tokenize", text="Hi"
    )
    assert parse_tokenize(
        {"prompt": "", "add_special_tokens": False, "return_token_strs": True}, MODEL
    ) == TokenizeQuery("tokenize", text="", add_special_tokens=False, return_token_strs=True)
    chat_q = parse_tokenize(
        {
            "messages": [{"role": "developer", "content": "Be brief."}],
            "add_generation_prompt": False,
            "chat_template_kwargs": {"enable_thinking": False},
        },
        MODEL,
    )
    assert chat_q == TokenizeQuery(
        "tokenize",
        messages=[{"role": "system", "content": "Be brief."}],
        chat_kwargs={"enable_thinking": False, "add_generation_prompt": False},
        add_special_tokens=False,
    )
    cont = parse_tokenize(
        {"messages": [{"role": "assistant", "content": "The"}], "continue_final_message": True},
        MODEL,
    )
    assert cont.chat_kwargs == {"add_generation_prompt": False, "continue_final_message": True}
    tools = parse_tokenize(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        MODEL,
    )
    assert [t["function"]["name"] for t in tools.chat_kwargs["tools"]] == ["f"]
    assert parse_detokenize({"tokens": [0, 5]}, MODEL, 10, 100) == TokenizeQuery(
        "detokenize", tokens=[0, 5]
    )
    assert parse_detokenize({"tokens": []}, MODEL, 10, 100).tokens == []


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a"]}, "prompt"),
        ({"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
        ({"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
        ({"prompt": "a", "model": "other"}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "add_generation_prompt": True,
                "continue_final_message": True,
            },
            "continue_final_message",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {"add_special_tokens": True},
            },
            "chat_template_kwargs.add_special_tokens",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tools": "f"}, "tools"),
    ],
)
def test_tokenize_refusals_name_the_field(body, param):
    with pytest.raises(ProtocolError) as e:
        parse_tokenize(body, MODEL)
    assert e.value.param == param and e.value.status in (400, 404)


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "'tokens' is required"),
        ({"tokens": "1 2"}, "list of token ids"),
        ({"tokens": [1, -1]}, "item 1"),
        ({"tokens": [1, True]}, "item 1"),
        ({"tokens": [10]}, "outside the vocabulary [0, 10)"),
        ({"tokens": [1] * 101}, "at most 100 ids"),
    ],
)
def test_detokenize_refusals_name_tokens(body, message):
    with pytest.raises(ProtocolError) as e:
        parse_detokenize(body, MODEL, 10, 100)
    assert (e.value.status, e.value.param) == (400, "tokens") and message in e.value.message
