"""Reasoning parsers and tool-call parsers (relay.api.reasoning, relay.api.tool_parsers): each
format read whole, and streamed split at every point, gives the same content, reasoning and
calls; their request fields and flags; the grammar that lets reasoning run before a constraint."""

from __future__ import annotations

import json

import pytest

from relay.api.chat import parse_chat
from relay.api.chat_output import ChatOutput, whole_message
from relay.api.errors import ProtocolError
from relay.api.reasoning import REASONING_PARSERS, Reasoning
from relay.api.tool_calls import AUTO, Tool, ToolCalling
from relay.api.tool_parsers import PARSERS, parser_for_template
from relay.config import REASONING_PARSERS as REASONING_NAMES
from relay.config import TOOL_CALL_PARSERS as TOOL_NAMES
from relay.config import EngineConfig
from tests.helpers.parser_checks import MODEL, PARIS, read, splits

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


def auto(parser: str, parallel: bool = True) -> ToolCalling:
    return ToolCalling((Tool("get_weather"), Tool("now")), AUTO, parser=parser, parallel=parallel)


def test_config_names_are_the_registries():
    assert set(REASONING_NAMES) - {None} == set(REASONING_PARSERS)
    assert set(TOOL_NAMES) - {None} == set(PARSERS)


# ---- tool-call parsers -------------------------------------------------------------------------

TOOL_OUTPUTS = [
    # (parser, text, content, calls)
    (
        "hermes",
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Checking.",
        [("get_weather", PARIS)],
    ),
    (
        "hermes",
        '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>',
        None,
        [("get_weather", PARIS)],
    ),  # arguments first: held whole, then parsed
    (
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "a}\\"{"}}</tool_call>'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
        None,
        [("get_weather", '{"city": "a}\\"{"}'), ("now", "{}")],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", PARIS)],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "now", "parameters": {}}',
        None,
        [("get_weather", PARIS), ("now", "{}")],
    ),
    ("llama3", 'The weather is {"city": "Paris"}.', 'The weather is {"city": "Paris"}.', []),
    ("llama3", '{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON that is no call
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "now", "arguments": {}}]',
        "Sure.",
        [("get_weather", PARIS), ("now", "{}")],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}',
        None,
        [("get_weather", PARIS), ("now", "{}")],
    ),
    ("mistral", "No calls [TOOLS] here", "No calls [TOOLS] here", []),
    ("mistral", "[TOOL_CALLS]not a name![ARGS]{}", "[TOOL_CALLS]not a name![ARGS]{}", []),
    (
        "pythonic",
        '[get_weather(city="Paris"), now()]',
        None,
        [("get_weather", PARIS), ("now", "{}")],
    ),
    (
        "pythonic",
        '<|python_start|>[get_weather(city="a)(\'"), x.now(n=[1, {"k": None}])]<|python_end|>',
        None,
        [("get_weather", '{"city": "a)(\'"}'), ("x.now", '{"n": [1, {"k": null}]}')],
    ),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    (
        "pythonic",
        "[get_weather(city=__import__('os'))]",
        "[get_weather(city=__import__('os'))]",
        [],
    ),
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),  # positional: no call
    ("pythonic", "Hello", "Hello", []),
]


@pytest.mark.parametrize("parser,text,content,calls", TOOL_OUTPUTS)
def test_tool_parser_whole_and_every_split_agree(parser, text, content, calls):
    for deltas in splits(text):
        assert read(auto(parser), None, deltas) == (
            None,
            content,
            calls,
            "tool_calls" if calls else "stop",
        ), deltas


def test_tool_call_streams_its_name_before_its_arguments_end():
    out = ChatOutput(auto("hermes"), None)
    first = out.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert [type(p).__name__ for p in first] == ["CallStart", "ArgsPiece"] and first[
        0
    ].name == "get_weather"
    assert first[1].text == '{"ci'
    second = out.feed('ty": "Paris"}}</tool_call>')
    assert [p.text for p in second] == ['ty": "Paris"}']


