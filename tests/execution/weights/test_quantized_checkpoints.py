"""AWQ, GPTQ and FP8 checkpoints (relay.checkpoint_quant, relay.execution.quantized_checkpoint):
tiny ones made here by quantizing a random Llama and packing it in each format's own layout
(tests/helpers/quantized_checkpoints.py), loaded by Relay and compared with transformers running the
float32 weights they stand for.

On the block kernels a 4-bit checkpoint's weights are blocks with no float copy, equal to the
dequantized weights bit for bit (d * q + m with d = s, m = -z * s: exact products of fp16
scales); with float block activations greedy output equals transformers' token for token.
Elsewhere (--disable-weight-blocks here; a GPU) they, and FP8 weights everywhere, are the
dequantized floats themselves.
"""

from __future__ import annotations

import json

import pytest
import torch

from relay import Engine
from relay.checkpoint_quant import read_checkpoint_quant
from relay.config import ModelConfig
from relay.execution.layers import has_float_weight
from relay.execution.packed_int4 import unpack_awq, unpack_gptq
from tests.helpers import quantized_checkpoints as qc
from tests.helpers.block_kernels import needs_blocks
from tests.helpers.engine_checks import GREEDY, NEW_TOKENS, random_prompts
from tests.helpers.server_utils import assert_one_line_error, serve

PROMPTS = random_prompts(1024, [3, 17, 40], seed=4)


@pytest.fixture
def make(tmp_path, default_model_dir):
    """(format, arguments) -> (checkpoint dir, transformers' reference on its float weights,
    those weights by module name)."""

    def build(method: str, *args, **opts):
        path = str(tmp_path / "model")
        model = qc.tiny_llama(default_model_dir, path)
        if method == "fp8":
            floats = qc.fp8_checkpoint(model, path, *args)
        else:
            floats = qc.int4_checkpoint(model, path, method, *args, **opts)
        return path, qc.reference_model(model, floats), floats

    return build


def greedy(model) -> list[list[int]]:
    with torch.inference_mode():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in PROMPTS
        ]


def served_weights(model, floats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each decoder GEMM module's weight as Relay serves it (its blocks dequantized, else its
    float weight), and the checkpoint's float weights for it (q/k/v, gate/up stacked)."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    pairs = {}
    for name, module in model.named_modules():
        if name.startswith("layers.") and hasattr(module, "blocks"):
            parent, last = name.rsplit(".", 1)
            want = torch.cat([floats[f"model.{parent}.{p}"] for p in fused.get(last, (last,))])
            got = module.blocks.dequantize() if module.blocks is not None else module.weight
            pairs[name] = (got, want)
    return pairs


@pytest.mark.parametrize(
    "method,group,opts",
    [
        ("awq", 32, {}),
        ("awq", 128, {}),
        ("gptq", 32, {"sym": False}),  # v1 zero points (stored z - 1)
        ("gptq", 64, {"sym": True, "act_order": True}),
        ("gptq", 128, {"sym": False, "act_order": True, "v1": False}),  # gptq_v2, zero points 0..15
    ],
    ids=["awq-g32", "awq-g128", "gptq-g32-asym", "gptq-g64-sym-actorder", "gptq_v2-g128-actorder"],
)
@needs_blocks
def test_4bit_checkpoints_are_exact_blocks_and_match_transformers(make, method, group, opts):
    path, ref, floats = make(method, group, **opts)
    engine = Engine(path, dtype="float32", kv_cache_gb=0.01, block_activations="float")
    model = engine.runner.model
    for name, (got, want) in served_weights(model, floats).items():
        module = model.get_submodule(name)
        assert module.blocks is not None and not has_float_weight(module), name
        # (act-order with one group per row, 128 inputs in groups of 128, needs no reordering)
        scattered = opts.get("act_order", False) and module.blocks.in_features > group
        assert (module.blocks.in_perm is not None) == scattered, name
        assert torch.equal(got, want), name  # bit for bit
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == greedy(ref)
    engine.check()


@pytest.mark.parametrize("block", [None, (64, 96)], ids=["per-tensor", "blocks-64x96"])
def test_fp8_checkpoints_load_dequantized_and_match_transformers(make, block):
    """Per-tensor scales (with the input_scale a static checkpoint carries, unused) and block
    scales whose last blocks are partial (96 does not divide 128 or 256)."""
    path, ref, floats = make("fp8", block)
    engine = Engine(path, dtype="float32", kv_cache_gb=0.01, block_activations="float")
    for name, (got, want) in served_weights(engine.runner.model, floats).items():
        assert torch.equal(got, want), name
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == greedy(ref)


def test_off_the_block_kernels_4bit_weights_are_the_dequantized_floats(make):
    """--disable-weight-blocks takes the path a GPU takes: each layer dequantized at load."""
    path, ref, floats = make("gptq", 64, sym=False, act_order=True)
    engine = Engine(path, dtype="float32", kv_cache_gb=0.01, disable_weight_blocks=True)
    for name, (got, want) in served_weights(engine.runner.model, floats).items():
        assert engine.runner.model.get_submodule(name).blocks is None
        assert torch.equal(got, want), name
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == greedy(ref)


