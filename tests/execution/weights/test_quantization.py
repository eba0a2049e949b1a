"""--quantization int8 (one scale per output row) and int4 (a scale and zero point per 32 input
features): weight-only quantized weights on CPU; w8a8: int8 weights times activations quantized
to int8 per row for GEMMs of at least W8A8_MIN_ROWS rows. A float checkpoint on the block
kernels is instead quantized at load into Q8_0 / Q4_1 blocks with no float copy (quantized_blocks:
the tests at the end); the default model, a GGUF file, takes torch's kernels below.

Small GEMMs (fewer than INT8_MAX_ROWS rows) run torch's int8 kernel; larger ones the float copy
of the same quantized values. So with enough requests in a batch, greedy output equals
transformers' on the quantized weights token for token; a lone request goes through the int8
kernel, whose bfloat16 activations may flip a near-tie.
"""

from __future__ import annotations

import pytest
import torch

from relay import Engine
from relay.execution.kernels import cpu as cpu_kernels
from relay.execution.kernels import cpu_gemm, isa
from relay.execution.layers import (
    INT4_MAX_ROWS,
    INT8_MAX_ROWS,
    W8A8_MIN_ROWS,
    Linear,
    int4_supported,
    quantize_int4,
    quantize_int8,
    quantize_rows_int8,
    w8a8_weight,
)
from tests.helpers.block_kernels import needs_blocks
from tests.helpers.engine_checks import DEFAULT_MODEL_TEXTS, GREEDY, NEW_TOKENS


def test_quantize_int8_rounds_each_weight_to_its_rows_grid():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different scales
    (q, scale), dequantized = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (64,)
    assert q.abs().max() <= 127
    assert torch.equal(dequantized, q.float() * scale.float()[:, None])
    err = (dequantized - w).abs()
    assert (
        err <= scale.float()[:, None] * 0.5 * 1.01 + 1e-7
    ).all()  # bf16 scale: up to 0.4% above amax/127
    assert err.max() / w.abs().max() < 0.01


def test_int8_kernel_and_float_path_agree():
    torch.manual_seed(1)
    layer = Linear(96, 80, bias=True, dtype=torch.float32)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.int8, layer.weight.data = quantize_int8(layer.weight.data)
    x = torch.randn(INT8_MAX_ROWS, 96)
    batched = layer(x)  # float path over the quantized values
    rows = torch.cat(
        [layer(x[i : i + 1]) for i in range(INT8_MAX_ROWS)]
    )  # int8 kernel, bf16 activations
    exact = x @ layer.weight.data.T + layer.bias.data
    assert torch.allclose(batched, exact, atol=1e-4)
    assert ((rows - exact).norm() / exact.norm()) < 1e-2
    assert not torch.equal(rows, batched), "a single row must take the int8 kernel"


