"""GGUF blocks recovered from dequantized float32 weights, and the GEMM that reads them."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from relay.execution import layers, weight_blocks
from relay.execution.kernels import cpu, cpu_gemm, cpu_layers, isa
from relay.execution.layers import Linear, pack_for_cpu
from relay.execution.model_runner import ModelRunner
from relay.execution.weight_blocks import recover
from tests.helpers.block_checks import (
    blocks_or_skip,
    gguf_q8_0,
    int8_rounded_product,
    step_each_way,
)
from tests.helpers.kernel_helpers import (  # noqa: F401 (kernel_level: a fixture)
    held_at,
    kernel_level,
    levels_here,
)


def gguf_q4_1(w: np.ndarray) -> np.ndarray:
    """w [N, K] quantized to Q4_1 as ggml does and dequantized as gguf-py does (float32)."""
    b = w.reshape(-1, 32).astype(np.float32)
    lo, hi = b.min(1), b.max(1)
    d = (hi - lo) / 15
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.minimum(15, ((b - lo[:, None]) * inv[:, None] + 0.5).astype(np.int8)).astype(np.float32)
    d16, m16 = d.astype(np.float16).astype(np.float32), lo.astype(np.float16).astype(np.float32)
    return ((d16[:, None] * q) + m16[:, None]).reshape(w.shape)


def weight(n: int, k: int, kind: str, seed: int = 0) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    w[0, :32] = 0.25  # a constant block (d = 0)
    return torch.from_numpy({"q4_1": gguf_q4_1, "q8_0": gguf_q8_0, "dense": lambda a: a}[kind](w))


@pytest.mark.parametrize("chunk", [7, 1 << 20])
@pytest.mark.parametrize("kind,bits", [("q4_1", 4), ("q8_0", 8)])
def test_blocks_come_back_bit_for_bit(kind, bits, chunk, monkeypatch):
    monkeypatch.setattr(weight_blocks, "CHUNK_BLOCKS", chunk)  # a large weight is fitted in parts
    w = weight(70, 96, kind)
    blocks = recover(w)
    assert blocks is not None and blocks.bits == bits
    assert torch.equal(blocks.dequantize(), w)


def test_weights_that_are_not_blocks_stay_float(monkeypatch):
    assert recover(weight(64, 64, "dense")) is None
    w = weight(64, 64, "q4_1")
    w[40, 7] = torch.nextafter(w[40, 7], torch.tensor(1.0))  # one weight one ulp off its block
    assert recover(w) is None
    monkeypatch.setattr(weight_blocks, "CHUNK_BLOCKS", 5)
    assert recover(w) is None, "a bad block in a later part fails the whole weight"
    assert recover(weight(64, 48, "q4_1")[:, :40]) is None  # not whole blocks
    assert recover(weight(64, 64, "q4_1").bfloat16()) is None


@pytest.fixture
def lib(kernel_level):
    """The block GEMM at each instruction-set level this CPU reaches."""
    return cpu.load()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 3, 6, 8, 9, 33, 190])
@pytest.mark.parametrize("n,k", [(200, 96), (64, 576), (40, 160)])
def test_gemm_on_blocks_matches_the_float_weights(lib, kind, m, n, k):
    w = weight(n, k, kind, seed=m)
    blocks = recover(w)
    x = torch.randn(m, k + 5)[:, :k]  # strided rows
    y = cpu_gemm.gemm_blocks(x, blocks)
    torch.testing.assert_close(y, x @ w.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 2, 7, 13, 40])
@pytest.mark.parametrize("n,k", [(200, 96), (40, 160), (64, 576)])
def test_a_bfloat16_models_blocks_multiply_rounded_activations_by_exact_weights(
    lib, kernel_level, kind, m, n, k
):
    """Blocks that stand for a bfloat16 model's weights (round_bf16): their GEMMs (Q8_0's of two
    rows or more) round the activations to bfloat16, as the model's own GEMMs do, where the CPU has
    bfloat16 dot products, and multiply them by the exact weights (float32 accumulation); one row
    of Q8_0, or a CPU without them, keeps float32 activations."""
    w = weight(n, k, kind, seed=m)
    blocks = recover(w)
    blocks.round_bf16 = True
    x = torch.randn(m, k + 5)[:, :k]
    rounded = (m > 1 or kind == "q4_1") and isa.at_least("avx512bf16", kernel_level)
    expect = (x.bfloat16() if rounded else x).double() @ w.double().T
    torch.testing.assert_close(
        cpu_gemm.gemm_blocks(x, blocks).double(), expect, atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_bfloat16_models_row_comes_out_the_same_whatever_rows_come_with_it(
    lib, kernel_level, kind
):
    """A decode step's rows (one per request) through a bfloat16 model's blocks: each row's output
    is the same bit for bit alone, in a small batch and in a large one (Q8_0 from two rows on: one
    row keeps float32 activations there), so a request's greedy output does not depend on how many
    others share its steps."""
    if not isa.at_least("avx512bf16", kernel_level):
        pytest.skip("float32 activations here: few rows and many take differently ordered sums")
    w = weight(200, 96, kind, seed=7)
    blocks = recover(w)
    blocks.round_bf16 = True
    x = torch.randn(40, 96)
    first_batched = 2 if kind == "q8_0" else 1
    alone = cpu_gemm.gemm_blocks(x[:first_batched], blocks)
    for rows in (3, 6, 7, 13, 40):
        assert torch.equal(cpu_gemm.gemm_blocks(x[:rows], blocks)[:first_batched], alone), rows


@pytest.mark.slow
def test_the_default_model_runs_on_its_gguf_blocks(default_model_dir):
    """SmolLM2 ships as Q4_1 (its embedding Q8_0): in float32 every GEMM finds its blocks, and
    greedy output equals transformers' (test_engine) with them."""
    blocks_or_skip()
    from relay.config import EngineConfig, ModelConfig

    runner = ModelRunner(
        EngineConfig(dtype="float32", kv_cache_gb=0.05),
        default_model_dir,
        ModelConfig.from_dir(default_model_dir),
    )
    modules = runner.model.gemm_modules()
    assert all(mod.blocks is not None for mod in modules)
    assert {mod.blocks.bits for mod in modules} == {4, 8}
    off = ModelRunner(
        EngineConfig(dtype="float32", kv_cache_gb=0.05, disable_weight_blocks=True),
        default_model_dir,
        ModelConfig.from_dir(default_model_dir),
    )
    assert all(mod.blocks is None for mod in off.model.gemm_modules())


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16"])
def test_decode_steps_in_one_c_call_equal_the_layer_by_layer_path(default_model_dir, kv_dtype):
    """A pure decode step of the default model runs its 30 layers in one C call; its logits and
    the keys and values it writes are bit for bit those of the layers called one by one, over
    a shared prefix (cascade attention) and requests of different lengths, with a float32 or a
    bfloat16 KV cache."""
    blocks_or_skip()
    from relay.config import EngineConfig, ModelConfig
    from relay.step import BatchInput

    runner = ModelRunner(
        EngineConfig(dtype="float32", kv_cache_dtype=kv_dtype, kv_cache_gb=0.05),
        default_model_dir,
        ModelConfig.from_dir(default_model_dir),
    )
    fast = runner.model.decode_layers
    assert fast is not None
    ids = torch.randint(100, 40000, (3, 100), generator=torch.Generator().manual_seed(0)).tolist()
    ids[1][:80] = ids[0][:80]  # request 1 shares request 0's first five pages
    tables = [list(range(1, 7)), list(range(1, 6)) + [7, 8], list(range(9, 16))]
    for i, (prefix, n) in enumerate([(0, 90), (80, 20), (0, 100)]):
        runner.step_logits(
            BatchInput(
                0, [i], ids[i][prefix : prefix + n], [prefix], [n], [0], [tables[i]], [True], [0]
            ),
            [tables[i]],
        )
    step = BatchInput(
        0, [0, 1, 2], [5, 6, 7], [90, 100, 100], [1, 1, 1], [0] * 3, [[]] * 3, [True] * 3, [1] * 3
    )
    kv = [t.clone() for t in runner.kv.k + runner.kv.v]
    results = step_each_way(runner, step, tables, (fast, None))
    assert runner.attn.dec_plan.num_groups == 1  # the shared prefix was attended as a cascade
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    assert not all(torch.equal(a, b) for a, b in zip(results[0][1], kv))  # the step wrote its keys