@needs_blocks
def test_fused_parts_in_different_act_orders_become_floats(make, monkeypatch):
    """q, k and v quantized in different input orders cannot share one reordering of x: their
    fused GEMM gets the dequantized floats; the others stay blocks."""
    monkeypatch.setattr(qc, "shared_input", lambda name: hash(name) % 1000)
    path, ref, floats = make("gptq", 32, act_order=True)
    engine = Engine(path, dtype="float32", kv_cache_gb=0.01, block_activations="float")
    model = engine.runner.model
    for name, (got, want) in served_weights(model, floats).items():
        fused = name.endswith(("qkv_proj", "gate_up_proj"))
        assert (model.get_submodule(name).blocks is None) == fused, name
        assert torch.equal(got, want), name
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == greedy(ref)


@needs_blocks
def test_the_one_call_decode_takes_awq_blocks_but_not_reordered_inputs(make, tmp_path):
    from tests.helpers.block_checks import assert_decode_call_is_the_layers

    path, _, _ = make("awq", 64)
    runner = Engine(path, dtype="float32", kv_cache_gb=0.01).runner  # int8 activations from AVX2
    assert runner.model.use_decode_layers(runner.attn)
    assert_decode_call_is_the_layers(runner, runner.model.decode_layers)

    act_order = str(tmp_path / "act-order")
    qc.int4_checkpoint(qc.tiny_llama(path, act_order), act_order, "gptq", 32, act_order=True)
    runner = Engine(act_order, dtype="float32", kv_cache_gb=0.01).runner
    assert not runner.model.use_decode_layers(runner.attn)


def _step_logits(rank: int, tp, model_dir: str, prompt: list[int]) -> torch.Tensor:
    from relay.config import EngineConfig
    from relay.execution.model_runner import ModelRunner
    from tests.helpers.runner_batches import PS, prefill, spec

    cfg = EngineConfig(
        dtype="float32", tp_size=tp.size, page_size=PS, kv_cache_gb=0.01, block_activations="float"
    )
    runner = ModelRunner(cfg, model_dir, ModelConfig.from_dir(model_dir), tp)
    batch = prefill([0], [prompt], [spec(0)])
    return runner.step_logits(batch, batch.new_pages)[-1]


@needs_blocks
def test_two_tensor_parallel_ranks_place_their_shards_as_one_rank_does(make, tmp_path):
    """--tp 2 on an act-order GPTQ checkpoint: each rank's heads of q/k/v and features of
    gate/up as blocks, o's and down's halves of the inputs (which cut act-order groups) as
    floats; the all-reduced logits are one rank's."""
    from relay.execution.distributed import TPGroup
    from tests.helpers.ranks import run_ranks

    path, _, _ = make("gptq", 32, act_order=True)
    want = _step_logits(0, TPGroup(), path, PROMPTS[2])
    for got in run_ranks(_step_logits, tmp_path, path, PROMPTS[2]):
        assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("v1", [True, False])
def test_gptq_tensors_unpack_to_their_quants(v1):
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    g_idx = qc.act_order_groups(256, 64, seed=3)
    q, z, s = qc.quantize_groups(w, g_idx, sym=False, min_zero=1 if v1 else 0)
    p = qc.pack_gptq(q, z, s, g_idx, v1)
    got = unpack_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], 1 if v1 else 0)
    assert torch.equal(got.q, q) and torch.equal(got.zeros, z) and torch.equal(got.group, g_idx)
    assert torch.equal(got.dequantize(), qc.dequantize(q, z, s, g_idx))


def test_awq_tensors_unpack_to_their_quants():
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    g_idx = (torch.arange(256) // 128).int()
    q, z, s = qc.quantize_groups(w, g_idx, sym=False)
    p = qc.pack_awq(q, z, s)
    got = unpack_awq(p["qweight"], p["qzeros"], p["scales"])
    assert torch.equal(got.q, q) and torch.equal(got.zeros, z)
    assert torch.equal(got.dequantize(), qc.dequantize(q, z, s, g_idx))


@pytest.mark.parametrize(
    "config,named",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "bits 8"),
    ],
    ids=["unknown-method", "awq-8-bit"],
)
def test_a_checkpoint_quantization_relay_does_not_load_exits_2_naming_it(
    tiny_model_dir, tmp_path, config, named
):
    import shutil

    path = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir("llama"), path)
    qc.set_quantization_config(path, config)
    assert_one_line_error(serve("--port", "0", "--model-path", path), named)


@pytest.mark.parametrize(
    "config,named",
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits 3"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "'e5m2'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 0}, "group size 0"),
        ({"quant_method": "mxfp4"}, "'mxfp4'"),  # gpt-oss's experts only (its own loader)
    ],
)
def test_quantization_configs_relay_does_not_load_are_named(config, named):
    with pytest.raises(ValueError, match=named):
        read_checkpoint_quant({"quantization_config": config})


def test_gpt_oss_mxfp4_experts_are_left_to_its_model_loader():
    gpt_oss = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    assert read_checkpoint_quant(gpt_oss) is None


def test_an_autogptq_quantize_config_beside_config_json_is_read(tmp_path):
    (tmp_path / "quantize_config.json").write_text(
        json.dumps({"bits": 4, "group_size": 32, "desc_act": True, "sym": False})
    )
    quant = read_checkpoint_quant({}, str(tmp_path))
    assert (quant.method, quant.group_size, quant.desc_act, quant.zero_offset) == (
        "gptq",
        32,
        True,
        1,
    )
    assert quant.describe() == "gptq 4-bit g32 act-order asym"
