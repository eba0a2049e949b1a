"""Grammar-constrained decoding (relay.text.grammar) on the default model, offline Engine: outputs
that validate against their JSON schema / fully match their regex, greedy and sampled, and
unconstrained neighbours left exactly as they were."""

from __future__ import annotations

import json
import math
import re
import threading
import time

import jsonschema
import pytest
import torch

from relay import Engine, SamplingParams
from relay.api.chat import parse_chat
from relay.api.completions import parse_completion
from relay.api.errors import ProtocolError
from relay.api.generate import parse_generate
from relay.config import EngineConfig, ModelConfig
from relay.execution.step_sampling import apply_token_masks
from relay.sampling_params import InvalidParam, json_depth, widest_object
from relay.scheduling.request import Req
from relay.text.grammar import COMPILE_WORKERS, make_backend

xgrammar = pytest.importorskip("xgrammar")

SHORT = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]},
            "sunny": {"type": "boolean"},
        },
        "required": ["city", "sunny"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "email": {"type": "string", "pattern": "^[a-z]{2,8}@[a-z]{2,6}\\.com$"},
                },
                "required": ["id", "email"],
            }
        },
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "currency": {"enum": ["EUR", "USD"]},
        },
        "required": ["price", "currency"],
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -50, "maximum": 50},
        "minItems": 2,
        "maxItems": 5,
    },
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "ok": {"type": "boolean"},
        },
        "required": ["code", "ok"],
    },
    {
        "type": "object",
        "properties": {
            "steps": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "n": {"type": "integer", "minimum": 1, "maximum": 9},
                        "do": SHORT,
                    },
                    "required": ["n", "do"],
                },
            }
        },
        "required": ["steps"],
    },
    {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no", "maybe"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["answer", "confidence"],
    },
    {
        "type": "object",
        "properties": {
            "title": SHORT,
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "genres": {
                "type": "array",
                "items": {"enum": ["drama", "comedy", "horror"]},
                "maxItems": 2,
            },
        },
        "required": ["title", "year", "genres"],
    },
]
# Bounded repeats: a 135M model greedily repeating "zm" forever inside [a-z]+ is the model's
# doing, not the engine's.
REGEXES = [
    r"\d{3}-\d{4}",
    r"[A-Z][a-z]{2,8}",
    r"(yes|no)",
    r"\d{1,5}\.\d{2}",
    r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)",
    r"#[0-9a-f]{6}",
    r"(\d{1,3}\.){3}\d{1,3}",
    r"[A-Z]{2}\d{4}",
    r"(true|false)",
    r"-?\d{1,4}",
    r"\d{4}-\d{2}-\d{2}",
    r"[a-z]{3,6}( [a-z]{3,6}){1,3}",
    r"(red|green|blue), (cat|dog)",
    r"0x[0-9A-F]{4}",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"[A-Z][a-z]{1,9}, [A-Z][a-z]{1,9}",
    r"v\d\.\d\.\d",
    r"(Mon|Tue|Wed)day",
    r"\d{2}:\d{2}",
    r"[a-z_]{2,10}\(\)",
]
PROMPTS = [
    "Answer in JSON.",
    "Give me some data:",
    "Here is a record:",
    "Write the output now.",
    "Example:",
]


@pytest.fixture(scope="module")
def engine(default_model_dir):
    # float block products: the n-gram test compares greedy output with and without speculation,
    # equal bit for bit only where a verify step's rows multiply as exactly as a decode step's
    # (int8 block activations round x, so a last-bit difference between the attention paths can
    # turn a token)
    return Engine(default_model_dir, dtype="float32", kv_cache_gb=0.5, block_activations="float")