def test_a_call_cut_short_keeps_what_it_streamed_and_an_unnamed_one_is_text():
    assert read(
        auto("hermes"), None, ['<tool_call>{"name": "now", "arguments": {"a'], "length"
    ) == (None, None, [("now", '{"a')], "length")
    assert read(auto("hermes"), None, ['<tool_call>{"name": "no'], "length") == (
        None,
        '<tool_call>{"name": "no',
        [],
        "length",
    )


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    text = '[get_weather(city="Paris"), now()] done'
    assert read(auto("pythonic", parallel=False), None, [text]) == (
        None,
        "done",
        [("get_weather", PARIS)],
        "tool_calls",
    )
    required = parse_chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER, NOW],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
        MODEL,
    )
    assert json.loads(required.params.json_schema)["maxItems"] == 1
    free = parse_chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER],
            "tool_choice": "required",
        },
        MODEL,
    )
    assert "maxItems" not in json.loads(free.params.json_schema)


@pytest.mark.parametrize("value", ["no", 0, [], {}])
def test_parallel_tool_calls_must_be_a_boolean(value):
    with pytest.raises(ProtocolError) as e:
        parse_chat(
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [WEATHER],
                "parallel_tool_calls": value,
            },
            MODEL,
        )
    assert (e.value.status, e.value.param) == (400, "parallel_tool_calls")


@pytest.mark.parametrize(
    "template,parser",
    [
        ("{% for t in tools %}<tools>{{ t | tojson }}</tools>{% endfor %}<tool_call>", "hermes"),
        ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3"),
        ("Respond in the format [func_name1(params_name1=params_value1)]", "pythonic"),
        ("{{ messages[0].content }}", "hermes"),
        (None, "hermes"),
    ],
)
def test_default_tool_call_parser_follows_the_chat_template(template, parser):
    assert parser_for_template(template) == parser


def test_mistral_requests_keep_special_tokens_so_the_marker_reaches_the_text():
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    assert parse_chat(body, MODEL, tool_call_parser="mistral").params.skip_special_tokens is False
    assert parse_chat(body, MODEL, tool_call_parser="hermes").params.skip_special_tokens is True
    assert (
        parse_chat(
            {**body, "skip_special_tokens": True}, MODEL, tool_call_parser="mistral"
        ).params.skip_special_tokens
        is True
    )


# ---- reasoning parsers -------------------------------------------------------------------------

REASONING_OUTPUTS = [
    # (parser, text, finish, reasoning, content)
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", "stop", "Let me see.", "Paris."),
    ("qwen3", "Paris.", "stop", None, "Paris."),  # enable_thinking false: no block
    (
        "qwen3",
        "<think>\nStill thinking",
        "length",
        "Still thinking",
        None,
    ),  # cut short: all reasoning
    ("qwen3", "<think>a</think>", "stop", "a", None),
    (
        "qwen3",
        "Use <think> tags</think> like this",
        "stop",
        None,
        "Use <think> tags</think> like this",
    ),
    ("qwen3", "<thin", "stop", None, "<thin"),
    ("deepseek-r1", "I should answer.\n</think>\n\nParis.", "stop", "I should answer.", "Paris."),
    (
        "deepseek-r1",
        "<think>\nI should answer.</think>Paris.",
        "stop",
        "I should answer.",
        "Paris.",
    ),
    ("deepseek-r1", "No close tag at all", "length", "No close tag at all", None),
    ("deepseek-r1", "a </thin b </think> c </think>", "stop", "a </thin b", "c </think>"),
    ("deepseek-r1", "</think>Paris.", "stop", None, "Paris."),
]


@pytest.mark.parametrize("parser,text,finish,reasoning,content", REASONING_OUTPUTS)
def test_reasoning_parser_whole_and_every_split_agree(parser, text, finish, reasoning, content):
    for deltas in splits(text):
        assert read(None, parser, deltas, finish) == (reasoning, content, [], finish), deltas


def test_reasoning_streams_as_it_comes_holding_back_only_a_possible_tag():
    out = ChatOutput(None, "deepseek-r1")
    assert out.feed("Think") == [Reasoning("Think")]
    assert out.feed("ing </th") == [Reasoning("ing")]  # the space waits for what follows it
    assert out.feed("ink>\n\nHi") == ["Hi"]


