"""Tensor parallelism on one machine's CPUs: the ranks' collectives over a shared memory segment
(relay.execution.distributed.ShmGroup), and the one-call decoder steps that all-reduce inside C. Two real
rank processes each time (gloo for the rendezvous, as the server starts them)."""

from __future__ import annotations

import os

import pytest
import torch

from relay.execution.distributed import TPGroup
from tests.helpers.ranks import run_ranks


def _collectives(rank: int, tp: TPGroup) -> dict:
    assert tp.shm is not None, "one machine's CPU ranks exchange through shared memory"
    g = torch.Generator().manual_seed(rank)
    f32 = torch.randn(1000, generator=g)  # 4,000 bytes: 16 pieces of 256
    bf16 = torch.randn(333, generator=g).bfloat16()
    mine = {"f32": f32.clone(), "bf16": bf16.clone()}
    out = {
        "mine": mine,
        "f32": tp.all_reduce(f32),
        "bf16": tp.all_reduce(bf16),
        "strided": tp.all_reduce(torch.arange(12.0).view(3, 4).t() * (rank + 1)),
        "gathered": tp.all_gather_last_dim(torch.full((2, 3 - rank), float(rank)), [3, 2]),
        "ints": tp.broadcast_ints([7 + rank, 8], torch.device("cpu")),
        "all_true": (tp.all_true(True), tp.all_true(rank == 0)),
    }
    try:  # float32 on one rank, bfloat16 on the other: caught, not summed
        tp.all_reduce(torch.ones(8) if rank == 0 else torch.ones(8, dtype=torch.bfloat16))
    except RuntimeError as e:
        out["mismatch"] = str(e)
    if rank == 0:  # rank 1 never joins this one
        tp.shm.state.timeout_s = 0.5
        try:
            tp.all_reduce(torch.ones(4))
        except RuntimeError as e:
            out["timeout"] = str(e)
    return out


def test_shared_memory_collectives_sum_gather_and_fail_loudly(tmp_path):
    r0, r1 = run_ranks(_collectives, tmp_path)
    f32 = r0["mine"]["f32"] + r1["mine"]["f32"]
    bf16 = (r0["mine"]["bf16"].float() + r1["mine"]["bf16"].float()).bfloat16()
    for r in (r0, r1):
        assert torch.equal(r["f32"], f32) and torch.equal(r["bf16"], bf16)
        assert torch.equal(r["strided"], torch.arange(12.0).view(3, 4).t() * 3)
        assert torch.equal(r["gathered"], torch.tensor([[0.0, 0, 0, 1, 1]] * 2))
        assert r["ints"] == [7, 8]  # the leader's
        assert r["all_true"] == (True, False)
        assert "out of step" in r["mismatch"]
    assert "did not join" in r0["timeout"]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(tmp_path.name)], (
        "the segment is not left behind"
    )


def _sums(rank: int, tp: TPGroup) -> tuple:
    return (
        tp.shm is None,
        tp.all_reduce(torch.arange(600.0) * (rank + 1)),
        tp.broadcast_ints([rank, 5], None),
        tp.all_gather_last_dim(torch.full((2, 3 - rank), float(rank)), [3, 2]),
    )


def test_ranks_without_shared_memory_fall_back_to_gloo_together(tmp_path):
    """A segment that cannot be made (here: its folder does not exist; in a container, a small
    /dev/shm) leaves every rank on gloo, with the same results."""
    for no_segment, summed, ints, gathered in run_ranks(
        _sums, tmp_path, segment_at=str(tmp_path / "missing" / "segment")
    ):
        assert no_segment and torch.equal(summed, torch.arange(600.0) * 3) and ints == [0, 5]
        assert torch.equal(gathered, torch.tensor([[0.0, 0, 0, 1, 1]] * 2))


def _prompt_and_decode_steps(rank: int, tp: TPGroup, model_dir: str) -> dict:
    from relay.config import EngineConfig, ModelConfig
    from relay.execution.model_runner import ModelRunner
    from relay.step import BatchInput
    from tests.helpers.block_checks import step_each_way

    runner = ModelRunner(
        # (float activations: bfloat16 panels stay beside the blocks)
        EngineConfig(dtype="bfloat16", tp_size=2, kv_cache_gb=0.05, block_activations="float"),
        model_dir,
        ModelConfig.from_dir(model_dir),
        tp,
    )
    runner.model.limit_weight_blocks(0)  # every GEMM on the panels, in both paths
    prompt_fast, decode_fast = runner.model.prompt_layers, runner.model.decode_layers
    assert prompt_fast is not None and decode_fast is not None
    ps = runner.page_size
    ids = torch.randint(
        100, 40000, (2 * ps + 3,), generator=torch.Generator().manual_seed(3)
    ).tolist()
    tables = [[1, 2, 3]]
    prompt = BatchInput(0, [0], ids, [0], [len(ids)], [0], tables, [True], [0])
    (call, kv_call), (layered, kv_layered) = step_each_way(
        runner, prompt, tables, (prompt_fast, None), "prompt_layers", rows=list(range(len(ids)))
    )
    runner.model.prompt_layers = prompt_fast
    decode = BatchInput(0, [0], [5], [len(ids)], [1], [0], [[]], [True], [1])
    (dec_call, _), (dec_layered, _) = step_each_way(runner, decode, tables, (decode_fast, None))
    return {
        "prompt": (call, layered),
        "kv": all(torch.equal(a, b) for a, b in zip(kv_call, kv_layered)),
        "decode": (dec_call, dec_layered),
    }


@pytest.mark.slow
def test_one_call_steps_of_two_ranks_equal_their_layer_by_layer_path(tmp_path, default_model_dir):
    """With --tp 2 a bfloat16 model's steps run their decoder layers in one C call per rank, each
    all-reducing its row-parallel GEMMs' outputs where the layers do: a prompt step's logits and
    keys and values are the layers' bit for bit on both ranks, a decode step's (float32
    activations against bfloat16 ones) close."""
    from relay.execution.kernels import cpu_gemm

    if not (cpu_gemm.gemm_blocks_available() and cpu_gemm.panels_preferred()):
        pytest.skip(
            "the one-call prompt step runs on Relay's bfloat16 panels (AVX512-BF16, no AMX)"
        )
    for r in run_ranks(_prompt_and_decode_steps, tmp_path, default_model_dir):
        call, layered = r["prompt"]
        assert torch.equal(call, layered) and r["kv"]
        dec_call, dec_layered = r["decode"]
        assert (dec_call - dec_layered).abs().max() < 0.05 * dec_layered.abs().max()
