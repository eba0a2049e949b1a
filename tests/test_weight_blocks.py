"""GGUF blocks recovered from dequantized float32 weights, and the GEMM that reads them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from relay import weight_blocks
from relay.kernels import cpu
from relay.weight_blocks import recover


def gguf_q4_1(w: np.ndarray) -> np.ndarray:
    """w [N, K] quantized to Q4_1 as ggml does and dequantized as gguf-py does (float32)."""
    b = w.reshape(-1, 32).astype(np.float32)
    lo, hi = b.min(1), b.max(1)
    d = (hi - lo) / 15
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.minimum(15, ((b - lo[:, None]) * inv[:, None] + 0.5).astype(np.int8)).astype(np.float32)
    d16, m16 = d.astype(np.float16).astype(np.float32), lo.astype(np.float16).astype(np.float32)
    return ((d16[:, None] * q) + m16[:, None]).reshape(w.shape)


def gguf_q8_0(w: np.ndarray) -> np.ndarray:
    b = w.reshape(-1, 32).astype(np.float32)
    d = np.abs(b).max(1) / 127
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.round(b * inv[:, None]).astype(np.float32)
    return (d.astype(np.float16).astype(np.float32)[:, None] * q).reshape(w.shape)


def weight(n: int, k: int, kind: str, seed: int = 0) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    w[0, :32] = 0.25  # a constant block (d = 0)
    return torch.from_numpy({"q4_1": gguf_q4_1, "q8_0": gguf_q8_0, "dense": lambda a: a}[kind](w))


@pytest.mark.parametrize("chunk", [7, 1 << 20])
@pytest.mark.parametrize("kind,bits", [("q4_1", 4), ("q8_0", 8)])
def test_blocks_come_back_bit_for_bit(kind, bits, chunk, monkeypatch):
    monkeypatch.setattr(weight_blocks, "CHUNK_BLOCKS", chunk)  # a large weight is fitted in parts
    w = weight(70, 96, kind)
    blocks = recover(w)
    assert blocks is not None and blocks.bits == bits
    assert torch.equal(blocks.dequantize(), w)


def test_weights_that_are_not_blocks_stay_float(monkeypatch):
    assert recover(weight(64, 64, "dense")) is None
    w = weight(64, 64, "q4_1")
    w[40, 7] = torch.nextafter(w[40, 7], torch.tensor(1.0))  # one weight one ulp off its block
    assert recover(w) is None
    monkeypatch.setattr(weight_blocks, "CHUNK_BLOCKS", 5)
    assert recover(w) is None, "a bad block in a later part fails the whole weight"
    assert recover(weight(64, 48, "q4_1")[:, :40]) is None  # not whole blocks
    assert recover(weight(64, 64, "q4_1").bfloat16()) is None


@pytest.fixture(scope="module")
def lib():
    if not cpu.gemm_blocks_available():
        pytest.skip("the block GEMM needs AVX-512 and a C compiler")
    return cpu.load()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 33, 190])
@pytest.mark.parametrize("n,k", [(200, 96), (64, 576), (40, 160)])
def test_gemm_on_blocks_matches_the_float_weights(lib, kind, m, n, k):
    w = weight(n, k, kind, seed=m)
    blocks = recover(w)
    x = torch.randn(m, k + 5)[:, :k]  # strided rows
    y = cpu.gemm_blocks(x, blocks)
    torch.testing.assert_close(y, x @ w.T, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_the_default_model_runs_on_its_gguf_blocks(default_model_dir):
    """SmolLM2 ships as Q4_1 (its embedding Q8_0): in float32 every GEMM finds its blocks, and
    greedy output equals transformers' (test_engine) with them."""
    if not cpu.gemm_blocks_available():
        pytest.skip("the block GEMM needs AVX-512 and a C compiler")
    from relay.config import EngineConfig, ModelConfig
    from relay.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(dtype="float32", kv_cache_gb=0.05), default_model_dir,
                         ModelConfig.from_dir(default_model_dir))
    modules = runner.model.gemm_modules()
    assert all(mod.blocks is not None for mod in modules)
    assert {mod.blocks.bits for mod in modules} == {4, 8}
    off = ModelRunner(EngineConfig(dtype="float32", kv_cache_gb=0.05, disable_weight_blocks=True), default_model_dir,
                      ModelConfig.from_dir(default_model_dir))
    assert all(mod.blocks is None for mod in off.model.gemm_modules())
