"""OpenAI's Responses API and Anthropic's Messages API end to end, driven by the real clients:
the openai SDK (`client.responses`), the OpenAI Agents SDK with its default Responses model,
and the anthropic SDK. Every streamed event is also validated against the SDKs' own types.

One server for the module: the default model with --reasoning-parser qwen3 (so reasoning items
and thinking blocks can be seen) and --api-key (so Anthropic's x-api-key is exercised by every
anthropic call). Tool calls are forced (tool_choice required / named, Anthropic any / tool):
the grammar guarantees a call whatever the model would say.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.server_utils import Server, wait_until

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-relay-test"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "London"]}},
    "required": ["city"],
}
ASK = "What is the capital of France?"
# With a schema to answer in, the model opens a <think> block on this prompt and reasons in it
# (qwen3's grammar lets reasoning run before the constrained answer): reasoning to be seen.
REASONS = "What is the weather like in Paris today?"
GREEDY = {"temperature": 0}

RESPONSE_EVENT = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
MESSAGE_EVENT = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)


@pytest.fixture(scope="module")
def server():
    s = Server(
        "--dtype",
        "float32",
        "--kv-cache-gb",
        "0.5",
        "--reasoning-parser",
        "qwen3",
        "--api-key",
        KEY,
        startup_timeout=600,
    )  # the shared 2 cores may be busy
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def sse_events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """A stream's events as sent (each `event:` line checked against its data's type)."""
    events = []
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                assert event["type"] == name
                events.append(event)
    return events


def assert_bad(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and f"'{param}'" in err["message"], err


# ---- /v1/responses ---------------------------------------------------------------------------


def test_response_whole_streamed_and_the_sdk_stream_helper_agree(oai, http):
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 20, **GREEDY}
    whole = oai.responses.create(**body)
    assert whole.status == "completed" and "Paris" in whole.output_text
    u = whole.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens < 20
    assert u.total_tokens == u.input_tokens + u.output_tokens
    openai.types.responses.Response.model_validate(http.post("/v1/responses", json=body).json())

    events = [RESPONSE_EVENT.validate_python(e) for e in sse_events(http, "/v1/responses", body)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    done = events[-1].response.usage  # its cached_tokens may differ: the prompt was seen before
    assert (done.input_tokens, done.output_tokens) == (u.input_tokens, u.output_tokens)

    with oai.responses.stream(**body) as stream:  # the SDK's accumulator checks the sequence
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == whole.output_text


def test_function_tool_round_trip_by_previous_response_id_and_by_items(oai, http):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = oai.responses.create(
        model=MODEL,
        instructions="Call a tool.",  # not carried over: the replay below has none either
        input=ask,
        tools=tools,
        tool_choice="required",
        max_output_tokens=40,
        **GREEDY,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)

    events = sse_events(
        http,
        "/v1/responses",
        {
            "input": ask,
            "tools": tools,
            "tool_choice": "required",
            "max_output_tokens": 40,
            **GREEDY,
        },
    )
    for e in events:
        RESPONSE_EVENT.validate_python(e)
    args = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [a["arguments"] for a in args] == [call.arguments]
    assert (
        "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        == call.arguments
    )

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    kw = dict(model=MODEL, tools=tools, max_output_tokens=16, **GREEDY)
    chained = oai.responses.create(previous_response_id=first.id, input=[result], **kw)
    replayed = oai.responses.create(input=[*ask, *first.output, result], **kw)
    assert chained.previous_response_id == first.id
    assert chained.output_text and chained.output_text == replayed.output_text
    assert chained.usage.input_tokens == replayed.usage.input_tokens


def test_structured_output_through_the_sdk_parse_helper(oai):
    class Weather(pydantic.BaseModel):
        city: str
        sunny: bool

    out = oai.responses.parse(
        model=MODEL,
        input="Is it sunny in Paris? Answer in JSON.",
        text_format=Weather,
        max_output_tokens=40,
        **GREEDY,
    )
    assert out.status == "completed" and isinstance(out.output_parsed, Weather)


def test_reasoning_is_a_reasoning_item_whole_and_streamed(oai, http):
    body = {
        "model": MODEL,
        "input": REASONS,
        "max_output_tokens": 12,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER_PARAMS}},
        **GREEDY,
    }
    whole = oai.responses.create(**body)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    reasoning = whole.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].text.strip()
    assert "<think>" not in reasoning.content[0].text
    events = [RESPONSE_EVENT.validate_python(e) for e in sse_events(http, "/v1/responses", body)]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == reasoning.content[0].text
    assert events[-1].type == "response.incomplete"


def test_previous_response_id_not_stored_or_unknown_is_a_404_naming_it(oai):
    kept = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    for missing in (kept.id, "resp-nope"):
        with pytest.raises(openai.NotFoundError) as e:
            oai.responses.create(
                model=MODEL, input="Hi", max_output_tokens=2, previous_response_id=missing
            )
        assert e.value.body["param"] == "previous_response_id" and missing in e.value.message


RESPONSES_BAD = [
    ({"input": []}, "input"),
    (
        {"input": [{"role": "user", "content": "Hi"}, {"type": "function_call", "name": "f"}]},
        "input[1].call_id",
    ),
    (
        {
            "input": [
                {"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "output": "x"},
            ]
        },
        "input[2].call_id",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "input[0].content[0].type",
    ),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input[0].role"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    (
        {"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": 3}]},
        "tools[0].parameters",
    ),
    (
        {
            "input": "Hi",
            "tools": [{"type": "function", "name": "f"}],
            "tool_choice": {"type": "function", "name": "g"},
        },
        "tool_choice.name",
    ),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    (
        {"input": "Hi", "text": {"format": {"type": "json_schema", "schema": 3}}},
        "text.format.schema",
    ),
    ({"input": "Hi", "temperature": 3}, "temperature"),
    ({"input": "Hi", "truncation": "auto"}, "truncation"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "store": "yes"}, "store"),
]


@pytest.mark.parametrize("body,param", RESPONSES_BAD, ids=[p for _, p in RESPONSES_BAD])
def test_a_malformed_responses_body_is_a_400_naming_its_path(http, body, param):
    assert_bad(http.post("/v1/responses", json=body), param)


def test_an_input_too_long_for_the_context_is_a_400_naming_input(http):
    r = http.post("/v1/responses", json={"input": "hello " * 10_000, "max_output_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_the_agents_sdk_runs_a_tool_through_its_default_responses_model(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        agent = agents.Agent(
            name="weather",
            instructions="You answer questions about the weather.",
            model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
            tools=[get_weather],
            # Forced on the first turn; the SDK resets it to auto once the tool ran.
            model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=30, **GREEDY),
        )
        whole = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        streamed = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=3)
        async for _ in streamed.stream_events():
            pass
        return whole, streamed

    whole, streamed = asyncio.run(run())
    kinds = [type(item).__name__ for item in whole.new_items]
    assert {"ToolCallItem", "ToolCallOutputItem"} <= set(kinds) and kinds[-1] == "MessageOutputItem"
    assert calls == ["Paris", "Paris"]
    assert isinstance(whole.final_output, str) and whole.final_output
    assert streamed.final_output == whole.final_output


# ---- /v1/messages ----------------------------------------------------------------------------


def test_message_whole_streamed_and_counted_agree(claude, http):
    kw = dict(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": ASK}])
    whole = claude.messages.create(**kw, extra_body=GREEDY)
    (block,) = whole.content
    assert block.type == "text" and "Paris" in block.text and whole.stop_reason == "end_turn"
    count = claude.messages.count_tokens(**{k: v for k, v in kw.items() if k != "max_tokens"})
    assert count.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens

    with claude.messages.stream(**kw, extra_body=GREEDY) as stream:
        assert stream.get_final_text() == block.text
        assert stream.get_final_message().usage.output_tokens == whole.usage.output_tokens

    events = [
        MESSAGE_EVENT.validate_python(e) for e in sse_events(http, "/v1/messages", {**kw, **GREEDY})
    ]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}


def test_tool_use_round_trip_with_any_and_a_named_tool(claude, http):
    tools = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER_PARAMS}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, max_tokens=40, messages=ask, tools=tools, extra_body=GREEDY)
    with claude.messages.stream(**kw, tool_choice={"type": "any"}) as stream:
        called = stream.get_final_message()
    assert called.stop_reason == "tool_use"
    (use,) = [b for b in called.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER_PARAMS)
    # Thinking disabled: with a named tool this model would otherwise reason first (qwen3's
    # grammar allows it) and spend its tokens there.
    named = claude.messages.create(
        **kw, tool_choice={"type": "tool", "name": "get_weather"}, thinking={"type": "disabled"}
    )
    assert [b.type for b in named.content] == ["tool_use"] and named.content[0].input == use.input

    body = {
        "model": MODEL,
        "max_tokens": 40,
        "messages": ask,
        "tools": tools,
        "tool_choice": {"type": "any"},
        **GREEDY,
    }
    events = [MESSAGE_EVENT.validate_python(e) for e in sse_events(http, "/v1/messages", body)]
    assert any(
        e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events
    )

    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=16,
        tools=tools,
        messages=[
            *ask,
            {"role": "assistant", "content": called.content},
            {"role": "user", "content": [result]},
        ],
        extra_body=GREEDY,
    )
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_reasoning_is_a_thinking_block_and_output_config_a_schema(claude):
    kw = dict(
        model=MODEL,
        max_tokens=12,
        messages=[{"role": "user", "content": REASONS}],
        output_config={"format": {"type": "json_schema", "schema": WEATHER_PARAMS}},
        extra_body=GREEDY,
    )
    whole = claude.messages.create(**kw)
    thinking = whole.content[0]
    assert thinking.type == "thinking" and thinking.thinking.strip()
    assert whole.stop_reason == "max_tokens"
    with claude.messages.stream(**kw) as stream:
        deltas = [e.delta.thinking for e in stream if e.type == "content_block_delta"]
    assert "".join(deltas) == thinking.thinking

    # Without thinking the schema rules the answer from its first token.
    answer = claude.messages.create(**{**kw, "max_tokens": 30}, thinking={"type": "disabled"})
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason == "end_turn"
    jsonschema.validate(json.loads(answer.content[0].text), WEATHER_PARAMS)


def test_stop_sequences_end_the_message_and_say_which(claude):
    out = claude.messages.create(
        model=MODEL,
        max_tokens=20,
        messages=[{"role": "user", "content": ASK}],
        stop_sequences=[" Paris"],
        extra_body=GREEDY,
    )
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", " Paris")
    assert "Paris" not in out.content[0].text


def test_x_api_key_is_accepted_and_a_wrong_key_refused_in_anthropics_shape(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}

    def count(headers: dict) -> httpx.Response:
        with server.client() as c:
            return c.post("/v1/messages/count_tokens", json=body, headers=headers)

    assert count({"x-api-key": KEY}).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
        r = count(headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(**body)


MESSAGES_BAD = [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, "messages.0.role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages.0.content.0.type",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}],
                },
            ]
        },
        "messages.1.content.0.input",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi"}, {"type": "tool_result"}],
                }
            ]
        },
        "messages.0.content.1.tool_use_id",
    ),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type"),
    ({"tools": [{"name": "f", "input_schema": 3}]}, "tools.0.input_schema"),
    (
        {
            "tools": [{"name": "f", "input_schema": {}}],
            "tool_choice": {"type": "tool", "name": "g"},
        },
        "tool_choice.name",
    ),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"temperature": 1.5}, "temperature"),
    ({"system": [{"type": "image"}]}, "system.0.type"),
    (
        {"output_config": {"format": {"type": "json_schema", "schema": 3}}},
        "output_config.format.schema",
    ),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
]


@pytest.mark.parametrize("changes,path", MESSAGES_BAD, ids=[p for _, p in MESSAGES_BAD])
def test_a_malformed_messages_body_is_a_400_naming_its_path(http, changes, path):
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}],
        **changes,
    }
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert f"'{path}'" in err["error"]["message"], err


# ---- fuzz: items and blocks mutated at random ---------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3)
    ),
    max_leaves=6,
)
RESPONSE_ITEMS = [
    {"role": "user", "content": "Hi"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    {"type": "reasoning", "id": "rs", "summary": []},
]
MESSAGE_TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""}]},
]
ITEM_KEYS = [
    "type",
    "role",
    "content",
    "call_id",
    "name",
    "arguments",
    "output",
    "input",
    "id",
    "tool_use_id",
    "text",
]
TOP_KEYS = [
    "tools",
    "tool_choice",
    "text",
    "instructions",
    "max_output_tokens",
    "max_tokens",
    "system",
    "stop_sequences",
    "output_config",
    "thinking",
    "previous_response_id",
    "temperature",
]


def _mutated(items: list[dict], data) -> list:
    """The items with a few of their fields replaced by arbitrary JSON, or one replaced."""
    items = [dict(item) for item in items]
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(items) - 1))
        if isinstance(items[i], dict) and data.draw(st.booleans()):
            items[i][data.draw(st.sampled_from(ITEM_KEYS))] = data.draw(JSON)
        else:
            items[i] = data.draw(JSON)
    return items


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_bodies_get_an_answer_or_a_400_naming_a_field_never_a_server_error(http, data):
    responses = data.draw(st.booleans())
    if responses:
        path, body = (
            "/v1/responses",
            {"input": _mutated(RESPONSE_ITEMS, data), "max_output_tokens": 2},
        )
    else:
        path, body = "/v1/messages", {"messages": _mutated(MESSAGE_TURNS, data), "max_tokens": 2}
    body.update(data.draw(st.dictionaries(st.sampled_from(TOP_KEYS), JSON, max_size=2)))
    for key in ("max_output_tokens", "max_tokens"):
        if isinstance(body.get(key), int) and body[key] > 4:
            body[key] = 4  # keep accepted requests short; refusals still see every value
    try:
        raw = json.dumps(body, allow_nan=True)
    except (TypeError, ValueError):
        return
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err.get("param") or "'" in err["message"], err  # the field is named


# ---- a client that leaves ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/responses", {"input": "Count to a thousand:", "max_output_tokens": 200}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "Count:"}], "max_tokens": 200}),
    ],
)
def test_a_stream_the_client_leaves_is_aborted(server, http, path, body):
    def aborted() -> float:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith('relay:aborted_requests_total{reason="client_disconnect"}'):
                return float(line.split()[-1])
        return 0.0

    before = aborted()
    with http.stream("POST", path, json={**body, "stream": True, "ignore_eos": True}) as r:
        next(r.iter_lines())
    wait_until(lambda: aborted() == before + 1, 15, "the disconnect counted")

    def ended() -> bool:
        info = http.get("/get_server_info").json()
        return info["num_http_requests"] == 0 and info["scheduler"]["num_running"] == 0

    wait_until(ended, 15, "the request ended in the scheduler")
