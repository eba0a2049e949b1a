"""Granite, OLMo 2, Gemma 1 and StarCoder 2 compute what transformers does.

Tiny seeded random-weight checkpoints from transformers' config classes (model_families'
maker: norms randomised, Gemma's embedding scaled down): greedy float32 output token for token
through the offline Engine (prompt chunks, again from the prefix cache, under retraction), prompt
logits (Granite's logits_scaling changes no greedy token), each detail that is easy to miss shown
to matter (every Granite multiplier; OLMo 2's norms after the sublayers and its q/k norms over the
whole projection), --tp 2 for the two whose split is new (OLMo 2's q/k norm sums its squares over
the ranks, StarCoder 2's row-parallel biases are added once), and which of them decode in one C
call: on weights that are exact Q8_0 blocks, Gemma 1 does (bit for bit its layers), the others
fall back to their layers one by one.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from relay import Engine
from relay.config import EngineConfig, ModelConfig
from relay.execution.block_rows import ALL_ROWS
from relay.execution.distributed import TPGroup
from relay.execution.kernels import cpu_layers
from relay.execution.model_runner import ModelRunner
from relay.execution.models import olmo2
from tests.helpers.block_checks import assert_decode_call_is_the_layers, blocks_or_skip, gguf_q8_0
from tests.helpers.engine_checks import GREEDY, check_three_ways, random_prompts, reference
from tests.helpers.model_families import COMMON, LOGIT_PROMPTS, PS, prompt_batch, tiny_model_maker
from tests.helpers.ranks import run_ranks
from tests.helpers.tiny_models import TINY_VOCAB

SHAPE = {k: v for k, v in COMMON.items() if k not in ("sliding_window", "head_dim")}
HEAD_DIM = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]  # but Gemma 1's
GRANITE_MULTIPLIERS = dict(
    embedding_multiplier=2.5,
    residual_multiplier=0.4,
    attention_multiplier=0.11,  # not head_dim ** -0.5 (0.25)
    logits_scaling=4.0,
)


def granite_config():
    from transformers import GraniteConfig

    return GraniteConfig(**SHAPE, num_hidden_layers=2, **GRANITE_MULTIPLIERS)


def olmo2_config():
    from transformers import Olmo2Config

    return Olmo2Config(**SHAPE, num_hidden_layers=2)


def gemma1_config():
    from transformers import GemmaConfig

    # head_dim 24, not hidden_size / heads (16), as Gemma 7B's 256 is not 3072 / 16
    return GemmaConfig(**SHAPE, num_hidden_layers=2, head_dim=24)


def starcoder2_config():
    from transformers import Starcoder2Config

    # a window of 8: the prompts and generations run far past it
    return Starcoder2Config(**SHAPE, num_hidden_layers=2, sliding_window=8, use_bias=True)


CONFIGS = {
    "granite": granite_config,
    "olmo2": olmo2_config,
    "gemma1": gemma1_config,
    "starcoder2": starcoder2_config,
}


def random_biases(model) -> None:
    """Every bias randomised (transformers initialises them to 0, where a bias dropped or added
    twice would change nothing), and StarCoder 2's LayerNorm weights centred on 1: with weights
    around 0 its final norm's bias decides the logits, and greedy output repeats one token."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.normal_(0.0, 0.1)
        elif "norm" in name and model.config.model_type == "starcoder2":
            p.normal_(1.0, 0.3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return tiny_model_maker(tmp_path_factory, default_model_dir, CONFIGS, random_biases)


def runner(path: str, mc: ModelConfig | None = None, tp: TPGroup | None = None) -> ModelRunner:
    cfg = EngineConfig(
        dtype="float32", page_size=PS, kv_cache_gb=0.01, tp_size=tp.size if tp else 1
    )
    return ModelRunner(cfg, path, mc or ModelConfig.from_dir(path), *([tp] if tp else []))


def prompt_logits(model: ModelRunner) -> torch.Tensor:
    batch, tables = prompt_batch(LOGIT_PROMPTS)
    return model.step_logits(batch, tables)


def transformers_logits(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        return torch.stack([model(torch.tensor([p])).logits[0, -1] for p in LOGIT_PROMPTS])


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= 1e-4 * want.abs().max())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_output_equals_transformers(model_dir, name):
    """Prompts of 3 to 40 tokens, 16 new tokens, batched: through prompt chunks of 24 tokens,
    again from the prefix cache, and in a pool small enough to force retraction (StarCoder 2's
    requests, every layer sliding, give back the pages behind the window and wait instead)."""
    config = CONFIGS[name]()
    page_bytes = PS * config.num_hidden_layers * 2 * 2 * getattr(config, "head_dim", HEAD_DIM) * 4
    check_three_ways(
        model_dir(name),
        random_prompts(TINY_VOCAB, [3, 9, 13, 25, 31, 40]),
        40 * page_bytes / (1 << 30),  # ~40 pages
        retracts=name != "starcoder2",
        page_size=PS,
        chunked_prefill_size=24,
        kv_cache_gb=0.01,
    )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prompt_logits_are_transformers_logits(model_dir, name):
    """Last-token logits of prompts of 7, 19 and 33 tokens (Granite's divided by logits_scaling)."""
    path = model_dir(name)
    got, want = prompt_logits(runner(path)), transformers_logits(path)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


def test_each_granite_multiplier_matters(model_dir):
    """Relay with any one multiplier left at 1 (dropped) computes other logits than transformers:
    the test above would catch it."""
    path = model_dir("granite")
    want, mc = transformers_logits(path), ModelConfig.from_dir(path)
    assert mc.attention_scale == GRANITE_MULTIPLIERS["attention_multiplier"]
    for field in GRANITE_MULTIPLIERS:
        dropped = dataclasses.replace(
            mc, **{field: None if field == "attention_multiplier" else 1.0}
        )
        assert not close(prompt_logits(runner(path, dropped)), want), f"{field} changed nothing"


def _norm_before_the_sublayers(self, x, residual, rope, attn, keep=None):
    """OLMo 2's layer with its norms moved before attention and the MLP (Llama's places)."""
    if residual is not None:
        x = x + residual
    h = self.self_attn(self.post_attention_layernorm(x), rope, attn, keep)
    x = (x if keep is None else x[keep]) + h
    return self.mlp(self.post_feedforward_layernorm(x)), x


def _norm_per_head(self, x):
    """OLMo 2's q/k norm taken per head (Qwen3's) instead of over the whole projection."""
    heads = x.unflatten(-1, (-1, HEAD_DIM))
    normed = F.rms_norm(heads, (HEAD_DIM,), eps=self.eps) * self.weight.view(-1, HEAD_DIM)
    return normed.flatten(-2)


@pytest.mark.parametrize(
    "mutation",
    [
        (olmo2.Olmo2DecoderLayer, "forward", _norm_before_the_sublayers),
        (olmo2.ProjectionNorm, "forward", _norm_per_head),
    ],
    ids=["norms-before-sublayers", "qk-norm-per-head"],
)
def test_olmo2_norm_placement_matters(model_dir, monkeypatch, mutation):
    """Relay's OLMo 2 with its norms where Llama has them, or its q/k norms per head, computes
    other logits than transformers: the tests above would catch either."""
    path = model_dir("olmo2")
    want = transformers_logits(path)
    monkeypatch.setattr(*mutation)
    assert not close(prompt_logits(runner(path)), want)


def _tp_logits(rank: int, tp: TPGroup, paths: list[str]) -> list[torch.Tensor]:
    return [prompt_logits(runner(path, tp=tp)) for path in paths]


def test_two_ranks_compute_the_logits_of_one(tmp_path, model_dir):
    """--tp 2: heads, MLP features and the vocabulary split over two CPU ranks: OLMo 2's q/k norm
    over both ranks' features, StarCoder 2's o_proj and c_proj biases added once (both models in
    one pair of rank processes: starting them is most of the cost)."""
    paths = [model_dir("olmo2"), model_dir("starcoder2")]
    ones = [prompt_logits(runner(path)) for path in paths]
    for rank_logits in run_ranks(_tp_logits, tmp_path, paths):
        for got, one in zip(rank_logits, ones):
            torch.testing.assert_close(got, one, atol=1e-4 * one.abs().max().item(), rtol=0)


@pytest.fixture(scope="module")
def q8_0_dir(tmp_path_factory, model_dir):
    """A factory: name -> a copy of the tiny model whose 2-D weights are exact Q8_0 blocks
    (quantized and dequantized as GGUF does): Relay finds the blocks again from the values."""
    from safetensors.torch import load_file, save_file

    made: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in made:
            source, path = model_dir(name), str(tmp_path_factory.mktemp(f"{name}_q8_0"))
            for f in os.listdir(source):
                if f != "model.safetensors":
                    os.symlink(os.path.join(source, f), os.path.join(path, f))
            weights = load_file(os.path.join(source, "model.safetensors"))
            blocks = {
                k: torch.from_numpy(gguf_q8_0(w.numpy())) if w.dim() == 2 else w
                for k, w in weights.items()
            }
            save_file(blocks, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
            made[name] = path
        return made[name]

    return make


def block_engine(path: str) -> Engine:
    """An engine whose GEMMs all read the blocks (start-up times the one-call decode against the
    layers, which a tiny model's layers can win: whether it is eligible is what is tested)."""
    engine = Engine(
        path,
        dtype="float32",
        kv_cache_gb=0.01,  # the default page size: assert_decode_call_is_the_layers's tables
        block_activations="float",
        weight_block_rows=ALL_ROWS,
    )
    model = engine.runner.model
    assert all(m.blocks is not None for m in model.gemm_modules() if m is not model.lm_head)
    return engine


def test_gemma1_decodes_in_one_c_call(q8_0_dir, monkeypatch):
    """On weights that are all GGUF blocks, Gemma 1's decode steps run in one C call (its layers
    are Llama's with Gemma's norms and GeGLU): greedy output is transformers', and a step is bit
    for bit its layers one by one."""
    blocks_or_skip()
    path = q8_0_dir("gemma1")
    prompts = random_prompts(TINY_VOCAB, [3, 11, 26])
    expected = reference(path, prompts, GREEDY.max_new_tokens)
    engine = block_engine(path)
    assert engine.runner.model.use_decode_layers(engine.runner.attn)
    calls, run = [], cpu_layers.DecodeLayers.run
    monkeypatch.setattr(
        cpu_layers.DecodeLayers, "run", lambda self, *a: calls.append(1) or run(self, *a)
    )
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
    assert len(calls) >= GREEDY.max_new_tokens - 1, "every decode step ran in one C call"
    assert_decode_call_is_the_layers(engine.runner, engine.runner.model.decode_layers)


@pytest.mark.parametrize("name", ["granite", "olmo2", "starcoder2"])
def test_layers_the_c_call_cannot_compute_run_one_by_one(q8_0_dir, name):
    """Granite's (scaled residual adds), OLMo 2's (norms after the sublayers, q/k normed over
    the whole projection) and StarCoder 2's (LayerNorms, biases, an ungated MLP) layers are not
    the one-call decode's, on weights that are all blocks too: the model declines it, and the
    engine (whose start-up ran every kind of step) decodes layer by layer on the blocks."""
    blocks_or_skip()
    engine = block_engine(q8_0_dir(name))
    assert not engine.runner.model.use_decode_layers(engine.runner.attn)
    assert engine.runner.model.decode_layers is None
    outs = engine.generate(random_prompts(TINY_VOCAB, [5, 9]), GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_new_tokens for o in outs)


def test_configs_as_released():
    """Defaults the released config.json files leave to transformers: StarCoder 2's tied
    embeddings, biases and LayerNorm epsilon; Gemma 1's legacy hidden_act "gelu" (the tanh GELU);
    Granite's multipliers; what Relay does not implement refused by name."""
    starcoder2 = ModelConfig.from_hf_dict(
        dict(
            architectures=["Starcoder2ForCausalLM"],
            hidden_size=3072,
            intermediate_size=12288,
            num_hidden_layers=30,
            num_attention_heads=24,
            num_key_value_heads=2,
            vocab_size=49152,
            norm_epsilon=1e-5,
            rope_theta=999999.4420358813,
            sliding_window=4096,
            hidden_act="gelu_pytorch_tanh",
        )
    )
    assert starcoder2.tie_word_embeddings and starcoder2.o_proj_and_mlp_bias
    assert starcoder2.attention_bias and starcoder2.rms_norm_eps == 1e-5
    assert starcoder2.layer_windows == [4096] * 30
    gemma = ModelConfig.from_hf_dict(
        dict(
            architectures=["GemmaForCausalLM"],
            hidden_size=3072,
            intermediate_size=24576,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=256,
            vocab_size=256000,
            hidden_act="gelu",
        )
    )
    assert gemma.tie_word_embeddings and gemma.attention_scale == 256**-0.5
    assert gemma.layer_windows == [] and gemma.attn_logit_softcap is None
    granite = ModelConfig.from_hf_dict(granite_config().to_dict())
    assert (granite.embedding_multiplier, granite.residual_multiplier) == (2.5, 0.4)
    assert (granite.logits_scaling, granite.attention_scale) == (4.0, 0.11)
    olmo = ModelConfig.from_hf_dict(olmo2_config().to_dict())
    assert olmo.architecture == "Olmo2ForCausalLM" and not olmo.tie_word_embeddings
    with pytest.raises(ValueError, match="hidden_activation 'gelu'"):
        ModelConfig.from_hf_dict({**starcoder2_config().to_dict(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf_dict({**granite_config().to_dict(), "mlp_bias": True})