@pytest.mark.slow
def test_a_decode_step_in_one_c_call_applies_each_layers_window_and_the_cap(default_model_dir):
    """The default model given a sliding window of 40 tokens on every other layer and soft-capped
    scores (as a Mistral- or Gemma-shaped GGUF would be): its decode steps still run in one C call,
    whose logits and keys and values are bit for bit the layers' called one by one over the same
    windows and cap, and differ from the same step attending the whole context."""
    blocks_or_skip()
    from relay.config import EngineConfig, ModelConfig
    from relay.step import BatchInput

    mc = ModelConfig.from_dir(default_model_dir)
    mc.layer_windows = [40 if i % 2 == 0 else None for i in range(mc.num_layers)]
    mc.attn_logit_softcap = 5.0
    runner = ModelRunner(EngineConfig(dtype="float32", kv_cache_gb=0.05), default_model_dir, mc)
    fast = runner.model.decode_layers
    assert fast is not None and fast[1].windows is not None and fast[1].softcap == 5.0
    ids = torch.randint(100, 40000, (2, 100), generator=torch.Generator().manual_seed(3)).tolist()
    tables = [list(range(1, 8)), list(range(8, 15))]
    for i, n in enumerate((90, 100)):
        runner.step_logits(
            BatchInput(0, [i], ids[i][:n], [0], [n], [0], [tables[i]], [True], [0]), [tables[i]]
        )
    step = BatchInput(0, [0, 1], [5, 6], [90, 100], [1, 1], [0] * 2, [[]] * 2, [True] * 2, [1] * 2)
    (call, kv_call), (layered, kv_layered) = step_each_way(runner, step, tables, (fast, None))
    assert torch.equal(call, layered)
    assert all(torch.equal(a, b) for a, b in zip(kv_call, kv_layered))
    fast[1].windows, fast[1].softcap = None, 0.0  # the call attending everything, uncapped
    ((whole, _),) = step_each_way(runner, step, tables, (fast,))
    assert (whole - call).abs().max() > 1e-3 * call.abs().max()


