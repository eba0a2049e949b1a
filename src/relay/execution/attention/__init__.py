"""Attention backends: `torch` (CPU and reference), `triton` and `flashinfer` (CUDA)."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from relay.execution.attention.base import BACKENDS, AttentionBackend, StepMeta, register_backend

# Modules that register backends; imported on demand so a CPU install never imports GPU code.
_MODULES = {
    "torch": "relay.execution.attention.torch_native",
    "triton": "relay.execution.attention.triton_backend",
    "flashinfer": "relay.execution.attention.flashinfer_backend",
}


def resolve_backend_name(
    name: str, device: torch.device, dtype: torch.dtype | None = None, masked: bool = False
) -> str:
    """`auto` picks flashinfer on CUDA when it is installed (and the dtype is float16 or
    bfloat16, all it runs), else triton on CUDA, else torch; torch wherever the model's
    attention is masked beyond causal (sliding windows, soft-capping: ModelConfig.masks_attention),
    which only the torch backend applies (on CPU in Relay's C attention kernels)."""
    if name != "auto":
        if name not in _MODULES:
            raise ValueError(
                f"unknown attention backend {name!r}; choose from {sorted(_MODULES)} or auto"
            )
        if name != "torch" and device.type != "cuda":
            raise ValueError(f"attention backend {name!r} needs a CUDA device")
        return name
    if device.type != "cuda" or masked:
        return "torch"
    if dtype not in (None, torch.float16, torch.bfloat16):
        return "triton"
    return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "triton"


def backend_class(
    name: str, device: torch.device, dtype: torch.dtype | None = None, masked: bool = False
) -> type[AttentionBackend]:
    name = resolve_backend_name(name, device, dtype, masked)
    if name not in BACKENDS:
        importlib.import_module(_MODULES[name])
    return BACKENDS[name]


def create_backend(name: str, device: torch.device, **kwargs) -> AttentionBackend:
    return backend_class(name, device)(**kwargs)


__all__ = [
    "AttentionBackend",
    "StepMeta",
    "register_backend",
    "backend_class",
    "create_backend",
    "resolve_backend_name",
]
