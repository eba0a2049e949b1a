"""Helpers shared by tests/execution/test_gpu.py, its Triton-interpreter subprocess (run this module
with TRITON_INTERPRET=1) and scripts/gpu_check.py.

- random paged attention batches and a backend-vs-torch comparison at the attention level
  (both KV layouts filled with the same contents, reference computed in float32);
- the runner-level step driver (Sequences, run_greedy) and random-weight model directories, which
  live in scripts/runner_steps.py and scripts/random_model.py (scripts/gpu_check.py needs them and
  scripts import nothing from tests) and are re-exported here for the tests.

    TRITON_INTERPRET=1 python tests/helpers/gpu_helpers.py     # the interpreter cases, on CPU
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch

from relay.execution.attention.base import StepMeta
from relay.memory.kv_cache import KVCache
from scripts.random_model import save_random_model, save_tokenizer  # noqa: F401 - the tests' API
from scripts.runner_steps import Sequences, run_greedy  # noqa: F401 - the tests' API

# ---- attention-level comparison -----------------------------------------------------------

TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@dataclass
class PagedCase:
    prefix_lens: list[int]
    extend_lens: list[int]
    page_size: int
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    seed: int = 0
    graph_bs: int | None = None  # decode only: run through plan_cuda_graph padded to this size
    min_tokens_per_split: int | None = None  # triton: with num_sms, force several decode splits
    num_sms: int | None = None

    def label(self) -> str:
        g = f" graph_bs={self.graph_bs}" if self.graph_bs else ""
        g += f" sms={self.num_sms}" if self.num_sms else ""
        return (
            f"ps={self.page_size} H={self.num_heads}/{self.num_kv_heads} D={self.head_dim} "
            f"prefix={self.prefix_lens} extend={self.extend_lens}{g}"
        )


def paged_meta(
    prefix_lens: list[int],
    extend_lens: list[int],
    page_size: int,
    num_pages: int,
    rng: random.Random,
    device,
) -> StepMeta:
    """Page tables drawn at random (non-consecutive) from pages 1..num_pages-1."""
    free = list(range(1, num_pages))
    rng.shuffle(free)
    tables = []
    for p, e in zip(prefix_lens, extend_lens):
        need = -(-(p + e) // page_size)
        tables.append([free.pop() for _ in range(need)])
    pos = np.concatenate([np.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)])
    slots = np.concatenate(
        [
            np.asarray(t, dtype=np.int64)[np.arange(p, p + e) // page_size] * page_size
            + np.arange(p, p + e) % page_size
            for t, p, e in zip(tables, prefix_lens, extend_lens)
        ]
    )
    return StepMeta(
        list(prefix_lens),
        list(extend_lens),
        tables,
        torch.from_numpy(pos).to(device),
        torch.from_numpy(slots).to(device),
    )


def _cache(
    layout: str,
    contents_nhd: list[tuple[torch.Tensor, torch.Tensor]],
    page_size: int,
    dtype,
    device,
) -> KVCache:
    slots, hkv, d = contents_nhd[0][0].shape
    kv = KVCache(
        len(contents_nhd), slots // page_size, page_size, hkv, d, dtype, device, layout=layout
    )
    for layer, (k, v) in enumerate(contents_nhd):
        for buf, src in ((kv.k[layer], k), (kv.v[layer], v)):
            buf.copy_(src.to(dtype) if layout == "NHD" else src.to(dtype).transpose(0, 1))
    return kv


def _nhd(kv: KVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = kv.k[layer], kv.v[layer]
    return (k, v) if kv.layout == "NHD" else (k.transpose(0, 1), v.transpose(0, 1))


def compare_with_torch(backend_cls, case: PagedCase, dtype: torch.dtype, device) -> float:
    """Max |out - reference| of backend_cls on a random paged batch; also checks that both
    backends wrote the step's K/V to the same slots. The reference is the torch backend in
    float32 on the same (dtype-rounded) inputs."""
    from relay.execution.attention.torch_native import TorchNativeBackend

    device = torch.device(device)
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    ps, h, hkv, d = case.page_size, case.num_heads, case.num_kv_heads, case.head_dim
    need = sum(-(-(p + e) // ps) for p, e in zip(case.prefix_lens, case.extend_lens))
    num_pages = need + 1 + rng.randrange(1, 4)
    contents = [
        (
            torch.randn(num_pages * ps, hkv, d, generator=gen).to(dtype).float(),
            torch.randn(num_pages * ps, hkv, d, generator=gen).to(dtype).float(),
        )
    ]
    meta = paged_meta(case.prefix_lens, case.extend_lens, ps, num_pages, rng, device)
    t = sum(case.extend_lens)
    q, k, v = (torch.randn(t, n, d, generator=gen).to(dtype) for n in (h, hkv, hkv))
    scale = d**-0.5

    ref_kv = _cache(TorchNativeBackend.kv_layout, contents, ps, torch.float32, device)
    ref = TorchNativeBackend(ref_kv, h, hkv, d, scale)
    ref.plan(meta)
    expected = ref.forward(q.float().to(device), k.float().to(device), v.float().to(device), 0)

    kv = _cache(backend_cls.kv_layout, contents, ps, dtype, device)
    be = backend_cls(kv, h, hkv, d, scale)
    if case.min_tokens_per_split is not None:
        be.min_tokens_per_split = case.min_tokens_per_split
    if case.num_sms is not None:
        be.num_sms = case.num_sms
    if case.graph_bs:
        from relay.execution.cuda_graph import pad_decode_meta

        assert meta.is_decode
        bs, n = case.graph_bs, t
        max_pages = max(len(p) for p in meta.page_tables) + 1
        be.init_cuda_graph_state(bs + 2, max_pages)
        prefix, ext, tables = pad_decode_meta(meta.prefix_lens, meta.page_tables, bs)
        zeros = torch.zeros(bs - n, dtype=torch.int64, device=device)
        gmeta = StepMeta(
            prefix,
            ext,
            tables,
            torch.cat([meta.positions, zeros]),
            torch.cat([meta.out_slots, zeros]),
        )
        be.plan_cuda_graph(bs, gmeta)
        pad = [torch.randn(bs - n, x.shape[1], d, generator=gen).to(dtype) for x in (q, k, v)]
        q2, k2, v2 = (torch.cat([x, p]).to(device) for x, p in zip((q, k, v), pad))
        got = be.forward(q2, k2, v2, 0)[:n]
    else:
        be.plan(meta)
        got = be.forward(q.to(device), k.to(device), v.to(device), 0)
    err = (got.float() - expected).abs().max().item()

    slots = meta.out_slots
    for a, b in zip(_nhd(kv, 0), _nhd(ref_kv, 0)):
        if not torch.equal(a[slots].float(), b[slots]):
            raise AssertionError(
                f"{backend_cls.__name__} wrote different K/V to the step's slots ({case.label()})"
            )
    return err


def interpreter_cases() -> list[tuple[PagedCase, torch.dtype]]:
    """Small batches the Triton interpreter runs in seconds: mixed decode + extend with
    prefixes, pure decode (several splits), pure prefill, GQA groups 1/2/4, page sizes 1/4/16,
    head_dim not a power of two, and the CUDA-graph (static, padded) decode path."""
    f32, f16 = torch.float32, torch.float16
    return [
        (PagedCase([5, 0, 9, 3], [1, 6, 1, 20], 4), f32),
        (PagedCase([5, 0, 9, 3], [1, 6, 1, 20], 4), f16),
        (PagedCase([0, 17, 2], [3, 1, 33], 1, num_heads=4, num_kv_heads=4), f32),
        (
            PagedCase(
                [40, 0, 7, 70],
                [1, 1, 1, 1],
                16,
                num_heads=8,
                num_kv_heads=2,
                min_tokens_per_split=8,
                num_sms=64,
            ),
            f32,
        ),  # 8 splits, some empty
        (
            PagedCase(
                [40, 0, 7, 70],
                [1, 1, 1, 1],
                16,
                num_heads=8,
                num_kv_heads=2,
                min_tokens_per_split=8,
                num_sms=64,
            ),
            f16,
        ),
        (PagedCase([0, 0], [19, 40], 16, num_heads=4, num_kv_heads=1, head_dim=48), f32),
        (PagedCase([31, 16, 1], [18, 2, 1], 16, seed=3), f32),
        (PagedCase([12, 3, 50], [1, 1, 1], 4, graph_bs=4, seed=1, num_sms=32), f32),  # 8 splits
        (PagedCase([12, 3, 50], [1, 1, 1], 4, graph_bs=8, seed=2), f16),
    ]


def run_interpreter_cases() -> int:
    """Triton backend vs torch under TRITON_INTERPRET=1 on CPU; returns the failure count."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "set TRITON_INTERPRET=1 before Python starts (Triton reads it at import)"
        )
    from relay.execution.attention.triton_backend import TritonBackend

    failures = 0
    for case, dtype in interpreter_cases():
        try:
            err = compare_with_torch(TritonBackend, case, dtype, "cpu")
            ok = err <= TOLERANCE[dtype]
            msg = f"max err {err:.2e} (tol {TOLERANCE[dtype]:.0e})"
        except Exception as e:  # report every case, then fail
            ok, msg = False, f"{type(e).__name__}: {e}"
        failures += not ok
        print(
            f"{'ok  ' if ok else 'FAIL'} {str(dtype).replace('torch.', ''):8s} {case.label()}: {msg}",
            flush=True,
        )
    return failures


