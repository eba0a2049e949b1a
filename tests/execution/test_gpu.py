"""The GPU path: attention backends (torch / triton / flashinfer), CUDA graphs, KV sizing.

Runs anywhere:
- backend names and their errors, which backends support CUDA graphs;
- the capture batch-size list, padding a decode step to a captured size;
- flashinfer's CSR page metadata built from page tables (pure torch/numpy);
- the Triton kernels themselves under Triton's interpreter (TRITON_INTERPRET=1, in a
  subprocess so this process keeps compiled Triton), against the torch backend on small
  random paged batches: mixed decode + extend with prefixes, page sizes 1/4/16, several
  decode splits, the static (CUDA-graph) decode path with padded rows; then a tiny model's
  runner with the Triton backend behind an emulated graph runner (re-runs on "replay");
- the same kernels compiled ahead of time for sm_90 and sm_80 (Triton's bundled ptxas, no
  GPU): compile-time typing and shared memory, which the interpreter does not check;
- the flashinfer backend's calls against a stand-in flashinfer module with 0.2.x signatures;
- the KV budget's new free-memory argument; a CPU runner has no CUDA graphs.

Marked gpu (skipped without CUDA): each backend vs torch on random paged batches, CUDA graph
replay vs eager logits, engine greedy equality across backends on a tiny random model, and
a 2-GPU NCCL smoke test of TPGroup (skipped with fewer GPUs).
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from relay.execution.attention import backend_class, resolve_backend_name
from relay.execution.attention.base import AttentionBackend
from relay.execution.attention.flashinfer_backend import page_csr, qo_indptr
from relay.execution.attention.torch_native import TorchNativeBackend, page_slots
from relay.execution.cuda_graph import capture_batch_sizes, pad_decode_meta, padded_batch_size
from relay.memory.kv_cache import num_pages_for_budget
from tests.helpers import gpu_helpers as gh
from tests.helpers.paths import ROOT
from tests.helpers.tiny_models import tiny_shape

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None

gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
GPU_BACKENDS = [
    "triton",
    pytest.param(
        "flashinfer",
        marks=pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer not installed"),
    ),
]


# ---- backend selection ------------------------------------------------------------------------
def test_resolve_backend_names(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend_name("auto", cpu) == "torch"
    assert resolve_backend_name("torch", cpu) == "torch"
    assert resolve_backend_name("torch", cuda) == "torch"
    for name in ("triton", "flashinfer"):
        assert resolve_backend_name(name, cuda) == name
        with pytest.raises(ValueError, match="needs a CUDA device"):
            resolve_backend_name(name, cpu)
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend_name("flash", cuda)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "flashinfer" else real(n, *a)
    )
    assert resolve_backend_name("auto", cuda) == "flashinfer"
    assert resolve_backend_name("auto", cuda, torch.bfloat16) == "flashinfer"
    assert resolve_backend_name("auto", cuda, torch.float32) == "triton"  # flashinfer has no fp32
    assert resolve_backend_name("auto", cpu, torch.bfloat16) == "torch"
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "flashinfer" else real(n, *a)
    )
    assert resolve_backend_name("auto", cuda) == "triton"


def test_graph_support_is_declared():
    cls = backend_class("torch", torch.device("cpu"))
    assert cls is TorchNativeBackend and not cls.supports_cuda_graph
    with pytest.raises(NotImplementedError, match="does not support CUDA graphs"):
        AttentionBackend.init_cuda_graph_state(TorchNativeBackend.__new__(TorchNativeBackend), 8, 4)
    from relay.execution.attention.flashinfer_backend import (
        FlashInferBackend,  # imports without flashinfer
    )

    assert FlashInferBackend.supports_cuda_graph and FlashInferBackend.kv_layout == "NHD"


@pytest.mark.skipif(HAS_FLASHINFER, reason="flashinfer is installed")
def test_flashinfer_backend_without_the_package_says_so():
    from relay.execution.attention.flashinfer_backend import FlashInferBackend
    from relay.memory.kv_cache import KVCache

    kv = KVCache(1, 4, 4, 2, 64, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="flashinfer package"):
        FlashInferBackend(kv, 4, 2, 64, 0.125)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_backend_class_and_splits():
    from relay.execution.attention.triton_backend import (
        MAX_SPLITS,
        TritonBackend,
        decode_num_splits,
    )

    assert TritonBackend.supports_cuda_graph and TritonBackend.kv_layout == "NHD"
    assert decode_num_splits(1, 8, 132) == MAX_SPLITS  # one request: fill the GPU
    assert decode_num_splits(64, 8, 132) == 1  # enough programs already
    assert decode_num_splits(16, 8, 132) == 4  # rounded up to a power of two
    assert decode_num_splits(1, 8, 132, max_seq_len=300) == 2  # short sequences: few splits
    for bs in range(1, 300, 7):
        s = decode_num_splits(bs, 2, 132)
        assert 1 <= s <= MAX_SPLITS and s & (s - 1) == 0


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton")),
        "flashinfer",  # its module imports flashinfer only when a backend is made
    ],
)
def test_gpu_backends_take_the_mask_arguments_and_refuse_masks(name):
    """kv_setup builds every backend with windows= and softcap=; the GPU kernels take them and
    refuse a model that needs them (a clear error naming the way out), and accept a plain one."""
    import importlib

    from relay.memory.kv_cache import KVCache

    module = importlib.import_module(f"relay.execution.attention.{name}_backend")
    cls = getattr(module, {"triton": "TritonBackend", "flashinfer": "FlashInferBackend"}[name])
    kv = KVCache(2, 4, 4, 2, 64, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="--attention-backend torch"):
        cls(kv=kv, num_heads=4, num_kv_heads=2, head_dim=64, scale=0.125, windows=[8, None])
    with pytest.raises(ValueError, match="--attention-backend torch"):
        cls(kv=kv, num_heads=4, num_kv_heads=2, head_dim=64, scale=0.125, softcap=50.0)
    try:  # no mask: past the check (flashinfer then wants its package and a CUDA device)
        cls(kv=kv, num_heads=4, num_kv_heads=2, head_dim=64, scale=0.125, windows=[], softcap=None)
    except (RuntimeError, ValueError) as e:
        assert "sliding window" not in str(e)


# ---- CUDA graph bookkeeping -------------------------------------------------------------------
def test_capture_batch_sizes():
    assert capture_batch_sizes(64) == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64]
    assert capture_batch_sizes(100)[-3:] == [88, 96, 100]
    assert capture_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(0) == []


def test_padded_batch_size():
    sizes = capture_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 9, 13, 17, 33, 64)] == [
        1,
        2,
        4,
        8,
        12,
        16,
        24,
        40,
        64,
    ]
    assert padded_batch_size(65, sizes) is None
    for n in range(1, 65):
        assert padded_batch_size(n, sizes) >= n


def test_pad_decode_meta():
    prefix, ext, tables = pad_decode_meta([7, 3, 20], [[5, 9], [2], [4, 6]], 8)
    assert prefix == [7, 3, 20, 0, 0, 0, 0, 0]
    assert ext == [1] * 8
    assert tables[:3] == [[5, 9], [2], [4, 6]] and tables[3:] == [[0]] * 5  # scratch page 0
    seq = [p + e for p, e in zip(prefix, ext)]
    assert seq[3:] == [1] * 5  # a padded row attends one token: slot 0 of page 0
    with pytest.raises(ValueError):
        pad_decode_meta([1, 2, 3], [[1], [2], [3]], 2)


def test_cuda_graph_runner_needs_cuda_and_support():
    from relay.execution.cuda_graph import CudaGraphRunner

    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphRunner(
            None, TorchNativeBackend.__new__(TorchNativeBackend), torch.device("cpu"), 8, 4
        )


# ---- flashinfer's CSR page metadata --------------------------------------------------------------
def test_page_csr_example():
    # page size 4: lengths 5 (2 pages, 1 in the last), 4 (1 full page), 9 (3 pages), 1
    indptr, indices, last = page_csr([[7, 3], [9, 11], [4, 5, 6, 8], [2]], [5, 4, 9, 1], 4)
    assert indptr.tolist() == [0, 2, 3, 6, 7]
    assert indices.tolist() == [7, 3, 9, 4, 5, 6, 2]  # surplus pages (11, 8) left out
    assert last.tolist() == [1, 4, 1, 1]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert qo_indptr([1, 6, 1, 20]).tolist() == [0, 1, 7, 8, 28]
    with pytest.raises(ValueError, match="only 1 pages"):
        page_csr([[1]], [5], 4)
    with pytest.raises(ValueError, match="at least one token"):
        page_csr([[1]], [0], 4)


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_page_csr_matches_slot_tables(page_size):
    rng = random.Random(page_size)
    lens = [rng.randint(1, 300) for _ in range(9)]
    pool = list(range(1, 2000))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-n // page_size) + rng.randint(0, 2))] for n in lens]
    indptr, indices, last = page_csr(tables, lens, page_size)
    slots = page_slots(tables, lens, page_size)  # the torch backend's view of the same tables
    for i, n in enumerate(lens):
        pages = indices[indptr[i] : indptr[i + 1]].numpy()
        assert (len(pages) - 1) * page_size + int(last[i]) == n
        assert 1 <= int(last[i]) <= page_size
        mine = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)[:n]
        assert (mine == slots[i, :n]).all()


# ---- the flashinfer backend's wiring, with a stand-in flashinfer module -------------------------------
class _FakePagedAttention:
    """What flashinfer computes from the CSR metadata (causal aligned to the end of the kv),
    in torch, so the backend's calls can be checked on CPU. plan()/__init__ keep flashinfer
    0.2.x's parameter names: a misspelt keyword fails here as it would there."""

    def _set(
        self,
        qo_indptr,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        causal,
        sm_scale,
        q_data_type,
        kv_data_type,
        non_blocking,
    ):
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert q_data_type == kv_data_type and non_blocking
        if self.use_cuda_graph:  # like flashinfer: copy into the fixed buffers
            assert len(last_page_len) == self.fixed_bs, "batch size differs from the wrapper's"
            self.indptr_buf.copy_(indptr)
            self.last_buf.copy_(last_page_len)
            self.indices_buf[: len(indices)].copy_(indices)
            indptr, indices, last_page_len = self.indptr_buf, self.indices_buf, self.last_buf
        self.meta = (
            qo_indptr,
            indptr.clone(),
            indices.clone(),
            last_page_len.clone(),
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            causal,
            sm_scale,
        )

    def run(self, q, paged_kv_cache, *args, **kw):
        qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal, scale = self.meta
        k_cache, v_cache = paged_kv_cache
        assert k_cache.shape[1:] == (ps, hkv, d) and q.shape[1:] == (hq, d) and q.is_contiguous()
        out = torch.empty_like(q)
        for i in range(len(last)):
            pages = indices[indptr[i] : indptr[i + 1]].long()
            kv_len = (len(pages) - 1) * ps + int(last[i])
            k = k_cache[pages].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(hq // hkv, 1)
            v = v_cache[pages].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(hq // hkv, 1)
            q0, q1 = int(qo_indptr[i]), int(qo_indptr[i + 1])
            s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale
            if causal:
                n = q1 - q0
                s.masked_fill_(
                    torch.arange(kv_len)[None, :] > torch.arange(n)[:, None] + kv_len - n,
                    float("-inf"),
                )
            out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
        return out


class _FakePrefill(_FakePagedAttention):
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend="auto",
        jit_args=None,
    ):
        assert kv_layout == "NHD" and not use_cuda_graph
        self.use_cuda_graph = False

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        head_dim_vo=None,
        custom_mask=None,
        packed_custom_mask=None,
        causal=False,
        pos_encoding_mode="NONE",
        use_fp16_qk_reduction=False,
        sm_scale=None,
        window_left=-1,
        logits_soft_cap=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type="float16",
        kv_data_type=None,
        non_blocking=True,
    ):
        self._set(
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            page_size,
            causal,
            sm_scale,
            q_data_type,
            kv_data_type,
            non_blocking,
        )