def test_outputs_validate_against_their_schemas(engine):
    """100 requests over 10 schemas, greedy and sampled, batched together."""
    jobs = [
        (schema, prompt, seed) for schema in SCHEMAS for prompt in PROMPTS for seed in (None, 1)
    ]
    params = [
        SamplingParams(
            max_new_tokens=160,
            json_schema=json.dumps(s),
            **({"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}),
        )
        for s, _, seed in jobs
    ]
    outs = engine.generate([f"{p} {json.dumps(s)[:60]}" for s, p, _ in jobs], params)
    for (schema, _, _), out in zip(jobs, outs):
        assert out.finish_reason == "stop", (out.text, schema)
        jsonschema.validate(json.loads(out.text), schema)
    assert engine.scheduler.stats().grammar["live_matchers"] == 0
    engine.check()


def test_outputs_fully_match_their_regexes(engine):
    outs = engine.generate(
        [f"Example {i}:" for i in range(len(REGEXES))],
        [SamplingParams(max_new_tokens=48, temperature=0, regex=r) for r in REGEXES],
    )
    for regex, out in zip(REGEXES, outs):
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), (regex, out.text)


def test_logit_bias_never_beats_the_grammar(engine):
    """+100 on tokens the grammar forbids changes nothing (the mask's -inf stays); -100 on the
    constrained greedy choice makes the grammar take its next best, still a match."""
    tok = engine.tokenizer.hf
    regex, prompt = r"(yes|no)", "Is the sky blue? Answer:"
    (plain,) = engine.generate(
        [prompt], SamplingParams(max_new_tokens=8, temperature=0, regex=regex)
    )
    letters = {tok.convert_tokens_to_ids(t): 100.0 for t in ("x", "z", "Q")}
    (pushed,) = engine.generate(
        [prompt], SamplingParams(max_new_tokens=8, temperature=0, regex=regex, logit_bias=letters)
    )
    assert pushed.token_ids == plain.token_ids
    (banned,) = engine.generate(
        [prompt],
        SamplingParams(
            max_new_tokens=8, temperature=0, regex=regex, logit_bias={plain.token_ids[0]: -100.0}
        ),
    )
    assert re.fullmatch(regex, banned.text) and banned.token_ids[0] != plain.token_ids[0]


def test_ebnf(engine):
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    (out,) = engine.generate(
        ["Is the sky blue?"], SamplingParams(max_new_tokens=16, temperature=0, ebnf=grammar)
    )
    assert out.text in ("The answer is yes.", "The answer is no.")


def test_unconstrained_neighbours_are_untouched(engine):
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    alone = engine.generate(prompts, greedy)
    schema = SamplingParams(max_new_tokens=24, temperature=0, json_schema=json.dumps(SCHEMAS[0]))
    mixed = engine.generate(
        ["JSON:", *prompts, "More JSON:"], [schema, greedy, greedy, greedy, schema]
    )
    assert [o.token_ids for o in mixed[1:4]] == [o.token_ids for o in alone]


def test_bad_constraints_name_their_field(engine):
    for params, field in [
        (SamplingParams(json_schema='{"type": "objec"}'), "json_schema"),
        (SamplingParams(json_schema="{not json"), "json_schema"),
        (SamplingParams(regex="a(b"), "regex"),
        (SamplingParams(ebnf="root ::= undefined_rule"), "ebnf"),
        (SamplingParams(regex="a", ebnf='root ::= "a"'), "ebnf"),
    ]:
        with pytest.raises(InvalidParam) as info:
            engine.generate(["x"], params)
        assert info.value.field == field


def test_cut_short_grammar_ends_with_length_and_frees_its_matcher(engine):
    (out,) = engine.generate(
        ["Say a's:"], SamplingParams(max_new_tokens=4, temperature=0, regex="a{40}")
    )
    assert out.finish_reason == "length" and len(out.token_ids) == 4 and set(out.text) == {"a"}
    assert engine.scheduler.stats().grammar["live_matchers"] == 0
    engine.check()


def test_abort_while_compiling_or_running_frees_the_matcher(engine):
    sched = engine.scheduler
    fresh = json.dumps({"type": "object", "properties": {"never_seen_before": {"type": "integer"}}})
    for rid, schema in (("compiling", fresh), ("cached", json.dumps(SCHEMAS[1]))):
        sched.add_request(Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=8, json_schema=schema)))
    assert sched.stats().grammar["live_matchers"] == 2
    gone = json.dumps(
        {"type": "object", "properties": {"aborted_while_compiling": {"type": "string"}}}
    )
    sched.add_request(Req("gone", [1, 2, 3], SamplingParams(max_new_tokens=8, json_schema=gone)))
    assert sched.abort("gone").finish_reason == "abort"
    sched.grammar_waits.wait()
    sched.poll_constraints()
    batch = sched.schedule()
    assert batch.token_masks  # the ready one runs with a mask
    for rid in ("compiling", "cached"):
        assert sched.abort(rid).finish_reason == "abort"
    sched.process_output(batch, engine.runner.forward(batch))
    assert sched.stats().grammar["live_matchers"] == 0 and not sched.has_work
    engine.check()


