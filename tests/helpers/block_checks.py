"""What the block-weight tests share: GGUF's Q8_0 rounding, the block kernels built or skipped,
random raw k-quant blocks and gguf's floats of them, the int8-activation reference product, and
one step run each way (the one-call decode against the layers, bit for bit)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from relay.execution.gguf_blocks import DECODERS
from relay.execution.kernels import cpu_gemm
from relay.execution.model_runner import ModelRunner
from relay.step import BatchInput
from tests.helpers.engine_checks import random_prompts
from tests.helpers.gguf_files import VOCAB_SIZE
from tests.helpers.kernel_helpers import cpu_kernels_or_skip


def gguf_q8_0(w: np.ndarray) -> np.ndarray:
    b = w.reshape(-1, 32).astype(np.float32)
    d = np.abs(b).max(1) / 127
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.round(b * inv[:, None]).astype(np.float32)
    return (d.astype(np.float16).astype(np.float32)[:, None] * q).reshape(w.shape)


def blocks_or_skip() -> None:
    cpu_kernels_or_skip()
    assert cpu_gemm.gemm_blocks_available(), "the block GEMM runs at every instruction-set level"


def raw_blocks(qtype: T, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks of qtype [rows, bytes per row] (as tests/execution/weights/test_gguf_blocks.q4_k_raw makes
    Q4_K's): random quants, sub-block scales and mins, and small float16 scales (weights ~0.1), as
    a quantizer could write them (a Q8_0 quant is never -128)."""
    per, size, _ = DECODERS[int(qtype)]
    rng = np.random.default_rng(seed)
    n = rows * k // per
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)

    def f16(lo: float, hi: float, count: int) -> np.ndarray:
        return rng.uniform(lo, hi, (n, count)).astype(np.float16).view(np.uint8)

    if qtype == T.Q6_K:
        b[:, 208:210] = f16(2e-5, 6e-5, 1)  # d; the int8 scales (-128..127) are random bytes
    elif qtype in (T.Q4_K, T.Q5_K):
        b[:, 0:4] = f16(2e-5, 2e-4, 2)  # d, dmin (times 6-bit scales and mins)
    elif qtype == T.Q5_1:
        b[:, 0:2], b[:, 2:4] = f16(1e-3, 5e-3, 1), f16(-0.08, 0.0, 1)
    elif qtype == T.Q8_0:
        b[:, 0:2] = f16(1e-4, 1e-3, 1)
        b[:, 2:] = np.maximum(b[:, 2:].view(np.int8), -127).view(np.uint8)
    else:
        raise ValueError(qtype)
    return b.reshape(rows, -1)


def gguf_floats(raw: np.ndarray, qtype: T, k: int) -> np.ndarray:
    """The weight as transformers' GGUF reader gives it (gguf.quants.dequantize)."""
    return dequantize(raw, qtype).reshape(len(raw), k)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def int8_rounded_product(x: torch.Tensor, blocks) -> torch.Tensor:
    """What GEMMs with int8 block activations compute, in float64: x rounded to 8 bits per block of
    32 (scale max |x| / 127, round half to even) times the exact weights, except the m term (Q4_1's,
    and any form's with a minimum), which takes the exact x's sums over each group of d and m."""
    k = x.shape[1]
    xb = x.reshape(x.shape[0], k // 32, 32)  # float32 steps, as the kernel takes them
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.full_like(amax, 127.0) / amax.clamp_min(
        1e-30
    )  # a float32 division, as the kernel does
    rounded = torch.where(amax > 0, torch.round(xb * inv), 0.0).double()
    xq = (rounded * (amax / torch.full_like(amax, 127.0)).double()).reshape(x.shape[0], k)
    n, w = blocks.out_features, blocks.dequantize().double()
    if not blocks.has_m:
        return xq @ w.T
    g = blocks.group
    m = blocks.float_scales()[1]  # (computed from the records where the scales are compact)
    m = m.permute(0, 2, 1).reshape(-1, k // g)[:n].double().repeat_interleave(g, dim=1)
    return xq @ w.T + (x.double() - xq) @ m.T


def step_each_way(
    runner: ModelRunner,
    step,
    tables: list[list[int]],
    ways: tuple,
    attr: str = "decode_layers",
    rows: list[int] | None = None,
) -> list:
    """The same step once per entry of ways (the model's decode_layers, or whatever attr names:
    its C call, or None for the layers one by one), each from the KV cache as it was before:
    (logits of rows, the KV after) per way."""
    kv = [t.clone() for t in runner.kv.k + runner.kv.v]
    results = []
    for way in ways:
        for t, saved in zip(runner.kv.k + runner.kv.v, kv):
            t.copy_(saved)
        setattr(runner.model, attr, way)
        logits = runner.step_logits(step, tables, rows)
        results.append((logits, [t.clone() for t in runner.kv.k + runner.kv.v]))
    return results


def assert_decode_call_is_the_layers(runner, fast) -> None:
    """Three requests prefilled (20, 5 and 30 tokens), then one decode step of all three run in
    one C call (fast: the model's decode_layers) and by the layers one by one: the same logits
    and the same keys and values written, bit for bit."""
    ids = random_prompts(VOCAB_SIZE, [20, 5, 30], seed=1)
    tables = [[1, 2], [3], [4, 5]]
    for i, prompt in enumerate(ids):
        n = len(prompt)
        runner.step_logits(
            BatchInput(0, [i], prompt, [0], [n], [0], [tables[i]], [True], [0]), [tables[i]]
        )
    lens = [len(p) for p in ids]
    step = BatchInput(
        0, [0, 1, 2], [5, 6, 7], lens, [1] * 3, [0] * 3, [[]] * 3, [True] * 3, [1] * 3
    )
    (call, kv_call), (layered, kv_layered) = step_each_way(runner, step, tables, (fast, None))
    assert torch.equal(call, layered)
    assert all(torch.equal(a, b) for a, b in zip(kv_call, kv_layered))