@pytest.mark.slow
def test_a_bfloat16_decode_step_in_one_c_call_reads_the_layers_panels(default_model_dir):
    """Where bfloat16 GEMMs run on Relay's panels (AVX512-BF16, no AMX), the one-call decode step
    reads the same panels past the blocks' rows, so it takes every batch size without timing it,
    and its logits match the layers called one by one (float32 activations against bfloat16
    ones: close, not equal)."""
    blocks_or_skip()
    if not cpu_gemm.panels_preferred():
        pytest.skip("bfloat16 GEMMs run on oneDNN here")
    from relay.config import EngineConfig, ModelConfig
    from relay.step import BatchInput

    runner = ModelRunner(
        # (float activations: the float GEMMs win past the blocks' few rows, so the weights
        # keep bfloat16 panels beside their blocks)
        EngineConfig(dtype="bfloat16", kv_cache_gb=0.05, block_activations="float"),
        default_model_dir,
        ModelConfig.from_dir(default_model_dir),
    )
    assert runner.model.decode_layers[1].on_panels and runner.model.decode_layers[1].max_rows > 1024
    runner.model.limit_weight_blocks(0)  # every GEMM on the panels, in both paths
    assert runner.model.use_decode_layers(runner.attn)
    fast = runner.model.decode_layers
    ids = torch.randint(100, 40000, (3, 40), generator=torch.Generator().manual_seed(1)).tolist()
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    for i in range(3):
        runner.step_logits(
            BatchInput(0, [i], ids[i], [0], [40], [0], [tables[i]], [True], [0]), [tables[i]]
        )
    step = BatchInput(
        0, [0, 1, 2], [5, 6, 7], [40] * 3, [1] * 3, [0] * 3, [[]] * 3, [True] * 3, [1] * 3
    )
    (call, _), (layered, _) = step_each_way(runner, step, tables, (fast, None))
    assert (call - layered).abs().max() < 0.05 * layered.abs().max()
    for m in runner.model.gemm_modules():  # what the C call read were the panels
        if isinstance(m.packed, cpu_gemm.Bf16Panels):
            m.packed.data.zero_()
    ((zeroed, _),) = step_each_way(runner, step, tables, (fast,))
    assert (zeroed - call).abs().max() > 0.5 * call.abs().max()


