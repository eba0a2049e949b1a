"""Embeddings (EngineConfig.is_embedding): how a prompt's final hidden states (the final norm's
output, before the LM head) become one vector, collected over its prefill chunks on the
scheduler's side.

The model directory's sentence-transformers config says how, as SGLang and vLLM read it:
modules.json lists a Pooling module (its config.json: mean, cls or lasttoken) and maybe a
Normalize module (L2). A directory without modules.json pools the last token, normalized.

A request's PoolState names the positions it pools, [lo, hi): the whole prompt (mean), the
first position (cls) or the last (lasttoken). Every prefill step that computes some of them
returns their hidden states' float32 sum (an EmbedChunk, relay.execution.hidden_sums); the
sums add up (relay.scheduling.embedding) and, once the prompt is in, are divided by the count
(mean) and normalized.

The prefix cache keeps KV, not hidden states, so positions still to pool must be computed:
a request's cached-prefix match stops at the first of them (as prompt logprobs limit theirs).
For mean and cls that is 0: a new request's prompt is recomputed whole, cached or not (one
retracted midway may take the positions it already pooled from the cache). For lasttoken the
usual limit (the last token is always computed) is the same.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

# sentence-transformers' Pooling config key of each mode Relay implements.
_MODE_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "lasttoken",
}
_OTHER_MODE_KEYS = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True)
class Pooling:
    """A server's pooling: mode (mean, cls or lasttoken), then L2 normalization or not."""

    mode: str = "lasttoken"
    normalize: bool = True

    @classmethod
    def from_dir(cls, model_dir: str) -> Pooling:
        """The model directory's sentence-transformers pooling; ValueError naming the file for
        one Relay cannot follow (another mode, or a module such as Dense after the pooling)."""
        path = os.path.join(model_dir, "modules.json")
        if not os.path.exists(path):
            return cls()
        mode, normalize = None, False
        for module in _read(path):
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            if kind == "Pooling":
                mode = _pooling_mode(os.path.join(model_dir, module.get("path", ""), "config.json"))
            elif kind == "Normalize":
                normalize = True
            elif kind != "Transformer":
                raise ValueError(f"{path}: module {module.get('type')!r} is not supported")
        if mode is None:
            raise ValueError(f"{path} lists no Pooling module")
        return cls(mode, normalize)

    def start(self, prompt_len: int) -> PoolState:
        """A new request's state: the positions this pooling reads of its prompt."""
        lo, hi = {"mean": (0, prompt_len), "cls": (0, 1)}.get(
            self.mode, (prompt_len - 1, prompt_len)
        )
        return PoolState(self, lo, hi, lo)


def _read(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def _pooling_mode(path: str) -> str:
    cfg = _read(path)
    modes = [mode for key, mode in _MODE_KEYS.items() if cfg.get(key)]
    others = [key for key in _OTHER_MODE_KEYS if cfg.get(key)]
    if others or len(modes) != 1:
        raise ValueError(
            f"{path}: Relay pools with exactly one of {', '.join(_MODE_KEYS)}; "
            f"this config sets {', '.join(others + [k for k in _MODE_KEYS if cfg.get(k)]) or 'none'}"
        )
    return modes[0]


@dataclass
class PoolState:
    """One request's embedding in the making: it pools positions [lo, hi); `next` is the first
    whose hidden state is not added to `total` yet."""

    pooling: Pooling
    lo: int
    hi: int
    next: int
    total: np.ndarray | None = None
