"""Rotary position embeddings and the rope scalings of Hugging Face configs, in one place.

transformers 5 (modeling_rope_utils) computes, per rope type, inverse frequencies and an attention
factor that multiplies cos and sin (YaRN, LongRoPE). Relay computes the same numbers by the same
float32 operations in the same order, once, for every position up to the context length, so its
tables are transformers' bit for bit. A token's rotation then depends on its position alone: the
prefix cache, chunked prefill and batching all rely on that.

Two types make transformers choose frequencies by the length of the sequence in the forward call
(max(position_ids) + 1):
  - longrope: the short factors while the sequence is at most original_max_position_embeddings
    long, the long ones past it. Phi-3's generate goes further: the step at which the sequence
    first grows past that length recomputes the whole sequence, so every token of a longer
    sequence is rotated with the long factors. Relay keeps two sets of rows: rows [0, P) rotate
    position p with the short factors below original_max_position_embeddings and the long ones
    from there on (what transformers' model computes with a KV cache), rows [P, 2P) (position +
    long_rope_rows) with the long factors everywhere. The scheduler sends a request's tokens to
    the long rows once its sequence is longer than original_max_position_embeddings, and a
    request that grows past it while decoding is recomputed on them (Scheduler: long_rope_after),
    which is transformers' generate, token for token.
  - dynamic (NTK): the base frequency of max(p + 1, max_position_embeddings): within
    max_position_embeddings exactly the default rope; past it, exact for decoded tokens, while a
    prompt longer than that transformers rotates whole with its full length's base.

The parsing and validation here import no torch (the HTTP process and the tokenizers read configs
too); building the tables does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")

# What each type reads from the config's rope parameters (transformers raises a KeyError without them).
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
_USES_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeSettings:
    theta: float
    scaling: (
        dict[str, Any] | None
    )  # None: the default rope; else the parameters, "rope_type" included
    partial_rotary_factor: float


def rope_settings(cfg: dict[str, Any], architecture: str, head_dim: int) -> RopeSettings:
    """The rope of an HF config.json, normalised as transformers 5's config classes do (rope_scaling
    wins over rope_parameters, "type" is the old "rope_type", original_max_position_embeddings at the
    top level wins, Phi-3's "su" and "yarn" are LongRoPE). Raises ValueError naming the field for a
    rope type Relay does not implement or parameters it lacks."""
    field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = dict(cfg.get(field) or {})
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    partial = float(
        params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
    )
    kind = params.pop("type", None)
    kind = params.get("rope_type", kind) or "default"
    if architecture == "Phi3ForCausalLM" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi3Config's backward compatibility
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"config.json {field}.rope_type {kind!r} is not supported; Relay implements "
            f"{', '.join(ROPE_TYPES)}"
        )
    if kind == "default":
        return RopeSettings(theta, None, partial)
    params["rope_type"] = kind
    missing = [
        k
        for k in _REQUIRED[kind]
        if params.get(k) is None and not (k == "factor" and kind == "yarn")
    ]
    if missing:
        raise ValueError(f"config.json {field}.{missing[0]} is required by rope_type {kind!r}")
    if kind in _USES_ORIGINAL_LENGTH:
        top = cfg.get("original_max_position_embeddings")
        if (
            top is not None
        ):  # transformers gives the top-level value priority (Phi-3 keeps it there)
            params["original_max_position_embeddings"] = top
        params.setdefault(
            "original_max_position_embeddings", cfg.get("max_position_embeddings", 4096)
        )
    if kind == "longrope":
        want = int(head_dim * partial) // 2
        for name in ("short_factor", "long_factor"):
            if len(params[name]) != want:
                raise ValueError(
                    f"config.json {field}.{name} has {len(params[name])} values; the rotary "
                    f"dimension needs {want}"
                )
    return RopeSettings(theta, params, partial)


# ---- the tables --------------------------------------------------------------------------------
def _exponents(dim: int) -> torch.Tensor:
    import torch

    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(dim))


def linear_inv_freq(theta: float, dim: int, s: dict) -> torch.Tensor:
    return default_inv_freq(theta, dim) / s["factor"]


def llama3_inv_freq(theta: float, dim: int, s: dict) -> torch.Tensor:
    import torch

    inv_freq = default_inv_freq(theta, dim)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(
    theta: float, dim: int, s: dict, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    import torch

    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position_embeddings / old_len
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = (
            float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
            if mscale and mscale_all_dim
            else yarn_mscale(factor)
        )
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention_factor


def longrope_inv_freqs(
    theta: float, dim: int, s: dict, max_position_embeddings: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(short, long) inverse frequencies and the attention factor."""
    import torch

    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position_embeddings / old_len
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
        )
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (
        1.0 / (torch.tensor(s[k], dtype=torch.float32) * theta**shape)
        for k in ("short_factor", "long_factor")
    )
    return short, long, attention_factor