@pytest.mark.slow
def test_steps_with_prompt_chunks_in_one_c_call_equal_the_layer_by_layer_path(
    default_model_dir, monkeypatch
):
    """Where a bfloat16 model's GEMMs run on Relay's panels, a step with prompt chunks runs its 30
    layers in one C call: a whole prompt, and a step mixing decodes (two of them sharing a cached
    prefix: cascade attention) with a chunk over a cached prefix and a new prompt give the logits
    of every row and the keys and values of the layers called one by one, bit for bit."""
    blocks_or_skip()
    if not cpu_gemm.panels_preferred():
        pytest.skip("bfloat16 GEMMs run on oneDNN here")
    from relay.config import EngineConfig, ModelConfig
    from relay.step import BatchInput

    runner = ModelRunner(
        # (float activations: the float GEMMs win past the blocks' few rows, so the weights
        # keep bfloat16 panels beside their blocks)
        EngineConfig(dtype="bfloat16", kv_cache_gb=0.05, block_activations="float"),
        default_model_dir,
        ModelConfig.from_dir(default_model_dir),
    )
    # the LM head picks its kernel by row count too (its blocks up to the crossover measured at
    # start-up): keep it on the panels, so that the rows kept below meet the same kernels
    runner.model.limit_weight_blocks(0)
    fast = runner.model.prompt_layers
    assert fast is not None
    calls = []
    monkeypatch.setattr(fast[1], "run", lambda *a, _run=fast[1].run: calls.append(1) or _run(*a))
    ps = runner.page_size
    ids = torch.randint(
        100, 40000, (4, 4 * ps), generator=torch.Generator().manual_seed(2)
    ).tolist()
    ids[1][: 3 * ps] = ids[0][: 3 * ps]  # request 1 shares request 0's first three pages
    tables = [[1, 2, 3, 4], [1, 2, 3, 5], [6, 7, 8, 9], [10, 11]]
    n0 = 3 * ps + 5
    whole = BatchInput(0, [0], ids[0][:n0], [0], [n0], [0], [tables[0]], [True], [0])
    (call, kv_call), (layered, kv_layered) = step_each_way(
        runner, whole, [tables[0]], (fast, None), "prompt_layers", rows=list(range(n0))
    )
    assert (
        calls
        and torch.equal(call, layered)
        and all(torch.equal(a, b) for a, b in zip(kv_call, kv_layered))
    )
    runner.model.prompt_layers = fast
    for i, n in ((0, n0), (1, 3 * ps + 7), (2, 3 * ps)):
        runner.step_logits(
            BatchInput(0, [i], ids[i][:n], [0], [n], [0], [tables[i]], [True], [0]), [tables[i]]
        )
    # decodes of 0 and 1 (a cascade over their shared pages), a chunk of 2 over its prefix, request 3 anew
    mixed = BatchInput(
        0,
        [0, 1, 2, 3],
        [5, 6] + ids[2][3 * ps : 3 * ps + 20] + ids[3][:40],
        [n0, 3 * ps + 7, 3 * ps, 0],
        [1, 1, 20, 40],
        [0] * 4,
        [[]] * 4,
        [True] * 4,
        [1, 1, 0, 0],
    )
    calls.clear()
    (call, kv_call), (layered, kv_layered) = step_each_way(
        runner, mixed, tables, (fast, None), "prompt_layers", rows=list(range(62))
    )
    assert calls and runner.attn.dec_plan.num_groups == 1
    assert torch.equal(call, layered)
    assert all(torch.equal(a, b) for a, b in zip(kv_call, kv_layered))
    # The server reads each request's last row only: the last layer runs past its attention for
    # those rows alone, and gives them (and the cache) what the step with every row gave.
    last = [0, 1, 21, 61]
    (call_last, kv_last), (layered_last, kv_layered_last) = step_each_way(
        runner, mixed, tables, (fast, None), "prompt_layers"
    )
    assert torch.equal(call_last, call[last])  # the C call: the same panels at any row count
    assert all(torch.equal(a, b) for a, b in zip(kv_last, kv_call))
    assert all(torch.equal(a, b) for a, b in zip(kv_layered_last, kv_call))
    # the layers pick their GEMM kernel by row count (4 rows: not the panels), so close, not equal
    assert (layered_last - layered[last]).abs().max() < 0.02 * layered.abs().max()
    assert torch.equal(layered_last.argmax(-1), layered[last].argmax(-1))


