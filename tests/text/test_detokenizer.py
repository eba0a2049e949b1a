"""Unit tests for relay.text.tokenizer (Tokenizer, DecodeStream, PromptPreparer) and
relay.text.detokenizer.Detokenizer, on the default model's tokenizer (byte-level BPE, so CJK and
emoji characters split over several tokens). No processes, no sockets."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from relay.outputs import RequestOutput
from relay.sampling_params import InvalidParam, SamplingParams
from relay.text.detokenizer import Detokenizer, DetokenizeSpec, Stopped
from relay.text.tokenizer import DecodeStream, PromptPreparer, Tokenizer

# Pieces that byte-level BPE splits awkwardly: multi-byte characters, emoji with modifiers and
# ZWJ sequences, combining accents, CJK, Korean, RTL, whitespace runs.
PIECES = [
    "Hello",
    " world",
    ",",
    " the",
    " quick",
    "brown",
    " fox",
    "\n",
    "  ",
    "\t",
    "é",
    "ñ",
    "ü",
    "ïve",
    "ß",
    "Ω",
    "λ",
    "世界",
    "你好",
    "中文",
    "日本語",
    "한국어",
    "שלום",
    "🎉",
    "👍🏽",
    "🚀",
    "😀",
    "👨‍👩‍👧",
    "e\u0301",
    "ﬁ",
    "€",
    "…",
    "—",
    "«",
    "»",
    "123",
    "x",
    "ok",
    "!",
    "?",
]


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 25))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


def stream_deltas(
    tok: Tokenizer,
    out_ids: list[int],
    prompt_ids: list[int] | None = None,
    chunk: int = 1,
    finish: bool = True,
    **params,
) -> tuple[list[str], DecodeStream]:
    ds = DecodeStream(
        tok, prompt_ids if prompt_ids is not None else tok.encode("Say:"), SamplingParams(**params)
    )
    deltas = []
    for k in range(0, len(out_ids), chunk):
        last = k + chunk >= len(out_ids)
        deltas.append(ds.add(out_ids[k : k + chunk], finished=finish and last))
    if not out_ids and finish:
        deltas.append(ds.add([], finished=True))
    return deltas, ds


# ---- Tokenizer ----------------------------------------------------------------------------
def test_tokenizer_basics(tok):
    assert tok.vocab_size >= 1000
    assert tok.eos_token_id is not None and 0 <= tok.eos_token_id < tok.vocab_size
    for text in random_texts(30, seed=1):
        assert tok.decode(tok.encode(text)) == text


def test_test_texts_really_split_characters_across_tokens(tok):
    """The premise of the streaming tests: some tokens alone are not whole characters."""
    ids = tok.encode("世界🎉👍🏽")
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_skip_special_tokens_in_decode(tok):
    ids = tok.encode("Hi") + [tok.eos_token_id] + tok.encode(" there")
    assert tok.decode(ids) == "Hi there"
    special = tok.hf.convert_ids_to_tokens(tok.eos_token_id)
    assert tok.decode(ids, skip_special_tokens=False) == f"Hi{special} there"


# ---- DecodeStream: UTF-8 safety ------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_concatenation_equals_decode(tok, chunk):
    for text in random_texts(120, seed=chunk):
        ids = tok.encode(text)
        deltas, ds = stream_deltas(tok, ids, chunk=chunk)
        joined = "".join(deltas)
        assert joined == tok.decode(ids) == text
        assert all("\ufffd" not in d for d in deltas), (text, deltas)
        assert ds.stopped is None


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
# U+FFFD itself is left out of the text: the stream must never emit it for a half-decoded
# character, which only a text without it can show.
@given(
    text=st.text(
        st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="\ufffd"),
        min_size=1,
        max_size=30,
    ),
    prompt=st.sampled_from(["", "Hello", "世界", "🎉 x", "Question: what?\nAnswer:"]),
)
def test_stream_any_unicode_text(tok, text, prompt):
    ids = tok.encode(text)
    # This vocabulary lacks a few byte tokens (e.g. 0xF1, the lead byte of planes 4-7), so
    # such text does not survive encoding at all; that is the tokenizer, not the stream.
    assume(tok.decode(ids) == text)
    deltas, _ = stream_deltas(tok, ids, prompt_ids=tok.encode(prompt))
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_stream_prefix_property_and_no_early_release(tok):
    """Every intermediate output is a prefix of the final text; a character split over
    tokens comes out whole, in the step of its last byte."""
    text = "a🎉b世c👨‍👩‍👧d"
    ids = tok.encode(text)
    ds = DecodeStream(tok, [], SamplingParams())
    shown = ""
    for k, t in enumerate(ids):
        shown += ds.add([t], finished=False)
        assert text.startswith(shown)
        full = tok.decode(ids[: k + 1])
        # Everything decodable so far is shown: the full text up to a trailing partial character.
        assert shown == full.rstrip("\ufffd")
    assert ds.add([], finished=True) == ""
    assert shown == text


def test_stream_uses_prompt_context_for_leading_space(tok):
    prompt = tok.encode("The answer is")
    out = tok.encode("The answer is 42 ok")[len(prompt) :]
    assert tok.decode(prompt + out) == "The answer is 42 ok"
    deltas, _ = stream_deltas(tok, out, prompt_ids=prompt)
    assert "".join(deltas) == tok.decode(prompt + out)[len(tok.decode(prompt)) :]


class SentencePieceLike:
    """A stub tokenizer whose decode drops the space of a leading '▁' the way Llama's does,
    so the first output token's space only survives with prompt context."""

    pieces = ("▁The", "▁answer", "▁is", "▁4", "2", "▁ok", ".")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")

    def byte_table(self) -> None:  # not byte-level BPE: DecodeStream decodes windows
        return None


