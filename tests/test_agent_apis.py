"""The Responses and Messages APIs' pure parts, without a server: the previous_response_id
store's bounds, the output blocks a streamed and a whole response share, and errors renamed
to the client's field names."""

from __future__ import annotations

import pytest

from relay.api.anthropic_request import parse_anthropic
from relay.api.fields import ProtocolError
from relay.api.output_blocks import CALL, REASONING, TEXT, BlockStream, Closed, Opened, whole_blocks
from relay.api.responses_request import parse_responses
from relay.api.responses_store import ResponseStore
from relay.api.tool_calls import Tool, ToolCalling

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
