"""The CPU attention backend against a dense reference: decode (C kernel and torch path),
prefill with a cached prefix, mixed batches, GQA ratios, scattered pages, bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relay.execution.attention.base import StepMeta
from relay.execution.attention.torch_native import TorchNativeBackend
from relay.memory.kv_cache import KVCache
from tests.helpers.kernel_helpers import cpu_kernels_or_skip, kernel_level  # noqa: F401 (a fixture)

PAGE = 4


def dense_attention(q, keys, values, prefix: int, scale: float) -> torch.Tensor:
    """q [n, H, D] at positions prefix..prefix+n-1 over keys/values [L, HKV, D]; causal."""
    n, h, d = q.shape
    group = h // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    allowed = torch.arange(keys.shape[0])[None, :] <= (prefix + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def make_case(
    seed: int,
    prefix_lens: list[int],
    extend_lens: list[int],
    hkv: int,
    group: int,
    dtype: torch.dtype,
    kernel: bool,
    d: int = 16,
):
    rng = np.random.default_rng(seed)
    kv = KVCache(1, 64, PAGE, hkv, d, dtype, torch.device("cpu"), layout="HND")
    free = rng.permutation(np.arange(1, 64)).tolist()  # scattered pages
    tables = []
    for p, e in zip(prefix_lens, extend_lens):
        n = -(-(p + e) // PAGE)
        tables.append([free.pop() for _ in range(n)])
    slot = lambda t, i: t[i // PAGE] * PAGE + i % PAGE  # noqa: E731
    # the cached prefixes: written straight into the cache
    full_k, full_v = [], []
    for t, p, e in zip(tables, prefix_lens, extend_lens):
        k = torch.randn(p + e, hkv, d).to(dtype)
        v = torch.randn(p + e, hkv, d).to(dtype)
        if p:
            kv.write(0, torch.tensor([slot(t, i) for i in range(p)]), k[:p], v[:p])
        full_k.append(k)
        full_v.append(v)
    positions = [i for p, e in zip(prefix_lens, extend_lens) for i in range(p, p + e)]
    out_slots = [
        slot(t, i) for t, p, e in zip(tables, prefix_lens, extend_lens) for i in range(p, p + e)
    ]
    meta = StepMeta(
        prefix_lens, extend_lens, tables, torch.tensor(positions), torch.tensor(out_slots)
    )
    backend = TorchNativeBackend(
        kv=kv, num_heads=hkv * group, num_kv_heads=hkv, head_dim=d, scale=d**-0.5
    )
    if not kernel:
        backend.kernel = None
    elif backend.kernel is None:
        cpu_kernels_or_skip()  # fails if the library should have built
    q = torch.randn(sum(extend_lens), hkv * group, d).to(dtype)
    new_k = torch.cat([k[p:] for k, p in zip(full_k, prefix_lens)])
    new_v = torch.cat([v[p:] for v, p in zip(full_v, prefix_lens)])
    return backend, meta, q, new_k, new_v, full_k, full_v


CASES = [
    ([5, 9, 17, 30], [1, 1, 1, 1]),  # pure decode, different lengths
    ([0, 0], [7, 12]),  # prefill from scratch
    ([8, 3], [5, 6]),  # prefill after a cached prefix (page-aligned and not)
    ([12, 0, 21, 4], [1, 9, 1, 3]),  # mixed decode + prefill
    (
        [0, 20, 7],
        [100, 76, 1],
    ),  # long chunks: the float32 kernel's items of 32-64 tokens, a causal edge inside
]


@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize("hkv,group", [(1, 1), (2, 3), (4, 2)])
@pytest.mark.parametrize("prefix_lens,extend_lens", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dense_reference(kernel, hkv, group, prefix_lens, extend_lens, dtype):
    backend, meta, q, k, v, full_k, full_v = make_case(
        0, prefix_lens, extend_lens, hkv, group, dtype, kernel
    )
    backend.plan(meta)
    out = backend.forward(q, k, v, layer=0).view(q.shape)
    row = 0
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for p, e, fk, fv in zip(prefix_lens, extend_lens, full_k, full_v):
        ref = dense_attention(q[row : row + e], fk, fv, p, backend.scale)
        torch.testing.assert_close(out[row : row + e].float(), ref, atol=tol, rtol=tol)
        row += e


@pytest.mark.parametrize(
    "d,hkv,group", [(64, 3, 3), (128, 2, 4), (64, 1, 8), (24, 2, 3), (80, 1, 5)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_dense_at_every_kernel_level(kernel_level, d, hkv, group, dtype):
    """Decode (and decode beside a prompt chunk) through the backend with each instruction-set
    level's kernels: the default model's heads (9 over 3 kv heads, head_dim 64), head_dim 128,
    groups up to 8, and head dims the dispatcher has no specialised kernel for."""
    for prefix_lens, extend_lens in (([5, 90, 17, 60], [1, 1, 1, 1]), ([12, 0, 33], [1, 9, 1])):
        backend, meta, q, k, v, full_k, full_v = make_case(
            d, prefix_lens, extend_lens, hkv, group, dtype, True, d
        )
        backend.plan(meta)
        out = backend.forward(q, k, v, layer=0).view(q.shape)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        row = 0
        for p, e, fk, fv in zip(prefix_lens, extend_lens, full_k, full_v):
            ref = dense_attention(q[row : row + e], fk, fv, p, backend.scale)
            torch.testing.assert_close(out[row : row + e].float(), ref, atol=tol, rtol=tol)
            row += e


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_windows_and_caps_in_the_c_kernels_equal_the_torch_path(dtype, softcap):
    """A model with a sliding window on layer 0 only (Gemma's pattern) and maybe soft-capped
    scores: the backend's C kernels (decode, and decode beside prompt chunks after a prefix) give
    each layer what its torch path gives, which masks in Python."""
    cpu_kernels_or_skip()
    d, hkv, group, windows = 64, 2, 3, [6, None]
    for prefix_lens, extend_lens in (([5, 30, 17, 60], [1] * 4), ([12, 0, 33, 9], [1, 20, 1, 14])):
        rng = np.random.default_rng(len(prefix_lens) + sum(extend_lens))
        kv = KVCache(2, 64, PAGE, hkv, d, dtype, torch.device("cpu"), layout="HND")
        free = rng.permutation(np.arange(1, 64)).tolist()
        tables = [
            [free.pop() for _ in range(-(-(p + e) // PAGE))]
            for p, e in zip(prefix_lens, extend_lens)
        ]
        slot = lambda t, i: t[i // PAGE] * PAGE + i % PAGE  # noqa: E731
        for t, p in zip(tables, prefix_lens):
            for layer in (0, 1):
                kv.write(
                    layer,
                    torch.tensor([slot(t, i) for i in range(p)], dtype=torch.int64),
                    *torch.randn(2, p, hkv, d).to(dtype),
                )
        positions = [i for p, e in zip(prefix_lens, extend_lens) for i in range(p, p + e)]
        out_slots = [
            slot(t, i) for t, p, e in zip(tables, prefix_lens, extend_lens) for i in range(p, p + e)
        ]
        meta = StepMeta(
            prefix_lens, extend_lens, tables, torch.tensor(positions), torch.tensor(out_slots)
        )
        q, k, v = (torch.randn(len(positions), h, d).to(dtype) for h in (hkv * group, hkv, hkv))
        outs = []
        for kernel in (True, False):
            saved = [t.clone() for t in kv.k + kv.v]
            backend = TorchNativeBackend(
                kv=kv,
                num_heads=hkv * group,
                num_kv_heads=hkv,
                head_dim=d,
                scale=d**-0.5,
                windows=windows,
                softcap=softcap,
            )
            assert backend.kernel is not None, "a masked model's attention takes the C kernels"
            if not kernel:
                backend.kernel = None
            backend.plan(meta)
            outs.append([backend.forward(q, k, v, layer).float() for layer in (0, 1)])
            for t, s in zip(kv.k + kv.v, saved):
                t.copy_(s)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        for layer in (0, 1):
            torch.testing.assert_close(outs[0][layer], outs[1][layer], atol=tol, rtol=tol)
