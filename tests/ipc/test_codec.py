"""Unit tests for ipc.codec: every wire type round-trips, nesting works, and decoding only
ever builds the listed dataclasses (no pickle, unknown codes rejected)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import pickle

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ipc.messages as m
from ipc import codec
from ipc.codec import WIRE_TYPES, decode, encode
from relay.config import EngineConfig
from relay.outputs import PromptLogprobs, RequestOutput
from relay.sampling_params import SamplingParams
from relay.step import (
    BatchInput,
    BatchOutput,
    EmbedChunk,
    EmbedSpan,
    PromptLogprobChunk,
    PromptLogprobSpan,
    SamplingSpec,
)
from relay.text.detokenizer import DetokenizeSpec
from relay.text.tokenize_query import TokenizeQuery

I64 = st.integers(-(2**63), 2**63 - 1)
U31 = st.integers(0, 2**31 - 1)
TOKEN = st.integers(0, 200_000)
SMALL = st.integers(0, 4096)
TEXT = st.text(max_size=40)  # any unicode, surrogates excluded by default
FINITE = st.floats(allow_nan=False, allow_infinity=False, width=64)
LOGPROB = st.one_of(
    st.floats(max_value=0.0, allow_nan=False), st.just(-math.inf)
)  # -inf is a real logprob
OPT_STR = st.none() | TEXT
# JSON-like payloads (chat messages, kwargs, control data, ready info): int keys too, msgpack maps allow them.
LEAF = st.none() | st.booleans() | I64 | FINITE | TEXT | st.binary(max_size=8)
JSONISH = st.recursive(
    LEAF,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT | I64, kids, max_size=4),
    max_leaves=12,
)
STR_DICT = st.dictionaries(TEXT, JSONISH, max_size=4)

sampling_params = st.builds(
    SamplingParams,
    max_new_tokens=st.integers(1, 2**31 - 1),
    min_new_tokens=SMALL,
    temperature=st.floats(0, 100),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.just(-1) | st.integers(1, 1000),
    min_p=st.floats(0, 1),
    repetition_penalty=st.floats(0.01, 10),
    frequency_penalty=st.floats(-2, 2),
    presence_penalty=st.floats(-2, 2),
    seed=st.none() | I64,
    stop=st.lists(st.text(min_size=1, max_size=10), max_size=4),
    stop_token_ids=st.lists(TOKEN, max_size=4),
    ignore_eos=st.booleans(),
    skip_special_tokens=st.booleans(),
    include_stop_str_in_output=st.booleans(),
    logprobs=st.booleans(),
    top_logprobs=st.integers(0, 20),
    logprob_start_len=st.integers(-1, 4096),
    prompt_top_logprobs=st.integers(0, 20),
    embed=st.booleans(),
    logit_bias=st.dictionaries(TOKEN, st.floats(-100, 100), max_size=4),
)
sampling_specs = st.builds(
    SamplingSpec,
    sid=U31,
    params=sampling_params,
    stop_token_ids=st.lists(TOKEN, max_size=3),
    prompt_ids=st.lists(TOKEN, max_size=20),
)

prompt_logprob_spans = st.builds(
    PromptLogprobSpan,
    row=st.integers(0, 7),
    first=SMALL,
    targets=st.lists(TOKEN, max_size=5),
    top_n=st.integers(0, 20),
)
prompt_logprob_chunks = st.builds(
    PromptLogprobChunk,
    row=st.integers(0, 7),
    logprobs=st.lists(LOGPROB, max_size=4),
    ranks=st.lists(st.integers(1, 200_000), max_size=4),
    top_ids=st.lists(st.lists(TOKEN, max_size=3), max_size=4),
    top_logprobs=st.lists(st.lists(LOGPROB, max_size=3), max_size=4),
)

embed_spans = st.builds(EmbedSpan, row=st.integers(0, 7), first=SMALL, count=st.integers(1, 64))
embed_chunks = st.builds(EmbedChunk, row=st.integers(0, 7), hidden_sum=st.binary(max_size=64))


@st.composite
def prompt_logprobs(draw) -> PromptLogprobs:
    n = draw(st.integers(1, 4))
    top = st.none() | st.tuples(
        st.lists(TOKEN, min_size=2, max_size=2), st.lists(LOGPROB, min_size=2, max_size=2)
    ).map(list)
    return PromptLogprobs(
        start=draw(SMALL),
        token_ids=draw(st.lists(TOKEN, min_size=n, max_size=n)),
        logprobs=[None] + draw(st.lists(LOGPROB, min_size=n - 1, max_size=n - 1)),
        ranks=[None] + draw(st.lists(st.integers(1, 200_000), min_size=n - 1, max_size=n - 1)),
        top=[None] + draw(st.lists(top, min_size=n - 1, max_size=n - 1)),
        texts=draw(st.none() | st.lists(TEXT, min_size=n, max_size=n)),
        top_texts=draw(
            st.none() | st.lists(st.none() | st.lists(TEXT, max_size=2), min_size=n, max_size=n)
        ),
    )


@st.composite
def batch_inputs(draw) -> BatchInput:
    n = draw(st.integers(0, 8))
    extend = [draw(st.integers(1, 20)) for _ in range(n)]
    prefix = [draw(st.integers(0, 5000)) for _ in range(n)]
    ids = draw(st.lists(TOKEN, min_size=sum(extend), max_size=sum(extend)))
    return BatchInput(
        step=draw(st.integers(0, 2**62)),
        sids=draw(st.lists(U31, min_size=n, max_size=n, unique=True)),
        input_ids=ids,
        prefix_lens=prefix,
        extend_lens=extend,
        page_starts=draw(st.lists(SMALL, min_size=n, max_size=n)),
        new_pages=[draw(st.lists(st.integers(0, 10**6), max_size=30)) for _ in range(n)],
        sample=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        output_lens=draw(st.lists(SMALL, min_size=n, max_size=n)),
        new_specs=draw(st.lists(sampling_specs, max_size=3)),
        released_sids=draw(st.lists(U31, max_size=5)),
        prompt_logprob_spans=draw(st.lists(prompt_logprob_spans, max_size=2)),
        embed_spans=draw(st.lists(embed_spans, max_size=2)),
    )


@st.composite
def batch_outputs(draw) -> BatchOutput:
    n = draw(st.integers(0, 8))
    toks = draw(st.lists(TOKEN, min_size=n, max_size=n))
    lps = draw(st.none() | st.lists(LOGPROB, min_size=n, max_size=n))
    top = draw(
        st.none()
        | st.lists(
            st.none()
            | st.tuples(
                st.lists(TOKEN, min_size=2, max_size=2), st.lists(LOGPROB, min_size=2, max_size=2)
            ).map(list),
            min_size=n,
            max_size=n,
        )
    )
    return BatchOutput(
        step=draw(U31),
        next_token_ids=toks,
        logprobs=lps,
        top_logprobs=top,
        error=draw(OPT_STR),
        row_errors=draw(st.dictionaries(st.integers(0, 7), TEXT, max_size=2)),
        prompt_logprobs=draw(st.lists(prompt_logprob_chunks, max_size=2)),
        embed_chunks=draw(st.lists(embed_chunks, max_size=2)),
    )


engine_configs = st.builds(
    EngineConfig,
    model_path=OPT_STR,
    tokenizer_path=OPT_STR,
    served_model_name=OPT_STR,
    dtype=st.sampled_from(["auto", "float32", "bfloat16", "float16"]),
    device=st.sampled_from(["auto", "cpu", "cuda"]),
    tp_size=st.integers(1, 8),
    page_size=st.sampled_from([1, 16, 64]),
    kv_cache_gb=st.none() | st.floats(0.1, 80),
    mem_fraction_static=st.none() | st.floats(0.05, 0.95),
    max_running_requests=st.integers(1, 1024),
    chunked_prefill_size=st.integers(1, 8192),
    context_length=st.none() | st.integers(16, 131072),
    num_threads=st.none() | st.integers(1, 64),
    seed=I64,
    load_format=st.sampled_from(["auto", "dummy", "dummy-null"]),
    disable_cuda_graph=st.booleans(),
    log_requests=st.booleans(),
)

messages_list = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}
    ),
    max_size=4,
)
generate_reqs = st.builds(
    m.GenerateReq,
    rids=st.lists(TEXT, min_size=1, max_size=4),
    params=sampling_params,
    text=OPT_STR,
    input_ids=st.none() | st.lists(TOKEN, max_size=20),
    messages=st.none() | messages_list,
    chat_kwargs=STR_DICT,
    priority=I64,
    arrival_time=st.floats(0, 2e9),
    inputs=st.none() | st.lists(TEXT | st.lists(TOKEN, min_size=1, max_size=8), max_size=3),
)
detokenize_specs = st.builds(
    DetokenizeSpec,
    rid=TEXT,
    prompt_tail=st.lists(TOKEN, max_size=5),
    skip_special_tokens=st.booleans(),
    stop=st.lists(TEXT, max_size=3),
    include_stop_str_in_output=st.booleans(),
)


@st.composite
def request_outputs(draw) -> RequestOutput:
    n = draw(st.integers(0, 3))
    ids = draw(st.lists(TOKEN, min_size=n, max_size=n))
    with_lp = draw(st.booleans())
    top = st.none() | st.tuples(
        st.lists(TOKEN, min_size=2, max_size=2), st.lists(LOGPROB, min_size=2, max_size=2)
    ).map(list)
    return RequestOutput(
        rid=draw(TEXT),
        token_ids=ids,
        logprobs=draw(st.lists(LOGPROB, min_size=n, max_size=n)) if with_lp else None,
        top_logprobs=draw(st.lists(top, min_size=n, max_size=n)) if with_lp else None,
        finish_reason=draw(st.sampled_from([None, "stop", "length", "abort"])),
        matched_stop=draw(st.none() | TEXT | TOKEN),
        prompt_tokens=draw(SMALL),
        completion_tokens=draw(SMALL),
        cached_tokens=draw(SMALL),
        queue_time=draw(st.none() | st.floats(0, 60)),
        error=draw(OPT_STR),
        status=draw(st.sampled_from([400, 500, 503])),
        param=draw(OPT_STR),
        text=draw(TEXT),
        token_texts=draw(st.lists(TEXT, min_size=n, max_size=n)) if with_lp else None,
        top_texts=draw(st.lists(st.none() | st.lists(TEXT, max_size=2), min_size=n, max_size=n))
        if with_lp
        else None,
        prompt_logprobs=draw(st.none() | prompt_logprobs()),
        embedding=draw(st.none() | st.binary(max_size=64)),
    )


TOKENIZE_QUERY = st.builds(
    TokenizeQuery,
    kind=st.sampled_from(["tokenize", "detokenize"]),
    text=OPT_STR,
    messages=st.none() | st.lists(STR_DICT, max_size=2),
    chat_kwargs=STR_DICT,
    add_special_tokens=st.booleans(),
    return_token_strs=st.booleans(),
    tokens=st.none() | st.lists(TOKEN, max_size=8),
)

STRATEGIES = {
    SamplingParams: sampling_params,
    SamplingSpec: sampling_specs,
    BatchInput: batch_inputs(),
    BatchOutput: batch_outputs(),
    EngineConfig: engine_configs,
    RequestOutput: request_outputs(),
    DetokenizeSpec: detokenize_specs,
    PromptLogprobSpan: prompt_logprob_spans,
    PromptLogprobChunk: prompt_logprob_chunks,
    PromptLogprobs: prompt_logprobs(),
    EmbedSpan: embed_spans,
    EmbedChunk: embed_chunks,
    m.GenerateReq: generate_reqs,
    m.TokenizedReq: st.builds(
        m.TokenizedReq,
        rid=TEXT,
        input_ids=st.lists(TOKEN, min_size=1, max_size=50),
        params=sampling_params,
        priority=I64,
        arrival_time=st.floats(0, 2e9),
    ),
    m.OutputBatch: st.builds(m.OutputBatch, outputs=st.lists(request_outputs(), max_size=4)),
    m.AbortRequest: st.builds(m.AbortRequest, rid=TEXT, sent_at=st.floats(0, 2e9)),
    m.StopGenerating: st.builds(m.StopGenerating, rid=TEXT, matched=OPT_STR),
    m.ControlCall: st.builds(
        m.ControlCall, call_id=I64, kind=st.sampled_from(["get_info", "flush_cache"])
    ),
    m.ControlReply: st.builds(m.ControlReply, call_id=I64, ok=st.booleans(), data=STR_DICT),
    m.Ready: st.builds(m.Ready, name=TEXT, ok=st.booleans(), info=STR_DICT, error=OPT_STR),
    m.Heartbeat: st.builds(m.Heartbeat, seq=U31, step_age=st.floats(0, 1e6)),
    m.NodeMsg: st.builds(
        m.NodeMsg,
        node=U31,
        kind=st.sampled_from(["hello", "beat", "ready", "down", "bye"]),
        detail=TEXT,
        info=STR_DICT,
    ),
    TokenizeQuery: TOKENIZE_QUERY,
    m.TokenizeCall: st.builds(m.TokenizeCall, call_id=I64, query=TOKENIZE_QUERY),
}


def test_every_wire_type_has_a_strategy_and_every_message_is_a_wire_type():
    assert set(STRATEGIES) == set(WIRE_TYPES)
    assert len(set(WIRE_TYPES)) == len(WIRE_TYPES)
    messages = {
        o for o in vars(m).values() if dataclasses.is_dataclass(o) and o.__module__ == m.__name__
    }
    assert messages <= set(WIRE_TYPES)
    for cls in WIRE_TYPES:  # decoding builds positionally: every field must be an init field
        assert all(f.init for f in dataclasses.fields(cls)), cls


def test_every_wire_type_has_its_own_code():
    """Codes are positions in WIRE_TYPES; one launcher starts every process from one checkout,
    so they only have to agree within a version."""
    codes = {msgpack.unpackb(encode(data), raw=False).code for data in EXAMPLES}
    assert codes == set(range(1, len(WIRE_TYPES) + 1))


def _same(a, b) -> bool:
    """Equality that treats NaN-free floats exactly and checks types recursively."""
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("cls", WIRE_TYPES, ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data())
def test_round_trip(cls, data):
    obj = data.draw(STRATEGIES[cls])
    blob = encode(obj)
    assert isinstance(blob, bytes)
    back = decode(blob)
    assert type(back) is cls
    assert _same(obj, back), (obj, back)
    assert encode(back) == blob  # canonical: re-encoding gives the same bytes


@settings(max_examples=25, deadline=None, derandomize=True)
@given(batches=st.lists(batch_inputs(), max_size=3))
def test_lists_of_batch_inputs_round_trip(batches):
    back = decode(encode(batches))
    assert back == batches
    for b in back:
        for spec in b.new_specs:
            assert type(spec) is SamplingSpec and type(spec.params) is SamplingParams


def test_nested_dataclasses_realistic_batch():
    spec = SamplingSpec(
        7,
        SamplingParams(
            max_new_tokens=64,
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            seed=-3,
            stop=["\n\n", "世界"],
            repetition_penalty=1.1,
            logprobs=True,
            top_logprobs=5,
            logit_bias={49151: 100.0, 0: -100.0, 17: 0.5},
        ),
        [2, 0],
        prompt_ids=[1, 9690, 198],
    )
    batch = BatchInput(
        step=12,
        sids=[7, 3],
        input_ids=[1, 9690, 198, 13],
        prefix_lens=[0, 40],
        extend_lens=[3, 1],
        page_starts=[0, 2],
        new_pages=[[5], [9]],
        sample=[True, True],
        output_lens=[0, 17],
        new_specs=[spec],
        released_sids=[4],
    )
    back = decode(encode(batch))
    assert back == batch
    assert back.new_specs[0].params.stop == ["\n\n", "世界"] and back.new_specs[0].params.seed == -3
    assert back.new_specs[0].params.logit_bias == {
        49151: 100.0,
        0: -100.0,
        17: 0.5,
    }  # int keys stay ints
    assert back.num_tokens == 4 and not back.is_decode
    # Wire types inside plain containers, and containers inside wire types.
    mixed = {
        "batch": batch,
        "outs": [BatchOutput(12, [5, 6], [-0.1, -math.inf], [[[5], [-0.1]], None])],
        "n": None,
        3: "int key",
    }
    assert decode(encode(mixed)) == mixed


def test_special_values_survive():
    out = BatchOutput(1, [0], [-math.inf], [[[0, 1], [-0.0, -1e-300]]], error="boom 💥")
    back = decode(encode(out))
    assert back.logprobs == [-math.inf] and math.copysign(1, back.top_logprobs[0][1][0]) == -1
    assert back.top_logprobs[0][1][1] == -1e-300 and back.error == "boom 💥"
    p = SamplingParams(seed=2**63 - 1, max_new_tokens=2**31 - 1)
    assert decode(encode(p)) == p
    assert decode(encode(SamplingParams(seed=-(2**63)))).seed == -(2**63)


def test_post_init_runs_on_decode():
    # SamplingParams normalises top_k 0 -> -1; EngineConfig validates; both run again on decode.
    assert decode(encode(SamplingParams(top_k=0))).top_k == -1
    bad = msgpack.ExtType(
        WIRE_TYPES.index(EngineConfig) + 1,
        msgpack.packb(
            [
                getattr(EngineConfig(), f.name) if f.name != "dtype" else "int3"
                for f in dataclasses.fields(EngineConfig)
            ]
        ),
    )
    with pytest.raises(ValueError, match="dtype"):
        decode(msgpack.packb(bad))


# ---- what must not decode or encode ------------------------------------------------------------
def raw_ext(code: int, data: bytes) -> bytes:
    """An ext8 record by hand: msgpack.ExtType refuses negative (reserved) codes."""
    return b"\xc7" + bytes([len(data)]) + code.to_bytes(1, "big", signed=True) + data


@pytest.mark.parametrize("code", [0, len(WIRE_TYPES) + 1, 99, 127, -5, -128])
def test_unknown_ext_codes_raise(code):
    blob = raw_ext(code, msgpack.packb(["x"]))
    with pytest.raises(ValueError, match="unknown wire type"):
        decode(blob)


def test_unknown_ext_code_nested_inside_a_wire_type_raises():
    fields = [
        getattr(SamplingSpec(1, SamplingParams(), []), f.name)
        for f in dataclasses.fields(SamplingSpec)
    ]
    fields[1] = msgpack.ExtType(99, b"\x90")
    blob = msgpack.packb(msgpack.ExtType(WIRE_TYPES.index(SamplingSpec) + 1, msgpack.packb(fields)))
    with pytest.raises(ValueError):
        decode(blob)
    blob = msgpack.packb({"a": [1, msgpack.ExtType(99, pickle.dumps(object()))]})
    with pytest.raises(ValueError):
        decode(blob)


def test_wrong_field_count_raises():
    code = WIRE_TYPES.index(m.AbortRequest) + 1
    for values in ([], ["r", 0.0, "extra"]):
        blob = msgpack.packb(msgpack.ExtType(code, msgpack.packb(values)))
        with pytest.raises(TypeError):
            decode(blob)


@dataclasses.dataclass
class NotOnTheWire:
    x: int = 1


class Sub(m.AbortRequest):
    pass


@pytest.mark.parametrize(
    "obj",
    [
        NotOnTheWire(),
        object(),
        {1, 2},
        Sub("r"),
        [m.AbortRequest("r"), NotOnTheWire()],
        {"k": NotOnTheWire()},
        BatchOutput(1, [NotOnTheWire()]),
    ],
)
def test_non_wire_types_raise_on_encode(obj):
    with pytest.raises(TypeError):
        encode(obj)


EXAMPLES = [
    SamplingParams(stop=["x"]),
    SamplingSpec(1, SamplingParams(), [2]),
    BatchInput(
        0,
        [1],
        [5, 6],
        [0],
        [2],
        [0],
        [[3]],
        [True],
        [0],
        [SamplingSpec(1, SamplingParams(), [2])],
        [3],
    ),
    BatchOutput(0, [7], [-0.5], [[[7], [-0.5]]]),
    EngineConfig(model_path="/m", tp_size=2),
    RequestOutput("a", [3], [-0.5], text="hi"),
    DetokenizeSpec("a", [1], True, ["\n"], False),
    m.GenerateReq(["a"], SamplingParams(), messages=[{"role": "user", "content": "hi"}]),
    m.TokenizedReq("a", [1, 2], SamplingParams()),
    m.OutputBatch([RequestOutput("a", [3], finish_reason="length")]),
    m.AbortRequest("a"),
    m.StopGenerating("a", "\n"),
    m.ControlCall(1, "get_info"),
    m.ControlReply(1, True, {"x": [1]}),
    m.Ready("sched", info={"max_total_tokens": 1000}),
    m.Heartbeat(3, 0.5),
    m.NodeMsg(1, "ready", info={"tp1": {"num_pages": 10}}),
    m.TokenizeCall(2, TokenizeQuery("detokenize", tokens=[1, 2])),
    TokenizeQuery("tokenize", text="hi", return_token_strs=True),
    PromptLogprobSpan(0, 1, [5, 6], 2),
    PromptLogprobChunk(0, [-0.5], [3], [[6, 9]], [[-0.2, -0.5]]),
    PromptLogprobs(0, [5, 6], [None, -0.5], [None, 3], [None, [[6], [-0.5]]]),
    EmbedSpan(0, 3, 2),
    EmbedChunk(0, b"\x00\x00\x80\x3f"),
]


def test_decoding_never_uses_pickle(monkeypatch):
    src = inspect.getsource(codec)
    assert "import pickle" not in src and "pickle." not in src
    assert not any(getattr(codec, name, None) is pickle for name in dir(codec))

    pickled = pickle.dumps({"x": 1})

    def boom(*a, **k):
        raise AssertionError("pickle used")

    for name in ("loads", "load", "dumps", "dump", "Unpickler", "Pickler"):
        monkeypatch.setattr(pickle, name, boom)
    # Every wire type, one realistic example each, still round-trips with pickle disabled.
    examples = EXAMPLES
    assert {type(e) for e in examples} == set(WIRE_TYPES)
    for e in examples:
        assert decode(encode(e)) == e
    # A pickle payload under a wire code is just bytes to msgpack: it cannot decode into anything.
    for code in (1, WIRE_TYPES.index(m.GenerateReq) + 1, 99):
        with pytest.raises(Exception) as e:
            decode(msgpack.packb(msgpack.ExtType(code, pickled)))
    assert "pickle used" not in str(e.value)


def test_plain_values_pass_through():
    for v in [None, 1, -1, 1.5, "s", b"bytes", [1, [2]], {"a": {"b": [None]}}, True]:
        assert decode(encode(v)) == v