def linear_on_blocks(n: int, k: int, seed: int) -> Linear:
    lin = Linear(k, n, False, torch.float32)
    lin.weight.data = weight(n, k, "q4_1", seed)
    lin.packed = pack_for_cpu(lin.weight)
    lin.blocks = recover(lin.weight)
    return lin


class VirtualClock:
    """Stands in for the clock PathTiming reads, so that which path "takes longer" is what a test
    says, not what a loaded 2-core machine happens to do (a threaded C kernel waiting for a busy
    core once lost to a float path slowed 100x)."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(layers, "time", types.SimpleNamespace(perf_counter=lambda: self.now))

    def costing(self, fn, seconds: float):
        """fn, run for real, taking `seconds` of this clock per call."""

        def timed(*args, **kwargs):
            self.now += seconds
            return fn(*args, **kwargs)

        return timed


def test_the_measured_crossover_follows_the_faster_path(lib, monkeypatch):
    """The server times GEMMs from blocks against the float path at growing row counts and uses
    the blocks up to where they stop winning: nowhere when the block kernel is the slow one, at
    every size tried when the float path is."""
    modules = [linear_on_blocks(64, 96, seed) for seed in range(2)]
    gemm_blocks, cpu_matmul = cpu_gemm.gemm_blocks, layers.cpu_matmul
    for blocks_cost, floats_cost, rows in (
        (1.0, 0.1, 0),
        (0.1, 1.0, layers.BLOCKS_ROW_CANDIDATES[-1]),
    ):
        clock = VirtualClock(monkeypatch)
        monkeypatch.setattr(cpu_gemm, "gemm_blocks", clock.costing(gemm_blocks, blocks_cost))
        monkeypatch.setattr(layers, "cpu_matmul", clock.costing(cpu_matmul, floats_cost))
        assert layers.blocks_crossover_rows(modules) == rows


def test_the_block_rows_rule_takes_the_nearest_measured_level_below(monkeypatch):
    """block_rows.MEASURED holds what scripts/measure_block_rows.py found per level; a level
    without a measurement of its own takes the nearest one below it, and a combination never
    measured keeps int8 activations on the blocks (their dot kernels beat float GEMMs) and
    float ones off them."""
    from relay.execution import block_rows as rule

    f32, bf16 = torch.float32, torch.bfloat16
    monkeypatch.setattr(rule, "MEASURED", {("avx2", f32, True): 64, ("avx512bf16", bf16, False): 6})
    assert rule.block_rows("avx2", f32, True) == 64
    assert rule.block_rows("amx", f32, True) == 64  # from avx2, the nearest below
    assert rule.block_rows("amx", bf16, False) == 6
    assert rule.block_rows("avx512", bf16, False) == 0  # nothing at or below avx512
    assert rule.block_rows("generic", f32, True) == rule.ALL_ROWS


def test_int8_activations_keep_every_gemm_on_the_blocks_at_every_level():
    """The defaults' greedy output is the same alone and in a crowded step (README) only where a
    GEMM's path does not change with its row count: with int8 block activations (the default from
    AVX2 up) every level's rule keeps every GEMM of a prompt chunk on the blocks, AMX's too."""
    from relay.execution import block_rows as rule
    from relay.execution.kernels.isa import LEVELS

    for level in LEVELS[1:]:
        for dtype in (torch.float32, torch.bfloat16):
            assert rule.block_rows(level, dtype, True) == rule.ALL_ROWS, (level, dtype)


@pytest.mark.slow
def test_which_gemms_read_the_blocks_is_a_fixed_rule_not_a_timing(default_model_dir, monkeypatch):
    """Start-up times no GEMMs to choose between blocks and float weights (a timing moved with the
    host's load, and the outputs with it): every block GEMM takes the rule for this level, or
    --weight-block-rows where given, 0 keeping every GEMM off the blocks."""
    blocks_or_skip()
    from relay.config import EngineConfig, ModelConfig
    from relay.execution.block_rows import ALL_ROWS, block_rows
    from relay.execution.kernels import isa

    def timed(*args, **kwargs):
        raise AssertionError("start-up timed the block GEMMs")

    monkeypatch.setattr(layers, "blocks_crossover_rows", timed)

    def max_rows(**kw) -> set[int]:
        cfg = EngineConfig(dtype="float32", kv_cache_gb=0.05, **kw)
        runner = ModelRunner(cfg, default_model_dir, ModelConfig.from_dir(default_model_dir))
        return {m.blocks.max_rows for m in runner.model.gemm_modules() if m.blocks is not None}

    # float activations: the float32 GEMMs win past the rule's rows, so floats stay beside the
    # blocks and GEMMs take the rule
    rule = block_rows(isa.level(), torch.float32, False)
    if 0 < rule < ALL_ROWS:
        assert max_rows(block_activations="float") == {rule}
    if block_rows(isa.level(), torch.float32, True) >= ALL_ROWS:  # int8 blocks win everywhere:
        assert max_rows(block_activations="int8") == {sys.maxsize}  # no floats, every GEMM
    assert max_rows(weight_block_rows=12) == {12}
    assert max_rows(weight_block_rows=0) <= {0}


@pytest.mark.slow
def test_decode_steps_take_one_c_call_up_to_the_batch_size_it_measured_faster_at(
    default_model_dir, monkeypatch
):
    """Start-up times whole decode steps in one C call against the layers called one by one: a C
    call that is the slow one is not used (and blocks no GEMM reads are dropped); when the layers
    are the slow ones, the C call takes every batch size tried that the KV pool holds."""
    blocks_or_skip()
    from relay.config import EngineConfig, ModelConfig
    from relay.execution import startup_timing
    from relay.execution.models import llama_layers

    def runner() -> ModelRunner:  # (float activations: float GEMMs beside the blocks, timed)
        return ModelRunner(
            EngineConfig(dtype="float32", kv_cache_gb=0.05, block_activations="float"),
            default_model_dir,
            ModelConfig.from_dir(default_model_dir),
        )

    clock = VirtualClock(monkeypatch)
    monkeypatch.setattr(
        layers, "cpu_matmul", clock.costing(layers.cpu_matmul, 0.001)
    )  # GEMMs: blocks win
    run, forward = cpu_layers.DecodeLayers.run, llama_layers.DecoderLayer.forward
    monkeypatch.setattr(cpu_layers.DecodeLayers, "run", clock.costing(run, 1.0))
    monkeypatch.setattr(llama_layers.DecoderLayer, "forward", clock.costing(forward, 0.001))
    slow_call = runner()
    assert slow_call.model.decode_layers is None
    assert all(m.blocks is None or m.blocks.max_rows for m in slow_call.model.gemm_modules())
    monkeypatch.setattr(cpu_layers.DecodeLayers, "run", clock.costing(run, 0.001))
    monkeypatch.setattr(llama_layers.DecoderLayer, "forward", clock.costing(forward, 1.0))
    slow_layers = runner()
    per_request = -(-(startup_timing.DECODE_LAYERS_CONTEXT + 1) // slow_layers.page_size)
    held = [
        s
        for s in startup_timing.DECODE_LAYERS_SIZES
        if 1 + s * per_request <= slow_layers.num_pages
    ]
    assert slow_layers.model.decode_layers[1].max_rows == held[-1]


@pytest.mark.slow
def test_a_bfloat16_model_decodes_on_the_checkpoints_exact_blocks(default_model_dir):
    """In bfloat16 the blocks are recovered from the float32 checkpoint before its weights are
    rounded, so small GEMMs and decode steps (one C call) multiply by the checkpoint's exact
    weights: a decode step's logits are closer to the float32 model's than those of the same
    bfloat16 model without its blocks, which multiplies by rounded weights. (With the default int8
    block activations x's rounding outweighs that: the blocks' bfloat16 activations are held.)"""
    blocks_or_skip()
    from relay.config import EngineConfig, ModelConfig
    from relay.step import BatchInput

    runners = [
        ModelRunner(
            EngineConfig(kv_cache_gb=0.05, **cfg),
            default_model_dir,
            ModelConfig.from_dir(default_model_dir),
        )
        for cfg in (
            {"dtype": "float32", "block_activations": "float"},
            {"dtype": "bfloat16", "block_activations": "float"},
            {"dtype": "bfloat16", "disable_weight_blocks": True},
        )
    ]
    exact, rounded = (r.model.gemm_modules() for r in runners[:2])
    for a, b in zip(exact, rounded):
        assert (
            b.blocks is not None
            and b.blocks.round_bf16
            and torch.equal(b.blocks.dequantize(), a.weight)
        )
        assert b.weight.dtype == torch.bfloat16 and torch.equal(b.weight, a.weight.bfloat16())
    assert runners[1].model.decode_layers is not None
    ids = torch.randint(100, 40000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = []
    for runner in runners:
        runner.step_logits(BatchInput(0, [0], ids, [0], [40], [0], [[1, 2]], [True], [0]), [[1, 2]])
        logits.append(
            runner.step_logits(
                BatchInput(0, [0], [ids[7]], [40], [1], [0], [[]], [True], [1]), [[1, 2]]
            )[0]
        )
    on_blocks, without = ((x - logits[0]).abs().max() for x in logits[1:])
    assert on_blocks < without
    assert on_blocks < 0.05 * logits[0].abs().max()


def test_a_dense_float32_checkpoint_in_bfloat16_is_a_plain_bfloat16_model(tiny_model_dir):
    """The float32 twin a bfloat16 model is loaded through finds no blocks in a dense checkpoint:
    the model is then the same bfloat16 model as without the twin."""
    blocks_or_skip()
    from relay.config import EngineConfig, ModelConfig

    path = tiny_model_dir("llama")
    runner = ModelRunner(
        EngineConfig(dtype="bfloat16", kv_cache_gb=0.01), path, ModelConfig.from_dir(path)
    )
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    assert all(m.blocks is None for m in runner.model.gemm_modules())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int8_block_activations_at_the_largest_sums_a_block_can_make(lib, sign):
    """Q4_1 quants at 15 times x at +-127 in every position: a block's integer sums at their
    largest (VPMADDUBSW's 16-bit pair sums without VNNI included) are still exact."""
    n, k = 48, 128
    q = torch.full((n, k), 15.0)
    q[:, ::32] = 0.0  # each block's minimum, so the blocks are m + d * q with q up to 15
    w = -0.5 + 0.0625 * q  # d and m exact in float16, as GGUF stores them
    blocks = recover(w).to_dot()
    assert blocks.bits == 4 and torch.equal(blocks.dequantize(), w)
    x = torch.full((7, k), sign)
    torch.testing.assert_close(
        cpu_gemm.gemm_blocks(x, blocks).double(),
        int8_rounded_product(x, blocks),
        atol=1e-4,
        rtol=1e-6,
    )


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_int8_block_activations_give_the_same_bits_at_every_level(kind):
    """A server's outputs do not depend on which CPU level (or RELAY_CPU_ISA) it runs at: the
    integer sums are exact and x's scale and block sum are taken in one order at every width."""
    w = weight(64, 576, kind, seed=3)
    blocks = recover(w).to_dot()
    x = torch.randn(40, 576) * torch.linspace(0.1, 10.0, 576)
    outputs = {}
    for level in levels_here():
        with held_at(level):
            outputs[level] = cpu_gemm.gemm_blocks(x, blocks)
    first = next(iter(outputs.values()))
    for level, y in outputs.items():
        assert torch.equal(y, first), f"{level} differs from {levels_here()[0]}"


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 2, 6, 7, 13, 33])
@pytest.mark.parametrize("n,k", [(200, 96), (40, 160), (64, 576)])
def test_int8_block_activations_are_x_rounded_to_8_bits_times_the_exact_weights(lib, kind, m, n, k):
    """--block-activations int8 (csrc/gemm_dot.c): integer sums of quant products at every level,
    whatever the row count, as the float64 reference of the same rounding; and the dot layout holds
    the same weights."""
    w = weight(n, k, kind, seed=m)
    blocks = recover(w).to_dot()
    assert torch.equal(blocks.dequantize(), w)
    x = torch.randn(m, k + 5)[:, :k]
    x[0, :32] = 0.0  # an all-zero block of x (scale 0)
    y = cpu_gemm.gemm_blocks(x, blocks)
    torch.testing.assert_close(y.double(), int8_rounded_product(x, blocks), atol=1e-5, rtol=1e-5)
    alone = cpu_gemm.gemm_blocks(x[-1:], blocks)
    assert torch.equal(y[-1:], alone), "a row's output does not depend on the rows beside it"