def test_tool_calls_are_read_from_the_answer_after_the_reasoning():
    text = (
        '<think>I could write <tool_call>{"name": "now", "arguments": {}}</tool_call> here.</think>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    for deltas in splits(text):
        assert read(auto("hermes"), "qwen3", deltas) == (
            'I could write <tool_call>{"name": "now", "arguments": {}}</tool_call> here.',
            None,
            [("get_weather", PARIS)],
            "tool_calls",
        )


def test_forced_call_after_reasoning_parses_the_answer_only():
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [WEATHER],
        "tool_choice": "required",
    }
    tools = parse_chat(body, MODEL, reasoning_parser="deepseek-r1").tools
    message, reason = whole_message(
        tools,
        "deepseek-r1",
        'Hmm.</think>\n[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
        "stop",
    )
    assert (message["reasoning_content"], message["content"], reason) == (
        "Hmm.",
        None,
        "tool_calls",
    )
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", PARIS)
    ]


def test_whole_message_carries_reasoning_content_only_under_a_reasoning_parser():
    message, _ = whole_message(None, "qwen3", "<think>x</think>y", "stop")
    assert message == {"role": "assistant", "content": "y", "reasoning_content": "x"}
    message, _ = whole_message(auto("hermes"), None, "<think>x</think>y", "stop")
    assert "reasoning_content" not in message and message["content"] == "<think>x</think>y"


def test_constraint_under_a_reasoning_parser_applies_after_the_close_tag():
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_object"},
    }
    assert parse_chat(body, MODEL, reasoning_parser="deepseek-r1").params.reasoning_tags == (
        "",
        "</think>",
    )
    assert parse_chat(body, MODEL, reasoning_parser="qwen3").params.reasoning_tags == (
        "<think>",
        "</think>",
    )
    assert parse_chat(body, MODEL).params.reasoning_tags is None
    off = parse_chat(
        {**body, "chat_template_kwargs": {"enable_thinking": False}},
        MODEL,
        reasoning_parser="qwen3",
    )
    assert (
        off.params.reasoning_tags is None and off.reasoning is None
    )  # thinking off: all output is answer
    free = parse_chat({"messages": body["messages"]}, MODEL, reasoning_parser="qwen3")
    assert free.params.reasoning_tags is None and free.reasoning == "qwen3"


def test_bad_parser_names_are_refused_at_start():
    with pytest.raises(ValueError, match="reasoning_parser"):
        EngineConfig(reasoning_parser="qwen2")
    with pytest.raises(ValueError, match="tool_call_parser"):
        EngineConfig(tool_call_parser="json")
    from launch.flags import build_parser

    for flag in ("--reasoning-parser", "--tool-call-parser"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([flag, "nope"])
        assert e.value.code == 2
    ns = build_parser().parse_args(
        ["--reasoning-parser", "deepseek-r1", "--tool-call-parser", "pythonic"]
    )
    assert (ns.reasoning_parser, ns.tool_call_parser) == ("deepseek-r1", "pythonic")


# ---- the HTTP layer over a stub token stream -----------------------------------------------------
# The default model cannot be made to think in <think> tags or to call tools in these formats on
# its own; these run the real /v1/chat/completions route (parsing, SSE, the openai client's
# reassembly) over scripted model text, one record per delta.

import asyncio  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402

from relay.api import openai as openai_routes  # noqa: E402
from relay.api.serving import ApiRequest  # noqa: E402
from relay.outputs import RequestOutput  # noqa: E402


class ScriptedRequest(ApiRequest):
    """Hands the route one scripted record per take(), as the engine would stream them."""

    def __init__(self, rid: str, deltas: list[str], finish: str):
        super().__init__(rid, 1)
        self._records = [
            RequestOutput(
                rid,
                [i],
                finish_reason=finish if i == len(deltas) - 1 else None,
                completion_tokens=i + 1,
                text=d,
            )
            for i, d in enumerate(deltas)
        ]

    async def take(self):
        return [(0, self._records.pop(0))]


class StubTokenStreamClient:
    """An EngineClient whose every request streams the same scripted deltas."""

    served_model, context_len, vocab_size = MODEL, 4096, None
    max_constraint_bytes = max_constraint_depth = max_constraint_properties = None
    server_info: dict = {}
    num_requests = 0

    def __init__(
        self,
        deltas: list[str],
        reasoning_parser: str | None,
        tool_call_parser: str = "hermes",
        finish: str = "stop",
    ):
        self.deltas, self.finish = deltas, finish
        self.reasoning_parser, self.tool_call_parser = reasoning_parser, tool_call_parser
        self.parsed = []

    def submit(self, parsed, kind):
        self.parsed.append(parsed)
        return ScriptedRequest("chatcmpl-1", list(self.deltas), self.finish)

    def release(self, api, abort, reason="client_disconnect"):
        pass


def _ask(stub: StubTokenStreamClient, stream: bool, **kw):
    app = FastAPI()
    openai_routes.add_routes(app, stub)

    async def go():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as http:
            client = openai.AsyncOpenAI(
                base_url="http://t/v1", api_key="x", http_client=http, max_retries=0
            )
            args = dict(
                model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], **kw
            )
            if not stream:
                return (await client.chat.completions.create(**args)).model_dump()
            chunks = [c async for c in await client.chat.completions.create(stream=True, **args)]
            return [c.model_dump(exclude_unset=True) for c in chunks]

    return asyncio.run(go())


