"""The attention backend interface and its registry.

A backend is told once per step what the batch looks like (`plan`), then called by every
layer with that layer's new q/k/v (`forward`): it writes k/v into the paged KV cache and
attends each request's new tokens over its prefix plus themselves (causally).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from relay.memory.kv_cache import KVCache


@dataclass
class StepMeta:
    """Runner-side description of one forward step (host lists and device tensors)."""

    prefix_lens: list[int]  # per request: tokens already cached
    extend_lens: list[int]  # per request: new tokens this step
    page_tables: list[list[int]]  # per request: pages covering prefix + new tokens
    positions: torch.Tensor  # [num_tokens] absolute position of each new token
    out_slots: torch.Tensor  # [num_tokens] KV slot each new token is written to

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def is_decode(self) -> bool:
        return all(e == 1 for e in self.extend_lens)


class AttentionBackend(ABC):
    name: str = ""
    # How the backend wants each layer's KV buffers laid out (see KVCache): "NHD" is
    # [slots, kv_heads, head_dim] (paged GPU kernels), "HND" is [kv_heads, slots, head_dim].
    kv_layout: str = "NHD"
    # Whether the backend applies per-layer sliding windows, soft-capped scores and attention sinks
    # (ModelConfig.masks_attention); one that does not refuses a model that needs them.
    masks_scores: bool = False

    def __init__(
        self,
        kv: KVCache,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        windows: list[int | None] | None = None,
        softcap: float | None = None,
        sinks: bool = False,
    ):
        """windows: each layer's sliding window (None: the whole context; no list: no layer has
        one); softcap: scores become softcap * tanh(scores / softcap) before the softmax; sinks:
        the model's layers pass forward their attention sinks (gpt-oss)."""
        if (windows or softcap is not None or sinks) and not self.masks_scores:
            raise ValueError(
                f"the {self.name} attention backend applies no sliding window, attention "
                f"soft-capping or attention sinks, which this model needs: use "
                f"--attention-backend torch (or auto)"
            )
        self.kv = kv
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.windows = list(windows or [])
        self.softcap = softcap

    @abstractmethod
    def plan(self, meta: StepMeta) -> None:
        """Precompute what all layers of this step share (indices, masks, kernel plans)."""

    @property
    def decode_kernel_plan(self):
        """The planned step's cpu_attention.DecodePlan where it is a pure decode step that Relay's
        C decode kernel attends over this backend's ("HND") cache; None otherwise."""
        return None

    @property
    def prompt_kernel_plan(self):
        """The planned step's cpu_layers.PromptPlan where it has prompt chunks that Relay's C
        kernels attend (with any decodes beside them) over this backend's cache; None otherwise."""
        return None

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """q: [T, num_heads, head_dim], k/v: [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim].
        A backend that masks scores also takes sinks=: the layer's float32 [num_heads] attention
        sinks, a logit per head in each row's softmax denominator that attends no value (gpt-oss);
        only models built with sinks pass it."""

    # ---- CUDA graphs (decode only) --------------------------------------------------------
    # A backend that can be captured keeps its per-step metadata in static tensors: the
    # graph runner calls init_cuda_graph_state once, then plan_cuda_graph before capturing
    # each batch size and before every replay; plan_cuda_graph only copies the new step's
    # metadata into those same tensors, so the captured kernels read it on replay.
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        """Allocate the static metadata buffers for decode batches of up to `max_bs` requests
        of up to `max_pages_per_req` pages each."""
        raise NotImplementedError(f"the {self.name} attention backend does not support CUDA graphs")

    def plan_cuda_graph(self, bs: int, meta: StepMeta) -> None:
        """Like plan() for a pure decode step of exactly `bs` requests (already padded by the
        graph runner: padded rows have prefix 0 and page table [0]), writing into the static
        buffers; meta.positions and meta.out_slots are the graph runner's static tensors."""
        raise NotImplementedError(f"the {self.name} attention backend does not support CUDA graphs")


BACKENDS: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str):
    def wrap(cls):
        cls.name = name
        BACKENDS[name] = cls
        return cls

    return wrap
