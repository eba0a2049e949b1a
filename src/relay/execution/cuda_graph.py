"""CUDA graphs for decode steps: capture once per batch size, replay every decode step.

A decode step of n requests is padded to the smallest captured batch size bs >= n. Padded
rows decode token 0 at position 0 into KV slot 0 with a one-token history on page 0 (the
scratch page the allocator never hands out), so they cost a little work and touch nothing
that matters. Static input buffers (token ids, positions, KV slots) and the attention
backend's static metadata (see AttentionBackend.init_cuda_graph_state / plan_cuda_graph) are
the same tensors at capture and at every replay; a replay only copies the new step's values
into them. The graph covers the whole model and the LM head: its output is the logits.

The batch-size list and the padding bookkeeping are plain Python (tested on CPU); the
runner itself needs CUDA.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time

import torch

from relay.config import EngineConfig
from relay.execution.attention.base import AttentionBackend, StepMeta

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 12, 16, 24, 32, 40, ... (steps of 8 from 16) up to max_bs, and max_bs itself."""
    if max_bs < 1:
        return []
    sizes = [s for s in [1, 2, 4, 8, 12] + list(range(16, max_bs + 1, 8)) if s <= max_bs]
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def padded_batch_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n requests, or None when n is too large."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def pad_decode_meta(
    prefix_lens: list[int], page_tables: list[list[int]], bs: int
) -> tuple[list[int], list[int], list[list[int]]]:
    """(prefix_lens, extend_lens, page_tables) of a decode step padded to bs rows: each
    padded row is a one-token sequence (prefix 0) on the scratch page 0."""
    pad = bs - len(prefix_lens)
    if pad < 0:
        raise ValueError(f"{len(prefix_lens)} requests do not fit a batch of {bs}")
    return list(prefix_lens) + [0] * pad, [1] * bs, list(page_tables) + [[0]] * pad


class CudaGraphRunner:
    """Captured decode graphs of `model` (with `attn`) for each batch size up to max_bs."""

    requires_cuda = True  # a CPU test double that re-runs instead of capturing clears it

    def __init__(
        self,
        model: torch.nn.Module,
        attn: AttentionBackend,
        device: torch.device,
        max_bs: int,
        max_pages_per_req: int,
    ):
        if device.type != "cuda" and self.requires_cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        if not attn.supports_cuda_graph:
            raise ValueError(f"the {attn.name} attention backend does not support CUDA graphs")
        self.model = model
        self.attn = attn
        self.device = device
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.max_pages_per_req = max_pages_per_req
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.out_slots = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        attn.init_cuda_graph_state(self.max_bs, max_pages_per_req)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # decode steps served by a graph (tests and benchmarks read it)
        self.capture()

    def _meta(self, bs: int, prefix_lens: list[int], page_tables: list[list[int]]) -> StepMeta:
        prefix, ext, tables = pad_decode_meta(prefix_lens, page_tables, bs)
        return StepMeta(
            prefix, ext, tables, positions=self.positions[:bs], out_slots=self.out_slots[:bs]
        )

    def _run(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.attn)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        gc.collect()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        self.input_ids.zero_()
        self.positions.zero_()
        self.out_slots.zero_()
        # Largest first: smaller graphs then reuse the largest one's memory from the shared pool.
        for bs in reversed(self.batch_sizes):
            self.attn.plan_cuda_graph(bs, self._meta(bs, [], []))
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: JIT compiles, cuBLAS/NCCL lazy init
                for _ in range(2):
                    self._run(bs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self._run(bs)
            self.graphs[bs] = graph
            self.outputs[bs] = out
        torch.cuda.synchronize(self.device)
        used = (free_before - torch.cuda.mem_get_info(self.device)[0]) / (1 << 20)
        logger.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s (%.0f MiB)",
            self.batch_sizes,
            time.perf_counter() - t0,
            used,
        )

    def can_run(self, num_reqs: int, is_decode: bool) -> bool:
        return is_decode and 0 < num_reqs <= self.max_bs

    def replay(self, meta: StepMeta, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of a decode step of n requests (a view of the graph's output,
        valid until the next replay)."""
        n = len(meta.prefix_lens)
        bs = padded_batch_size(n, self.batch_sizes)
        if bs is None:
            raise ValueError(
                f"a decode batch of {n} exceeds the largest captured graph ({self.max_bs})"
            )
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.out_slots[:n].copy_(meta.out_slots, non_blocking=True)
        if bs > n:  # padded rows: token 0 at position 0 into scratch slot 0
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.out_slots[n:bs].zero_()
        self.attn.plan_cuda_graph(bs, self._meta(bs, meta.prefix_lens, meta.page_tables))
        self.graphs[bs].replay()
        self.replays += 1
        return self.outputs[bs][:n]


def decode_graphs(
    cfg: EngineConfig,
    model: torch.nn.Module,
    attn: AttentionBackend,
    device: torch.device,
    context_len: int,
) -> CudaGraphRunner | None:
    """The runner's decode graphs; None (decode runs eagerly) on CPU, with --disable-cuda-graph,
    or where the attention backend or the model cannot be captured."""
    if device.type != "cuda" or cfg.disable_cuda_graph:
        return None
    if not attn.supports_cuda_graph:
        logger.info(
            "the %s attention backend does not support CUDA graphs: decode runs eagerly", attn.name
        )
        return None
    if not model.supports_cuda_graph:
        logger.info(
            "%s steps run eagerly: which experts run depends on the tokens, which a CUDA graph "
            "cannot follow",
            model.config.architecture,
        )
        return None
    max_bs = min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
    if max_bs < 1:
        return None
    return CudaGraphRunner(model, attn, device, max_bs, -(-context_len // cfg.page_size))
