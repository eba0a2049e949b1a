"""One request's bad input or failure fails that request alone: the model runner leaves a
malformed row out of the step, and finds the culprit when a batch's sampling raises."""

from __future__ import annotations

import pytest

from relay.config import EngineConfig, ModelConfig
from relay.execution.model_runner import ModelRunner
from relay.step import PENDING_TOKEN, BatchInput
from tests.helpers.kernel_helpers import cpu_kernels_or_skip
from tests.helpers.runner_batches import PS, prefill, spec
from tests.helpers.tiny_models import TINY_VOCAB


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    path = tiny_model_dir("llama")
    return ModelRunner(
        EngineConfig(dtype="float32", page_size=PS, kv_cache_gb=0.01),
        path,
        ModelConfig.from_dir(path),
    )


def release(sids: list[int], step: int) -> BatchInput:
    return BatchInput(step, [], [], [], [], [], [], [], [], released_sids=sids)


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]


def alone(runner, i: int) -> int:
    out = runner.forward(prefill([i + 100], [PROMPTS[i]], [spec(i + 100)], step=50 + i))
    runner.forward(release([i + 100], 99))
    return out.next_token_ids[0]


@pytest.mark.parametrize(
    "bad",
    [
        dict(prompt=[5, TINY_VOCAB + 3, 7]),  # an input id outside the vocabulary
        dict(
            spec=dict(stop_token_ids=[10**9], min_new_tokens=2)
        ),  # the bug of issue 9: a stop id the sampler indexes
        dict(table=[10**7]),  # a KV page outside the pool
        dict(table=[]),  # a page table that does not hold the request's tokens
    ],
)
def test_a_malformed_row_fails_alone_and_the_rest_of_the_batch_runs(runner, bad):
    expected = [alone(runner, 0), alone(runner, 2)]
    prompts = [PROMPTS[0], bad.get("prompt", PROMPTS[1]), PROMPTS[2]]
    specs = [spec(1), spec(2, **bad.get("spec", {})), spec(3)]
    batch = prefill([1, 2, 3], prompts, specs)
    if "table" in bad:
        batch.new_pages[1] = bad["table"]
    assert runner.invalid_rows(batch).keys() == {1}
    out = runner.forward(batch)
    assert list(out.row_errors) == [1] and out.error is None
    assert [out.next_token_ids[0], out.next_token_ids[2]] == expected and out.next_token_ids[
        1
    ] == -1
    runner.forward(release([1, 2, 3], 98))


def test_a_pending_input_continues_from_the_token_sampled_last_or_fails_alone(runner):
    """Overlap: a decode row built before its token was seen carries PENDING_TOKEN; the runner
    continues from the token it sampled for that request. A request whose last sampling row
    failed has none: that row fails alone."""
    first = runner.forward(prefill([20, 21], PROMPTS[:2], [spec(20), spec(21)], step=60))
    decode = lambda ids, step: BatchInput(  # noqa: E731
        step=step,
        sids=[20, 21],
        input_ids=ids,
        prefix_lens=[5, 3],
        extend_lens=[1, 1],
        page_starts=[2, 1],
        new_pages=[[], [4]] if step == 61 else [[], []],
        sample=[True, True],
        output_lens=[1, 1],
    )
    known = runner.forward(decode(first.next_token_ids, 61))
    runner.forward(release([20, 21], 62))
    again = runner.forward(prefill([20, 21], PROMPTS[:2], [spec(20), spec(21)], step=63))
    runner.requests.last_tokens.pop(21)  # as if its sampling had failed
    pending = runner.forward(decode([PENDING_TOKEN, PENDING_TOKEN], 61))
    assert again.next_token_ids == first.next_token_ids
    assert pending.next_token_ids[0] == known.next_token_ids[0] and pending.next_token_ids[1] == -1
    assert list(pending.row_errors) == [1] and "previous step failed" in pending.row_errors[1]
    runner.forward(release([20, 21], 64))


def test_when_sampling_a_batch_raises_only_the_culprit_fails(runner, monkeypatch):
    expected = [alone(runner, 0), alone(runner, 2)]
    real = runner.sampler.sample

    def fragile(logits, sids, out_lens):
        if 7 in sids:
            raise RuntimeError("boom")
        return real(logits, sids, out_lens)

    monkeypatch.setattr(runner.sampler, "sample", fragile)
    out = runner.forward(prefill([6, 7, 8], PROMPTS, [spec(6), spec(7), spec(8)]))
    assert list(out.row_errors) == [1] and "boom" in out.row_errors[1]
    assert [out.next_token_ids[0], out.next_token_ids[2]] == expected


def test_bf16_cpu_kernels_match_the_torch_path(tiny_model_dir):
    """The fused CPU ops and small-batch GEMM (bfloat16) compute what torch's ops do, to bf16 precision."""
    cpu_kernels_or_skip()
    path = tiny_model_dir("llama")
    cfg = EngineConfig(dtype="bfloat16", page_size=PS, kv_cache_gb=0.01)
    fast = ModelRunner(cfg, path, ModelConfig.from_dir(path))
    plain = ModelRunner(cfg, path, ModelConfig.from_dir(path))
    plain.model.fused_cpu_ops = False
    for module in plain.model.modules():
        for name in ("fused", "gemv"):
            if hasattr(module, name):
                setattr(module, name, False)
        if hasattr(module, "rotary") and module is not plain.model:
            module.rotary = None
    assert fast.model.fused_cpu_ops
    for rows in ([PROMPTS[0]], PROMPTS):  # 1 row (the small-batch GEMM), then a batch
        batch = prefill(list(range(len(rows))), rows, [spec(i) for i in range(len(rows))])
        a = fast.step_logits(batch, batch.new_pages)
        b = plain.step_logits(batch, batch.new_pages)
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() < 0.05 * scale


def test_start_up_runs_each_kind_of_step_once_and_leaves_nothing_behind(
    tiny_model_dir, monkeypatch
):
    """The first request after "ready" must not pay for a kernel build or a first-call path: the
    runner runs a prompt, a mixed step, decode steps and a release before it is handed out."""
    seen = []
    real = ModelRunner.forward

    def recording(self, batch):
        seen.append(
            "release"
            if not batch.sids
            else "decode"
            if batch.is_decode
            else "mixed"
            if 1 in batch.extend_lens
            else "prompt"
        )
        return real(self, batch)

    monkeypatch.setattr(ModelRunner, "forward", recording)
    path = tiny_model_dir("llama")
    fresh = ModelRunner(
        EngineConfig(dtype="float32", page_size=PS, kv_cache_gb=0.01),
        path,
        ModelConfig.from_dir(path),
    )
    assert seen == ["prompt", "mixed", "decode", "decode", "release"]
    assert fresh.requests.page_tables == {} and fresh.sampler.states == {}