class _FakeDecode(_FakePagedAttention):
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend="auto",
        jit_args=None,
    ):
        assert kv_layout == "NHD"
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            self.indptr_buf, self.indices_buf = paged_kv_indptr_buffer, paged_kv_indices_buffer
            self.last_buf = paged_kv_last_page_len_buffer
            self.fixed_bs = len(paged_kv_last_page_len_buffer)
            assert len(self.indptr_buf) == self.fixed_bs + 1

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        pos_encoding_mode="NONE",
        window_left=-1,
        logits_soft_cap=None,
        q_data_type="float16",
        kv_data_type=None,
        data_type=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        non_blocking=False,
    ):
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._set(
            qo,
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            True,
            sm_scale,
            q_data_type,
            kv_data_type,
            non_blocking,
        )


@pytest.mark.parametrize("graph_bs", [None, 8])
def test_flashinfer_backend_wiring_with_a_stand_in(monkeypatch, graph_bs):
    import types

    from relay.execution.attention.flashinfer_backend import FlashInferBackend

    fake = types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_FakePrefill,
        BatchDecodeWithPagedKVCacheWrapper=_FakeDecode,
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(FlashInferBackend, "requires_cuda", False)
    monkeypatch.setattr("relay.execution.attention.flashinfer_backend.WORKSPACE_BYTES", 1 << 10)
    cases = (
        [gh.PagedCase([12, 3, 50], [1, 1, 1], 4, graph_bs=graph_bs)]
        if graph_bs
        else [
            gh.PagedCase([5, 0, 9, 3], [1, 6, 1, 20], 4),
            gh.PagedCase([40, 0, 7], [1, 1, 1], 16, 8, 2, 64),
            gh.PagedCase([0, 30], [17, 9], 1, 4, 1, 32),
        ]
    )
    for case in cases:
        err = gh.compare_with_torch(FlashInferBackend, case, torch.bfloat16, "cpu")
        assert err <= gh.TOLERANCE[torch.bfloat16], f"{case.label()}: {err}"


