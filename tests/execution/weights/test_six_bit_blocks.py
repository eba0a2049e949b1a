"""8-bit block forms whose quants all lie in -32..31 (Q6_K's, Q5_K's, Q5_1's, a fused Q4_K/Q6_K
q/k/v's) narrowed to 6 bits (BlockWeight.to_six_bits; csrc/blocks.h: u = q + 32 as a 4-bit and a
2-bit plane): the same weights as gguf.quants dequantizes them, and every GEMM - float32 and int8
activations, GEMVs and tiles, float32 and compact scales - the 8-bit form's output bit for bit at
every instruction-set level (the integer sums are exact: sum(u * qx) - 32 * sum(qx) is sum(q * qx)).
A file loads such weights in 6 bits (gguf_weights.SIX_BIT_QUANTS), and a broken high plane is
caught."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from relay.execution import gguf_weights
from relay.execution.gguf_blocks import common_form, decode_rows, pack_rows, six_bit_form
from relay.execution.gguf_weights import GgufFile, Part, read_blocks
from relay.execution.kernels import cpu_gemm
from relay.execution.weight_blocks import (
    DOT_FLAG,
    GROUP16_FLAG,
    KSCALES_FLAG,
    MIN_FLAG,
    pack,
)
from tests.helpers.block_checks import gguf_floats, raw_blocks, same_bits
from tests.helpers.gguf_models import q4_k_m_file  # noqa: F401 (q4_k_m_file: a fixture)
from tests.helpers.kernel_helpers import held_at, kernel_level, levels_here  # noqa: F401 (a fixture)

KS = KSCALES_FLAG
# the parts' types, the 6-bit kernel form with float32 scales, and its bits a weight with compact ones
SIX = {
    "q6_k": ([T.Q6_K], 6 | GROUP16_FLAG, 6.5625),
    "q5_k": ([T.Q5_K], 6 | MIN_FLAG, 6.625),
    "q5_1": ([T.Q5_1], 6 | MIN_FLAG, None),
    "q4_k+q6_k": ([T.Q4_K, T.Q4_K, T.Q6_K], 6 | MIN_FLAG | GROUP16_FLAG, 7.125),
    "q4_k+q5_k": ([T.Q4_K, T.Q5_K], 6 | MIN_FLAG, 6.625),
}


def six_pair(kind: str, rows: int, k: int, compact: bool, seed: int = 0):
    """The kind's weight (rows per part) in the 8-bit and the 6-bit form from the same decoded
    rows, with float32 or compact scales, and gguf's floats of it."""
    parts, floats = [], []
    for i, qtype in enumerate(SIX[kind][0]):
        raw = raw_blocks(qtype, rows, k, seed * 10 + i)
        parts.append(decode_rows(raw, int(qtype), k))
        floats.append(gguf_floats(raw, qtype, k))
    form = common_form(parts)
    n = rows * len(parts)
    eight = pack_rows(form, n, k, compact=compact)
    six = pack_rows(form, n, k, compact=compact, six_bits=True)
    return eight, six, torch.from_numpy(np.concatenate(floats))


