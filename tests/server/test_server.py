"""End to end against a real server: real processes, ZeroMQ, HTTP, the default model."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.helpers.server_utils import Server, wait_until

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "The capital of France is",
    "def fib(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Q: What is 2+2?\nA:",
]


@pytest.fixture(scope="module")
def server():
    s = Server("--dtype", "float32", "--kv-cache-gb", "1", "--log-requests", "--log-steps")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def idle_stats(server: Server) -> dict:
    with server.client() as c:
        return c.get("/get_server_info").json()["scheduler"]


def test_models_and_health(server, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    with server.client() as c:
        assert c.get("/health").status_code == 200
        assert c.get("/health_generate").status_code == 200


def test_a_generating_server_refuses_embeddings(server):
    with server.client() as c:
        r = c.post("/v1/embeddings", json={"input": "Hello"})
        assert c.get("/model_info").json()["is_generation"] is True
    assert r.status_code == 400
    assert "--is-embedding" in r.json()["error"]["message"]


def test_completion_greedy_is_sensible_and_matches_generate(server, oai):
    out = oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert "Paris" in out.choices[0].text
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    with server.client() as c:
        native = c.post(
            "/generate",
            json={
                "text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            },
        ).json()
    assert native["text"] == out.choices[0].text
    assert native["meta_info"]["completion_tokens"] == 8


def test_chat_streaming_equals_non_streaming(oai):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    whole = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and "Paris" in text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
        0
    ].finish_reason


def test_completion_stream_n_seed_stop_logprobs(oai):
    a = oai.completions.create(
        model=MODEL,
        prompt="My favourite food is",
        max_tokens=12,
        n=3,
        temperature=1.0,
        seed=7,
        logprobs=2,
    )
    b = oai.completions.create(
        model=MODEL, prompt="My favourite food is", max_tokens=12, n=3, temperature=1.0, seed=7
    )
    assert [c.text for c in a.choices] == [c.text for c in b.choices], "same seed, same output"
    assert len({c.text for c in a.choices}) > 1, "choices of one seeded request differ"
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    # Sampled tokens outside the top 2 come as a third entry (OpenAI's logprobs + 1).
    sizes = []
    for choice in a.choices:
        for token, x, top in zip(
            choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs
        ):
            assert token in top and len(top) in (2, 3) and top[token] == pytest.approx(x)
            sizes.append(len(top))
    assert 3 in sizes
    stopped = oai.completions.create(
        model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=30, temperature=0, stop=[" 6"]
    )
    assert stopped.choices[0].finish_reason == "stop" and " 6" not in stopped.choices[0].text
    assert stopped.choices[0].text.strip().startswith("4")


def test_32_concurrent_streams(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=16, temperature=0, stream=True
        )
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run())
    assert all(reason in ("stop", "length") and text for text, reason in results)
    stats = wait_until(lambda: (s := idle_stats(server))["num_running"] == 0 and s, 30, "idle")
    assert stats["kv_locked_tokens"] == 0


def test_disconnect_aborts_and_frees_kv(server):
    body = {
        "prompt": "Tell me a long story.",
        "max_tokens": 4000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert got
        assert idle_stats(server)["num_running"] == 1
    # Leaving the block closed the connection mid-stream.
    stats = wait_until(
        lambda: (s := idle_stats(server))["num_running"] == 0 and s,
        15,
        "the abort to free the request",
    )
    assert stats["num_waiting"] == 0 and stats["kv_locked_tokens"] == 0


def test_abort_request_endpoint(server):
    rid = "test-abort-endpoint"
    body = {
        "text": "Write an essay.",
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0},
    }
    with server.client() as c, c.stream("POST", "/generate", json=body) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: {"))
        assert json.loads(next(lines)[5:])["meta_info"]["id"] == rid
        found = c.post("/abort_request", json={"rid": rid}).json()["found"]
        assert found, server.log
        last = list(lines)[-1]
    assert json.loads(last[5:])["meta_info"]["finish_reason"]["type"] == "abort"
    assert idle_stats(server)["kv_locked_tokens"] == 0


LONG = "hello " * 9000  # > 8192 tokens: longer than the context
BAD_SCHEMA = {"type": "objec"}  # found by the scheduler's grammar compile
# Over the default --max-constraint-bytes (128 KiB).
HUGE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(6000)}}
# Objects nested 800 deep (43 KB, 1601 levels of JSON: over the default --max-constraint-depth, 128):
# 54 s to compile.
# 2,000 optional properties in one object (over the default --max-constraint-properties, 128):
# 13 s to compile.
WIDE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}
DEEP_SCHEMA = (
    '{"type":"object","properties":{"a":' * 800 + '{"type":"string"}' + '},"required":["a"]}' * 800
)

BAD_INPUTS = [
    ("/v1/completions", b"{not json", "invalid JSON", None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', "invalid UTF-8", None),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": "10"},
        "wrong type",
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": -5},
        "negative",
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 10**9},
        "absurd",
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 9000},
        "past the context",
        "max_tokens",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": LONG}, "prompt too long", "prompt"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "temperature": -0.1},
        "temperature < 0",
        "temperature",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p 0", "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p > 1", "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "empty prompt", "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, "unknown model", "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 1000}, "n too large", "n"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": [1, 2, 10**7]},
        "token id past the vocabulary",
        "prompt",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": [1, -2]}, "negative token id", "prompt"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": ["hi", [1, 10**7]]},
        "a prompt list's token id past the vocabulary",
        "prompt[1]",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": ["hi"] * 257},
        "more prompts than allowed",
        "prompt",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": ["hi", "there", LONG]},
        "a prompt list's prompt too long",
        "prompt[2]",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "no messages", "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
        "bad content",
        "messages.0.content",
    ),
    ("/generate", {"text": "hi", "input_ids": [1]}, "text and input_ids", None),
    (
        "/generate",
        {"text": "hi there", "return_logprob": True, "logprob_start_len": 1000},
        "logprob_start_len past the prompt",
        "logprob_start_len",
    ),
    (
        "/generate",
        {"text": "hi", "return_logprob": True, "top_logprobs_num": 21},
        "top_logprobs_num too large",
        "top_logprobs_num",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "prompt_logprobs": 21},
        "prompt_logprobs too large",
        "prompt_logprobs",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": -1},
        "negative logprobs",
        "logprobs",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
        "negative tokens",
        "sampling_params.max_new_tokens",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objec"}},
            },
        },
        "invalid response schema",
        "response_format.json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
        },
        "invalid tool schema, required",
        "tools",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
        },
        "invalid tool schema, named",
        "tools.0.function.parameters",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"regex": "(unclosed"}},
        "invalid regex",
        "sampling_params.regex",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"ebnf": "root ::= root"}},
        "grammar matching nothing",
        "sampling_params.ebnf",
    ),
    # Its first token is allowed, then nothing: the request ends mid-output.
    (
        "/generate",
        {
            "text": "Say a:",
            "sampling_params": {"ebnf": 'root ::= "a" x\nx ::= x', "max_new_tokens": 8},
        },
        "grammar dead end",
        "sampling_params.ebnf",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "json_schema": HUGE_SCHEMA},
        "constraint too large",
        "json_schema",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": HUGE_SCHEMA},
            },
        },
        "response schema too large",
        "response_format.json_schema.schema",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"json_schema": DEEP_SCHEMA}},
        "schema nested too deep",
        "sampling_params.json_schema",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": WIDE_SCHEMA}}],
        },
        "tool schema too wide",
        "tools.0.function.parameters",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "function_call": "auto"},
        "legacy function_call",
        "function_call",
    ),
]


@pytest.mark.parametrize("path,body,why,param", BAD_INPUTS, ids=[b[2] for b in BAD_INPUTS])
def test_bad_input_gets_4xx_naming_the_field(server, path, body, why, param):
    with server.client() as c:
        if isinstance(body, bytes):
            r = c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = c.post(path, json=body)
    assert 400 <= r.status_code < 500, (why, r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"]
    if param is not None:
        assert err["param"] == param, (why, err)


def test_bad_stream_request_gets_status_not_stream(server):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": LONG, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_server_healthy_after_bad_inputs_and_metrics(server, oai):
    out = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2
    with server.client() as c:
        text = c.get("/metrics").text
    for name in (
        "relay:time_to_first_token_seconds",
        "relay:inter_token_latency_seconds",
        "relay:e2e_request_latency_seconds",
        "relay:num_running_reqs",
        "relay:prefix_cache_hit_rate",
        "relay:generation_tokens_total",
    ):
        assert name in text
    assert "request rid=" in server.log and "output_ids=[" in server.log  # --log-requests
    assert re.search(
        r"step \d+: prompt chunks 1 \(\d+ tokens over \d+ cached\), decodes 0", server.log
    )  # --log-steps
    assert re.search(
        r"step \d+: prompt chunks 0 \(0 tokens over 0 cached\), decodes 1, running 1", server.log
    )


def test_prefix_cache_reported(server):
    prompt = "You are a helpful assistant. " * 20 + "Say hi."
    with server.client() as c:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        c.post("/generate", json=body)
        second = c.post("/generate", json=body).json()
        page = c.get("/get_server_info").json()["scheduler"]["page_size"]
        # every whole page but the one holding the last prompt token (recomputed for its logits)
        prompt_tokens = second["meta_info"]["prompt_tokens"]
        assert second["meta_info"]["cached_tokens"] == (prompt_tokens - 1) // page * page > 0
        assert c.post("/flush_cache").json()["success"]
        third = c.post("/generate", json=body).json()
    assert third["meta_info"]["cached_tokens"] == 0


def test_openai_client_errors_are_typed(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="hi")


def test_overload_answers_503():
    s = Server(
        "--load-format",
        "dummy-null",
        "--max-queued-requests",
        "2",
        "--context-length",
        "100000",
        "--api-key",
        "sekret",
    )
    try:
        auth = {"Authorization": "Bearer sekret"}
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.get("/health").status_code == 200  # /health needs no key
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get("/v1/models", headers=auth).status_code == 200
            body = {"prompt": "hi", "max_tokens": 90000, "ignore_eos": True, "stream": True}
            with (
                c.stream("POST", "/v1/completions", json=body, headers=auth) as r1,
                c.stream("POST", "/v1/completions", json=body, headers=auth) as r2,
            ):
                assert r1.status_code == 200 and r2.status_code == 200
                r3 = httpx.post(
                    s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, headers=auth
                )
                assert r3.status_code == 503 and r3.json()["error"]["message"]
            # both streams closed: their requests are aborted and the server takes work again
            wait_until(
                lambda: (
                    c.get("/get_server_info", headers=auth).json()["scheduler"]["num_running"] == 0
                ),
                15,
                "aborted streams to end",
            )
            ok = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}, headers=auth)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
            # Overlap is on, and the depth it reports follows its rule from the averages it
            # reports (which depth that is depends on the host's load: without a model a step is
            # as short as the scheduler's work on a quiet host, and overlaps; the rule itself:
            # test_scheduler's OverlapPolicy tests)
            overlap = c.get("/get_server_info", headers=auth).json()["scheduler"]["overlap"]
            pays = overlap["busy_ms"] >= overlap["min_share"] * overlap["step_ms"]
            assert overlap["enabled"] and overlap["depth"] == (2 if pays else 1), overlap
    finally:
        s.stop()


# ---- structured output and tool calls ------------------------------------------------------

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER_PARAMS,
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _weather_call(oai, tool_choice, **kw):
    return oai.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=60,
        **kw,
    )


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_call_validates_and_streams_the_same_call(oai, tool_choice):
    whole = _weather_call(oai, tool_choice).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
    calls = whole.message.tool_calls
    assert calls and all(
        c.function.name == "get_weather" and c.id.startswith("call_") for c in calls
    )
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    state = ChatCompletionStreamState()
    for chunk in _weather_call(oai, tool_choice, stream=True):
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_auto_tools_and_call_history_on_a_template_without_tool_support(oai):
    # SmolLM2's template ignores `tools`: rendering them must still work, and the answer is text.
    history = [
        *ASK_WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."},
    ]
    out = oai.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER_TOOL], temperature=0, max_tokens=8
    ).choices[0]
    assert (
        out.finish_reason in ("stop", "length")
        and out.message.content
        and out.message.tool_calls is None
    )


def test_chat_response_format_json_schema_validates(oai):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    }
    out = oai.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=40,
        messages=[{"role": "user", "content": "Invent a person: give a name and an age."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema},
        },
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_generate_regex_output_matches(server):
    pattern = r"(yes|no), because [a-z]{1,12}\."
    with server.client() as c:
        r = c.post(
            "/generate",
            json={
                "text": "Is the sky blue? Answer:",
                "sampling_params": {"regex": pattern, "max_new_tokens": 16, "temperature": 0},
            },
        ).json()
    assert r["meta_info"]["finish_reason"]["type"] == "stop", r
    assert re.fullmatch(pattern, r["text"]), r["text"]


def slow_schema(tag: int) -> str:
    """20 objects of 128 optional string properties each: within the default limits (70 KB, 5
    levels deep, 128 optional properties per object), yet seconds to compile (4.1 s on the
    2-core box at load 8; nesting or breadth that costs as much in one object is refused at the
    door by --max-constraint-depth / --max-constraint-properties). tag makes each one distinct."""
    inner = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(128)}}
    return json.dumps({"type": "object", "properties": {f"o{j}_{tag}": inner for j in range(20)}})


def test_compiling_grammars_do_not_hold_up_a_plain_request(server):
    """Ten distinct slow-to-compile schemas reach the scheduler first; a plain completion sent
    after them finishes before any of their grammars has compiled (nothing parses or compiles on
    a process's loop). Their clients then leave: the compiles not started are dropped, and the
    requests and what they held are gone."""

    async def server_stats(c: httpx.AsyncClient) -> dict:
        return (await c.get("/get_server_info")).json()["scheduler"]

    async def run() -> tuple[httpx.Response, dict, dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            before = (await server_stats(c))["grammar"]
            slow = [
                asyncio.create_task(
                    c.post(
                        "/v1/chat/completions",
                        json={
                            "model": MODEL,
                            "messages": [{"role": "user", "content": "JSON, please."}],
                            "max_tokens": 4,
                            "json_schema": slow_schema(i),
                        },
                    )
                )
                for i in range(10)
            ]

            async def all_at_the_scheduler() -> None:
                while (await server_stats(c))["num_waiting"] < 10:
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(
                all_at_the_scheduler(), 60
            )  # a tokenizer parsing them never gets there
            plain = await c.post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": "The capital of France is",
                    "max_tokens": 4,
                    "temperature": 0,
                },
            )
            during = await server_stats(c)
            for task in slow:
                task.cancel()
            await asyncio.gather(*slow, return_exceptions=True)
        return plain, before, during

    plain, before, during = asyncio.run(run())
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 4
    assert during["grammar"]["compiles"] == before["compiles"] and during["num_waiting"] == 10
    stats = wait_until(
        lambda: (
            (s := idle_stats(server))["num_waiting"] == 0
            and s["grammar"]["live_matchers"] == 0
            and s
        ),
        30,
        "the leaving clients' requests to end",
    )
    assert stats["grammar"]["compiles_cancelled"] > before["compiles_cancelled"]
    assert stats["num_running"] == 0 and stats["kv_locked_tokens"] == 0


def test_constrained_stream_disconnect_frees_its_matcher_and_kv(server):
    # At least one token per repetition: the request is still running when the client leaves.
    body = {
        "prompt": "Write many short words:",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "regex": "( [a-z]{1,3}){400}",
    }
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a collected iterator would close the connection here
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert got
        stats = idle_stats(server)
        assert stats["num_running"] == 1 and stats["grammar"]["live_matchers"] == 1
    stats = wait_until(
        lambda: (
            (s := idle_stats(server))["num_running"] == 0
            and s["grammar"]["live_matchers"] == 0
            and s
        ),
        15,
        "the abort to free the request and its matcher",
    )
    assert stats["num_waiting"] == 0 and stats["kv_locked_tokens"] == 0


def test_logit_bias_forces_and_bans_greedy_tokens_next_to_an_unbiased_request(server):
    """+100 forces its token at every step and -100 on the greedy first token replaces it (and
    that token never comes), while an unbiased request sent alongside (in the same steps) keeps
    its greedy output."""
    prompt, n = "The capital of France is", 12
    sampling = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    with server.client() as c:
        plain = c.post("/generate", json={"text": prompt, "sampling_params": sampling}).json()
        forced = c.post("/tokenize", json={"prompt": " Lyon", "add_special_tokens": False}).json()[
            "tokens"
        ][0]
    assert "Paris" in plain["text"]
    first = plain["output_ids"][0]

    async def together():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(
                c.post("/generate", json={"text": prompt, "sampling_params": sampling}),
                c.post(
                    "/v1/completions",
                    json={
                        "model": MODEL,
                        "prompt": prompt,
                        "max_tokens": n,
                        "temperature": 0,
                        "ignore_eos": True,
                        "logit_bias": {str(forced): 100},
                    },
                ),
                c.post(
                    "/generate",
                    json={
                        "text": prompt,
                        "sampling_params": {**sampling, "logit_bias": {str(first): -100}},
                    },
                ),
            )

    unbiased, pushed, banned = (r.json() for r in asyncio.run(together()))
    assert unbiased["output_ids"] == plain["output_ids"]
    with server.client() as c:
        assert (
            pushed["choices"][0]["text"]
            == c.post("/detokenize", json={"tokens": [forced] * n}).json()["prompt"]
        )
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 1}},
        )
    assert banned["output_ids"][0] != first and first not in banned["output_ids"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert (
        r.json()["error"]["message"]
        == "logit_bias: token id 99999 is outside the vocabulary (49152)"
    )


def test_tokenize_and_detokenize_round_trip_and_equal_the_tokenizer(server, default_model_dir):
    """vLLM's shapes; the ids are the model tokenizer's own, a chat's are those its completion is
    billed for, and an id outside the vocabulary is a 400 naming `tokens`."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(default_model_dir)
    text = "Héllo, world! 日本語 🙂\n  indented"
    with server.client() as c:
        out = c.post(
            "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}
        ).json()
        assert out == {
            "count": len(hf.encode(text)),
            "max_model_len": c.get("/v1/models").json()["data"][0]["max_model_len"],
            "tokens": hf.encode(text),
            "token_strs": hf.convert_ids_to_tokens(hf.encode(text)),
        }
        assert c.post("/detokenize", json={"model": MODEL, "tokens": out["tokens"]}).json() == {
            "prompt": text
        }
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        chat = c.post("/tokenize", json={"messages": msgs}).json()
        assert chat["token_strs"] is None
        assert chat["tokens"] == list(
            hf.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        billed = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}).json()[
            "usage"
        ]
        assert chat["count"] == billed["prompt_tokens"]
        bad = c.post("/detokenize", json={"tokens": [1, 49152]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        long = c.post("/tokenize", json={"prompt": "word " * 20_000})
        assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"


# ---- prompt logprobs: echo, prompt_logprobs, input_token_logprobs ------------------------------

ECHO_PROMPT = "The capital of France is Paris, and the capital of Italy is"


def test_echo_logprobs_max_tokens_0_as_lm_eval_reads_them(server):
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 0, temperature 0."""
    body = {"model": MODEL, "prompt": ECHO_PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
    with server.client() as c:
        out = c.post("/v1/completions", json={**body, "temperature": 0}).json()
        ids = c.post("/tokenize", json={"prompt": ECHO_PROMPT}).json()["tokens"]
    choice = out["choices"][0]
    assert choice["text"] == ECHO_PROMPT and choice["finish_reason"] == "length"
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(ids) == out["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 0
    assert "".join(lps["tokens"]) == ECHO_PROMPT
    assert lps["text_offset"][0] == 0 and lps["text_offset"][-1] == len(ECHO_PROMPT) - len(
        lps["tokens"][-1]
    )
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert all(x <= 0 for x in lps["token_logprobs"][1:])
    for token, lp, top in zip(
        lps["tokens"][1:], lps["token_logprobs"][1:], lps["top_logprobs"][1:]
    ):
        # The likeliest token, then the prompt's own where it is not that one (OpenAI's and
        # vLLM's logprobs + 1 entries).
        assert token in top and len(top) == (1 if max(top, key=top.get) == token else 2)
        assert lp <= max(top.values()) + 1e-6
        if len(top) == 2:
            assert top[token] == pytest.approx(lp)
    assert any(len(top) == 2 for top in lps["top_logprobs"][1:])
    # " Paris" after "The capital of France is" is the likeliest token: greedy there.
    k = lps["tokens"].index(" Paris")
    assert lps["top_logprobs"][k] == {" Paris": pytest.approx(lps["token_logprobs"][k])}


def test_prompt_logprobs_agree_across_routes_and_rank_their_tokens(server):
    """The same prompt's logprobs from echo, vLLM's prompt_logprobs and /generate's
    input_token_logprobs (from logprob_start_len on); each top list sorted, holding the
    prompt's token wherever its rank is within it."""
    with server.client() as c:
        ids = c.post("/tokenize", json={"prompt": ECHO_PROMPT}).json()["tokens"]
        comp = c.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": ids,
                "echo": True,
                "logprobs": 3,
                "prompt_logprobs": 4,
                "max_tokens": 1,
                "temperature": 0,
            },
        ).json()["choices"][0]
        gen = c.post(
            "/generate",
            json={
                "input_ids": ids,
                "return_logprob": True,
                "logprob_start_len": 2,
                "top_logprobs_num": 2,
                "sampling_params": {"max_new_tokens": 0},
            },
        ).json()
    echo = comp["logprobs"]["token_logprobs"]
    assert comp["text"].startswith(ECHO_PROMPT) and len(echo) == len(ids) + 1
    # max_tokens 1: the generated token last, greedy (its own top-1).
    last_top = comp["logprobs"]["top_logprobs"][-1]
    assert len(last_top) == 3 and max(last_top, key=last_top.get) == comp["logprobs"]["tokens"][-1]
    vllm = comp["prompt_logprobs"]
    assert len(vllm) == len(ids) and vllm[0] is None
    for k in range(1, len(ids)):
        entry = vllm[k]
        mine = entry[str(ids[k])]
        assert mine["logprob"] == pytest.approx(echo[k], abs=1e-5)
        top = sorted((v for v in entry.values() if v["rank"] <= 4), key=lambda v: v["rank"])
        assert [v["rank"] for v in top][:4] == list(range(1, min(4, len(top)) + 1))
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(top, top[1:]))
        assert (mine["rank"] <= 4) == (len(entry) == 4)  # else it is the fifth entry
    meta = gen["meta_info"]
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == ids[2:] and inputs[0][0] is None
    assert [lp for lp, _, _ in inputs[1:]] == pytest.approx(echo[3 : len(ids)], abs=1e-5)
    assert meta["input_top_logprobs"][0] is None
    for k, top in enumerate(meta["input_top_logprobs"][1:], start=3):
        assert len(top) == 2 and top[0][0] >= top[1][0]
        if vllm[k][str(ids[k])]["rank"] <= 2:
            assert ids[k] in [t for _, t, _ in top]
    assert gen["output_ids"] == [] and meta["completion_tokens"] == 0