# ---- KV sizing ---------------------------------------------------------------------------------
def test_kv_budget_free_bytes():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    per_token, ps = 1024, 16
    # CUDA: a fraction of the free memory measured after the warm-up (no CUDA call needed here)
    assert num_pages_for_budget(per_token, ps, None, 0.5, cuda, free_bytes=64 << 20) == (
        32 << 20
    ) // (per_token * ps)
    assert num_pages_for_budget(per_token, ps, None, None, cuda, free_bytes=100 << 20) == int(
        (100 << 20) * 0.85
    ) // (per_token * ps)
    # an explicit size wins; CPU ignores free_bytes
    assert num_pages_for_budget(per_token, ps, 1.0, 0.5, cuda, free_bytes=1) == (1 << 30) // (
        per_token * ps
    )
    assert num_pages_for_budget(
        per_token, ps, None, 0.1, cpu, free_bytes=1
    ) == num_pages_for_budget(per_token, ps, None, 0.1, cpu)


# ---- the Triton kernels under the interpreter (CPU) -------------------------------------------------
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(
    HAS_CUDA, reason="with a GPU the gpu tests compile and run the kernels for real"
)
def test_triton_kernels_in_interpreter(tiny_gpu_model):
    """The kernel cases of gpu_helpers.interpreter_cases, then a tiny model's runner with the
    Triton backend and an emulated CUDA-graph runner (re-run instead of replayed) against the
    torch backend: greedy tokens equal, logits within 1e-4 (float32)."""
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "src")]),
    }
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "helpers", "gpu_helpers.py"), tiny_gpu_model],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == len(gh.interpreter_cases()) + 1


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(
    HAS_CUDA, reason="with a GPU the gpu tests compile and run the kernels for real"
)
@pytest.mark.parametrize("arch", [90, 80])
def test_triton_kernels_compile_for_gpu(arch):
    """The kernels as the backend launches them for Qwen3-0.6B (bf16, head_dim 128, GQA 2,
    page 16) compile to sm_90 / sm_80 cubins here, without a GPU, within shared memory."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this Triton has no ahead-of-time compile API: {e}")
    shared = gh.aot_compile_triton_kernels(torch.bfloat16, 128, 2, 16, arch)
    assert set(shared) == {"decode_stage1", "decode_stage2", "extend"}
    assert max(shared.values()) <= 99 * 1024  # fits even an sm_86/89 card's 99 KB per block


# ---- a tiny model ------------------------------------------------------------------------------------
TINY_VOCAB = 512


@pytest.fixture(scope="session")
def tiny_gpu_model(tmp_path_factory) -> str:
    """Qwen3-style, head_dim 64 (a size every backend builds), random weights, any tokenizer."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        **tiny_shape(
            vocab_size=TINY_VOCAB,
            hidden_size=128,
            intermediate_size=256,
            head_dim=64,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        )
    )
    return gh.save_random_model(str(tmp_path_factory.mktemp("tiny-gpu")), cfg)


