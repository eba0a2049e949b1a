"""The qwen3_coder, deepseek_v3 / deepseek_v31 and harmony tool-call parsers: each format read
whole and split at every point (and at random) gives the same content, reasoning and calls;
malformed output is content; the default from the chat template; the forced-call structural
tag of each format compiles in xgrammar, accepts a call the parser reads back and refuses a
wrong one."""

from __future__ import annotations

import json

import pytest

from relay.api.chat import parse_chat
from relay.api.chat_output import ChatOutput
from relay.api.reasoning import Reasoning
from relay.api.tool_calls import AUTO, NAMED, REQUIRED, Tool, ToolCalling
from relay.api.tool_output import CallStart
from relay.api.tool_parsers import parser_for_template
from tests.helpers.parser_checks import MODEL, PARIS, read, splits

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "units": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city"],
}
TOOLS = (Tool("get_weather", None, WEATHER_PARAMS), Tool("now"))
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
NOW = {"type": "function", "function": {"name": "now"}}


def calling(parser: str, mode: str = AUTO, named: str | None = None) -> ToolCalling:
    return ToolCalling(TOOLS, mode, named, parser=parser)


def reasoning_of(parser: str) -> str | None:
    return "harmony" if parser == "harmony" else None


BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
V3_CALL = f'{CALL}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{CALL_END}'
ANALYSIS = "<|channel|>analysis<|message|>Need the weather.<|end|>"
H_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)

OUTPUTS = [
    # (parser, text, reasoning, content, calls)
    (
        "qwen3_coder",
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        '<parameter=days>\n3\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
        "</function>\n</tool_call>",
        None,
        "Let me check.",
        [("get_weather", '{"city": "Paris", "days": 3, "tags": ["a", "b"]}')],
    ),
    (  # two blocks; a string that looks like JSON stays a string; an open parameter is closed
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=units>\nnull\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=now>\n</function>\n</tool_call>\n"
        "<function=get_weather>\n<parameter=city>\na < b\n<parameter=days>\nsoon\n</function> done",
        None,
        "done",
        [
            ("get_weather", '{"city": "42", "units": "null"}'),
            ("now", "{}"),
            ("get_weather", '{"city": "a < b", "days": "soon"}'),
        ],
    ),
    ("qwen3_coder", "x <tool_call> y", None, "x <tool_call> y", []),  # no function: text
    ("qwen3_coder", "<function=not a name>", None, "<function=not a name>", []),
    ("qwen3_coder", "a <b> <functio", None, "a <b> <functio", []),
    (
        "qwen3_coder",  # cut short in a value: what was read is kept, and closed
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        None,
        None,
        [("get_weather", '{"city": "Par"}')],
    ),
    (
        "deepseek_v3",
        f"Checking.{BEGIN}{V3_CALL}\n{CALL}now{SEP}{{}}{CALL_END}{END} after",
        None,
        "Checking. after",
        [("get_weather", PARIS), ("now", "{}")],
    ),
    (
        "deepseek_v31",
        f'{BEGIN}{CALL}get_weather{SEP}{{"city": "a}}\\"{{"}}{CALL_END}{END}',
        None,
        None,
        [("get_weather", '{"city": "a}\\"{"}')],
    ),
    ("deepseek_v3", f"{BEGIN}oops{END}", None, f"{BEGIN}oops{END}", []),
    ("deepseek_v3", f"{BEGIN}{CALL}bad name{SEP}{{}}", None, f"{BEGIN}{CALL}bad name{SEP}{{}}", []),
    ("deepseek_v3", "no calls <｜tool▁", None, "no calls <｜tool▁", []),
    ("harmony", ANALYSIS + H_CALL, "Need the weather.", None, [("get_weather", PARIS)]),
    (
        "harmony",
        ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
        "Need the weather.",
        "It is sunny.",
        [],
    ),
    (  # recipient before the channel; a call of no arguments; cut short before <|call|>
        "harmony",
        "<|start|>assistant to=functions.now<|channel|>commentary json<|message|><|call|>"
        ' to=functions.get_weather<|channel|>commentary json<|message|> {"city": "Paris"} ',
        None,
        None,
        [("now", "{}"), ("get_weather", PARIS)],
    ),
    ("harmony", "Plain text, no channels.", None, "Plain text, no channels.", []),
    (
        "harmony",
        "<|channel|>final<|message|>Hi<|end|><|channel|>analysis",  # an unfinished header
        None,
        "Hi",
        [],
    ),
]


@pytest.mark.parametrize("parser,text,reasoning,content,calls", OUTPUTS)
def test_whole_and_every_split_agree(parser, text, reasoning, content, calls):
    for deltas in splits(text):
        assert read(calling(parser), reasoning_of(parser), deltas) == (
            reasoning,
            content,
            calls,
            "tool_calls" if calls else "stop",
        ), deltas


def test_harmony_without_tools_splits_channels_and_calls_nothing():
    text = ANALYSIS + H_CALL.replace("<|call|>", "<|end|>") + "<|start|>assistant<|channel|>final"
    text += "<|message|>Sunny.<|return|>"
    for deltas in splits(text):
        assert read(None, "harmony", deltas) == (
            "Need the weather.",
            '{"city": "Paris"}Sunny.',
            [],
            "stop",
        )