# ---- ahead-of-time compile of the Triton kernels for a GPU this machine may not have ---------


def aot_compile_triton_kernels(
    dtype: torch.dtype, head_dim: int, group: int, page_size: int, arch: int
) -> dict:
    """Compile the three kernels as TritonBackend launches them (same constexprs, tile sizes,
    warps and stages) for CUDA compute capability `arch` (90 = H100/H200) down to a cubin,
    with Triton's bundled ptxas; no GPU needed. Returns {kernel: shared memory bytes}. This
    catches what the interpreter cannot: Triton's compile-time typing, tl.dot shape rules,
    shared-memory budgets."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from relay.execution.attention import triton_backend as tb
    from relay.execution.attention import triton_kernels as tk

    ty = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    cfg = tb.launch_config(head_dim, dtype, on_gpu=True)
    block_d = tb._next_pow2(head_dim)
    common = dict(
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=block_d, IEEE=dtype == torch.float32
    )
    kernels = {
        "decode_stage1": (
            tk.decode_stage1,
            dict(
                common,
                GROUP=group,
                BLOCK_G=max(16, tb._next_pow2(group)),
                BLOCK_N=cfg["decode_block_n"],
            ),
        ),
        "decode_stage2": (
            tk.decode_stage2,
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=tb.MAX_SPLITS),
        ),
        "extend": (
            tk.extend_kernel,
            dict(common, GROUP=group, BLOCK_M=cfg["ext_block_m"], BLOCK_N=cfg["ext_block_n"]),
        ),
    }
    fp32_ptrs = {"MidO", "MidLse"}
    i32_ptrs = {"PageTable", "SeqLens", "QRows", "PrefixLens", "ExtendLens", "QStarts"}
    out = {}
    for name, (fn, constexprs) in kernels.items():
        params = list(inspect.signature(fn.fn).parameters)
        sig = {}
        for p in params:
            if p in constexprs:
                sig[p] = "constexpr"
            elif p in fp32_ptrs:
                sig[p] = "*fp32"
            elif p in i32_ptrs:
                sig[p] = "*i32"
            elif p == "sm_scale_log2":
                sig[p] = "fp32"
            elif p == "num_splits" or p.startswith("stride_"):
                sig[p] = "i32"
            else:
                sig[p] = f"*{ty}"
        src = ASTSource(
            fn=fn, signature=sig, constexprs={(params.index(k),): v for k, v in constexprs.items()}
        )
        opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
        out[name] = compiled.metadata.shared
    return out


# ---- runner-level batches -------------------------------------------------------------------


def position_logits(runner, tokens: list[int]) -> torch.Tensor:
    """Float32 logits at every position of one sequence, from one eager prefill."""
    seqs = Sequences([tokens], runner.page_size)
    batch = seqs.batch()
    with torch.inference_mode():
        meta, ids = runner.prepare(batch, batch.new_pages)
        runner.attn.plan(meta)
        hidden = runner.model(ids, meta.positions, runner.attn)
        return runner.model.compute_logits(hidden).float().cpu()


def near_argmax_violations(ref_logits: torch.Tensor, chosen: list[int], tol: float) -> list[int]:
    """Positions where `chosen` is not within tol of the reference's best logit."""
    best = ref_logits.max(-1).values
    picked = ref_logits[torch.arange(len(chosen)), torch.tensor(chosen)]
    return torch.nonzero(picked < best - tol).flatten().tolist()


