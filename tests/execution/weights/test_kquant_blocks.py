"""GGUF k-quants kept as exact blocks (gguf_blocks, weight_blocks, csrc/gemm_blocks.c, gemm_dot.c):
Q6_K (scales per 16, quants - 32), Q5_K and Q5_1 (5-bit quants with a minimum), and fused weights
whose parts come in different types (a Q4_K_M file's Q4_K q/k beside its Q6_K v), lifted to one
form (common_form). Their blocks give gguf's dequantized weights bit for bit; their GEMMs with
float32 activations are the float product of those weights, with int8 activations the float64
reference of x rounded per 32, the same bits at every instruction-set level; the one-call decode
step reads them as the layers do; and a Q4_K_M-like file runs on them as transformers runs it.

Weights whose parts are all k-quants keep the file's compact scales (KSCALES_FLAG: per strip and
super-block the float16 D, -Dmin and the integer sub-block scales and mins, d and m computed in the
kernels): the same weights, and every GEMM's output bit for bit that of the float32-scale form, at
every level, row count and path; a file loads them so, and a row-parallel shard that cuts a
super-block falls back to float32 scales."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from relay import Engine
from relay.execution import gguf_weights
from relay.execution.block_rows import ALL_ROWS
from relay.execution.gguf_blocks import (
    DECODERS,
    GgufRows,
    RowBlocks,
    SourceTensor,
    common_form,
    decode_rows,
    pack_rows,
)
from relay.execution.gguf_weights import GgufFile, Part, read_blocks
from relay.execution.kernels import cpu_gemm
from relay.execution.layers import pack_for_cpu
from relay.execution.weight_blocks import (
    DOT_FLAG,
    GROUP16_FLAG,
    KSCALES_FLAG,
    MIN_FLAG,
    UNSIGNED_FLAG,
    BlockWeight,
    pack,
    pack_kquant,
    record_bytes,
)
from tests.helpers.block_checks import (
    assert_decode_call_is_the_layers,
    gguf_floats,
    int8_rounded_product,
    raw_blocks,
    same_bits,
)
from tests.helpers.engine_checks import random_prompts
from tests.helpers.gguf_files import VOCAB_SIZE
from tests.helpers.gguf_models import (  # noqa: F401 (q4_k_m_file, q8_0_file: fixtures)
    GREEDY,
    greedy,
    one_call_engine,
    q4_k_m_file,
    q8_0_file,
    transformers_on,
)
from tests.helpers.kernel_helpers import held_at, kernel_level, levels_here  # noqa: F401 (a fixture)

# the fused weights' part types, and the kernel form (BlockWeight.kernel_bits) their rows take
KINDS = {
    "q6_k": ([T.Q6_K], 8 | GROUP16_FLAG),
    "q5_k": ([T.Q5_K], 8 | MIN_FLAG | UNSIGNED_FLAG),
    "q5_1": ([T.Q5_1], 8 | MIN_FLAG | UNSIGNED_FLAG),
    "q4_k+q6_k+q8_0": ([T.Q4_K, T.Q6_K, T.Q8_0], 8 | MIN_FLAG | GROUP16_FLAG),
    "q4_k+q8_0": ([T.Q4_K, T.Q8_0], 8 | MIN_FLAG),
    "q4_k+q5_k": ([T.Q4_K, T.Q5_K], 8 | MIN_FLAG | UNSIGNED_FLAG),
    "q6_k+q8_0": ([T.Q6_K, T.Q8_0], 8 | GROUP16_FLAG),
}


def kind_weight(kind: str, rows: int, k: int, seed: int = 0) -> tuple[BlockWeight, torch.Tensor]:
    """A fused weight of `rows` rows per part of the kind's types: its blocks (decode_rows, then
    common_form, then pack, as a loader calls them) and gguf's floats of the same rows."""
    parts, floats = [], []
    for i, qtype in enumerate(KINDS[kind][0]):
        raw = raw_blocks(qtype, rows, k, seed * 10 + i)
        parts.append(decode_rows(raw, int(qtype), k))
        floats.append(gguf_floats(raw, qtype, k))
    form = common_form(parts)
    n = rows * len(parts)
    return pack(form.bits, form.d, form.m, form.q, n, k, group=form.group), torch.from_numpy(
        np.concatenate(floats)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_give_gguf_weights_bit_for_bit(kind):
    """decode_rows -> common_form -> pack: every weight (signs of zero included) as gguf.quants
    dequantizes it, in the strips' layout and in the dot layout, and the kernel form expected."""
    blocks, w = kind_weight(kind, 40, 512)
    assert blocks.kernel_bits == KINDS[kind][1], hex(blocks.kernel_bits)
    assert blocks.to_dot().kernel_bits == KINDS[kind][1] | DOT_FLAG
    assert same_bits(blocks.dequantize(), w)
    assert same_bits(blocks.to_dot().dequantize(), w)


def test_common_form_lifts_each_part_exactly():
    """All 4-bit parts stay 4-bit; a 4-bit part beside an 8-bit one becomes int8 quants; a part
    with scales per 32 beside a Q6_K one gets each scale (and minimum) twice; the rows come out in
    the parts' order."""
    k = 256
    q4 = [decode_rows(raw_blocks(T.Q4_K, 3, k, s), int(T.Q4_K), k) for s in (1, 2)]
    assert common_form(q4).bits == 4 and common_form(q4).group == 32
    q6 = decode_rows(raw_blocks(T.Q6_K, 2, k, 3), int(T.Q6_K), k)
    both = common_form([q4[0], q6])
    assert (both.bits, both.group, both.q.dtype) == (8, 16, np.int8)
    assert both.d.shape == both.m.shape == (5, k // 16)
    np.testing.assert_array_equal(both.d[:3, 0::2], q4[0].d)
    np.testing.assert_array_equal(both.d[:3, 1::2], q4[0].d)
    np.testing.assert_array_equal(both.m[:3, 1::2], q4[0].m)
    np.testing.assert_array_equal(both.q[:3], q4[0].q)
    np.testing.assert_array_equal(both.d[3:], q6.d)
    assert (both.m[3:] == 0).all() and np.signbit(both.m[3:]).all()  # -0.0: adds nothing, exactly
    with pytest.raises(ValueError):
        common_form([q4[0], decode_rows(raw_blocks(T.Q4_K, 1, 512), int(T.Q4_K), 512)])


def test_fused_rows_of_three_types_are_found_in_the_file():
    """A Q4_K_M-like fused q/k/v: Q4_K q (rows reversed, as conversion permutes them), Q6_K k in
    another order, Q8_0 v: found by their hashes, lifted to one form, equal to the weight."""
    k = 512
    q, kk, v = (
        SourceTensor(raw_blocks(t, 48, k, s), int(t), k)
        for t, s in ((T.Q4_K, 1), (T.Q6_K, 2), (T.Q8_0, 3))
    )
    floats = [torch.from_numpy(gguf_floats(t.raw, T(t.qtype), k)) for t in (q, kk, v)]
    fused = torch.cat([floats[0].flip(0), floats[1][torch.randperm(48)], floats[2]])
    blocks = GgufRows.of([q, kk, v]).blocks_for(fused)
    assert blocks is not None and (blocks.bits, blocks.group, blocks.has_m) == (8, 16, True)
    assert same_bits(blocks.dequantize(), fused)


def test_a_saved_index_from_before_these_types_is_rebuilt(tmp_path):
    """An index saved before Q6_K, Q5_K and Q5_1 were decoded lists none of their tensors:
    GgufRows.index_is_current says so (model_files.gguf_rows then indexes the file again)."""
    t = SourceTensor(raw_blocks(T.Q6_K, 8, 256), int(T.Q6_K), 256)
    rows = GgufRows.of([t])
    index = dict(table=np.zeros((0, 4), np.int64), hashes=rows.hashes, owners=rows.owners)
    assert not GgufRows.index_is_current(index)
    index["qtypes"] = np.array(sorted(DECODERS), dtype=np.int64)
    assert GgufRows.index_is_current(index)


@pytest.fixture(scope="module")
def weights() -> dict:
    """Each kind's blocks and floats at two shapes: rows past a strip's end (200 = 6 strips + 8),
    and a longer K."""
    return {
        (kind, shape): kind_weight(kind, *shape, seed=1)
        for kind in KINDS
        for shape in ((200 // len(KINDS[kind][0]), 256), (40, 768))
    }


def shapes_of(kind: str) -> list[tuple[int, int]]:
    return [(200 // len(KINDS[kind][0]), 256), (40, 768)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 4, 6, 9, 33])
def test_float_gemm_on_the_new_forms_matches_the_float_weights(kernel_level, weights, kind, m):
    """relay_gemm_blocks with float32 x: the GEMV (up to 6 rows, sums per group of 16 or 32) and
    the unpacked tiles (d * q + m per weight) both the float product of the exact weights."""
    for shape in shapes_of(kind):
        blocks, w = weights[kind, shape]
        x = torch.randn(m, w.shape[1] + 5)[:, : w.shape[1]]  # strided rows
        torch.testing.assert_close(cpu_gemm.gemm_blocks(x, blocks), x @ w.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_a_bfloat16_models_new_forms_keep_float32_activations(kernel_level, weights, kind):
    """round_bf16 (a bfloat16 model's blocks): the VDPBF16PS kernels take Q4_1's and Q8_0's forms
    only, so these forms' GEMMs stay float32 products at every level and row count."""
    blocks, w = weights[kind, shapes_of(kind)[0]]
    rounded = replace(blocks, round_bf16=True)
    for m in (1, 2, 7, 13):
        x = torch.randn(m, w.shape[1])
        assert torch.equal(cpu_gemm.gemm_blocks(x, rounded), cpu_gemm.gemm_blocks(x, blocks))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 2, 6, 7, 13, 33])
def test_int8_activations_on_the_new_forms_are_x_rounded_times_the_exact_weights(
    kernel_level, weights, kind, m
):
    """relay_gemm_dot: x rounded to 8 bits per 32, integer sums per group of 16 or 32, d * dx per
    group, + m times x's exact sums over the group: the float64 reference of that rounding; and a
    row's output does not depend on the rows beside it."""
    for shape in shapes_of(kind):
        blocks, w = weights[kind, shape]
        dot = blocks.to_dot()
        x = torch.randn(m, w.shape[1] + 5)[:, : w.shape[1]] * torch.linspace(0.1, 3.0, w.shape[1])
        x[0, :32] = 0.0  # an all-zero block of x (scale 0)
        y = cpu_gemm.gemm_blocks(x, dot)
        torch.testing.assert_close(y.double(), int8_rounded_product(x, dot), atol=1e-5, rtol=1e-5)
        assert torch.equal(y[-1:], cpu_gemm.gemm_blocks(x[-1:], dot))


@pytest.mark.parametrize("kind", KINDS)
def test_int8_activations_give_the_same_bits_at_every_level(weights, kind):
    """Integer sums are exact and the float steps per group (and x's sums per 16 or 32, in one
    fixed order) the same at every width: a server's output does not depend on its level."""
    blocks, w = weights[kind, (40, 768)]
    dot = blocks.to_dot()
    outputs = {}
    for m in (1, 40):
        x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m)) * 3
        for level in levels_here():
            with held_at(level):
                outputs[level, m] = cpu_gemm.gemm_blocks(x, dot)
        first = outputs[levels_here()[0], m]
        for level in levels_here():
            assert torch.equal(outputs[level, m], first), f"{level} differs at {m} rows"


def test_the_unsigned_hint_changes_no_bit(kernel_level, weights):
    """UNSIGNED_FLAG only picks how Q5_K-range quants are multiplied (as unsigned bytes; without
    VNNI four units summed in 16 bits): the same blocks taken the signed way give the same bits."""
    blocks, w = weights["q5_k", (40, 768)]
    assert blocks.q_unsigned
    signed = replace(blocks.to_dot(), q_unsigned=False)
    for m in (1, 7, 33):
        x = torch.randn(m, w.shape[1]) * 2
        assert torch.equal(
            cpu_gemm.gemm_blocks(x, blocks.to_dot()), cpu_gemm.gemm_blocks(x, signed)
        )


@pytest.mark.parametrize("kind,q_value", [("q5_k", 31), ("q6_k", -32), ("q6_k+q8_0", -127)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int8_activations_at_the_largest_sums_the_new_forms_make(kernel_level, kind, q_value, sign):
    """Every quant at its extreme times x at +-127 in every position: the integer sums at their
    largest (without VNNI, 5-bit quants' four units of VPMADDUBSW pairs in 16 bits: 31,496) are
    still exact."""
    n, k = 48, 256
    d = np.full((n, k // 32), 2.0**-10, np.float32)
    group = 16 if "q6_k" in kind else 32
    d = np.repeat(d, 32 // group, axis=1)
    m = np.full_like(d, -0.25) if kind == "q5_k" else np.full_like(d, -0.0)
    q = np.full((n, k), q_value, np.int8)
    blocks = pack(8, d, m, q, n, k, group=group).to_dot()
    x = torch.full((7, k), sign)
    torch.testing.assert_close(
        cpu_gemm.gemm_blocks(x, blocks).double(),
        int8_rounded_product(x, blocks),
        atol=1e-4,
        rtol=1e-6,
    )


# --- the one-call decode step on layers whose GEMMs are in the new forms ---


def synthetic_rows(kind: str, n: int, k: int, rng: np.random.Generator) -> RowBlocks:
    """n rows of one type's kernel form with random quants and float16 scales, for shapes no
    k-quant super-block fits (a tiny model's K = 64)."""

    def f16(lo: float, hi: float, cols: int) -> np.ndarray:
        return rng.uniform(lo, hi, (n, cols)).astype(np.float16).astype(np.float32)

    minus0 = np.full((n, k // 32), -0.0, np.float32)
    if kind == "q4_k":
        return RowBlocks(
            4,
            f16(0.005, 0.02, k // 32),
            f16(-0.1, 0, k // 32),
            rng.integers(0, 16, (n, k)).astype(np.uint8),
        )
    if kind == "q5_k":
        return RowBlocks(
            8,
            f16(0.003, 0.01, k // 32),
            f16(-0.1, 0, k // 32),
            rng.integers(0, 32, (n, k)).astype(np.int8),
        )
    if kind == "q8_0":
        return RowBlocks(
            8, f16(5e-4, 1e-3, k // 32), minus0, rng.integers(-127, 128, (n, k)).astype(np.int8)
        )
    d = f16(-0.005, 0.005, k // 16)  # Q6_K: scales per 16, of either sign
    return RowBlocks(8, d, np.full_like(d, -0.0), rng.integers(-32, 32, (n, k)).astype(np.int8), 16)


@pytest.mark.parametrize("six_bits", [False, True])
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_a_decode_step_in_one_c_call_reads_the_new_forms_as_the_layers_do(
    q8_0_file, kernel_level, activations, six_bits
):
    """A Qwen3 decode step of three requests in one C call (relay_decode_layers, each GEMM's form
    in LayerGemm.bits as it is) with every layer's GEMMs in a new form - q/k/v fused from 4-bit,
    4-bit and Q6_K rows (8-bit, scales per 16, minima), o Q6_K, gate/up Q5_K (5-bit with minima),
    down mixed Q4_K/Q8_0 (8-bit with minima, signed) - gives the layers' logits and KV bit for bit,
    with float32 and with int8 activations, at each instruction-set level; and with the forms
    whose quants fit narrowed to 6 bits (all but down's)."""
    runner = one_call_engine(q8_0_file("qwen3")).runner
    rng = np.random.default_rng(0)
    a0 = runner.model.layers[0].self_attn
    q_rows, kv_rows = a0.num_heads * a0.head_dim, a0.num_kv_heads * a0.head_dim
    forms = set()
    for layer in runner.model.layers:
        inter = layer.mlp.down_proj.weight.shape[1]
        plan = {
            layer.self_attn.qkv_proj: [("q4_k", q_rows), ("q4_k", kv_rows), ("q6_k", kv_rows)],
            layer.self_attn.o_proj: [("q6_k", layer.self_attn.o_proj.weight.shape[0])],
            layer.mlp.gate_up_proj: [("q5_k", inter), ("q5_k", inter)],
            layer.mlp.down_proj: [("q4_k", 32), ("q8_0", layer.mlp.down_proj.weight.shape[0] - 32)],
        }
        for module, parts in plan.items():
            n, k = module.weight.shape
            rows = common_form([synthetic_rows(kind, r, k, rng) for kind, r in parts])
            blocks = pack(rows.bits, rows.d, rows.m, rows.q, n, k, group=rows.group)
            if six_bits and module is not layer.mlp.down_proj:
                blocks = blocks.to_six_bits()
            blocks.max_rows = module.blocks.max_rows
            module.weight.data = blocks.dequantize()
            module.packed = pack_for_cpu(module.weight)
            module.blocks = blocks.to_dot() if activations == "int8" else blocks
            forms.add(blocks.kernel_bits)
    bits = 6 if six_bits else 8
    assert forms == {
        bits | MIN_FLAG | GROUP16_FLAG,
        bits | GROUP16_FLAG,
        bits | MIN_FLAG | (0 if six_bits else UNSIGNED_FLAG),
        8 | MIN_FLAG,
    }
    assert runner.model.use_decode_layers(runner.attn)
    fast = runner.model.decode_layers
    assert_decode_call_is_the_layers(runner, fast)


# --- compact k-quant scales (KSCALES_FLAG) ---

KS = KSCALES_FLAG
# all-k-quant weights: their compact kernel form, and the bits a weight it reads
COMPACT = {
    "q4_k": ([T.Q4_K], 4 | KS, 4.625),
    "q5_k": ([T.Q5_K], 8 | MIN_FLAG | UNSIGNED_FLAG | KS, 8.625),
    "q6_k": ([T.Q6_K], 8 | GROUP16_FLAG | KS, 8.5625),
    "q4_k+q6_k": ([T.Q4_K, T.Q4_K, T.Q6_K], 8 | MIN_FLAG | GROUP16_FLAG | KS, 9.125),
    "q4_k+q5_k": ([T.Q4_K, T.Q5_K], 8 | MIN_FLAG | UNSIGNED_FLAG | KS, 8.625),
}


def compact_pair(kind: str, rows: int, k: int, seed: int = 0, **mutate):
    """A weight of the kind's types (rows per part) packed both ways from the same decoded rows -
    float32 d and m (today's form) and compact - and gguf's floats of it. mutate: fields of the
    common form replaced before the compact packing (a mutation the tests must catch)."""
    parts, floats = [], []
    for i, qtype in enumerate(COMPACT[kind][0]):
        raw = raw_blocks(qtype, rows, k, seed * 10 + i)
        parts.append(decode_rows(raw, int(qtype), k))
        floats.append(gguf_floats(raw, qtype, k))
    form = common_form(parts)
    n = rows * len(parts)
    old = pack_rows(form, n, k, compact=False)
    new = pack_rows(replace(form, **mutate), n, k, has_m=old.has_m)
    return old, new, torch.from_numpy(np.concatenate(floats))


@pytest.fixture(scope="module")
def compact_weights() -> dict:
    """Each kind at two shapes: rows past a strip's end, K one super-block; and K of three."""
    return {
        (kind, k): compact_pair(kind, 200 // len(COMPACT[kind][0]), k, seed=2)
        for kind in COMPACT
        for k in (256, 768)
    }


@pytest.mark.parametrize("kind", COMPACT)
def test_compact_scales_are_the_gguf_weights_in_fewer_bytes(kind):
    """decode_rows -> common_form -> pack_rows keeps the integer scales of all-k-quant weights:
    the kernel form gets KSCALES_FLAG, the records read 0.5625-1.125 bits a weight (Q4_K 4.625
    in all where the float32 scales made it 6, Q6_K 8.5625 for 10: D and -Dmin as float16, 2 bytes
    per feature each, csrc/blocks.h), dequantize() gives every weight
    as gguf.quants does (signs of zero included) in both layouts, and with_float_scales() is the
    float32-scale form exactly."""
    old, new, w = compact_pair(kind, 40, 512)
    assert new.kernel_bits == COMPACT[kind][1] and new.kscales, hex(new.kernel_bits)
    assert new.to_dot().kernel_bits == COMPACT[kind][1] | DOT_FLAG
    assert old.kernel_bits == COMPACT[kind][1] & ~KS
    assert new.bytes_per_weight * 8 == COMPACT[kind][2]
    subs = 256 // new.group  # a record: float16 D (and -Dmin), int8 scales (and mins) per feature
    assert new.d.shape[2] == record_bytes(new.group, new.has_m) == (1 + new.has_m) * (2 + subs) * 32
    assert new.d.dtype == torch.uint8 and new.m.numel() == 0
    for blocks in (new, new.to_dot()):
        assert same_bits(blocks.dequantize(), w)
    back = new.with_float_scales()
    assert same_bits(back.d, old.d) and same_bits(back.m, old.m) and torch.equal(back.q, old.q)


@pytest.mark.parametrize("types", [[T.Q4_K, T.Q8_0], [T.Q4_K, T.Q6_K, T.Q8_0], [T.Q5_1]])
def test_a_part_that_is_no_k_quant_keeps_float32_scales(types):
    """A fused weight with a part of another type (Q8_0 beside Q4_K, ...) carries no integer
    scales through common_form: it packs in today's form (float32 d and m)."""
    k = 256
    parts = [decode_rows(raw_blocks(t, 8, k, i), int(t), k) for i, t in enumerate(types)]
    rows = common_form(parts)
    assert not rows.kquant
    blocks = pack_rows(rows, 8 * len(types), k)
    assert not blocks.kscales and not blocks.kernel_bits & KS and blocks.d.dtype == torch.float32


@pytest.mark.parametrize("kind", COMPACT)
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_compact_gemms_equal_the_float32_scale_forms_bit_for_bit(
    kernel_level, compact_weights, kind, activations
):
    """The same weight packed both ways, the same x: identical outputs at every row count from 1
    to 33 - the GEMVs (up to 6 rows; int8: row groups of up to 6 or 8) and the unpacked tiles
    beyond - with float32 and with int8 activations, a short last strip and K of 1 and 3
    super-blocks, at each instruction-set level."""
    for k in (256, 768):
        old, new, _ = compact_weights[kind, k]
        if activations == "int8":
            old, new = old.to_dot(), new.to_dot()
        for m in range(1, 34):
            x = torch.randn(m, k + 3, generator=torch.Generator().manual_seed(m))[:, :k] * 2
            y = cpu_gemm.gemm_blocks(x, new)
            assert same_bits(y, cpu_gemm.gemm_blocks(x, old)), f"{m} rows, K {k}"


def test_compact_q4_k_of_a_bfloat16_model_equals_its_float32_scale_form(
    kernel_level, compact_weights
):
    """round_bf16 (Q4_K's blocks of a bfloat16 model: VDPBF16PS where the CPU has AVX512-BF16,
    GEMVs up to 6 rows at a time and qbuf tiles beyond): the compact scales give the same bits."""
    old, new, _ = compact_weights["q4_k", 768]
    old, new = replace(old, round_bf16=True), replace(new, round_bf16=True)
    for m in range(1, 34):
        x = torch.randn(m, 768, generator=torch.Generator().manual_seed(m))
        assert same_bits(cpu_gemm.gemm_blocks(x, new), cpu_gemm.gemm_blocks(x, old)), m


def shifted(t: np.ndarray, per: int) -> np.ndarray:
    """Each super-block's sub-block values (per of them) taken from the next sub-block along."""
    r, cols = t.shape
    return np.roll(t.reshape(r, cols // per, per), -1, axis=2).reshape(r, cols)


@pytest.mark.parametrize(
    "kind,field",
    [
        ("q4_k", "sub_scales"),
        ("q6_k", "sub_scales"),
        ("q5_k", "sub_mins"),
        ("q4_k+q6_k", "super_d"),
    ],
)
def test_a_record_read_one_sub_block_off_is_caught(kernel_level, kind, field):
    """Mutations the bit-for-bit checks must catch: each sub-block given its neighbour's scale (or
    min), or a super-block its neighbour's D, makes the compact weights and every path's outputs
    differ from the float32-scale form's."""
    k = 512
    old, good, w = compact_pair(kind, 16, k)
    rows = common_form(
        [decode_rows(raw_blocks(t, 16, k, i), int(t), k) for i, t in enumerate(COMPACT[kind][0])]
    )
    per = 256 // rows.group if field.startswith("sub") else k // 256
    _, bad, _ = compact_pair(kind, 16, k, **{field: shifted(getattr(rows, field), per)})
    assert same_bits(good.dequantize(), w) and not same_bits(bad.dequantize(), w)
    x = torch.randn(9, k)
    for m in (1, 9):
        for a, b in ((old, bad), (old.to_dot(), bad.to_dot())):
            assert not same_bits(cpu_gemm.gemm_blocks(x[:m], a), cpu_gemm.gemm_blocks(x[:m], b))


def test_pack_kquant_without_mins_in_a_form_with_them_adds_minus_zero():
    """A Q6_K-only chunk of a weight whose form has a minimum (rows of a fused Q4_K/Q6_K q/k/v
    read a chunk at a time): Dmin 0 and mins 0 give m = -0.0, common_form's m for such rows."""
    k = 256
    rows = decode_rows(raw_blocks(T.Q6_K, 8, k), int(T.Q6_K), k)
    blocks = pack_kquant(8, rows.super_d, None, rows.sub_scales, None, rows.q, 8, k, 16, True)
    d, m = blocks.float_scales()
    m = m[:, :, :8]  # (the strip's 24 rows of padding aside)
    assert blocks.has_m and (m == 0).all() and torch.signbit(m).all()
    assert same_bits(
        blocks.dequantize(), torch.from_numpy(gguf_floats(raw_blocks(T.Q6_K, 8, k), T.Q6_K, k))
    )


def test_pack_kquant_refuses_a_super_scale_float16_cannot_hold():
    """The records hold D and -Dmin as float16 (the file's own): a float32 one that float16 does not
    hold exactly is refused, not rounded."""
    k = 256
    rows = decode_rows(raw_blocks(T.Q4_K, 8, k), int(T.Q4_K), k)
    args = (rows.sub_scales, rows.sub_mins, rows.q, 8, k)
    pack_kquant(4, rows.super_d, rows.super_dmin, *args)  # the file's values: exact
    bad = np.array(rows.super_d, dtype=np.float32, copy=True)
    bad.flat[3] = np.float32(1.0 + 2.0**-12)  # between two float16 values
    with pytest.raises(ValueError, match="float16"):
        pack_kquant(4, bad, rows.super_dmin, *args)


# --- a Q4_K_M-like file, loaded on its compact blocks ---


# (8-bit quants in -32..31 narrowed to 6 bits: gguf_weights.SIX_BIT_QUANTS)
LAYER_FORMS = [
    6 | MIN_FLAG | GROUP16_FLAG | KS,  # q/k/v: Q4_K, Q4_K, Q6_K
    4 | KS,  # o: Q4_K
    6 | MIN_FLAG | KS,  # gate/up: Q5_K
    6 | GROUP16_FLAG | KS,  # down: Q6_K
]


def test_a_q4_k_m_like_file_runs_on_its_blocks_as_transformers_runs_it(q4_k_m_file):
    """Every GEMM weight of the file is kept as blocks with the file's compact scales - q/k/v
    fused from Q4_K and Q6_K rows in the mixed form, the Q6_K and Q5_K ones in 6 bits - and the
    GEMMs reading them (float32 activations) give transformers' greedy output token for token."""
    path, cfg = q4_k_m_file
    prompts = random_prompts(VOCAB_SIZE, [3, 17, 40])
    expected = greedy(transformers_on(path, "llama"), prompts)
    engine = Engine(
        path,
        dtype="float32",
        kv_cache_gb=0.01,
        block_activations="float",
        weight_block_rows=ALL_ROWS,
    )
    forms = [m.blocks and m.blocks.kernel_bits for m in engine.runner.model.gemm_modules()]
    assert forms == LAYER_FORMS * cfg.num_hidden_layers + [6 | GROUP16_FLAG | KS], forms
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_a_decode_step_in_one_c_call_reads_compact_scales_as_the_layers_do(
    q4_k_m_file, kernel_level, activations
):
    """The Q4_K_M-like file's decode step of three requests in one C call (relay_decode_layers:
    every GEMM's LayerGemm.bits with KSCALES_FLAG, its d the records) gives the layers' logits and
    KV bit for bit, with float32 and with int8 activations, at each instruction-set level."""
    runner = one_call_engine(q4_k_m_file[0]).runner
    layer_gemms = [m for m in runner.model.gemm_modules() if m.blocks is not None][:-1]
    assert [m.blocks.kernel_bits for m in layer_gemms[:4]] == LAYER_FORMS
    if activations == "int8":
        for module in layer_gemms:
            module.blocks = module.blocks.to_dot()
        assert runner.model.use_decode_layers(runner.attn)
    fast = runner.model.decode_layers
    assert_decode_call_is_the_layers(runner, fast)


@pytest.mark.parametrize(
    "tensor,cols,compact",
    [
        ("attn_output", slice(0, 256), True),  # the whole row
        ("attn_output", slice(128, 256), False),  # half a super-block: --tp 2 of K 256
        ("ffn_down", slice(256, 512), True),  # --tp 2 of K 512: whole super-blocks
        ("ffn_down", slice(0, 128), False),
        ("ffn_down", slice(96, 480), False),  # (whole groups of 32 only)
    ],
)
def test_a_row_parallel_shard_that_cuts_a_super_block_keeps_float32_scales(
    q4_k_m_file, tensor, cols, compact
):
    """read_blocks on a row-parallel shard's columns: whole super-blocks keep the compact scales,
    a cut one falls back to float32 d and m; either way the blocks are gguf's weights of those
    columns bit for bit, and both forms' GEMMs agree."""
    file = GgufFile.read(q4_k_m_file[0])
    name = f"blk.0.{tensor}.weight"
    n = file.tensors[name].shape[0]
    blocks = read_blocks(file, [Part(name, np.arange(n), cols)], dot=False)
    assert blocks is not None and blocks.kscales == compact
    assert same_bits(blocks.dequantize(), file.floats(name)[:, cols].contiguous())
    x = torch.randn(3, cols.stop - cols.start)
    y = cpu_gemm.gemm_blocks(x, blocks)
    assert same_bits(y, cpu_gemm.gemm_blocks(x, blocks.with_float_scales()))


def test_compact_scales_can_be_turned_off_for_a_load(q4_k_m_file, monkeypatch):
    """gguf_weights.COMPACT_SCALES False (a benchmark's "before"): the same file's weights in the
    float32-scale forms, giving the same GEMM outputs."""
    file = GgufFile.read(q4_k_m_file[0])
    parts = [
        Part(f"blk.1.{t}.weight", np.arange(256 if t != "attn_v" else 128))
        for t in ("attn_q", "attn_v")
    ]
    compact = read_blocks(file, parts, dot=True)
    monkeypatch.setattr(gguf_weights, "COMPACT_SCALES", False)
    floats = read_blocks(file, parts, dot=True)
    assert compact.kscales and not floats.kscales
    assert compact.kernel_bits == floats.kernel_bits | KS
    x = torch.randn(5, 256)
    assert same_bits(cpu_gemm.gemm_blocks(x, compact), cpu_gemm.gemm_blocks(x, floats))