@pytest.fixture
def held_compiles(engine, monkeypatch):
    """Compiles on the engine's grammar backend wait at a gate until the test opens it (set());
    whatever is still held then runs at teardown."""
    backend = engine.scheduler.grammars
    gate = threading.Event()
    compile_now = backend._compile

    def held(kind, text, reasoning=None):
        gate.wait()
        return compile_now(kind, text, reasoning)

    monkeypatch.setattr(backend, "_compile", held)
    yield gate
    gate.set()


def _schema(name: str) -> str:
    return json.dumps(
        {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    )


def _run(engine, done) -> list:
    """Step the engine's scheduler (no Engine.generate: nothing waits for a compile) until done()."""
    sched, records = engine.scheduler, []
    while not done():
        records += sched.poll_constraints()
        batch = sched.schedule()
        if batch is not None:
            records += sched.process_output(batch, engine.runner.forward(batch))
        else:
            sched.grammar_waits.wait()
    return records


def test_plain_requests_run_while_grammars_compile(engine, held_compiles):
    """With every compile thread busy and more compiles queued behind them, a plain request
    arriving after the constrained ones is admitted, runs and finishes while they all still
    compile; then they run too."""
    sched = engine.scheduler
    held = [f"held-{i}" for i in range(COMPILE_WORKERS + 2)]
    for rid in held:
        sched.add_request(
            Req(
                rid,
                [1, 2, 3],
                SamplingParams(max_new_tokens=4, temperature=0, json_schema=_schema(rid)),
            )
        )
    sched.add_request(Req("plain", [1, 2, 3, 4], SamplingParams(max_new_tokens=4, temperature=0)))
    records = _run(engine, lambda: "plain" not in sched.table.reqs)
    assert [r.finish_reason for r in records if r.rid == "plain"][-1] == "length"
    assert all(sched.table.reqs[rid].grammar_compiling for rid in held)
    held_compiles.set()
    records = _run(engine, lambda: not sched.has_work)
    assert {r.rid for r in records if r.finished and r.error is None} == set(held)
    assert sched.stats().grammar["live_matchers"] == 0
    engine.check()


def test_grammar_compile_timeout_ends_the_request_with_a_400(engine, held_compiles, monkeypatch):
    sched = engine.scheduler
    now = [0.0]
    monkeypatch.setattr(sched, "clock", lambda: now[0])
    slow = _schema("slow_to_compile")
    sched.add_request(Req("slow", [1, 2, 3], SamplingParams(max_new_tokens=4, json_schema=slow)))
    assert sched.poll_constraints() == []
    now[0] += sched.cfg.grammar_compile_timeout  # its deadline
    (out,) = sched.poll_constraints()
    assert out.finish_reason == "abort" and (out.status, out.param) == (400, "json_schema")
    assert "did not compile within" in out.error and "--grammar-compile-timeout" in out.error
    assert not sched.has_work and sched.stats().grammar["live_matchers"] == 0
    # The offline engine's check before queueing says the same.
    with pytest.raises(InvalidParam) as info:
        sched.grammars.check([("json_schema", slow)], timeout=0.0)
    assert info.value.field == "json_schema" and "did not compile within 0 s" in str(info.value)
    assert sched.stats().grammar["live_matchers"] == 0
    engine.check()


def test_compile_nobody_waits_for_is_cancelled(engine, held_compiles):
    """A compile not yet started is dropped once the last request that wanted it ends (abort,
    client gone); while another still wants it, it stays."""
    sched, backend = engine.scheduler, engine.scheduler.grammars
    busy = [f"busy-{i}" for i in range(COMPILE_WORKERS)]  # holds every compile thread
    for rid in busy:
        sched.add_request(
            Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=4, json_schema=_schema(rid)))
        )
    queued = _schema("queued_then_abandoned")
    for rid in ("first", "second"):
        sched.add_request(Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=4, json_schema=queued)))
    cancelled = backend.stats()["compiles_cancelled"]
    sched.abort("first")
    assert backend.stats()["compiles_cancelled"] == cancelled
    sched.abort("second")
    assert backend.stats()["compiles_cancelled"] == cancelled + 1
    for rid in busy:
        sched.abort(rid)
    assert not sched.has_work and backend.stats()["live_matchers"] == 0
    held_compiles.set()
    # The dropped compile is not what a later request with the same text gets.
    sched.add_request(
        Req("later", [1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0, json_schema=queued))
    )
    records = _run(engine, lambda: not sched.has_work)
    assert [r.error for r in records if r.finished] == [None]
    assert backend.stats()["live_matchers"] == 0
    engine.check()