def test_calls_stream_their_name_before_their_arguments_end():
    for parser, head, tail in [
        (
            "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=ci",
            "ty>\nParis\n</parameter>",
        ),
        ("deepseek_v31", f'{BEGIN}{CALL}get_weather{SEP}{{"ci', 'ty": "Paris"'),
        ("harmony", ANALYSIS + H_CALL[:-14], H_CALL[-14:-9]),
    ]:
        out = ChatOutput(calling(parser), reasoning_of(parser))
        first = out.feed(head)
        starts = [p for p in first if isinstance(p, CallStart)]
        assert [s.name for s in starts] == ["get_weather"], parser
        if parser == "harmony":  # the reasoning came before the call
            assert first[0] == Reasoning("Need the weather.")
        assert out.feed(tail), parser  # more of the arguments, before the call ends


@pytest.mark.parametrize(
    "template,parser",
    [
        (
            "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
            "{{- '<parameter=' + name + '>\\n' }}",
            "qwen3_coder",
        ),
        (
            "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
            "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments']}}",
            "deepseek_v3",
        ),
        (
            "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + "
            "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}",
            "deepseek_v31",
        ),
        (
            "{{- '<|start|>assistant<|channel|>commentary to=functions.' + name + "
            "' <|constrain|>json<|message|>' }}<tool_call>",
            "harmony",
        ),
        ("<tool_call>{{ tools | tojson }}</tool_call>", "hermes"),
    ],
)
def test_default_parser_follows_the_chat_template(template, parser):
    assert parser_for_template(template) == parser


# ---- forced calls -------------------------------------------------------------------------------

FORCED = [
    # (parser, a valid forced call of get_weather, a wrong one)
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n",
    ),
    (
        "deepseek_v3",
        f'{BEGIN}{CALL}function{SEP}get_weather\n```json\n{{"city": "Paris", "days": 3}}'
        f"\n```{CALL_END}{END}",
        f'{BEGIN}{CALL}function{SEP}get_weather\n```json\n{{"town": "Paris"}}',
    ),
    (
        "deepseek_v31",
        f'{BEGIN}{CALL}get_weather{SEP}{{"city": "Paris", "days": 3}}{CALL_END}{END}',
        f'{BEGIN}{CALL}get_weather{SEP}{{"city": 3}}',
    ),
    (
        "harmony",
        "<|channel|>analysis<|message|>Sure.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>',
        '<|channel|>final<|message|>{"city": "Paris"}',
    ),
]
STOP = "</s>"


def _matcher(structural_tag: str):
    xgrammar = pytest.importorskip("xgrammar")
    markers = [BEGIN, END, CALL, CALL_END, SEP, "<tool_call>", "</tool_call>", "<|start|>"]
    markers += ["<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>", STOP]
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "｜", "▁"] + markers
    info = xgrammar.TokenizerInfo(vocab, stop_token_ids=[vocab.index(STOP)])
    compiled = xgrammar.GrammarCompiler(info).compile_structural_tag(structural_tag)
    return xgrammar.GrammarMatcher(compiled), vocab.index(STOP)


@pytest.mark.parametrize("parser,valid,wrong", FORCED)
@pytest.mark.parametrize("mode", [NAMED, REQUIRED])
def test_forced_call_grammar_accepts_a_call_the_parser_reads_and_refuses_a_wrong_one(
    parser, valid, wrong, mode
):
    tools = calling(parser, mode, "get_weather" if mode == NAMED else None)
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [WEATHER, NOW],
        "tool_choice": (
            {"type": "function", "function": {"name": "get_weather"}} if mode == NAMED else mode
        ),
    }
    params = parse_chat(body, MODEL, tool_call_parser=parser).params
    assert params.json_schema is None and params.structural_tag == tools.structural_tag()
    matcher, stop = _matcher(params.structural_tag)
    assert matcher.accept_string(valid) and matcher.accept_token(stop) and matcher.is_terminated()
    matcher, _ = _matcher(params.structural_tag)
    assert not matcher.accept_string(wrong)
    if mode == NAMED:  # only the named function
        matcher, _ = _matcher(params.structural_tag)
        assert not matcher.accept_string(valid.replace("get_weather", "now"))
    for deltas in splits(valid):  # the forced output is read by the format's parser
        assert read(tools, reasoning_of(parser), deltas) == (
            "Sure." if parser == "harmony" else None,
            None,
            [("get_weather", '{"city": "Paris", "days": 3}')],
            "tool_calls",
        )


def test_forced_calls_of_other_parsers_stay_json_and_harmony_keeps_special_tokens():
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    forced = {**body, "tool_choice": "required"}
    hermes = parse_chat(forced, MODEL, tool_call_parser="hermes").params
    assert hermes.structural_tag is None and json.loads(hermes.json_schema)["type"] == "array"
    plain = {"messages": body["messages"]}
    harmony = parse_chat(plain, MODEL, tool_call_parser="harmony")  # no tools: still channels
    assert harmony.reasoning == "harmony" and harmony.params.skip_special_tokens is False
    assert (
        parse_chat(body, MODEL, tool_call_parser="deepseek_v3").params.skip_special_tokens is False
    )
    assert parse_chat(plain, MODEL, tool_call_parser="deepseek_v3").params.skip_special_tokens
    # After a <think> block, the structural tag is wrapped like any constraint.
    wrapped = parse_chat(forced, MODEL, reasoning_parser="qwen3", tool_call_parser="qwen3_coder")
    assert wrapped.params.structural_tag and wrapped.params.reasoning_tags == (
        "<think>",
        "</think>",
    )
    from relay.text.grammar import after_reasoning

    matcher, stop = _matcher(
        after_reasoning(
            "structural_tag", wrapped.params.structural_tag, *wrapped.params.reasoning_tags
        )
    )
    assert matcher.accept_string("<think>Hmm.</think>\n" + FORCED[0][1]) and matcher.accept_token(
        stop
    )
