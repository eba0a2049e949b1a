"""Prompt log-probabilities (echo, vLLM's prompt_logprobs, SGLang's input_token_logprobs) equal
transformers' log_softmax of the same model's logits, in float32: over prompts split into
several prefill chunks, several requests in one step, and prompts whose prefix the radix cache
already holds. Plus what the API answers with them (pure functions, no server)."""

from __future__ import annotations

import random

import pytest
import torch

from relay import Engine, SamplingParams
from relay.api.completions import completion_chunk, completion_response, parse_completion
from relay.api.errors import ProtocolError
from relay.api.generate import generate_response, parse_generate
from relay.api.prompt_output import PromptView
from relay.outputs import PromptLogprobs, RequestOutput

TOP = 5
MODEL = "tiny"


def transformers_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: row t scores the token at t + 1."""
    from relay.execution.model_files import load_transformers_model

    model = load_transformers_model(model_dir, torch.float32)
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_matches(lp: PromptLogprobs, prompt: list[int], start: int, ref: torch.Tensor) -> None:
    assert lp.start == start and lp.token_ids == prompt[start:]
    assert lp.logprobs[0] is None and lp.ranks[0] is None and lp.top[0] is None
    positions = torch.arange(start, len(prompt) - 1)
    targets = torch.tensor(prompt[start + 1 :])
    want = ref[positions, targets]
    assert lp.logprobs[1:] == pytest.approx(want.tolist(), abs=1e-4)
    want_ranks = (ref[positions] > want[:, None]).sum(dim=1) + 1
    assert lp.ranks[1:] == want_ranks.tolist()
    vals, ids = ref[positions].topk(TOP, dim=-1)
    assert [top[0] for top in lp.top[1:]] == ids.tolist()
    got = torch.tensor([top[1] for top in lp.top[1:]])
    torch.testing.assert_close(got, vals, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def prompts():
    from tests.helpers.tiny_models import TINY_VOCAB

    rng = random.Random(1)
    shared = [rng.randrange(2, TINY_VOCAB - 2) for _ in range(40)]
    return [
        shared + [rng.randrange(2, TINY_VOCAB - 2) for _ in range(30)],  # 70 tokens
        shared[:20] + [rng.randrange(2, TINY_VOCAB - 2) for _ in range(13)],  # 33
        [rng.randrange(2, TINY_VOCAB - 2) for _ in range(9)],
    ]


def params(start: int, max_new_tokens: int = 0) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        logprob_start_len=start,
        prompt_top_logprobs=TOP,
    )


@pytest.fixture(scope="module")
def engine(model_dir):
    # 16-token chunks: the 70-token prompt's positions come from five prefill steps.
    return Engine(
        model_dir, dtype="float32", page_size=4, chunked_prefill_size=16, kv_cache_gb=0.01
    )


@pytest.fixture
def spans_per_step(engine, monkeypatch) -> list[int]:
    """How many requests each step of the engine scores prompt positions for, step by step."""
    counts: list[int] = []
    forward = engine.runner.forward

    def spy(batch):
        counts.append(len(batch.prompt_logprob_spans))
        return forward(batch)

    monkeypatch.setattr(engine.runner, "forward", spy)
    return counts


def test_prompt_logprobs_equal_transformers_over_chunks_and_the_prefix_cache(
    engine, model_dir, prompts, spans_per_step
):
    refs = [transformers_logprobs(model_dir, p) for p in prompts]
    starts = [0, 3, 0]
    first = engine.generate(prompts, [params(s) for s in starts])
    assert sum(n > 0 for n in spans_per_step) >= 4, "the prompts must span several chunks"
    assert max(spans_per_step) >= 2, "some step must score several requests"
    for out, p, s, ref in zip(first, prompts, starts, refs):
        assert out.token_ids == [] and out.finish_reason == "length"
        assert_matches(out.prompt_logprobs, p, s, ref)

    # Again: the cache holds every prompt now. From position 0 it serves none of it (every
    # position is scored); from 30 it serves up to there, and the rest is still computed.
    again = engine.generate(prompts, [params(0), params(30), params(0, max_new_tokens=1)])
    assert again[0].cached_tokens == 0 and 0 < again[1].cached_tokens <= 30
    for out, p, s, ref in zip(again, prompts, [0, 30, 0], refs):
        assert_matches(out.prompt_logprobs, p, s, ref)
    # max_new_tokens 1: the prompt's logprobs and the greedy next token.
    assert again[2].token_ids == [int(refs[2][-1].argmax())]

    # A plain request after them still reuses the cache (the limit is only theirs).
    plain = engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_new_tokens=1))[0]
    assert plain.cached_tokens >= 64 and plain.prompt_logprobs is None
    engine.check()
    assert engine.scheduler.stats().kv_locked_tokens == 0


def test_requests_scoring_the_same_prompt_run_side_by_side(
    engine, model_dir, prompts, spans_per_step
):
    """Two requests for one prompt's logprobs (echo with n=2) cannot share its KV: the second
    is not held back for the first's prefill to cache it (it would wait for nothing)."""
    prompt = prompts[1]
    outs = engine.generate([prompt, prompt], params(0))
    assert max(spans_per_step) == 2
    ref = transformers_logprobs(model_dir, prompt)
    for out in outs:
        assert_matches(out.prompt_logprobs, prompt, 0, ref)


