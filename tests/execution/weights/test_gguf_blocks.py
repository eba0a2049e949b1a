"""A GGUF file's blocks read from the file for the weights converted from it (gguf_blocks): the
types whose blocks their float values alone do not give back (Q4_K, Q4_0, Q5_0; the k-quants with
scales per 16 or 5-bit quants: test_kquant_blocks), found exactly,
through the row reorderings and fusions a model's loading makes, and the model on them."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from relay import Engine
from relay.execution import model_files
from relay.execution.block_rows import ALL_ROWS
from relay.execution.gguf_blocks import GgufRows, SourceTensor
from relay.execution.weight_blocks import recover
from tests.helpers.engine_checks import random_prompts
from tests.helpers.gguf_files import VOCAB_SIZE, quantize_q4_k, write_gguf
from tests.helpers.gguf_models import COMMON, GREEDY, greedy, transformers_on


def q4_k_raw(rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K super-blocks (as llama.cpp's quantizer could write): small positive float16
    scales, random 6-bit sub-block scales and mins and random quants."""
    rng = np.random.default_rng(seed)
    n = rows * k // 256
    scales = rng.uniform(1e-4, 2e-3, (n, 2)).astype(np.float16).view(np.uint8)
    rest = rng.integers(0, 256, (n, 140), dtype=np.uint8)
    return np.concatenate([scales, rest], axis=1).reshape(rows, -1)


def source(qtype: T, rows: int, k: int, seed: int = 0) -> SourceTensor:
    if qtype == T.Q4_K:
        return SourceTensor(q4_k_raw(rows, k, seed), int(qtype), k)
    w = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32) * 0.05
    return SourceTensor(quantize(w, qtype), int(qtype), k)


def floats(t: SourceTensor) -> torch.Tensor:
    """The weight as transformers' GGUF reader gives it (gguf.quants.dequantize)."""
    return torch.from_numpy(dequantize(t.raw, T(t.qtype)).reshape(len(t.raw), t.k).copy())


@pytest.mark.parametrize(
    "qtype,bits", [(T.Q4_K, 4), (T.Q4_0, 8), (T.Q5_0, 8), (T.Q8_0, 8), (T.Q4_1, 4)]
)
def test_blocks_read_from_the_file_equal_the_weight_bit_for_bit(qtype, bits):
    t = source(qtype, 40, 512)
    w = floats(t)
    blocks = GgufRows.of([t]).blocks_for(w)
    assert blocks is not None and blocks.bits == bits
    assert torch.equal(blocks.dequantize(), w)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q4_0, T.Q5_0])
def test_their_values_alone_do_not_give_these_types_back(qtype):
    """Why the file is read: weight_blocks.recover fits float16 scales from the values."""
    assert recover(floats(source(qtype, 40, 512))) is None


def test_rows_reordered_and_fused_from_several_tensors_are_found():
    """Conversion reorders q and k rows (Llama's rotary permutation) and Relay fuses q/k/v and
    gate/up into one weight: its rows come from several tensors, in any order."""
    q, k, v = (source(T.Q5_0, 64, 256, seed) for seed in (1, 2, 3))
    fused = torch.cat([floats(q).flip(0), floats(k)[torch.randperm(64)], floats(v)])
    blocks = GgufRows.of([q, k, v]).blocks_for(fused)
    assert blocks is not None and torch.equal(blocks.dequantize(), fused)


def test_weights_not_in_the_file_stay_float():
    """A weight whose rows are in no tensor of the file (a Q5_1 one not indexed, a Q8_0 one), one
    whose rows agree with a tensor's only in their first and last blocks, and a row-parallel shard
    (half of each row). (Rows of both forms in one weight are lifted to one: test_kquant_blocks.)"""
    four, eight = source(T.Q4_K, 8, 256, 1), source(T.Q8_0, 8, 256, 2)
    rows = GgufRows.of([four, eight])
    mixed = torch.cat([floats(four), floats(eight)])
    assert torch.equal(rows.blocks_for(mixed).dequantize(), mixed)
    assert rows.blocks_for(floats(source(T.Q5_1, 8, 256, 3))) is None
    assert rows.blocks_for(floats(source(T.Q8_0, 8, 256, 4))) is None
    changed = floats(eight).clone()
    changed[:, 100] += 1.0
    assert rows.blocks_for(changed) is None
    assert rows.blocks_for(floats(eight)[:, :128].contiguous()) is None


def test_quantize_q4_k_writes_what_gguf_reads_back():
    """The test files' Q4_K writer (tests/helpers/gguf_files.py) against gguf's dequantizer: close to the
    weights it quantized (so its files are models, not noise)."""
    w = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32) * 0.05
    back = dequantize(quantize_q4_k(w), T.Q4_K)
    assert np.abs(back - w).max() < 0.2 * np.abs(w).max()


def test_a_mixed_file_runs_on_its_blocks_as_transformers_runs_it(tmp_path):
    """A tiny Llama written as a Q4_K_M-like file (Q4_K attention and gate/up, Q5_0 down, Q4_0
    output, Q8_0 embedding): every GEMM weight is kept in its file's blocks, and the GEMMs reading
    them (float32 activations) give transformers' greedy output token for token."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**COMMON, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64})
    path = write_gguf(
        str(tmp_path / "tiny-q4_k_m.gguf"),
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32),
        qtype={
            **{part: T.Q4_K for part in ("attn_q", "attn_k", "attn_v", "attn_output")},
            **{"ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": T.Q5_0},
            **{"output": T.Q4_0, "token_embd": T.Q8_0},
        },
    )
    try:
        prompts = random_prompts(VOCAB_SIZE, [3, 17, 40])
        expected = greedy(transformers_on(path, "llama"), prompts)
        engine = Engine(
            path,
            dtype="float32",
            kv_cache_gb=0.01,
            block_activations="float",
            weight_block_rows=ALL_ROWS,
        )
        bits = [m.blocks and m.blocks.bits for m in engine.runner.model.gemm_modules()]
        assert bits == [4, 4, 4, 8] * cfg.num_hidden_layers + [8], bits
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
    finally:
        shutil.rmtree(model_files.converted_dir(path), ignore_errors=True)