def _runner(model_dir: str, **kw):
    from relay.config import EngineConfig, ModelConfig
    from relay.execution.model_runner import ModelRunner

    cfg = EngineConfig(model_path=model_dir, **{"kv_cache_gb": 0.05, "page_size": 16, **kw})
    return ModelRunner(cfg, model_dir, ModelConfig.from_dir(model_dir))


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(2, TINY_VOCAB - 2) for _ in range(rng.randint(lo, hi))] for _ in range(n)
    ]


def test_cpu_runner_has_no_cuda_graphs(tiny_gpu_model):
    runner = _runner(tiny_gpu_model, device="cpu", dtype="float32")
    assert runner.cuda_graphs is None
    tokens, logits = gh.run_greedy(runner, _prompts(3), steps=2)
    assert len(logits) == 3 and logits[0].shape == (3, TINY_VOCAB)
    # the decode steps' logits equal a one-shot prefill of the same tokens
    full = gh.position_logits(runner, _prompts(3)[0] + tokens[0][:2])
    assert torch.allclose(full[-1], logits[-1][0], atol=1e-4)


# ---- GPU: backends vs torch at the attention level ------------------------------------------------------
def _gpu_cases(seed: int, page_size: int) -> list[gh.PagedCase]:
    rng = random.Random(seed)
    shapes = [(16, 8, 128), (32, 8, 128), (9, 3, 64)]  # Qwen3-0.6B, Llama-3-8B, SmolLM2-135M
    cases = []
    for h, hkv, d in shapes:
        n_dec, n_ext = rng.randint(1, 6), rng.randint(1, 4)
        prefix = [rng.randint(0, 700) for _ in range(n_dec)] + [
            rng.choice([0, rng.randint(1, 300)]) for _ in range(n_ext)
        ]
        ext = [1] * n_dec + [rng.randint(2, 200) for _ in range(n_ext)]
        order = list(range(len(prefix)))
        rng.shuffle(order)  # decodes and extends interleaved
        cases.append(
            gh.PagedCase(
                [prefix[i] for i in order], [ext[i] for i in order], page_size, h, hkv, d, seed=seed
            )
        )
    # pure decode: long and short sequences, odd batch; and the static graph path, padded
    cases.append(
        gh.PagedCase([2047, 5, 900, 0, 130] * 7, [1] * 35, page_size, 16, 8, 128, seed=seed)
    )
    cases.append(gh.PagedCase([3000], [1], page_size, 16, 8, 128, seed=seed))
    cases.append(
        gh.PagedCase([700, 1, 64], [1, 1, 1], page_size, 16, 8, 128, seed=seed, graph_bs=4)
    )
    cases.append(
        gh.PagedCase([700, 1, 64] * 5, [1] * 15, page_size, 32, 8, 128, seed=seed, graph_bs=16)
    )
    return cases


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_backend_matches_torch(backend, page_size, dtype):
    if backend == "flashinfer" and dtype == torch.float32:
        pytest.skip("flashinfer runs float16/bfloat16 only")
    cls = backend_class(backend, torch.device("cuda"))
    for case in _gpu_cases(seed=page_size, page_size=page_size):
        err = gh.compare_with_torch(cls, case, dtype, "cuda")
        assert err <= gh.TOLERANCE[dtype], f"{backend} {dtype} {case.label()}: max err {err:.3g}"


