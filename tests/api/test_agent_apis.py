"""The Responses and Messages APIs' pure parts, without a server: the previous_response_id
store's bounds, the output blocks a streamed and a whole response share, the translation of
their bodies into chat requests (errors renamed to the client's fields), and their event
streams when a request fails mid-way."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pydantic
import pytest

from relay.api.anthropic_output import message_events
from relay.api.anthropic_request import parse_anthropic
from relay.api.errors import ProtocolError
from relay.api.output_blocks import CALL, REASONING, TEXT, BlockStream, Closed, Opened, whole_blocks
from relay.api.responses_output import ResponseEvents
from relay.api.responses_request import parse_responses
from relay.api.responses_store import ResponseStore
from relay.api.tool_calls import Tool, ToolCalling
from relay.outputs import RequestOutput

MODEL = "m"


def test_the_store_keeps_the_most_recently_used_responses_within_its_bounds():
    store = ResponseStore(max_responses=2, max_chars=10_000)
    for rid in ("a", "b"):
        store.put(rid, [{"role": "user", "content": rid}])
    assert store.get("a") == [{"role": "user", "content": "a"}]  # "a" is now the most recent
    store.put("c", [{"role": "user", "content": "c"}])
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    big = [{"role": "user", "content": "x" * 6_000}]
    store.put("d", big)
    store.put("e", big)  # two do not fit in 10,000 characters: the older goes
    assert store.get("d") is None and store.get("e") == big
    store.put("huge", [{"role": "user", "content": "x" * 20_000}])  # larger than the bound
    assert store.get("huge") is None and store.get("e") == big


def test_a_stored_conversation_is_a_copy():
    store = ResponseStore()
    store.put("a", [{"role": "user", "content": "Hi"}])
    store.get("a").append({"role": "user", "content": "more"})
    assert store.get("a") == [{"role": "user", "content": "Hi"}]


def test_blocks_streamed_in_pieces_are_the_whole_responses_blocks():
    tools = ToolCalling((Tool("f"),), "auto")
    text = '<think>hmm</think>Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    whole, reason = whole_blocks(tools, "qwen3", text, "stop")
    assert [(b.kind, b.text) for b in whole] == [
        (REASONING, "hmm"),
        (TEXT, "Sure."),
        (CALL, '{"x": 1}'),
    ]
    assert reason == "tool_calls" and whole[2].name == "f"
    stream = BlockStream(tools, "qwen3")
    events = [e for ch in text for e in stream.feed(ch)]
    events += stream.finish("stop")[0]
    assert [(b.kind, b.text) for b in stream.blocks] == [(b.kind, b.text) for b in whole]
    opened = [e.block.index for e in events if isinstance(e, Opened)]
    closed = [e.block.index for e in events if isinstance(e, Closed)]
    assert opened == closed == [0, 1, 2]  # each opened once, closed once, in order


def _error(parse, body) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        parse(body)
    return e.value


def test_chat_errors_name_the_responses_field():
    def parse(body):
        return parse_responses(body, MODEL, ResponseStore())

    e = _error(parse, {"input": "Hi", "max_output_tokens": -1})
    assert e.param == "max_output_tokens" and "'max_output_tokens'" in e.message
    e = _error(parse, {"input": "Hi", "tools": [{"type": "function", "name": "a b"}]})
    assert e.param == "tools[0].name"


def test_chat_errors_name_the_anthropic_field():
    def parse(body):
        return parse_anthropic({"max_tokens": 4, **body}, MODEL)

    msgs = [{"role": "user", "content": "Hi"}]
    e = _error(parse, {"messages": msgs, "stop_sequences": [3]})
    assert e.param == "stop_sequences" and "'stop_sequences'" in e.message
    tools = [{"name": "f", "input_schema": {}}]
    e = _error(
        parse, {"messages": msgs, "tools": tools, "tool_choice": {"type": "tool", "name": "g"}}
    )
    assert e.param == "tool_choice.name"


def test_function_calls_in_a_row_are_one_assistant_turn_and_outputs_name_their_call():
    parsed = parse_responses(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "b", "output": "2"},
            ],
        },
        MODEL,
        ResponseStore(),
    )
    system, user, turn, result = parsed.parsed.messages
    assert (system["role"], user["content"]) == ("system", "Hi")
    assert [c["id"] for c in turn["tool_calls"]] == ["a", "b"]
    assert (result["role"], result["tool_call_id"], result["name"]) == ("tool", "b", "g")
    assert [m["role"] for m in parsed.conversation] == ["user", "assistant", "tool"]


def test_tool_results_come_before_the_text_of_their_turn_and_errors_say_so():
    parsed = parse_anthropic(
        {
            "max_tokens": 4,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": ""},
                        {"type": "tool_use", "id": "t", "name": "f", "input": {"x": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "and?"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": "no",
                            "is_error": True,
                        },
                    ],
                },
            ],
        },
        MODEL,
    )
    roles = [(m["role"], m["content"]) for m in parsed.messages]
    assert roles == [
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", ""),
        ("tool", "Error: no"),
        ("user", "and?"),
    ]
    assert parsed.messages[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


def _sse(records: list[RequestOutput], events) -> list[dict]:
    """The events a stream of these records makes, as sent."""

    async def outs():
        for r in records:
            yield 0, r

    async def run():
        return [chunk async for chunk in events(outs())]

    out = []
    for chunk in asyncio.run(run()):
        head, data = chunk.decode().strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


FIRST = RequestOutput("r", text="Hel", prompt_tokens=3, completion_tokens=1)
FAILED = RequestOutput("r", finish_reason="abort", error="boom", status=503)


def test_a_response_failing_mid_stream_ends_with_error_and_response_failed():
    req = parse_responses({"input": "Hi", "stream": True}, MODEL, ResponseStore())
    kept = []
    events = _sse([FIRST, FAILED], ResponseEvents(req, "resp-1", 0, MODEL, kept.append).events)
    adapter = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["error"]["message"] == "boom"
    assert kept == []  # a failed response is not stored


def test_a_message_failing_mid_stream_ends_with_an_error_event():
    parsed = parse_anthropic(
        {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}, MODEL
    )
    events = _sse([FIRST, FAILED], lambda outs: message_events(outs, parsed, "msg-1", MODEL))
    adapter = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for e in events[:-1]:
        adapter.validate_python(e)
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    assert events[-1]["error"] == {"type": "overloaded_error", "message": "boom"}


def test_anthropic_tool_choice_and_cache_control_read_as_chat_does():
    parsed = parse_anthropic(
        {
            "max_tokens": 4,
            "system": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"name": "f", "input_schema": {}, "cache_control": {"type": "ephemeral"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        },
        MODEL,
    )
    assert (parsed.tools.mode, parsed.tools.parallel) == ("required", False)
    assert parsed.params.json_schema is not None  # the forced call's grammar


def test_a_developer_message_is_a_system_message():
    parsed = parse_responses(
        {"input": [{"type": "message", "role": "developer", "content": "Be brief."}]},
        MODEL,
        ResponseStore(),
    )
    assert parsed.parsed.messages == [{"role": "system", "content": "Be brief."}]
