"""PromptPreparer's limits: a prompt that cannot fit the context is refused after about one
context's worth of tokenizing, never a false refusal, and ids outside the model's vocabulary
never reach the model."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.sampling_params import InvalidParam
from relay.text.tokenizer import PromptPreparer, Tokenizer


@pytest.fixture(scope="module")
def tok(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


class CountingTokenizer:
    """The real tokenizer, counting the characters it is asked to encode."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.chars = tok, 0
        self.vocab_size, self.max_token_chars = tok.vocab_size, tok.max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.chars += len(text)
        return self.tok.encode(text, add_special_tokens)

    def apply_chat_template(self, messages, **kw):
        self.chars += sum(len(m["content"]) for m in messages)
        return self.tok.apply_chat_template(messages, **kw)


@pytest.mark.parametrize("size", [10_000_000, 600_000, 60_000])
def test_an_oversized_prompt_costs_about_one_context_of_tokenizing(tok, size):
    """A 10 MB prompt once held the tokenizer for ~7 s while every other request waited."""
    counting = CountingTokenizer(tok)
    prep = PromptPreparer(counting, context_len=8192)
    text = ("The quick brown fox jumps over the lazy dog. " * (size // 45 + 1))[:size]
    with pytest.raises(InvalidParam) as e:
        prep.prompt_ids(text)
    assert e.value.field == "prompt" and "context" in str(e.value)
    assert counting.chars <= 4 * 4 * 8192, f"tokenized {counting.chars} characters to refuse it"


def test_oversized_chat_messages_are_refused_the_same_way(tok):
    counting = CountingTokenizer(tok)
    prep = PromptPreparer(counting, context_len=2048)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Summarise this: " + "lorem ipsum dolor sit amet " * 20_000},
    ]
    with pytest.raises(InvalidParam) as e:
        prep.prompt_ids(messages=messages)
    assert e.value.field == "messages" and counting.chars <= 4 * 4 * 2048


WORDS = st.sampled_from(
    ["the", " ", "  ", "\n", "fox", "über", "日本語", "🙂", "1234", "x" * 30, "\t", "."]
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(parts=st.lists(WORDS, min_size=1, max_size=1500), context=st.sampled_from([16, 64, 200]))
def test_never_a_false_refusal(tok, parts, context):
    """Whatever the probe decides, a refused prompt really has >= context tokens, and an
    accepted one is tokenized exactly as a plain encode would."""
    text = "".join(parts)
    prep = PromptPreparer(tok, context_len=context)
    full = tok.encode(text)
    try:
        ids = prep.prompt_ids(text)
    except InvalidParam:
        assert len(full) >= context, (
            f"refused a {len(full)}-token prompt for a {context}-token context"
        )
        return
    assert ids == full and len(ids) < context


def test_ids_outside_the_models_vocabulary_are_refused(tok):
    """A model whose vocabulary is smaller than its tokenizer's (or a client's raw ids) must
    not index past the embedding table."""
    prep = PromptPreparer(tok, context_len=512, vocab_size=1000)
    with pytest.raises(InvalidParam, match="outside this model's vocabulary"):
        prep.prompt_ids(input_ids=[5, 1000])
    with pytest.raises(InvalidParam, match="outside this model's vocabulary"):
        prep.prompt_ids("a text whose tokens run past id 1000: überraschend")
    assert prep.prompt_ids(input_ids=[0, 999]) == [0, 999]


# ---- /tokenize and /detokenize (the tokenizer process's side) -------------------------------------


def test_tokenize_is_the_tokenizers_encoding_and_detokenize_its_inverse(tok):
    prep = PromptPreparer(tok, context_len=2048)
    text = "Hello world! Ünïcödé 日本語 🙂  two  spaces\n"
    for special in (True, False):
        assert prep.tokenize(text, add_special_tokens=special) == tok.hf.encode(
            text, add_special_tokens=special
        )
    ids = prep.tokenize(text, add_special_tokens=False)
    assert prep.detokenize(ids) == text
    assert prep.tokenize("") == [] and prep.detokenize([]) == ""
    assert tok.token_strs(ids) == tok.hf.convert_ids_to_tokens(ids)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert prep.tokenize(
        messages=messages, chat_kwargs={"add_generation_prompt": True}
    ) == prep.prompt_ids(messages=messages, chat_kwargs={"add_generation_prompt": True})
    special = [t for t in prep.tokenize(messages=messages) if t in tok.byte_table().special]
    assert special and prep.detokenize(prep.tokenize(messages=messages)).startswith("<|im_start|>")


def test_tokenize_and_detokenize_refuse_naming_the_field(tok):
    prep = PromptPreparer(tok, context_len=64, vocab_size=49152)
    with pytest.raises(InvalidParam) as e:
        prep.tokenize("word " * 500)
    assert e.value.field == "prompt" and "context is 64 tokens" in str(e.value)
    with pytest.raises(InvalidParam) as e:
        prep.tokenize(messages=[{"role": "user", "content": "word " * 500}])
    assert e.value.field == "messages"
    for ids in ([0, 49152], [-1], [1] * 65):
        with pytest.raises(InvalidParam) as e:
            prep.detokenize(ids)
        assert e.value.field == "tokens"


def test_the_tokenizer_process_answers_tokenize_calls(tok):
    from ipc.messages import TokenizeCall
    from procs.tokenizer import answer
    from relay.text.tokenize_query import TokenizeQuery as Q

    prep = PromptPreparer(tok, context_len=64)
    ok = answer(prep, TokenizeCall(3, Q("tokenize", text="Hi there", return_token_strs=True)))
    assert (ok.call_id, ok.ok, ok.data) == (
        3,
        True,
        {"tokens": tok.encode("Hi there"), "token_strs": tok.token_strs(tok.encode("Hi there"))},
    )
    assert answer(prep, TokenizeCall(4, Q("detokenize", tokens=ok.data["tokens"]))).data == {
        "prompt": "Hi there"
    }
    refused = answer(prep, TokenizeCall(5, Q("detokenize", tokens=[10**6])))
    assert not refused.ok and refused.data["param"] == "tokens" and refused.data["status"] == 400