# ---- GPU: CUDA graphs ----------------------------------------------------------------------------------
def _logit_tol(dtype: str, ref: torch.Tensor) -> float:
    scale = float(ref.abs().max())
    return {"float32": 1e-4, "bfloat16": 3e-2}[dtype] * max(1.0, scale)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_graph_replay_matches_eager(tiny_gpu_model, backend):
    dtype = "float32" if backend == "triton" else "bfloat16"
    graphed = _runner(
        tiny_gpu_model, device="cuda", dtype=dtype, attention_backend=backend, cuda_graph_max_bs=16
    )
    eager = _runner(
        tiny_gpu_model,
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        disable_cuda_graph=True,
    )
    assert graphed.cuda_graphs is not None and eager.cuda_graphs is None
    assert graphed.cuda_graphs.batch_sizes == [1, 2, 4, 8, 12, 16]
    for n, seed in ((1, 0), (5, 1), (16, 2)):  # exact size, padded 5 -> 8, the largest graph
        prompts = _prompts(n, seed)
        before = graphed.cuda_graphs.replays
        tokens, g_logits = gh.run_greedy(graphed, prompts, steps=12)
        assert graphed.cuda_graphs.replays - before == 12
        _, e_logits = gh.run_greedy(eager, prompts, steps=12, forced=[t[:-1] for t in tokens])
        for step, (g, e) in enumerate(zip(g_logits, e_logits)):
            diff = (g - e).abs().max().item()
            assert diff <= _logit_tol(dtype, e), (
                f"batch {n} step {step}: graph vs eager logits differ by {diff}"
            )
    # a batch larger than the largest graph runs eagerly
    before = graphed.cuda_graphs.replays
    gh.run_greedy(graphed, _prompts(17, 3), steps=2)
    assert graphed.cuda_graphs.replays == before


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_torch_backend_on_cuda_runs_without_graphs(tiny_gpu_model):
    runner = _runner(tiny_gpu_model, device="cuda", dtype="bfloat16", attention_backend="torch")
    assert runner.cuda_graphs is None
    gh.run_greedy(runner, _prompts(3), steps=3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_kv_pool_sized_from_free_memory_after_warmup(tiny_gpu_model):
    from relay.config import ModelConfig

    runner = _runner(
        tiny_gpu_model,
        device="cuda",
        dtype="bfloat16",
        attention_backend="triton",
        kv_cache_gb=None,
        mem_fraction_static=0.05,
        cuda_graph_max_bs=4,
    )
    per_token = ModelConfig.from_dir(tiny_gpu_model).kv_bytes_per_token(2)
    total = torch.cuda.mem_get_info()[1]
    pool = runner.num_pages * runner.page_size * per_token
    assert 0.01 * total < pool <= 0.05 * total  # 5% of what was free after weights + warm-up
    gh.run_greedy(runner, _prompts(2), steps=2)


# ---- GPU: the engine, greedy, across backends ----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_engine_greedy_equal_across_backends(tiny_gpu_model):
    from relay import Engine, SamplingParams

    prompts = _prompts(8, seed=7, hi=120)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", kv_cache_gb=0.05, page_size=16, chunked_prefill_size=128)

    # float32: torch and triton (fp32 dots, no TF32), graphs on and off, token for token
    outs = {}
    for name, extra in (
        ("torch", {}),
        ("triton", {}),
        ("triton-eager", {"disable_cuda_graph": True}),
    ):
        engine = Engine(
            tiny_gpu_model, dtype="float32", attention_backend=name.split("-")[0], **kw, **extra
        )
        outs[name] = [o.token_ids for o in engine.generate(prompts, params)]
        outs[name + "-cached"] = [
            o.token_ids for o in engine.generate(prompts, params)
        ]  # prefix-cache hits
        engine.check()
    assert all(v == outs["torch"] for v in outs.values()), {k: v[:2] for k, v in outs.items()}

    # bfloat16: every token each backend picks is a greedy choice of the torch reference
    # (within bf16 noise) on that same sequence; exact equality would fail on near-ties.
    ref = _runner(tiny_gpu_model, device="cuda", dtype="bfloat16", attention_backend="torch")
    for name in ["torch", "triton"] + (["flashinfer"] if HAS_FLASHINFER else []):
        engine = Engine(tiny_gpu_model, dtype="bfloat16", attention_backend=name, **kw)
        for p, o in zip(prompts, engine.generate(prompts, params)):
            logits = gh.position_logits(ref, p + o.token_ids)[len(p) - 1 : -1]
            tol = max(0.1, 0.02 * float(logits.abs().max()))
            bad = gh.near_argmax_violations(logits, o.token_ids, tol)
            assert not bad, f"{name}: tokens at {bad} are not greedy under the reference"


# ---- GPU: tensor parallel over NCCL (needs 2 GPUs) ------------------------------------------------------
def _tp_worker(rank: int, size: int, init: str, q) -> None:
    from relay.execution.distributed import TPGroup

    tp = TPGroup.init(rank, size, init, torch.device("cuda", rank))
    x = torch.full((4,), float(rank + 1), device="cuda")
    tp.all_reduce(x)
    g = tp.all_gather_last_dim(torch.full((2, rank + 1), float(rank), device="cuda"), [1, 2])
    q.put((rank, torch.cuda.current_device(), x.tolist(), g.tolist()))
    tp.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp_group_over_nccl(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp_path / 'rdv'}"
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, init, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, device, x, g in results:
        assert device == rank  # each rank bound its own GPU
        assert x == [3.0] * 4
        assert g == [[0.0, 1.0, 1.0]] * 2