def dynamic_inv_freqs(
    theta: float, dim: int, s: dict, max_position_embeddings: int, positions: int
) -> torch.Tensor:
    """[positions - max_position_embeddings, dim / 2]: the frequencies transformers uses for a token
    at each position from max_position_embeddings on (sequence length p + 1), by its float32 tensor
    arithmetic (the sequence length is a tensor there)."""
    import torch

    factor, mp = s["factor"], max_position_embeddings
    seq = torch.arange(mp + 1, positions + 1, dtype=torch.int64)
    base = theta * ((factor * seq / mp) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[:, None] ** _exponents(dim)[None, :])


def rope_angles(
    theta: float, dim: int, scaling: dict | None, positions: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """([positions, dim / 2] angles position x inverse frequency, the attention factor)."""
    import torch

    t = torch.arange(positions, dtype=torch.int64).float()
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return t[:, None] * default_inv_freq(theta, dim), 1.0
    if kind == "linear":
        return t[:, None] * linear_inv_freq(theta, dim, scaling), 1.0
    if kind == "llama3":
        return t[:, None] * llama3_inv_freq(theta, dim, scaling), 1.0
    if kind == "yarn":
        inv, factor = yarn_inv_freq(theta, dim, scaling, max_position_embeddings)
        return t[:, None] * inv, factor
    if (
        kind == "longrope"
    ):  # see long_rope_rows: positions by their own rule, then all on the long factors
        short, long, factor = longrope_inv_freqs(theta, dim, scaling, max_position_embeddings)
        edge = min(scaling["original_max_position_embeddings"], positions)
        return torch.cat([t[:edge, None] * short, t[edge:, None] * long, t[:, None] * long]), factor
    if kind == "dynamic":
        # Within max_position_embeddings transformers keeps the frequencies of its start-up, computed
        # with Python floats (there factor * L / L - (factor - 1) is 1).
        mp = max_position_embeddings
        base = theta * ((scaling["factor"] * mp / mp) - (scaling["factor"] - 1)) ** (
            dim / (dim - 2)
        )
        edge = min(mp, positions)
        angles = [t[:edge, None] * default_inv_freq(base, dim)]
        if positions > mp:
            angles.append(t[edge:, None] * dynamic_inv_freqs(theta, dim, scaling, mp, positions))
        return torch.cat(angles), 1.0
    raise ValueError(
        f"rope_type {kind!r} is not supported; Relay implements {', '.join(ROPE_TYPES)}"
    )


def long_rope_rows(scaling: dict | None, positions: int) -> int:
    """Where a LongRoPE model's second set of table rows starts (position p of a sequence on the
    long factors is row p + this); 0 for every other rope."""
    return positions if (scaling or {}).get("rope_type") == "longrope" else 0


def rotary_tables(
    theta: float, dim: int, scaling: dict | None, positions: int, max_position_embeddings: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [positions (twice that for LongRoPE: long_rope_rows), dim] cos and signed-sin tables:
    cat(cos, cos) and cat(-sin, sin), times the attention factor (rotate_half(x) * sin == swap_halves(x) * [-sin, sin]: the sign lives in
    the table)."""
    import torch

    angles, attention_factor = rope_angles(theta, dim, scaling, positions, max_position_embeddings)
    cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