# ---- the CUDA-graph runner's bookkeeping, on CPU ---------------------------------------------


def emulated_graph_runner_cls():
    """CudaGraphRunner whose 'graphs' re-run the captured step on replay and copy the result
    into the captured output tensor. It keeps everything a replay depends on (static inputs,
    padding, the backend's plan_cuda_graph path, output slicing) but needs no CUDA."""
    from relay.execution.cuda_graph import CudaGraphRunner

    class _Replay:
        def __init__(self, fn):
            self.replay = fn

    class EmulatedGraphRunner(CudaGraphRunner):
        requires_cuda = False

        @torch.inference_mode()
        def capture(self) -> None:
            for bs in reversed(self.batch_sizes):
                self.attn.plan_cuda_graph(bs, self._meta(bs, [], []))
                self.outputs[bs] = self._run(bs)
                self.graphs[bs] = _Replay(lambda bs=bs: self.outputs[bs].copy_(self._run(bs)))

    return EmulatedGraphRunner


def run_emulated_graph_check(model_dir: str) -> str:
    """A tiny model on CPU whose runner uses the Triton backend (interpreted) and the emulated
    graph runner, vs the torch backend eagerly: same greedy tokens, logits within 1e-4."""
    from relay.config import EngineConfig, ModelConfig
    from relay.execution.attention.triton_backend import TritonBackend
    from relay.execution.model_runner import ModelRunner

    mc = ModelConfig.from_dir(model_dir)
    cfg = EngineConfig(
        model_path=model_dir, device="cpu", dtype="float32", kv_cache_gb=0.01, page_size=4
    )
    ref = ModelRunner(cfg, model_dir, mc)
    runner = ModelRunner(cfg, model_dir, mc)
    runner.kv = KVCache(
        mc.num_layers,
        runner.num_pages,
        runner.page_size,
        mc.num_kv_heads,
        mc.head_dim,
        runner.dtype,
        runner.device,
        layout=TritonBackend.kv_layout,
    )
    runner.attn = TritonBackend(
        runner.kv, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.head_dim**-0.5
    )
    runner.cuda_graphs = emulated_graph_runner_cls()(
        runner.model, runner.attn, runner.device, 4, -(-runner.context_len // runner.page_size)
    )
    assert runner.cuda_graphs.batch_sizes == [1, 2, 4]
    rng = random.Random(0)
    prompts = [
        [rng.randrange(2, mc.vocab_size - 2) for _ in range(n)] for n in (3, 9, 17)
    ]  # 3 -> padded to 4
    tokens, logits = run_greedy(runner, prompts, steps=5)
    ref_tokens, ref_logits = run_greedy(ref, prompts, steps=5)
    if runner.cuda_graphs.replays != 5:
        raise AssertionError(f"expected 5 graph replays, got {runner.cuda_graphs.replays}")
    err = max((a - b).abs().max().item() for a, b in zip(logits, ref_logits))
    if tokens != ref_tokens or err > 1e-4:
        raise AssertionError(
            f"emulated graph decode differs from torch: max logit err {err:.2e}, "
            f"tokens equal: {tokens == ref_tokens}"
        )
    return f"max logit err {err:.2e} over {len(logits)} steps, {runner.cuda_graphs.replays} replays"


if __name__ == "__main__":
    failed = run_interpreter_cases()
    if len(sys.argv) > 1:  # a tiny model directory: the runner + emulated CUDA graph check
        try:
            print(
                f"ok   runner with triton + emulated CUDA graphs: {run_emulated_graph_check(sys.argv[1])}"
            )
        except Exception as e:
            failed += 1
            print(f"FAIL runner with triton + emulated CUDA graphs: {type(e).__name__}: {e}")
    sys.exit(1 if failed else 0)