def test_streamed_echo_comes_first(server):
    with server.client() as c:
        with c.stream(
            "POST",
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": ECHO_PROMPT,
                "echo": True,
                "max_tokens": 3,
                "temperature": 0,
                "stream": True,
            },
        ) as r:
            events = [
                json.loads(line[6:])
                for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        whole = c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": ECHO_PROMPT, "max_tokens": 3, "temperature": 0},
        ).json()
    texts = [e["choices"][0]["text"] for e in events]
    assert texts[0].startswith(ECHO_PROMPT)
    assert "".join(texts) == ECHO_PROMPT + whole["choices"][0]["text"]
    assert idle_stats(server)["kv_locked_tokens"] == 0


# ---- a list of prompts in one /v1/completions request ---------------------------------------


def _streamed_choices(c: httpx.Client, body: dict) -> tuple[dict[int, str], list[dict]]:
    """Each choice's streamed text by index, and the events."""
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts, events


def test_a_prompt_list_answers_as_its_prompts_alone_do_whole_and_streamed(server):
    """Choice i * n + j is prompt i's choice j (a seeded choice j samples alike alone and in
    the list); text and token-id prompts mix; echo and logprobs are each prompt's own; usage
    adds up over the prompts, each prompt counted once."""
    body = {
        "model": MODEL,
        "max_tokens": 6,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": 11,
        "n": 2,
        "echo": True,
        "logprobs": 1,
    }
    with server.client() as c:
        ids = c.post("/tokenize", json={"prompt": PROMPTS[1]}).json()["tokens"]
        prompts = [PROMPTS[0], ids, PROMPTS[2]]
        alone = [c.post("/v1/completions", json={**body, "prompt": p}).json() for p in prompts]
        r = c.post("/v1/completions", json={**body, "prompt": prompts})
        streamed, events = _streamed_choices(
            c, {**body, "prompt": prompts, "stream_options": {"include_usage": True}}
        )
    assert r.status_code == 200, r.text
    out = r.json()
    assert r.headers["x-request-id"] == out["id"]
    want = [choice for a in alone for choice in a["choices"]]
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert [c["text"] for c in out["choices"]] == [c["text"] for c in want]
    assert out["choices"][2]["text"].startswith(PROMPTS[1])  # the token ids decoded, echoed
    assert len({c["text"] for c in out["choices"]}) == 6  # seeds differ across j, prompts across i
    for got, alone_choice in zip(out["choices"], want):
        lps, alone_lps = got["logprobs"], alone_choice["logprobs"]
        assert lps["tokens"] == alone_lps["tokens"]
        assert lps["token_logprobs"][1:] == pytest.approx(alone_lps["token_logprobs"][1:], abs=1e-4)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert out["usage"][key] == sum(a["usage"][key] for a in alone)
    assert out["usage"]["completion_tokens"] == 3 * 2 * 6
    assert streamed == {c["index"]: c["text"] for c in out["choices"]}
    assert len({e["id"] for e in events}) == 1  # one response
    assert events[-1]["choices"] == []
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert events[-1]["usage"][key] == out["usage"][key]