@pytest.fixture(scope="module")
def six_weights() -> dict:
    """Each kind, float32 and compact scales, at rows past a strip's end and K of 1 and 3
    super-blocks."""
    return {
        (kind, k, compact): six_pair(kind, 200 // len(SIX[kind][0]), k, compact, seed=3)
        for kind in SIX
        for k in (256, 768)
        for compact in (False, True)
        if compact is False or SIX[kind][2] is not None
    }


def kinds_and_scales() -> list[tuple[str, bool]]:
    return [(kind, c) for kind in SIX for c in (False, True) if not c or SIX[kind][2] is not None]


@pytest.mark.parametrize("kind,compact", kinds_and_scales())
def test_six_bit_blocks_are_the_gguf_weights_in_fewer_bytes(kind, compact):
    """decode_rows -> common_form -> pack_rows(six_bits=True): the 6-bit kernel form, every weight
    as gguf.quants dequantizes it (signs of zero included) in the strips' and the dot layout, 2
    bits a weight fewer than the 8-bit form (Q6_K with compact scales 6.5625, the file's own)."""
    eight, six, w = six_pair(kind, 40, 512, compact)
    flags = KS if compact else 0
    assert six.kernel_bits == SIX[kind][1] | flags, hex(six.kernel_bits)
    assert six.to_dot().kernel_bits == SIX[kind][1] | flags | DOT_FLAG
    assert eight.kernel_bits & 0xFF == 8
    assert (eight.bytes_per_weight - six.bytes_per_weight) * 8 == 2.0
    if compact:
        assert six.bytes_per_weight * 8 == SIX[kind][2]
    for blocks in (six, six.to_dot(), eight.to_dot().to_six_bits()):
        assert same_bits(blocks.dequantize(), w)
    assert torch.equal(six.to_dot().q, eight.to_dot().to_six_bits().q)


def test_quants_outside_six_bits_are_refused():
    """A Q8_0 part's quants (beyond -32..31) do not narrow; Q4_0's and Q5_0's would, but their
    per-32 form without a minimum stays 8-bit (a bfloat16 model's GEMMs of it round x)."""
    k = 256
    rows = common_form([decode_rows(raw_blocks(T.Q8_0, 8, k), int(T.Q8_0), k)])
    with pytest.raises(ValueError):
        pack_rows(rows, 8, k, six_bits=True)
    assert pack_rows(rows, 8, k, six_bits=None).bits == 8
    assert not six_bit_form([int(T.Q4_K), int(T.Q8_0)], 8, 16, True)
    assert not six_bit_form([int(T.Q5_0)], 8, 32, False)
    assert six_bit_form([int(T.Q4_K), int(T.Q6_K)], 8, 16, True)
    assert six_bit_form([int(T.Q6_K)], 8, 16, False)


@pytest.mark.parametrize("kind,compact", kinds_and_scales())
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_six_bit_gemms_equal_the_eight_bit_forms_bit_for_bit(
    kernel_level, six_weights, kind, compact, activations
):
    """The same x on both forms: identical outputs at 1 to 33 rows (GEMVs up to 6 rows, int8 row
    groups of up to 6 or 8, unpacked tiles beyond), a short last strip, K of 1 and 3 super-blocks,
    an all-zero block of x, at each instruction-set level; float32 activations also the float
    product of gguf's weights."""
    for k in (256, 768):
        eight, six, w = six_weights[kind, k, compact]
        if activations == "int8":
            eight, six = eight.to_dot(), six.to_dot()
        for m in (1, 2, 3, 5, 6, 7, 8, 9, 13, 33):
            x = torch.randn(m, k + 3, generator=torch.Generator().manual_seed(m))[:, :k] * 2
            x[0, 32:64] = 0.0
            y = cpu_gemm.gemm_blocks(x, six)
            assert same_bits(y, cpu_gemm.gemm_blocks(x, eight)), f"{m} rows, K {k}"
            if activations == "float":
                torch.testing.assert_close(y, x @ w.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_value", [-32, 31])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("group", [16, 32])
def test_six_bit_sums_at_their_largest(kernel_level, q_value, sign, group):
    """Every quant at an extreme (u 0 or 63) times x at +-127 everywhere: the unsigned products
    at their largest (without VNNI two VPMADDUBSW pairs in 16 bits: 32,004) and the - 32 sum(qx)
    term give the 8-bit form's sums exactly."""
    n, k = 48, 256
    d = np.full((n, k // group), 2.0**-10, np.float32)
    m = np.full_like(d, -0.25) if group == 32 else None
    eight = pack(8, d, m, np.full((n, k), q_value, np.int8), n, k, group=group)
    x = torch.full((7, k), sign)
    for blocks in (eight, eight.to_dot()):
        assert same_bits(
            cpu_gemm.gemm_blocks(x, blocks.to_six_bits()), cpu_gemm.gemm_blocks(x, blocks)
        )


def high_plane_broken(blocks):
    """The blocks with one 2-bit field of every high-plane byte flipped (bits 0-1 in the strips
    layout's rows 16-23, bits 2-3 of the dot layout's H units): a mutation the checks must catch."""
    q = blocks.q.clone()
    if blocks.dot:
        per_block = q.view(q.shape[0], 4, -1, 192)
        per_block[..., 128:] ^= 0x0C
    else:
        per_block = q.view(q.shape[0], -1, 24, q.shape[2])
        per_block[:, :, 16:] ^= 0x03
    return replace(blocks, q=q)


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_a_broken_high_plane_is_caught(kernel_level, six_weights, activations):
    """Flipping bits of the 2-bit plane changes the dequantized weights and every path's outputs
    (the kernels read it, in both layouts)."""
    eight, six, w = six_weights["q6_k", 256, True]
    if activations == "int8":
        eight, six = eight.to_dot(), six.to_dot()
    bad = high_plane_broken(six)
    assert not same_bits(bad.dequantize(), w)
    for m in (1, 9):
        x = torch.randn(m, 256)
        assert not same_bits(cpu_gemm.gemm_blocks(x, bad), cpu_gemm.gemm_blocks(x, eight))


def test_a_q4_k_m_like_file_loads_q6_k_and_q5_k_in_six_bits(q4_k_m_file, monkeypatch):
    """read_blocks of the file's Q6_K down, Q5_K gate/up, Q4_K/Q6_K q/k/v: 6-bit forms with the
    file's compact scales; gguf_weights.SIX_BIT_QUANTS False (a benchmark's "before") the 8-bit
    ones: the same GEMM outputs from 2 bits a weight fewer; a row-parallel shard that cuts a
    super-block keeps 6 bits with float32 scales."""
    file = GgufFile.read(q4_k_m_file[0])
    layer = "blk.1."
    weights = {
        "down": [Part(layer + "ffn_down.weight", np.arange(256))],
        "gate_up": [Part(layer + t, np.arange(512)) for t in ("ffn_gate.weight", "ffn_up.weight")],
        "qkv": [
            Part(layer + t, np.arange(256 if "v" not in t else 128))
            for t in ("attn_q.weight", "attn_v.weight")
        ],
        "down_cut": [Part(layer + "ffn_down.weight", np.arange(256), slice(128, 384))],
    }
    for name, parts in weights.items():
        monkeypatch.setattr(gguf_weights, "SIX_BIT_QUANTS", True)
        six = read_blocks(file, parts, dot=name == "gate_up")
        monkeypatch.setattr(gguf_weights, "SIX_BIT_QUANTS", False)
        eight = read_blocks(file, parts, dot=name == "gate_up")
        assert six.bits == 6 and eight.bits == 8, name
        assert six.kscales == (name != "down_cut") == eight.kscales
        assert same_bits(six.dequantize(), eight.dequantize())
        x = torch.randn(3, six.in_features)
        assert same_bits(cpu_gemm.gemm_blocks(x, six), cpu_gemm.gemm_blocks(x, eight)), name


@pytest.mark.parametrize("kind", ["q6_k", "q4_k+q6_k"])
def test_single_rows_over_long_groups_give_the_same_bits_at_every_level(kind):
    """At AVX-512 one row takes the 8-features-a-pass kernel where a group of 8 features' quants
    is short (gemm_dot.c: YMM_MAX_K inputs) and the 16-features one beyond (K 4096 here, in 6
    and 8 bits): both forms, both kernels, every level give the same bits."""
    eight, six, _ = six_pair(kind, 40, 4096, compact=True, seed=4)
    x = torch.randn(1, 4096, generator=torch.Generator().manual_seed(5)) * 2
    dot = []
    for level in levels_here():
        with held_at(level):
            dot += [cpu_gemm.gemm_blocks(x, b) for b in (eight.to_dot(), six.to_dot())]
            floats = [cpu_gemm.gemm_blocks(x, b) for b in (eight, six)]
            assert same_bits(floats[1], floats[0]), level  # (float sums: the same per level)
    assert all(same_bits(y, dot[0]) for y in dot)


@pytest.mark.parametrize("k", [2048, 4096])
def test_single_q4_k_rows_give_the_same_bits_at_every_level(k):
    """One row of a Q4_K weight at AVX-512 runs 8 features a pass up to gemm_dot.c's YMM_MAX_K
    inputs and 16 beyond (an 8B model's 4096-input q/k/v, o and gate/up): every level the same
    bits, and near the float product of gguf's own floats (x is rounded to 8 bits)."""
    raw = raw_blocks(T.Q4_K, 40, k, 7)
    w = pack_rows(common_form([decode_rows(raw, int(T.Q4_K), k)]), 40, k, compact=True)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(8))
    outs = []
    for level in levels_here():
        with held_at(level):
            outs.append(cpu_gemm.gemm_blocks(x, w.to_dot()))
    assert all(same_bits(y, outs[0]) for y in outs)
    want = x @ gguf_floats(raw, T.Q4_K, k).T
    assert torch.allclose(outs[0], want, rtol=0.02, atol=0.02 * want.abs().max().item())