@pytest.mark.slow
def test_default_model_int8_matches_transformers_on_the_quantized_weights(default_model_dir):
    from relay.execution.model_files import load_transformers_model
    from relay.text.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir)
    prompts = [tok.encode(t) for t in DEFAULT_MODEL_TEXTS]
    assert len(prompts) >= INT8_MAX_ROWS  # every decode step of the batch takes the float path
    model = load_transformers_model(default_model_dir, torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.inference_mode():
        for p in model.parameters():
            if p.dim() == 2:  # every GEMM weight; the embedding is tied to the LM head
                p.data = quantize_int8(p.data)[1]
        expected = [
            model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]

    engine = Engine(default_model_dir, dtype="float32", quantization="int8", kv_cache_gb=0.2)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected

    alone = [
        engine.generate([p], GREEDY)[0].token_ids for p in prompts
    ]  # int8 kernel every decode step
    assert sum(a == e for a, e in zip(alone, expected)) >= len(prompts) - 3
    assert tok.decode(alone[0]).startswith(" Paris")
    engine.check()


def test_unknown_quantization_is_rejected():
    from relay.config import EngineConfig

    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")


needs_int4 = pytest.mark.skipif(not int4_supported(), reason="this torch has no CPU int4 kernels")


@needs_int4
def test_quantize_int4_rounds_each_group_to_its_grid():
    torch.manual_seed(0)
    w = torch.randn(48, 128) * torch.logspace(-3, 1, 48)[:, None]
    q4, dequantized = quantize_int4(w)
    groups = w.view(48, 4, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    err = (dequantized - w).view(48, 4, 32).abs()
    assert (
        err <= step[..., None] * 0.51 + 1e-2 * groups.abs().amax(-1, keepdim=True)
    ).all()  # bf16 scales
    assert q4.packed.dtype == torch.uint8 and q4.scales_and_zeros.shape == (4, 48, 2)


@needs_int4
def test_int4_kernel_and_float_path_agree():
    torch.manual_seed(1)
    layer = Linear(128, 80, bias=True, dtype=torch.float32)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.int4, layer.weight.data = quantize_int4(layer.weight.data)
    x = torch.randn(INT4_MAX_ROWS + 1, 128)
    exact = x @ layer.weight.data.T + layer.bias.data
    assert torch.allclose(layer(x), exact, atol=1e-4)  # the float path over the quantized values
    rows = torch.cat(
        [layer(x[i : i + 1]) for i in range(len(x))]
    )  # the int4 kernel, bf16 activations
    assert ((rows - exact).norm() / exact.norm()) < 1e-2
    assert not torch.equal(rows, layer(x)), "a single row must take the int4 kernel"


@needs_int4
@pytest.mark.slow
def test_default_model_int4_is_still_the_model(default_model_dir):
    """A lone request takes the int4 kernel every step: its greedy answers stay sensible."""
    engine = Engine(default_model_dir, quantization="int4", kv_cache_gb=0.2)
    out = engine.generate(["The capital of France is"], GREEDY)[0]
    assert out.text.startswith(" Paris"), out.text
    engine.check()


needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available(), reason="Relay's CPU kernels are not built here"
)


def int8_rows_reference(x: torch.Tensor, int8, bias: torch.Tensor) -> torch.Tensor:
    """What w8a8 computes, in float64: x rounded to int8 per row (s = max|x| / 127), the exact
    integer product with the int8 weight, scaled back."""
    q, w_scale = int8
    qx, s = quantize_rows_int8(x)
    return (qx.double() @ q.double().T) * s.double() * w_scale.double() + bias.double()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_is_the_integer_product_of_rows_rounded_to_int8(dtype):
    torch.manual_seed(2)
    layer = Linear(100, 70, bias=True, dtype=dtype)  # 100 inputs: vector body and scalar tail
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    int8, layer.weight.data = quantize_int8(layer.weight.data)
    layer.w8a8 = w8a8_weight(int8)  # as quantize_w8a8 leaves a layer: no weight-only int8 path
    x = torch.randn(W8A8_MIN_ROWS + 5, 100).to(dtype)
    x[3] = 0  # an all-zero row has scale 1, not a division by zero
    ref = int8_rows_reference(x, int8, layer.bias.data)
    y = layer(x)
    assert y.dtype == dtype and torch.all(y[3] == layer.bias.data)
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # bfloat16: the output's own rounding
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < tolerance
    few = x[
        : W8A8_MIN_ROWS - 1
    ]  # below the threshold: float activations over the same int8 weights
    assert (
        (layer(few).double() - ref[: W8A8_MIN_ROWS - 1]).abs().max() / ref.abs().max()
    ) > tolerance


def test_w8a8_is_refused_where_int8_gemms_have_no_vnni(default_model_dir, monkeypatch):
    """Held to AVX2 (as on a Zen 3), torch's int8 GEMM is a reference loop far slower than
    float32: the mode is refused up front, naming what the CPU lacks, not served slowly."""
    monkeypatch.setenv("RELAY_CPU_ISA", "avx2")
    with pytest.raises(ValueError, match="quantization='w8a8' needs a CPU with VNNI"):
        Engine(default_model_dir, quantization="w8a8", kv_cache_gb=0.2)


@needs_kernels
@pytest.mark.slow
@pytest.mark.skipif(
    not isa.int8_dot_products(), reason="w8a8 is refused on this CPU (no VNNI): tested above"
)
def test_default_model_w8a8_is_still_the_model(default_model_dir, monkeypatch):
    """16 requests at once: prompts and decode steps take the int8 x int8 GEMMs, and the answers
    stay the model's."""
    calls = []
    real = cpu_gemm.int8_matmul
    monkeypatch.setattr(
        cpu_gemm, "int8_matmul", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k)
    )
    engine = Engine(default_model_dir, quantization="w8a8", kv_cache_gb=0.2)
    prompts = ["The capital of France is"] + [
        f"Count from {i} to {i + 5}:" for i in range(W8A8_MIN_ROWS - 1)
    ]
    outs = engine.generate(prompts, GREEDY)
    assert outs[0].text.startswith(" Paris"), outs[0].text
    assert calls and max(calls) >= W8A8_MIN_ROWS
    engine.check()