def test_stream_keeps_leading_space_through_prompt_context():
    tok = SentencePieceLike()
    prompt, out = [0, 1, 2], [3, 4, 5, 6]
    assert tok.decode(out) == "42 ok."  # decoded alone, the leading space is lost
    ds = DecodeStream(tok, prompt, SamplingParams())
    deltas = [ds.add([t], finished=t == 6) for t in out]
    assert deltas == [" 4", "2", " ok", "."]
    # Only the last few prompt tokens are kept as context; a long prompt works the same.
    ds = DecodeStream(tok, [0, 1, 2] * 50, SamplingParams())
    assert ds.add(out, finished=True) == " 42 ok."
    assert len(ds.ids) < 20


def test_stream_empty_output(tok):
    deltas, ds = stream_deltas(tok, [])
    assert deltas == [""] and ds.stopped is None


@pytest.mark.parametrize("skip", [True, False])
def test_stream_skip_special_tokens(tok, skip):
    ids = tok.encode("Hi") + [tok.eos_token_id] + tok.encode(" there 🎉") + [tok.eos_token_id]
    deltas, _ = stream_deltas(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    special = tok.hf.convert_ids_to_tokens(tok.eos_token_id)
    assert (special in "".join(deltas)) is (not skip)


# ---- DecodeStream: stop strings ----------------------------------------------------------
def test_stop_string_cuts_text(tok):
    ids = tok.encode("Hello world and more text")
    deltas, ds = stream_deltas(tok, ids, finish=False, stop=["world"])
    assert "".join(deltas) == "Hello "
    assert ds.stopped == "world"


def test_stop_string_included(tok):
    ids = tok.encode("Hello world and more text")
    deltas, ds = stream_deltas(
        tok, ids, finish=False, stop=["world"], include_stop_str_in_output=True
    )
    assert "".join(deltas) == "Hello world"
    assert ds.stopped == "world"


def test_stop_inside_one_token_cuts_mid_token(tok):
    ids = tok.encode("Hello world")
    deltas, ds = stream_deltas(tok, ids, stop=["ell"])
    assert "".join(deltas) == "H" and ds.stopped == "ell"
    deltas, ds = stream_deltas(tok, ids, stop=["ell"], include_stop_str_in_output=True)
    assert "".join(deltas) == "Hell"


def test_stop_spanning_tokens_and_multibyte(tok):
    text = "abc 世界🎉 tail"
    ids = tok.encode(text)
    for stop in ["c 世", "界🎉", "🎉 t", "世界🎉 tail"]:
        deltas, ds = stream_deltas(tok, ids, stop=[stop])
        assert "".join(deltas) == text[: text.index(stop)], stop
        assert ds.stopped == stop
        assert all("\ufffd" not in d for d in deltas)


def test_earliest_stop_wins_whatever_the_list_order(tok):
    text = "one two three four"
    ids = tok.encode(text)
    for stops in (["four", "two", "three"], ["three", "two"], ["two", "four"]):
        deltas, ds = stream_deltas(tok, ids, stop=stops)
        assert ds.stopped == "two"
        assert "".join(deltas) == "one "
    # Two stops completing in the same token: the one starting first wins.
    deltas, ds = stream_deltas(tok, tok.encode("xx hello"), stop=["llo", "hel"])
    assert ds.stopped == "hel" and "".join(deltas) == "xx "


def test_tokens_after_stop_are_ignored(tok):
    ds = DecodeStream(tok, [], SamplingParams(stop=["world"]))
    assert ds.add(tok.encode("Hello world"), finished=False) == "Hello "
    assert ds.stopped == "world"
    assert ds.add(tok.encode(" more"), finished=False) == ""
    assert ds.add(tok.encode(" more"), finished=True) == ""
    assert ds.text == "Hello "


def test_stop_string_in_prompt_does_not_fire(tok):
    prompt = tok.encode("please say world")
    deltas, ds = stream_deltas(tok, tok.encode(" again"), prompt_ids=prompt, stop=["world"])
    assert ds.stopped is None and "".join(deltas) == " again"


def test_possible_stop_prefix_is_held_then_flushed(tok):
    stop = "STOP!"
    text = "abc defSTOP xyz STO"
    ids = tok.encode(text)
    ds = DecodeStream(tok, [], SamplingParams(stop=[stop]))
    shown = ""
    for k, t in enumerate(ids):
        shown += ds.add([t], finished=False)
        decoded = tok.decode(ids[: k + 1])
        assert decoded.startswith(shown)
        # Nothing that could still grow into the stop string is shown: any tail of the text
        # that is a start of the stop string lies entirely in the held-back part.
        held = decoded[len(shown) :]
        for j in range(1, len(stop)):
            if decoded.endswith(stop[:j]):
                assert len(held) >= j, (decoded, shown)
    assert "STO" not in shown.split("xyz")[-1]  # the trailing "STO" was held
    rest = ds.add([], finished=True)
    assert shown + rest == text and ds.stopped is None


def test_no_hold_without_stops(tok):
    ids = tok.encode("Hello world")
    ds = DecodeStream(tok, [], SamplingParams())
    shown = "".join(ds.add([t], finished=False) for t in ids)
    assert shown == "Hello world"


def stop_reference(
    tok: Tokenizer, ids: list[int], stops: list[str], include: bool
) -> tuple[str, str | None]:
    """Token-by-token: the first prefix whose text holds any stop, cut at the earliest."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            i, s = min(hits)
            return (text[: i + len(s)] if include else text[:i]), s
    return tok.decode(ids), None


def test_stop_strings_random(tok):
    rng = random.Random(7)
    checked_stops = 0
    for text in random_texts(150, seed=3):
        ids = tok.encode(text)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.8 and len(text) > 1:
                a = rng.randrange(len(text))
                stops.append(text[a : a + rng.randint(1, 6)])
            else:
                stops.append(rng.choice(PIECES) + "#")  # never present
        include = rng.random() < 0.5
        want, want_stop = stop_reference(tok, ids, stops, include)
        for chunk in (1, 4):
            deltas, ds = stream_deltas(
                tok, ids, chunk=chunk, stop=stops, include_stop_str_in_output=include
            )
            assert "".join(deltas) == want, (text, stops, chunk)
            assert ds.stopped == want_stop
            assert all("\ufffd" not in d for d in deltas)
        checked_stops += want_stop is not None
    assert checked_stops > 50


# ---- PromptPreparer ---------------------------------------------------------------------
def test_prompt_text_and_ids(tok):
    pp = PromptPreparer(tok, 64)
    ids = pp.prompt_ids(text="Hello world")
    assert ids == tok.encode("Hello world")
    assert pp.prompt_ids(input_ids=ids) == ids
    assert pp.prompt_ids(input_ids=[0, tok.vocab_size - 1]) == [0, tok.vocab_size - 1]


@pytest.mark.parametrize("kw", [dict(text=""), dict(text=None), dict(input_ids=[]), dict()])
def test_empty_prompt(tok, kw):
    with pytest.raises(InvalidParam) as e:
        PromptPreparer(tok, 64).prompt_ids(**kw)
    assert e.value.field == "prompt" and "empty" in str(e.value)


@pytest.mark.parametrize("bad", [-1, 49152, 10**9])
def test_out_of_vocab_ids(tok, bad):
    bad = tok.vocab_size if bad == 49152 else bad
    with pytest.raises(InvalidParam) as e:
        PromptPreparer(tok, 64).prompt_ids(input_ids=[5, bad, 7])
    assert e.value.field == "prompt" and str(bad) in str(e.value)


def test_prompt_must_leave_room_for_output(tok):
    pp = PromptPreparer(tok, 10)
    assert len(pp.prompt_ids(input_ids=list(range(9)))) == 9
    for n in (10, 11):
        with pytest.raises(InvalidParam) as e:
            pp.prompt_ids(input_ids=list(range(n)))
        assert e.value.field == "prompt" and str(n) in str(e.value)
    long_text = " word" * 20
    with pytest.raises(InvalidParam):
        pp.prompt_ids(text=long_text)
    with pytest.raises(InvalidParam) as e:
        pp.prompt_ids(
            messages=[{"role": "user", "content": "hi"}]
        )  # the template alone is > 10 tokens
    assert e.value.field == "messages"


def test_fit_context(tok):
    pp = PromptPreparer(tok, 100)
    assert (
        pp.fit_context(SamplingParams(max_new_tokens=70), 30).max_new_tokens == 70
    )  # exactly the room
    with pytest.raises(InvalidParam) as e:
        pp.fit_context(SamplingParams(max_new_tokens=71), 30)
    assert e.value.field == "max_tokens"
    p = pp.fit_context(SamplingParams(max_new_tokens=None, min_new_tokens=500), 30)
    assert p.max_new_tokens == 70 and p.min_new_tokens == 70
    p = pp.fit_context(SamplingParams(max_new_tokens=None, min_new_tokens=5), 99)
    assert p.max_new_tokens == 1 and p.min_new_tokens == 1
    p = pp.fit_context(SamplingParams(max_new_tokens=20, min_new_tokens=5), 30)
    assert (p.max_new_tokens, p.min_new_tokens) == (20, 5)


def test_chat_template(tok):
    pp = PromptPreparer(tok, 4096)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2? 世界🎉"},
    ]
    ids = pp.prompt_ids(messages=msgs)
    text = tok.decode(ids, skip_special_tokens=False)
    assert "What is 2+2? 世界🎉" in text and "Be brief." in text
    assert text.index("Be brief.") < text.index("What is 2+2?")
    assert text.rstrip().endswith("assistant")  # the generation prompt
    no_gen = pp.prompt_ids(messages=msgs, chat_kwargs={"add_generation_prompt": False})
    assert len(no_gen) < len(ids) and ids[: len(no_gen)] == no_gen
    assert all(isinstance(i, int) for i in ids)


@pytest.mark.parametrize("msgs", [[], [{"role": "user"}], [{"content": "x"}], "abc"])
def test_chat_template_failure_is_a_messages_error(tok, msgs):
    with pytest.raises(InvalidParam) as e:
        PromptPreparer(tok, 4096).prompt_ids(messages=msgs)
    assert e.value.field == "messages"


def test_tokenizer_without_chat_template(tok, monkeypatch):
    monkeypatch.setattr(tok.hf, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidParam) as e:
        PromptPreparer(tok, 4096).prompt_ids(messages=[{"role": "user", "content": "hi"}])
    assert e.value.field == "messages"


# ---- Detokenizer ------------------------------------------------------------------------------
def rec(
    rid: str,
    token: int | None = None,
    finish: str | None = None,
    logprob: float | None = None,
    top=None,
    completion: int = 1,
    **kw,
) -> RequestOutput:
    """A scheduler record: one new token (or none), maybe a finish and logprobs."""
    return RequestOutput(
        rid,
        [] if token is None else [token],
        None if logprob is None else [logprob],
        None if top is None else [top],
        finish,
        completion_tokens=completion,
        **kw,
    )


def spec(
    rid: str,
    tok: Tokenizer,
    prompt: str = "Q:",
    stop: list[str] | None = None,
    skip: bool = True,
    include: bool = False,
) -> DetokenizeSpec:
    return DetokenizeSpec.of(
        rid,
        tok.encode(prompt),
        SamplingParams(
            stop=list(stop or []), skip_special_tokens=skip, include_stop_str_in_output=include
        ),
    )


def shown_by_rid(outs: list[RequestOutput]) -> dict[str, RequestOutput]:
    assert len({o.rid for o in outs}) == len(outs), "one record per request per batch"
    return {o.rid: o for o in outs}


def test_detokenizer_streams_two_requests_and_stops_one(tok):
    """The detokenizer owns stop strings: it ends the output and reports the request stopped;
    the tokens the scheduler made before it heard are dropped, and it answers nothing back."""
    d = Detokenizer(tok)
    d.start(spec("a", tok, stop=["world"]))
    d.start(spec("b", tok, stop=["!!"]))
    a_ids, b_ids = tok.encode("Hello world and more"), tok.encode("Bonjour 🎉 世界!")
    texts = {"a": "", "b": ""}
    finishes: dict[str, tuple] = {}
    stops: list[Stopped] = []
    for k in range(max(len(a_ids), len(b_ids))):
        records = [
            rec(
                rid,
                ids[k],
                "length" if rid == "b" and k == len(ids) - 1 else None,
                completion=k + 1,
            )
            for rid, ids in (("a", a_ids), ("b", b_ids))
            if k < len(ids)
        ]
        outs, new_stops = d.process(records)
        stops += new_stops
        for rid, r in shown_by_rid(outs).items():
            assert rid not in finishes, f"{rid} reported after it finished"
            texts[rid] += r.text
            if r.finished:
                finishes[rid] = (r.finish_reason, r.matched_stop)
    assert texts == {"a": "Hello ", "b": "Bonjour 🎉 世界!"}
    assert finishes == {"a": ("stop", "world"), "b": ("length", None)}
    assert stops == [Stopped("a", "world")]
    assert d.streams == {}


def test_records_that_come_before_their_spec_wait_for_it(tok):
    """The spec comes from the tokenizer, the records from the scheduler: another socket."""
    d = Detokenizer(tok)
    ids = tok.encode("a b c")
    outs, _ = d.process([rec("r", ids[0]), rec("r", ids[1])])
    assert outs == []
    outs, _ = d.start(spec("r", tok))
    assert "".join(o.text for o in outs) == tok.decode(ids[:2])
    outs, _ = d.process([rec("r", ids[2], "length")])
    assert outs[0].finished and d.streams == {}


def test_a_stopped_requests_late_records_are_dropped_and_its_id_can_be_reused(tok):
    d = Detokenizer(tok)
    d.start(spec("r", tok, stop=["b"]))
    ids = tok.encode("a b c d")
    outs, stops = d.process([rec("r", t) for t in ids[:2]])
    assert stops == [Stopped("r", "b")] and outs[-1].finish_reason == "stop"
    assert d.process([rec("r", ids[2]), rec("r", ids[3], "abort")]) == ([], [])
    d.start(spec("r", tok))  # a new request with the same id
    outs, _ = d.process([rec("r", ids[0], "length")])
    assert [o.text for o in outs] == [tok.decode(ids[:1])]


def test_detokenizer_flushes_held_text_on_finish_without_token(tok):
    d = Detokenizer(tok)
    d.start(spec("r", tok, stop=["STOP"]))
    shown = ""
    for t in tok.encode("abc ST"):
        outs, _ = d.process([rec("r", t)])
        shown += "".join(o.text for o in outs)
    assert not shown.endswith("ST")
    outs, stops = d.process([rec("r", None, "abort")])
    assert shown + outs[0].text == "abc ST"
    assert outs[0].token_ids == [] and outs[0].logprobs is None and outs[0].finish_reason == "abort"
    assert stops == []


def test_detokenizer_stop_included_and_pass_through_fields(tok):
    d = Detokenizer(tok)
    d.start(spec("r", tok, stop=[";"], include=True))
    shown, last, stops = "", None, []
    for k, t in enumerate(tok.encode("x = 1; y")):
        outs, stops = d.process(
            [rec("r", t, prompt_tokens=11, completion=k + 1, cached_tokens=8, queue_time=0.25)]
        )
        if outs:
            shown += outs[0].text
            last = outs[0]
            if last.finished:
                break
    assert shown == "x = 1;"
    assert last.finish_reason == "stop" and last.matched_stop == ";"
    assert (last.prompt_tokens, last.cached_tokens, last.queue_time) == (11, 8, 0.25)
    assert stops == [Stopped("r", ";")]


def test_detokenizer_logprobs_carry_token_text(tok):
    d = Detokenizer(tok)
    for rid in "rst":
        d.start(spec(rid, tok))
    ids = tok.encode("Hi 🎉")
    top_ids = [ids[0], tok.eos_token_id, 1000]
    outs, _ = d.process(
        [
            rec("r", ids[0], logprob=-0.25, top=[top_ids, [-0.25, -2.0, -3.5]]),
            rec("s", ids[0], logprob=-0.5),
            rec("t", ids[0]),
        ]
    )
    r, s_, t = (shown_by_rid(outs)[x] for x in "rst")
    assert r.token_texts == [tok.decode([ids[0]], False)] and r.logprobs == [-0.25]
    assert r.top_texts == [[tok.decode([i], False) for i in top_ids]]
    assert r.top_texts[0][1] == tok.hf.convert_ids_to_tokens(tok.eos_token_id)  # specials shown
    assert s_.token_texts == ["Hi"] and s_.top_texts is None
    assert t.token_texts is None and t.logprobs is None
    # A token that is part of a character: its text is the raw (replacement) decode, the stream text waits.
    emoji_part = ids[-2] if len(ids) > 2 else ids[-1]
    outs, _ = d.process([rec("r", emoji_part, logprob=-1.0)])
    assert outs[0].token_texts == [tok.decode([emoji_part], False)] and outs[0].logprobs == [-1.0]


def test_detokenizer_skip_special_tokens_per_request(tok):
    d = Detokenizer(tok)
    d.start(spec("keep", tok, skip=False))
    d.start(spec("skip", tok, skip=True))
    eos = tok.eos_token_id
    texts = {"keep": "", "skip": ""}
    hi = tok.encode("Hi")
    for k, t in enumerate(hi + [eos]):
        fin = "stop" if k == len(hi) else None
        outs, _ = d.process([rec("keep", t, fin), rec("skip", t, fin)])
        for rid, r in shown_by_rid(outs).items():
            texts[rid] += r.text
    assert texts == {"keep": "Hi" + tok.hf.convert_ids_to_tokens(eos), "skip": "Hi"}


def test_detokenizer_stop_on_the_final_length_token(tok):
    """The scheduler ends a request for length on the very token that completes a stop
    string: the text is still cut there and the finish says stop (the stop string wins, as
    in vLLM/OpenAI), and the scheduler, which already finished the request, is told nothing."""
    d = Detokenizer(tok)
    d.start(spec("r", tok, stop=["world"]))
    ids = tok.encode("Hello world")
    text, all_stops = "", []
    for k, t in enumerate(ids):
        outs, stops = d.process([rec("r", t, "length" if k == len(ids) - 1 else None)])
        text += "".join(o.text for o in outs)
        all_stops += stops
    assert text == "Hello "
    assert outs[0].finish_reason == "stop" and outs[0].matched_stop == "world"
    assert all_stops == [] and d.streams == {}


def test_a_failure_detokenizing_one_request_ends_only_it(tok, monkeypatch):
    d = Detokenizer(tok)
    d.start(spec("bad", tok))
    d.start(spec("good", tok))
    real = d._fill

    def fragile(r, stream, stops):
        if r.rid == "bad":
            raise RuntimeError("boom")
        return real(r, stream, stops)

    monkeypatch.setattr(d, "_fill", fragile)
    outs, stops = d.process([rec("bad", 5), rec("good", tok.encode("ok")[0])])
    by = shown_by_rid(outs)
    assert by["bad"].finish_reason == "abort" and "boom" in by["bad"].error
    assert stops == [Stopped("bad", None)] and by["good"].text == "ok"


def test_output_ending_inside_a_character_is_flushed_at_finish(tok):
    ids = tok.encode("🎉")
    stream = DecodeStream(tok, [], SamplingParams())
    text = stream.add(ids[:1], finished=True)
    assert text == tok.decode(ids[:1])  # the partial character is shown, not dropped


def test_byte_table_and_windowed_decoding_agree(tok):
    texts = [
        "héllo wörld 🎉 你好, 세계!",
        "naïve café — ½ ∑ x²",
        "👩🏽‍🚀 launches\n\ttabs  and   spaces",
        "<|im_end|> is special",
    ]
    for text in texts:
        ids = tok.encode(text)
        fast = DecodeStream(tok, [], SamplingParams(skip_special_tokens=False))
        slow = DecodeStream(tok, [], SamplingParams(skip_special_tokens=False))
        slow.bytes = None  # force the windowed path
        assert fast.bytes is not None
        a = "".join(fast.add([i], False) for i in ids) + fast.add([], True)
        b = "".join(slow.add([i], False) for i in ids) + slow.add([], True)
        assert a == b == tok.decode(ids, False)
