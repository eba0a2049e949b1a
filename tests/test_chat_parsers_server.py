"""--reasoning-parser and --tool-call-parser end to end: a real server and the default model,
made to write the formats by constraints (the model knows neither on its own)."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server_utils import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "London"]}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server():
    s = Server("--dtype", "float32", "--kv-cache-gb", "0.5", "--reasoning-parser", "qwen3",
               "--tool-call-parser", "pythonic")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _streamed(oai, **kw):
    state = ChatCompletionStreamState()
    for chunk in oai.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
    return state.get_final_completion().choices[0]


def test_server_reports_its_parsers(server):
    with server.client() as c:
        info = c.get("/get_server_info").json()
    assert (info["reasoning_parser"], info["tool_call_parser"]) == ("qwen3", "pythonic")


def test_pythonic_call_the_model_is_made_to_write_is_a_tool_call(oai):
    # A regex forces the pythonic text; tool_choice auto reads it as the parser would any output.
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=30,
              extra_body={"guided_regex": r'\[get_weather\(city="(Paris|London)"\)\]', **NO_THINKING})
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    streamed = _streamed(oai, **kw)
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]


def test_reasoning_written_in_think_tags_comes_back_as_reasoning_content(oai):
    # The model writes a think block and an answer because the regex makes it; the parser splits them.
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=40,
              extra_body={"guided_regex": r"<think>[a-z]{2,8}( [a-z]{2,8}){0,3}</think>\n\n(Sunny|Rainy)\."})
    whole = oai.chat.completions.create(**kw).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert whole.finish_reason == "stop", whole
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning, whole
    assert re.search(r"(Sunny|Rainy)\.$", whole.message.content) and not whole.message.content.startswith("\n")
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == whole.message.content


def test_response_format_applies_to_the_answer_after_the_reasoning(oai):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "London"]}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"]}
    out = oai.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": schema}}).choices[0]
    assert out.finish_reason == "stop", out
    jsonschema.validate(json.loads(out.message.content), schema)
    assert "reasoning_content" in out.message.model_extra


def test_forced_tool_call_under_a_reasoning_parser(oai):
    out = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), WEATHER_PARAMS)


def test_bad_constraint_under_a_reasoning_parser_names_its_field(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "objec"}}})
    assert e.value.body["param"] == "response_format.json_schema.schema"
