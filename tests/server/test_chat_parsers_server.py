"""--reasoning-parser and --tool-call-parser end to end: a real server and the default model,
made to write the formats by constraints (the model knows neither on its own)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.helpers.server_utils import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "London"]}},
    "required": ["city"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


# SmolLM2's own template, with Llama 3.2's pythonic tool-call instructions when tools are given:
# no --tool-call-parser, so the server must read the format off the template.
PYTHONIC_PREAMBLE = (
    "{%- if tools %}{{ '<|im_start|>system\\nCall tools as [func_name1(params_name1=params_value1), "
    "func_name2(params)]: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    template = tmp_path_factory.mktemp("template") / "pythonic.jinja"
    template.write_text(
        PYTHONIC_PREAMBLE + AutoTokenizer.from_pretrained(default_model_dir).chat_template
    )
    s = Server(
        "--dtype",
        "float32",
        "--kv-cache-gb",
        "0.5",
        "--reasoning-parser",
        "qwen3",
        "--chat-template",
        str(template),
        startup_timeout=600,
    )  # the shared 2 cores may be busy
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


def test_tool_call_format_comes_from_the_chat_template(server):
    with server.client() as c:
        info = c.get("/get_server_info").json()
    assert (info["reasoning_parser"], info["tool_call_parser"]) == ("qwen3", "pythonic")


def test_pythonic_call_the_model_is_made_to_write_is_a_tool_call(oai):
    # A regex forces the pythonic text; tool_choice auto reads it as the parser would any output.
    kw = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        temperature=0,
        max_tokens=30,
        extra_body={"guided_regex": r'\[get_weather\(city="(Paris|London)"\)\]', **NO_THINKING},
    )
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    streamed = _streamed(oai, **kw)
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]


# SmolLM2 never closes a think block on its own: under qwen3's grammar it opens one and rambles.
# These biases make it write "<think></think>" and go on to the answer, which the grammar rules.
CLOSE_AT_ONCE = {"9617": 100, "17400": 100, "46": 100}  # "</", "think", ">"


def test_response_format_rules_the_answer_after_the_reasoning(oai):
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "London"]}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
    }
    kw = dict(
        model=MODEL,
        messages=ASK,
        temperature=0,
        max_tokens=60,
        logit_bias=CLOSE_AT_ONCE,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
    )
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop", whole
    jsonschema.validate(json.loads(whole.message.content), schema)  # no think tags left in it
    assert "reasoning_content" in whole.message.model_extra
    deltas = [
        c.choices[0].delta for c in oai.chat.completions.create(stream=True, **kw) if c.choices
    ]
    assert "".join(d.content or "" for d in deltas) == whole.message.content


def test_forced_tool_call_after_the_reasoning(oai):
    kw = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        temperature=0,
        max_tokens=60,
        logit_bias=CLOSE_AT_ONCE,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
    (call,) = whole.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    streamed = _streamed(oai, **kw)
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_output_cut_short_inside_the_reasoning_is_all_reasoning(oai):
    out = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0,
        max_tokens=12,
        response_format={"type": "json_object"},
    ).choices[0]
    # The grammar's optional block opened and never closed within 12 tokens.
    assert out.finish_reason == "length" and out.message.content is None, out
    reasoning = out.message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning


def test_bad_constraint_under_a_reasoning_parser_names_its_field(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=5,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": {"type": "objec"}},
            },
        )
    assert e.value.body["param"] == "response_format.json_schema.schema"