def test_prompt_logprobs_with_overlap_scheduling(model_dir, prompts):
    """With overlap a prompt's next chunk is built before its last one's output is in."""
    engine = Engine(
        model_dir,
        dtype="float32",
        page_size=4,
        chunked_prefill_size=16,
        kv_cache_gb=0.01,
        overlap_min_share=0,
    )
    outs = engine.generate(prompts, [params(0, max_new_tokens=4) for _ in prompts])
    for out, p in zip(outs, prompts):
        assert_matches(out.prompt_logprobs, p, 0, transformers_logprobs(model_dir, p))
        assert len(out.token_ids) == 4
    engine.check()


# ---- the API (pure functions) -----------------------------------------------------------------


def prompt_record() -> RequestOutput:
    """A finished record of prompt [5, 6, 7] with max_tokens 1 (output token 8), as the
    detokenizer fills it."""
    lp = PromptLogprobs(
        0,
        [5, 6, 7],
        [None, -0.5, -2.0],
        [None, 1, 3],
        [None, [[6, 9], [-0.5, -1.5]], [[9, 4], [-0.25, -1.0]]],
        texts=["a", "b", "c"],
        top_texts=[None, ["b", "x"], ["x", "y"]],
    )
    return RequestOutput(
        "r",
        [8],
        logprobs=[-0.1],
        top_logprobs=[[[8, 2], [-0.1, -3.0]]],
        finish_reason="length",
        prompt_tokens=3,
        completion_tokens=1,
        text="d",
        token_texts=["d"],
        top_texts=[["d", "z"]],
        prompt_logprobs=lp,
    )


def test_echo_with_logprobs_reads_as_lm_eval_reads_it():
    parsed = parse_completion(
        {"model": MODEL, "prompt": [5, 6, 7], "echo": True, "logprobs": 2, "max_tokens": 1},
        MODEL,
    )
    assert parsed.echo and parsed.params.logprob_start_len == 0
    assert parsed.params.prompt_top_logprobs == 2
    view = PromptView(echo_text="abc", echo_logprobs=2)
    choice = completion_response("id", 0, MODEL, [prompt_record()], view)["choices"][0]
    assert choice["text"] == "abcd"
    lps = choice["logprobs"]
    assert lps["tokens"] == ["a", "b", "c", "d"]
    assert lps["token_logprobs"] == [None, -0.5, -2.0, -0.1]
    # "c" is the prompt's token but third likeliest: it comes after the top 2 (OpenAI's and
    # vLLM's logprobs + 1 entries).
    assert lps["top_logprobs"] == [
        None,
        {"b": -0.5, "x": -1.5},
        {"x": -0.25, "y": -1.0, "c": -2.0},
        {"d": -0.1, "z": -3.0},
    ]
    assert lps["text_offset"] == [0, 1, 2, 3]
    # lm-eval: the continuation's logprobs and whether it was greedy.
    assert sum(lps["token_logprobs"][1:3]) == -2.5
    assert "prompt_logprobs" not in choice


def test_max_tokens_zero_with_echo_is_the_prompt_alone():
    parsed = parse_completion(
        {"model": MODEL, "prompt": "abc", "echo": True, "logprobs": 0, "max_tokens": 0}, MODEL
    )
    assert parsed.params.max_new_tokens == 0 and parsed.params.prompt_top_logprobs == 0
    record = prompt_record()
    record.token_ids, record.logprobs, record.top_logprobs = [], None, None
    record.text, record.token_texts, record.top_texts = "", None, None
    view = PromptView(echo_text="abc", echo_logprobs=0)
    choice = completion_response("id", 0, MODEL, [record], view)["choices"][0]
    assert choice["text"] == "abc"
    assert choice["logprobs"]["tokens"] == ["a", "b", "c"]
    assert choice["logprobs"]["token_logprobs"] == [None, -0.5, -2.0]
    # logprobs 0: each position's own token alone, as vLLM answers it.
    assert choice["logprobs"]["top_logprobs"] == [None, {"b": -0.5}, {"c": -2.0}]
    # Without echo: nothing at all.
    plain = completion_response("id", 0, MODEL, [record], PromptView())["choices"][0]
    assert plain["text"] == "" and plain["logprobs"] is None


