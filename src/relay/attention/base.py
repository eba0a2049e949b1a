"""The attention backend interface and its registry.

A backend is told once per step what the batch looks like (`plan`), then called by every
layer with that layer's new q/k/v (`forward`): it writes k/v into the paged KV cache and
attends each request's new tokens over its prefix plus themselves (causally).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from relay.kv_cache import KVCache


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

    def __init__(self, kv: KVCache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.kv = kv
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def plan(self, meta: StepMeta) -> None:
        """Precompute what all layers of this step share (indices, masks, kernel plans)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q: [T, num_heads, head_dim], k/v: [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim]."""


BACKENDS: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str):
    def wrap(cls):
        cls.name = name
        BACKENDS[name] = cls
        return cls
    return wrap