def test_unsatisfiable_grammar_is_refused_before_it_runs(engine):
    """A grammar no output can match (no first token allowed) is a 400 naming its field before
    a step runs, offline and on the server's path."""
    never = SamplingParams(max_new_tokens=4, ebnf="root ::= root")
    with pytest.raises(InvalidParam) as info:
        engine.generate(["x"], never)
    assert info.value.field == "ebnf" and "no output can match it" in str(info.value)
    sched = engine.scheduler
    sched.add_request(Req("never", [1, 2, 3], never))
    records = _run(engine, lambda: not sched.has_work)
    assert [(r.status, r.param, r.completion_tokens) for r in records] == [(400, "ebnf", 0)]
    assert sched.stats().grammar["live_matchers"] == 0
    engine.check()


def test_grammar_dead_end_mid_output_ends_with_a_400(engine):
    """A grammar that allows a first token and then none (its rule x matches nothing): the
    request ends with a 400 naming the field once its matcher allows no token, not a 500, and
    its KV and matcher come back."""
    dead_end = SamplingParams(max_new_tokens=8, temperature=0, ebnf='root ::= "a" x\nx ::= x')
    (out,) = engine.generate(["Say a:"], dead_end)
    assert out.finish_reason == "abort" and (out.status, out.param) == (400, "ebnf"), out
    assert out.error == "the ebnf allows no token after 1 output tokens: no output can complete it"
    assert engine.scheduler.stats().grammar["live_matchers"] == 0
    engine.check()


def test_constraint_over_the_size_limit_is_refused(engine):
    big = json.dumps(
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(6000)}}
    )
    assert len(big) > engine.config.max_constraint_bytes
    with pytest.raises(InvalidParam) as info:
        engine.generate(["x"], SamplingParams(json_schema=big))
    assert info.value.field == "json_schema" and "--max-constraint-bytes" in str(info.value)


def _nested_objects(levels: int) -> str:
    """Object schemas nested `levels` deep: a JSON document 2 * levels + 1 levels deep."""
    return (
        '{"type":"object","properties":{"a":' * levels
        + '{"type":"string"}'
        + '},"required":["a"]}' * levels
    )