# ---- a float checkpoint quantized at load into the CPU block kernels' forms (quantized_blocks) ----


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_blocks_round_each_block_of_32_to_its_grid(quantization):
    """int4: d = (max - min) / 15 and m = min per 32 inputs; int8: d = max|w| / 127. Each weight
    within half a step of d; a block of equal weights (d = 0) comes back exactly; a tied
    embedding's rows (BlockRows) are the blocks' own, in either layout."""
    from relay.execution.distributed import TPGroup
    from relay.execution.quantized_blocks import BITS, BlockRows, quantize_weight

    torch.manual_seed(0)
    w = torch.randn(70, 96) * torch.logspace(-3, 1, 70)[:, None]
    w[5, 32:64] = 0.25  # blocks of equal weights: d = 0 for int4 (and for int8 at 0)
    w[6, :32] = 0
    bits = BITS[quantization]
    blocks = quantize_weight(w, bits, dot=False)
    assert (blocks.bits, blocks.has_m) == (bits, bits == 4)
    got = blocks.dequantize()
    groups = w.view(70, 3, 32)
    span = groups.amax(-1) - groups.amin(-1) if bits == 4 else 2 * groups.abs().amax(-1)
    step = span / (15 if bits == 4 else 254)
    err = (got - w).view(70, 3, 32).abs()
    assert (err <= step[..., None] * 0.5 * (1 + 1e-5) + 1e-7).all()
    assert torch.equal(got[6, :32], w[6, :32]) and not got.isnan().any()
    if bits == 4:
        assert torch.equal(got[5, 32:64], w[5, 32:64])
    rows = torch.tensor([69, 0, 5, 33, 5])
    for dot in (False, True):
        lookup = BlockRows(quantize_weight(w, bits, dot), 0, torch.float32, TPGroup())
        assert torch.equal(lookup.rows(rows), got[rows])


def test_checkpoint_tensors_come_a_decoder_layer_at_a_time():
    """after_each_layer: layer i is done once its last tensor is taken, before layer i + 1's."""
    from relay.execution.model_loading import after_each_layer

    names = ["model.layers.0.a", "model.layers.0.b", "model.layers.1.a", "model.norm.weight"]
    events = []
    for name, _ in after_each_layer(((n, None) for n in names), events.append):
        events.append(name)
    assert events == [names[0], names[1], 0, names[2], 1, names[3]]


def quantized_reference(path: str, quantization: str):
    """transformers' float32 model with every GEMM weight (a tied embedding with its head) the
    blocks' dequantized values."""
    from transformers import AutoModelForCausalLM

    from relay.execution.quantized_blocks import dequantized

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    embedding = model.get_input_embeddings().weight  # float where untied
    with torch.no_grad():
        for p in model.parameters():  # (a tied weight once)
            if p.dim() == 2 and (p is not embedding or model.config.tie_word_embeddings):
                p.data = dequantized(p.data, quantization)
    return model