def test_http_reasoning_content_whole_and_streamed_over_a_stub_token_stream():
    deltas = ["<th", "ink>\nThe user", " wants Paris.</th", "ink>\n\nIt is", " sunny."]
    stub = StubTokenStreamClient(deltas, "qwen3")
    whole = _ask(stub, stream=False)["choices"][0]
    assert whole["message"]["reasoning_content"] == "The user wants Paris."
    assert whole["message"]["content"] == "It is sunny."
    chunks = _ask(stub, stream=True)
    deltas_out = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas_out) == "The user wants Paris."
    assert "".join(d.get("content") or "" for d in deltas_out) == "It is sunny."
    assert all(
        "<think>" not in (d.get("content") or "") + (d.get("reasoning_content") or "")
        for d in deltas_out
    )
    assert deltas_out[0]["role"] == "assistant"


@pytest.mark.parametrize(
    "parser,deltas",
    [
        (
            "hermes",
            [
                "<think>Use the tool.</think>\n<tool_",
                'call>{"name": "get_weather", "argu',
                'ments": {"city": "Pa',
                'ris"}}</tool_call>',
            ],
        ),
        (
            "llama3",
            [
                "<think>Use the tool.</think>",
                '<|python_tag|>{"name": "get_weather", ',
                '"parameters": {"city":',
                ' "Paris"}}',
            ],
        ),
        (
            "mistral",
            ["<think>Use the tool.</think>[TOOL_", "CALLS]get_weather[AR", 'GS]{"city": "Paris"}'],
        ),
        ("pythonic", ["<think>Use the tool.</think>[get_wea", 'ther(city="Par', 'is")]']),
    ],
)
def test_http_streamed_tool_calls_reassemble_like_the_whole_response(parser, deltas):
    stub = StubTokenStreamClient(deltas, "qwen3", parser)
    tools = [WEATHER, NOW]
    whole = _ask(stub, stream=False, tools=tools)["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert whole["message"]["reasoning_content"] == "Use the tool."
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]
    ]
    assert calls == [("get_weather", PARIS)]
    state = ChatCompletionStreamState()
    chunks = _ask(stub, stream=True, tools=tools)
    for chunk in chunks:
        state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate(chunk))
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == calls
    named = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    assert named[0]["choices"][0]["delta"]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": "",
    }


def test_http_parallel_tool_calls_false_returns_one_call_over_a_stub_token_stream():
    stub = StubTokenStreamClient(['[get_weather(city="Paris"), now()]'], None, "pythonic")
    whole = _ask(stub, stream=False, tools=[WEATHER, NOW], parallel_tool_calls=False)["choices"][0]
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]


def test_http_bad_parallel_tool_calls_is_a_400_naming_it():
    stub = StubTokenStreamClient(["x"], None)
    with pytest.raises(openai.BadRequestError) as e:
        _ask(stub, stream=False, tools=[WEATHER], extra_body={"parallel_tool_calls": "yes"})
    assert e.value.body["param"] == "parallel_tool_calls"