def test_json_depth_counts_the_schema_documents_nesting():
    """Objects and arrays of the document; brackets in strings (escaped quotes too) do not
    count. Linear whatever the text: a string scan that could fail to close (on '"' followed
    by escaped quotes) made the second text below take 43 s."""
    assert json_depth(_nested_objects(3)) == 7
    assert json_depth('{"enum": [[1], [2, [3]]]}') == 4
    assert json_depth('{"a": "]]}} [[{{ \\" [[", "b": {"c": []}}') == 3
    start = time.perf_counter()
    assert json_depth("[" * 131072) == 131072
    assert json_depth('"' + '\\"' * 65535) == 0
    assert time.perf_counter() - start < 2


def _parses_by_field(schema: dict, limit_name: str) -> dict:
    """For each API field a JSON schema may come in: the field's name -> a parse of a request
    carrying schema there under limit_name=limit (a forced tool call's: the tool's parameters)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    messages = [{"role": "user", "content": "Hi"}]
    return {
        "json_schema": lambda limit: parse_completion(
            {"model": "m", "prompt": "x", "json_schema": schema}, "m", **{limit_name: limit}
        ),
        "response_format.json_schema.schema": lambda limit: parse_chat(
            {
                "model": "m",
                "messages": messages,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema},
                },
            },
            "m",
            **{limit_name: limit},
        ),
        "guided_json": lambda limit: parse_chat(
            {"model": "m", "messages": messages, "guided_json": json.dumps(schema)},
            "m",
            **{limit_name: limit},
        ),
        "tools": lambda limit: parse_chat(
            {"model": "m", "messages": messages, "tools": [tool], "tool_choice": "required"},
            "m",
            **{limit_name: limit},
        ),
        "tools.0.function.parameters": lambda limit: parse_chat(
            {
                "model": "m",
                "messages": messages,
                "tools": [tool],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "m",
            **{limit_name: limit},
        ),
        "sampling_params.json_schema": lambda limit: parse_generate(
            {"text": "x", "sampling_params": {"json_schema": schema}}, **{limit_name: limit}
        ),
    }


def test_schema_nested_past_the_depth_limit_is_a_400_naming_the_field(engine):
    """--max-constraint-depth: a JSON schema nesting deeper than the limit is a 400 naming the
    API field it came from (a forced tool call's: the schema built from the tools), at parsing,
    before anything compiles; one exactly at the limit passes. Objects nested 800 deep took
    54 s to compile; at the default limit the door turns them away at once, offline too, and a
    schema at the limit compiles and runs."""
    schema = json.loads(_nested_objects(5))
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    messages = [{"role": "user", "content": "Hi"}]
    cases = _parses_by_field(schema, "max_constraint_depth")
    for param, parse in cases.items():
        depth = json_depth(parse(None).params.json_schema)
        assert depth >= 11 and parse(depth).params.json_schema
        with pytest.raises(ProtocolError) as info:
            parse(depth - 1)
        assert (info.value.status, info.value.param) == (400, param)
        assert info.value.message == (
            f"{param} must nest at most {depth - 1} levels deep "
            f"(--max-constraint-depth), got {depth}"
        )
    two = [
        tool,
        {"type": "function", "function": {"name": "g"}},
    ]  # the calls' schemas under an anyOf
    assert [
        json_depth(
            parse_chat(
                {"model": "m", "messages": messages, "tools": tools, "tool_choice": "required"}, "m"
            ).params.json_schema
        )
        - json_depth(json.dumps(schema))
        for tools in ([tool], two)
    ] == [3, 5]

    limit = EngineConfig().max_constraint_depth
    deep = _nested_objects(800)  # 43 KB, 1601 levels
    compiles = engine.scheduler.grammars.stats()["compiles"]
    start = time.perf_counter()
    with pytest.raises(ProtocolError) as info:
        parse_generate(
            {"text": "x", "sampling_params": {"json_schema": deep}}, max_constraint_depth=limit
        )
    assert (info.value.status, info.value.param) == (400, "sampling_params.json_schema")
    assert info.value.message.endswith(
        f"at most {limit} levels deep (--max-constraint-depth), got 1601"
    )
    with pytest.raises(InvalidParam) as offline:
        engine.generate(["x"], SamplingParams(json_schema=deep))
    assert offline.value.field == "json_schema" and "--max-constraint-depth" in str(offline.value)
    assert (
        time.perf_counter() - start < 1
        and engine.scheduler.grammars.stats()["compiles"] == compiles
    )
    at_limit = '{"type":"array","items":' * (limit - 1) + '{"type":"integer"}' + "}" * (limit - 1)
    assert json_depth(at_limit) == limit
    (out,) = engine.generate(
        ["x"], SamplingParams(max_new_tokens=2, temperature=0, json_schema=at_limit)
    )
    assert out.error is None and out.finish_reason == "length", out
    engine.check()


def _wide_object(optional: int, required: int = 0) -> dict:
    """An object schema of integer properties p0, p1, ...: the first `optional` of them optional."""
    names = [f"p{i}" for i in range(optional + required)]
    return {
        "type": "object",
        "properties": {n: {"type": "integer"} for n in names},
        "required": names[optional:],
    }


def test_widest_object_counts_optional_properties_per_object():
    """Per object, its properties not under "required", anywhere in the document (an array's
    items, an anyOf's branch); where, as a JSON pointer. A text that is not JSON, or nests too
    deep to parse, counts nothing: the compiler or the depth limit refuses it."""
    doc = {
        "type": "object",
        "properties": {
            "a": _wide_object(5, required=40),
            "b/c": {"anyOf": [{"type": "array", "items": _wide_object(7)}]},
        },
    }
    assert widest_object(json.dumps(doc)) == (7, "/properties/b~1c/anyOf/0/items")
    assert widest_object(json.dumps(_wide_object(3, required=1))) == (3, "/")
    assert widest_object(json.dumps({"properties": {"x": {}}, "required": "x"})) == (
        1,
        "/",
    )  # not a list: none
    assert widest_object('{"type": "objec"') == (0, "")
    assert widest_object("[" * 100_000 + "]" * 100_000) == (0, "")


def test_schema_wider_than_the_property_limit_is_a_400_naming_the_field(engine):
    """--max-constraint-properties: an object with more optional properties than the limit is a
    400 naming the API field the schema came from, at parsing, before anything compiles; one at
    the limit passes, and required properties do not count. The issue's flat object of 2,000
    optional properties (13 s to compile; 5,900 in 128 KiB: 404 s) is turned away at once,
    offline too, and an object at the default limit compiles and generates to its schema."""
    for param, parse in _parses_by_field(
        _wide_object(9, required=30), "max_constraint_properties"
    ).items():
        assert parse(9).params.json_schema
        with pytest.raises(ProtocolError) as info:
            parse(8)
        assert (info.value.status, info.value.param) == (400, param)
        assert info.value.message.startswith(
            f"{param} objects may have at most 8 optional properties each "
            "(--max-constraint-properties; required ones are not counted), got 9 at /"
        )

    limit = EngineConfig().max_constraint_properties
    compiles = engine.scheduler.grammars.stats()["compiles"]
    start = time.perf_counter()
    with pytest.raises(InvalidParam) as offline:
        engine.generate(["x"], SamplingParams(json_schema=json.dumps(_wide_object(2000))))
    assert offline.value.field == "json_schema" and str(offline.value).endswith(
        f"at most {limit} optional properties each (--max-constraint-properties; required ones are not counted), "
        "got 2000 at /"
    )
    assert (
        time.perf_counter() - start < 1
        and engine.scheduler.grammars.stats()["compiles"] == compiles
    )
    # The model lists property after property: the text so far, closed after its last whole
    # property, holds only the schema's properties with the schema's types.
    at_limit = _wide_object(limit, required=2)
    (out,) = engine.generate(
        ["A record:"],
        SamplingParams(max_new_tokens=32, temperature=0, json_schema=json.dumps(at_limit)),
    )
    assert out.error is None and out.finish_reason == "length", out
    so_far = json.loads(out.text[: out.text.rindex(", ")] + "}")
    assert len(so_far) >= 3, out.text
    jsonschema.validate(so_far, {**at_limit, "required": [], "additionalProperties": False})
    engine.check()


def test_backend_loads_its_vocabulary_on_the_first_constraint(default_model_dir, tmp_path, caplog):
    """Nothing loads until a constraint comes (xgrammar imports torch, which a server's scheduler
    otherwise never holds: tests/server/test_process_memory.py). A vocabulary that cannot load fails each
    constrained request alone, with a 400 naming its field, and is logged once."""
    vocab = ModelConfig.from_dir(default_model_dir).vocab_size
    backend = make_backend(default_model_dir, vocab, [2])
    assert not backend.loaded
    backend.check([("regex", "[0-9]+")], 120)
    assert backend.loaded
    broken = make_backend(str(tmp_path), vocab, [2])
    for _ in range(2):
        with pytest.raises(InvalidParam) as info:
            broken.check([("regex", "[0-9]+")], 120)
        assert info.value.field == "regex" and not broken.loaded
    failures = [r for r in caplog.records if "loading the vocabulary failed" in r.getMessage()]
    assert len(failures) == 1


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_apply_token_masks_matches_xgrammar(path, monkeypatch):
    from relay.execution.kernels import cpu as cpu_kernels

    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    elif cpu_kernels.load() is None:
        pytest.skip("no CPU kernels here")
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 1000, [0, 2]
    words = torch.randint(
        -(2**31), 2**31 - 1, (2, (vocab + 31) // 32), generator=gen, dtype=torch.int64
    )
    words = words.to(torch.int32)
    logits = torch.randn(3, vocab, generator=gen)
    ours = logits.clone()
    apply_token_masks(ours, rows, [w.numpy().tobytes() for w in words])
    theirs = logits.clone()
    full = torch.full((3, words.shape[1]), -1, dtype=torch.int32)
    full[rows] = words
    xgrammar.apply_token_bitmask_inplace(theirs, full)
    assert torch.equal(ours, theirs)


def test_ngram_speculation_keeps_constrained_output(engine, default_model_dir):
    """n-gram proposals are trimmed to what the grammar allows and verified under a mask per
    position: greedy output is the one without speculation, and proposals do get accepted."""
    record = {"name": "Ada", "age": 36, "city": "London", "tags": ["math", "code"]}
    schema = {
        "type": "object",
        "properties": {
            "name": SHORT,
            "age": {"type": "integer"},
            "city": SHORT,
            "tags": {"type": "array", "items": SHORT, "maxItems": 2},
        },
        "required": ["name", "age", "city", "tags"],
    }
    prompts = [
        f"Copy this JSON exactly: {json.dumps(record)}\nCopy: ",
        'Repeat: {"name": "Bob", "age": 7',
    ]
    params = SamplingParams(max_new_tokens=100, temperature=0, json_schema=json.dumps(schema))
    plain = engine.generate(prompts, params)
    spec = Engine(
        default_model_dir,
        dtype="float32",
        kv_cache_gb=0.2,
        speculative_algorithm="ngram",
        speculative_disable_by_batch_size=64,
        block_activations="float",
    )
    fast = spec.generate(prompts, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert fast[0].finish_reason == "stop" and json.loads(fast[0].text) == record
    for out in fast:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
    assert spec.scheduler.spec_stats.to_dict()["spec_accepted_tokens"] > 0
    assert spec.scheduler.stats().grammar["live_matchers"] == 0
    spec.check()


# ---- a constraint after a reasoning block (--reasoning-parser) ---------------------------------


def _accepts(backend, kind: str, text: str, tags, output: str, tokenizer) -> bool:
    """Whether the grammar lets the model write exactly `output` and then stop."""
    constraint = backend.start(kind, text, reasoning=tags)
    constraint.wait(30)
    assert constraint.failure(math.inf) is None
    try:
        ok = all(constraint.accept(t) for t in tokenizer.encode(output, add_special_tokens=False))
        return ok and constraint.accept(2) and constraint.terminated
    finally:
        constraint.release()


def test_reasoning_runs_free_until_its_close_tag_then_the_constraint_rules(engine):
    backend, tok = engine.scheduler.grammars, engine.tokenizer.hf
    schema = json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    r1, qwen3 = ("", "</think>"), ("<think>", "</think>")
    for tags, output, ok in [
        (r1, 'Free text, even {"a": "no"} JSON-ish.</think>\n\n{"a": 1}', True),
        (r1, '<think>\nRepeated open tag.</think>{"a": 1}', True),
        (r1, '{"a": 1}', False),  # the reasoning must close first
        (r1, 'x</think>{"a": "one"}', False),  # the answer must match the schema
        (r1, 'x</think>{"a": 1} and more', False),
        (qwen3, '<think>why not</think>\n\n{"a": 1}', True),
        (qwen3, '{"a": 1}', True),  # no block (enable_thinking false in the template)
        (qwen3, 'Free text first</think>{"a": 1}', False),  # a block must open with <think>
    ]:
        assert _accepts(backend, "json_schema", schema, tags, output, tok) is ok, (tags, output)
    assert _accepts(backend, "regex", r"(yes|no)", r1, "maybe</think> yes", tok)
    assert _accepts(backend, "ebnf", 'root ::= "A" | "B"', qwen3, "<think></think>B", tok)


def test_bad_constraint_under_reasoning_still_names_its_field(engine):
    params = SamplingParams(
        json_schema='{"type": "objec"}', reasoning_open="", reasoning_close="</think>"
    )
    with pytest.raises(InvalidParam) as info:
        engine.generate(["x"], params)
    assert info.value.field == "json_schema"


def test_constrained_answer_after_optional_reasoning_validates(engine):
    from relay.api.chat_output import whole_message

    schema = SCHEMAS[1]
    params = SamplingParams(
        max_new_tokens=120,
        temperature=0,
        json_schema=json.dumps(schema),
        reasoning_open="<think>",
        reasoning_close="</think>",
    )
    (out,) = engine.generate(["Answer in JSON: is it sunny in Paris?"], params)
    message, reason = whole_message(None, "qwen3", out.text, out.finish_reason)
    assert reason == "stop", out.text
    jsonschema.validate(json.loads(message["content"]), schema)
    assert engine.scheduler.stats().grammar["live_matchers"] == 0


def test_forced_call_in_a_parsers_own_format_runs_and_reads_back(engine):
    """A structural tag (SamplingParams.structural_tag: the chat route's forced call for
    qwen3_coder, deepseek and harmony) compiles and rules the output like any constraint."""
    from relay.api.chat_output import whole_message
    from relay.api.tool_calls import NAMED, Tool, ToolCalling

    params = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
    tools = ToolCalling((Tool("get_weather", None, params),), NAMED, "get_weather", "qwen3_coder")
    (out,) = engine.generate(
        ["What is the weather in Paris?"],
        SamplingParams(max_new_tokens=96, temperature=0, structural_tag=tools.structural_tag()),
    )
    assert out.text.startswith("<tool_call>\n<function=get_weather>\n"), out.text
    message, reason = whole_message(tools, None, out.text, out.finish_reason)
    assert reason == "tool_calls", out.text
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')
    ]