def test_a_refused_prompt_in_a_list_answers_with_its_index_and_ends_the_others(server):
    """The tokenizer refuses the last prompt (too long); the others, submitted with it and
    asking for thousands of tokens, are ended: the 4xx comes whole or streamed, nothing runs."""
    body = {
        "model": MODEL,
        "prompt": [*PROMPTS, "hello " * 30_000],
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
    }
    with server.client() as c:
        whole = c.post("/v1/completions", json=body)
        stream = c.post("/v1/completions", json={**body, "stream": True})
    for r in (whole, stream):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"prompt[{len(PROMPTS)}]"
    stats = wait_until(
        lambda: (s := idle_stats(server))["num_running"] == 0 and s, 15, "the others ended"
    )
    assert stats["num_waiting"] == 0 and stats["kv_locked_tokens"] == 0


def test_a_streamed_prompt_list_whose_client_leaves_frees_every_prompt(server):
    body = {
        "model": MODEL,
        "prompt": ["Tell me a long story.", "Write an essay."],
        "max_tokens": 4000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        seen: set[int] = set()
        lines = r.iter_lines()  # held: a dropped iterator closes the connection
        for line in lines:
            if line.startswith("data: {"):
                seen.update(choice["index"] for choice in json.loads(line[6:])["choices"])
            if seen == {0, 1}:
                break
        assert idle_stats(server)["num_running"] == 2
    stats = wait_until(
        lambda: (s := idle_stats(server))["num_running"] == 0 and s, 15, "the abort of both"
    )
    assert stats["num_waiting"] == 0 and stats["kv_locked_tokens"] == 0


# ---- a batch on /generate (SGLang's: text or input_ids a list) ----------------------------------


def _generate_stream(c: httpx.Client, body: dict) -> list[dict]:
    """A streamed /generate's events, checked to end with SGLang's `data: [DONE]`."""
    with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_a_generate_batch_answers_as_its_prompts_alone_do(server):
    """Texts and token-id lists, each prompt with its own sampling_params: the answer is the
    list of what each prompt alone answers, token for token, in order; a rid names prompt i
    `<rid>-<i>`."""
    params = [
        {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True},
    ]
    texts = PROMPTS[:3]
    with server.client() as c:
        ids = [c.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
        alone = [
            c.post("/generate", json={"text": t, "sampling_params": p}).json()
            for t, p in zip(texts, params)
        ]
        by_text = c.post("/generate", json={"text": texts, "sampling_params": params, "rid": "gb"})
        by_ids = c.post("/generate", json={"input_ids": ids, "sampling_params": params})
        ids_alone = [
            c.post("/generate", json={"input_ids": i, "sampling_params": p}).json()
            for i, p in zip(ids, params)
        ]
    assert by_text.status_code == 200, by_text.text
    assert by_text.headers["x-request-id"] == "gb"
    out = by_text.json()
    assert [o["output_ids"] for o in out] == [a["output_ids"] for a in alone]
    assert [o["text"] for o in out] == [a["text"] for a in alone]
    assert [len(o["output_ids"]) for o in out] == [5, 3, 7]  # each prompt's own budget
    assert [o["meta_info"]["id"] for o in out] == ["gb-0", "gb-1", "gb-2"]
    assert [o["output_ids"] for o in by_ids.json()] == [a["output_ids"] for a in ids_alone]


def test_a_generate_batch_with_n_orders_choices_by_prompt_and_streams_with_indices(server):
    """n > 1 with a batch: prompt i's choice j at i * n + j, each as prompt i alone samples it
    (seeded); streamed, every event one choice's output so far with that `index`."""
    sampling = {
        "max_new_tokens": 6,
        "temperature": 0.8,
        "sampling_seed": 11,
        "n": 2,
        "ignore_eos": True,
    }
    texts = PROMPTS[3:5]
    with server.client() as c:
        alone = [
            c.post("/generate", json={"text": t, "sampling_params": sampling}).json() for t in texts
        ]
        whole = c.post("/generate", json={"text": texts, "sampling_params": sampling}).json()
        events = _generate_stream(c, {"text": texts, "sampling_params": sampling})
    want = [choice["output_ids"] for a in alone for choice in a]
    assert [o["output_ids"] for o in whole] == want
    assert len({tuple(w) for w in want}) == 4  # seeds differ across j, prompts across i
    last = {e["index"]: e for e in events}
    assert sorted(last) == [0, 1, 2, 3]
    assert [last[k]["output_ids"] for k in range(4)] == want
    assert [last[k]["text"] for k in range(4)] == [o["text"] for o in whole]
    assert all(last[k]["meta_info"]["finish_reason"]["type"] == "length" for k in range(4))
    assert idle_stats(server)["kv_locked_tokens"] == 0


GENERATE_BATCH_BAD_INPUTS = [
    ({"text": []}, "text"),
    ({"text": ["hi", ""]}, "text[1]"),
    ({"input_ids": [[1, 2], []]}, "input_ids[1]"),
    ({"text": ["hi", "there"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": ["hi", "there"], "rid": ["a", "b", "c"]}, "rid"),
    ({"text": ["hi", "there"], "sampling_params": [{}, {"top_p": 0}]}, "sampling_params[1].top_p"),
    # found by the tokenizer, past the parser: the prompt's own field all the same
    ({"text": ["hi", LONG]}, "text[1]"),
    (
        {"text": ["hi", "there"], "sampling_params": [{}, {"max_new_tokens": 9000}]},
        "sampling_params[1].max_new_tokens",
    ),
    (
        {"text": ["hi", "there"], "return_logprob": True, "logprob_start_len": [0, 50]},
        "logprob_start_len[1]",
    ),
    (
        {"text": ["hi", "there"], "sampling_params": [{}, {"regex": "(a"}]},
        "sampling_params[1].regex",
    ),
]


@pytest.mark.parametrize("body,param", GENERATE_BATCH_BAD_INPUTS)
def test_a_bad_prompt_of_a_generate_batch_gets_a_400_naming_it(server, body, param):
    with server.client() as c:
        whole = c.post("/generate", json=body)
        stream = c.post("/generate", json={**body, "stream": True})
    for r in (whole, stream):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def _long_batch(**extra) -> dict:
    return {
        "text": ["Tell me a long story.", "Write an essay."],
        "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True},
        **extra,
    }


def _both_heard(lines) -> None:
    """Read a streamed batch until each of its two prompts has sent an event."""
    seen: set[int] = set()
    for line in lines:
        if line.startswith("data: {"):
            seen.add(json.loads(line[6:])["index"])
        if seen == {0, 1}:
            return


def test_a_generate_batch_ends_whole_when_its_client_leaves_or_its_rid_is_aborted(server):
    with server.client() as c, c.stream("POST", "/generate", json=_long_batch(stream=True)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped iterator closes the connection
        _both_heard(lines)
        assert idle_stats(server)["num_running"] == 2
    stats = wait_until(
        lambda: (s := idle_stats(server))["num_running"] == 0 and s, 15, "the abort of both"
    )
    assert stats["num_waiting"] == 0 and stats["kv_locked_tokens"] == 0

    body = _long_batch(stream=True, rid="gen-batch-abort")
    with server.client() as c, c.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        _both_heard(lines)
        assert c.post("/abort_request", json={"rid": "gen-batch-abort"}).json()["found"]
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    last = {e["index"]: e for e in (json.loads(line[6:]) for line in rest[:-1])}
    assert [last[k]["meta_info"]["finish_reason"]["type"] for k in (0, 1)] == ["abort"] * 2
    stats = wait_until(lambda: (s := idle_stats(server))["num_running"] == 0 and s, 15, "idle")
    assert stats["num_waiting"] == 0 and stats["kv_locked_tokens"] == 0


def test_a_generate_batch_whose_rid_is_in_use_runs_none_of_its_prompts(server):
    """Prompt 1's rid is already running: a 400 naming rid[1], and prompt 0, submitted before
    it, is ended; prompt 2 never starts."""
    busy = {
        "text": "Write an essay.",
        "rid": "gen-batch-busy",
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
        "stream": True,
    }
    with server.client() as c, c.stream("POST", "/generate", json=busy) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the connection
        next(line for line in lines if line.startswith("data: {"))
        refused = c.post(
            "/generate", json=_long_batch(text=PROMPTS[:3], rid=["gen-free", busy["rid"], "x"])
        )
        assert c.post("/abort_request", json={"rid": busy["rid"]}).json()["found"]
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "rid[1]"
    stats = wait_until(lambda: (s := idle_stats(server))["num_running"] == 0 and s, 15, "idle")
    assert stats["num_waiting"] == 0 and stats["kv_locked_tokens"] == 0