def test_streamed_echo_comes_in_the_first_chunk():
    view = PromptView(echo_text="abc", echo_logprobs=2)
    first = completion_chunk("id", 0, MODEL, 0, prompt_record(), 0, view)["choices"][0]
    assert first["text"] == "abcd" and first["logprobs"]["tokens"][:3] == ["a", "b", "c"]
    later = RequestOutput("r", [9], logprobs=[-1.0], text="e", token_texts=["e"])
    second = completion_chunk("id", 0, MODEL, 0, later, 4)["choices"][0]
    assert second["text"] == "e" and second["logprobs"]["text_offset"] == [4]


@pytest.mark.parametrize(
    "top, texts, want",
    [
        ([[2], [-0.3]], ["z"], {"z": -0.3, "d": -2.5}),  # not among the top 1: one more entry
        ([[8, 2], [-2.5, -2.6]], ["d", "z"], {"d": -2.5, "z": -2.6}),  # among them: no more
        ([[2], [-0.3]], ["d"], {"d": -0.3}),  # another token with its text: the likelier stays
        (None, None, {"d": -2.5}),  # logprobs 0: the chosen token alone
    ],
)
def test_output_top_logprobs_hold_the_chosen_token(top, texts, want):
    """OpenAI's legacy logprobs N: the N likeliest and the chosen token, up to N + 1 entries."""
    record = RequestOutput(
        "r",
        [8],
        logprobs=[-2.5],
        top_logprobs=None if top is None else [top],
        finish_reason="length",
        text="d",
        token_texts=["d"],
        top_texts=None if texts is None else [texts],
    )
    whole = completion_response("id", 0, MODEL, [record])["choices"][0]["logprobs"]
    chunk = completion_chunk("id", 0, MODEL, 0, record)["choices"][0]["logprobs"]
    assert whole["top_logprobs"] == chunk["top_logprobs"] == [want]
    assert whole["token_logprobs"] == [-2.5]


def test_vllm_prompt_logprobs_field():
    parsed = parse_completion({"model": MODEL, "prompt": "abc", "prompt_logprobs": 1}, MODEL)
    assert parsed.prompt_logprobs == 1 and parsed.params.logprob_start_len == 0
    assert not parsed.params.logprobs  # the output's are not asked for
    view = PromptView(prompt_logprobs=1)
    choice = completion_response("id", 0, MODEL, [prompt_record()], view)["choices"][0]
    assert choice["prompt_logprobs"] == [
        None,
        {"6": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}},
        {
            "7": {"logprob": -2.0, "rank": 3, "decoded_token": "c"},
            "9": {"logprob": -0.25, "rank": 1, "decoded_token": "x"},
        },
    ]
    assert choice["text"] == "d"  # no echo


def test_generate_input_token_logprobs():
    parsed = parse_generate(
        {
            "input_ids": [5, 6, 7],
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
        }
    )
    assert parsed.params.logprob_start_len == 0 and parsed.params.prompt_top_logprobs == 2
    meta = generate_response("r", prompt_record())["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 5, "a"], [-0.5, 6, "b"], [-2.0, 7, "c"]]
    assert meta["input_top_logprobs"] == [
        None,
        [[-0.5, 6, "b"], [-1.5, 9, "x"]],
        [[-0.25, 9, "x"], [-1.0, 4, "y"]],
    ]
    # Without logprob_start_len (-1), or without return_logprob: none.
    assert parse_generate({"text": "hi", "return_logprob": True}).params.logprob_start_len == -1
    assert parse_generate({"text": "hi", "logprob_start_len": 0}).params.logprob_start_len == -1


@pytest.mark.parametrize(
    "parse, body, param",
    [
        (parse_completion, {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        (parse_completion, {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        (parse_completion, {"prompt": "x", "prompt_logprobs": True}, "prompt_logprobs"),
        (parse_completion, {"prompt": "x", "prompt_logprobs": 1.5}, "prompt_logprobs"),
        (parse_completion, {"prompt": "x", "echo": "yes"}, "echo"),
        (parse_completion, {"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
        (parse_completion, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        (parse_generate, {"text": "x", "logprob_start_len": -2}, "logprob_start_len"),
        (parse_generate, {"text": "x", "logprob_start_len": "0"}, "logprob_start_len"),
        (parse_generate, {"text": "x", "top_logprobs_num": 21}, "top_logprobs_num"),
        (parse_generate, {"text": "x", "top_logprobs_num": -1}, "top_logprobs_num"),
    ],
)
def test_out_of_range_fields_are_400s_naming_them(parse, body, param):
    with pytest.raises(ProtocolError) as e:
        parse(body, MODEL) if parse is parse_completion else parse(body)
    assert e.value.status == 400 and e.value.param == param


def test_logprob_start_len_past_the_prompt_is_refused(engine):
    from relay.sampling_params import InvalidParam

    with pytest.raises(InvalidParam) as e:
        engine.generate([[5, 6, 7]], params(3))
    assert e.value.field == "logprob_start_len"