@needs_blocks
@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("arch", ["llama", "llama3"])
def test_a_safetensors_model_quantized_at_load_is_served_from_blocks_alone(
    tiny_model_dir, arch, quantization
):
    """Every GEMM weight becomes blocks with no float copy (a stand-in weight); a tied embedding
    looks its rows up from the head's blocks, an untied one stays float; greedy output on the
    exact block products (--block-activations float) equals transformers' on the blocks'
    dequantized weights token for token."""
    from relay.execution.layers import has_float_weight
    from relay.execution.model_loading import weight_bytes
    from relay.execution.quantized_blocks import BlockRows
    from tests.helpers.engine_checks import random_prompts

    path = tiny_model_dir(arch)
    engine = Engine(
        path,
        dtype="float32",
        quantization=quantization,
        kv_cache_gb=0.01,
        block_activations="float",
    )
    model = engine.runner.model
    gemms = model.gemm_modules()
    assert all(m.blocks is not None and not has_float_weight(m) for m in gemms)
    assert all(getattr(m, quantization) is None and m.packed is None for m in gemms)
    tied = arch == "llama3"
    assert isinstance(model.embed_tokens.lookup, BlockRows) == tied
    assert has_float_weight(model.embed_tokens) != tied
    floats = 4 * sum(m.weight.numel() for m in gemms)
    assert sum(weight_bytes(m) for m in gemms) < (0.2 if quantization == "int4" else 0.3) * floats

    prompts = random_prompts(1024, [3, 17, 40], seed=4)
    ref = quantized_reference(path, quantization)
    with torch.inference_mode():
        want = [
            ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == want
    engine.check()


def _quantized_step_logits(rank: int, tp, model_dir: str, prompt: list[int]) -> torch.Tensor:
    from relay.config import EngineConfig, ModelConfig
    from relay.execution.layers import has_float_weight
    from relay.execution.model_runner import ModelRunner
    from tests.helpers.runner_batches import PS, prefill, spec

    cfg = EngineConfig(
        dtype="float32",
        tp_size=tp.size,
        page_size=PS,
        kv_cache_gb=0.01,
        block_activations="float",
        quantization="int4",
    )
    runner = ModelRunner(cfg, model_dir, ModelConfig.from_dir(model_dir), tp)
    assert all(not has_float_weight(m) for m in runner.model.gemm_modules())
    batch = prefill([0], [prompt], [spec(0)])
    return runner.step_logits(batch, batch.new_pages)[-1]


@needs_blocks
def test_two_tensor_parallel_ranks_quantize_their_shards_as_one_rank_does(tiny_model_dir, tmp_path):
    """--tp 2: each rank quantizes its rows of q/k/v, gate/up and the tied head, and its whole
    blocks of o's and down's inputs; its embedding rows come from its shard of the head's blocks
    (the others' summed in): the all-reduced logits are one rank's."""
    from relay.execution.distributed import TPGroup
    from tests.helpers.engine_checks import random_prompts
    from tests.helpers.ranks import run_ranks

    path = tiny_model_dir("llama3")
    prompt = random_prompts(1024, [20], seed=3)[0]
    want = _quantized_step_logits(0, TPGroup(), path, prompt)
    for got in run_ranks(_quantized_step_logits, tmp_path, path, prompt):
        assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


@needs_blocks
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_the_one_call_decode_reads_quantized_blocks_as_the_layers_do(tiny_model_dir, quantization):
    """With the default block activations (int8 from AVX2 up: the dot layout) a float32 model's
    decode step runs in one C call on the quantized blocks, bit for bit what the layers compute."""
    from tests.helpers.block_checks import assert_decode_call_is_the_layers

    path = tiny_model_dir("llama3")
    engine = Engine(path, dtype="float32", quantization=quantization, kv_cache_gb=0.01)
    runner = engine.runner
    assert runner.model.use_decode_layers(runner.attn), "eligible for the C call"
    assert_decode_call_is_the_layers(runner, runner.model.decode_layers)
