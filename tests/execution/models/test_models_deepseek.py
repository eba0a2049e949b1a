"""DeepSeek V2 and V3 (multi-head latent attention, DeepSeek's mixture of experts) compute what
transformers does.

Tiny seeded random-weight checkpoints from transformers' config classes (norms around 1, and
the biases and V3's e_score_correction_bias randomised: transformers starts them at 0, where a
bias dropped would change nothing):
- v2_lite: V2-Lite's shape: q one projection (q_lora_rank None), greedy softmax routing, the
  first layer dense, the default rope;
- v2: low-rank q, group_limited_greedy routing (4 groups, the best 2), attention biases,
  routed_scaling_factor 16, YaRN with mscale = mscale_all_dim as V2 has it;
- v3: 3 layers, the first dense; noaux_tc routing (sigmoid, e_score_correction_bias, 4 groups
  of 2, the best 2), norm_topk_prob, YaRN with mscale != mscale_all_dim (the tables' attention
  factor and the softmax scale both), the interleaved rope.
Greedy float32 output token for token through the offline Engine (prompt chunks of 16, again
from the prefix cache, a pool small enough to retract), prompt logits, a pool that holds the
latent and nothing else, each MLA detail shown to matter, the C attention kernels, --tp 2,
n-gram speculation and a regex constraint, the configs as released.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import random
import re
import shutil

import pytest
import torch

from relay import Engine, SamplingParams
from relay.config import EngineConfig, ModelConfig
from relay.execution.distributed import TPGroup
from relay.execution.kernels import cpu_attention
from relay.execution.model_runner import ModelRunner
from tests.helpers.kernel_helpers import cpu_kernels_or_skip
from tests.helpers.model_families import prompt_batch
from tests.helpers.ranks import run_ranks
from tests.helpers.tiny_models import TINY_VOCAB

PS = 4
NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
RANK, NOPE, ROPE, V = 32, 16, 16, 24  # every width distinct: a mixed-up split cannot fit
COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=RANK,
    qk_nope_head_dim=NOPE,
    qk_rope_head_dim=ROPE,
    v_head_dim=V,
    max_position_embeddings=512,
    initializer_range=0.3,
    eos_token_id=TINY_VOCAB - 1,
    bos_token_id=1,
    pad_token_id=0,
)


def yarn(mscale: float, mscale_all_dim: float) -> dict:
    # scaled against 64 positions: the prompts and generations run past them
    return dict(
        rope_type="yarn",
        factor=8.0,
        original_max_position_embeddings=64,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
        rope_theta=10000.0,
    )


def v2_lite_config():
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        **COMMON, num_hidden_layers=2, q_lora_rank=None, n_shared_experts=2, first_k_dense_replace=1
    )


def v2_config():
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        **COMMON,
        num_hidden_layers=2,
        q_lora_rank=48,
        n_shared_experts=2,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        attention_bias=True,
        routed_scaling_factor=16.0,
        rope_parameters=yarn(0.707, 0.707),
    )


def v3_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **COMMON,
        num_hidden_layers=3,
        q_lora_rank=48,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        rope_parameters=yarn(0.9, 0.7),
    )


CONFIGS = {"v2_lite": v2_lite_config, "v2": v2_config, "v3": v3_config}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    """A factory: name -> the directory of a seeded random model of CONFIGS[name]() (the default
    model's tokenizer beside it: the prompts are token ids), made once."""
    from transformers import AutoModelForCausalLM

    made: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in made:
            torch.manual_seed(0)
            path = str(tmp_path_factory.mktemp(name))
            model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32)
            with torch.no_grad():
                for n, t in [*model.named_parameters(), *model.named_buffers()]:
                    if "norm" in n:
                        t.normal_(1.0, 0.3)
                    elif n.endswith("bias"):  # e_score_correction_bias included
                        t.normal_(0.0, 0.1)
            model.save_pretrained(path)
            for f in os.listdir(default_model_dir):
                if f.startswith("tokenizer"):
                    shutil.copy(os.path.join(default_model_dir, f), path)
            made[name] = path
        return made[name]

    return make


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Every other prompt starts with the first half of a shared run (a prefix-cache hit)."""
    rng = random.Random(seed)
    shared = [rng.randrange(2, TINY_VOCAB - 2) for _ in range(32)]
    out = []
    for i, n in enumerate(lengths):
        body = [rng.randrange(2, TINY_VOCAB - 2) for _ in range(n)]
        out.append(shared[: n // 2] + body[n // 2 :] if i % 2 else body)
    return out


def reference(path: str, prompts: list[list[int]], n: int = NEW) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # full-length outputs
    model.generation_config.pad_token_id = 0
    with torch.inference_mode():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


LOGIT_PROMPTS = random_prompts([7, 19, 33], seed=5)


def prompt_logits(path: str, mc: ModelConfig | None = None, tp: TPGroup | None = None):
    """(each LOGIT_PROMPTS' last-token logits from one prompt step, the runner)."""
    cfg = EngineConfig(
        dtype="float32", page_size=PS, kv_cache_gb=0.01, tp_size=tp.size if tp else 1
    )
    runner = ModelRunner(cfg, path, mc or ModelConfig.from_dir(path), *([tp] if tp else []))
    batch, tables = prompt_batch(LOGIT_PROMPTS)
    return runner.step_logits(batch, tables), runner


def transformers_logits(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        return torch.stack([model(torch.tensor([p])).logits[0, -1] for p in LOGIT_PROMPTS])


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= 1e-4 * want.abs().max())


def pool_bytes(path: str, pages: int) -> float:
    """GiB of a KV pool of this many pages (float32)."""
    return pages * PS * ModelConfig.from_dir(path).kv_bytes_per_token(4) / (1 << 30)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_output_equals_transformers(model_dir, name):
    """Prompts of 3 to 30 tokens and 12 new ones, batched: through prompt chunks of 16 tokens,
    again from the prefix cache (chunks that start mid-sequence, over cached latents), and in a
    pool of 14 pages, which the four requests outgrow: some are retracted and recomputed."""
    path = model_dir(name)
    prompts = random_prompts([3, 11, 22, 30])
    expected = reference(path, prompts)
    engine = Engine(path, dtype="float32", page_size=PS, chunked_prefill_size=16, kv_cache_gb=0.01)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
    again = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == expected
    assert all(0 < o.cached_tokens < len(p) for o, p in zip(again, prompts) if len(p) > PS)
    engine.check()
    assert engine.scheduler.stats().kv_locked_tokens == 0
    tight = Engine(path, dtype="float32", page_size=PS, kv_cache_gb=pool_bytes(path, 14))
    assert [o.token_ids for o in tight.generate(prompts, GREEDY)] == expected
    assert tight.scheduler.stats().num_retractions_total > 0, "the small pool must preempt"
    tight.check()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prompt_logits_and_a_pool_of_latents(model_dir, name):
    """Last-token logits of prompts of 7, 19 and 33 tokens are transformers'; the KV pool holds
    one tensor a layer of kv_lora_rank + qk_rope_head_dim features a token (the latent and the
    rotated key part, the values being the latent: v is k), not per-head keys and values."""
    path = model_dir(name)
    got, runner = prompt_logits(path)
    want = transformers_logits(path)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)
    kv, layers = runner.kv, CONFIGS[name]().num_hidden_layers
    assert len(kv.k) == layers and kv.v is kv.k
    assert all(k.shape == (1, runner.num_pages * PS, RANK + ROPE) for k in kv.k)
    per_token = runner.mc.kv_bytes_per_token(4)
    assert per_token == layers * (RANK + ROPE) * 4
    expanded = layers * 4 * (NOPE + ROPE + V) * 4  # 4 heads' keys and values
    assert per_token * 4 < expanded  # (real models: 576 against 128 heads x 448, 99x)


def _attention_scale_without_mscale(mc: ModelConfig) -> ModelConfig:
    return dataclasses.replace(mc, attention_multiplier=(NOPE + ROPE) ** -0.5)


@pytest.mark.parametrize(
    "name, mutate",
    [
        ("v3", lambda mc: dataclasses.replace(mc, rope_interleave=False)),
        ("v2", lambda mc: dataclasses.replace(mc, rope_interleave=False)),
        ("v3", _attention_scale_without_mscale),
        ("v2", lambda mc: dataclasses.replace(mc, routed_scaling_factor=1.0)),
        ("v3", lambda mc: dataclasses.replace(mc, moe_renormalize=False)),
    ],
    ids=[
        "v3-rope-not-deinterleaved",
        "v2-rope-not-deinterleaved",
        "v3-softmax-scale-without-mscale",
        "v2-routed-scaling-dropped",
        "v3-topk-not-renormalised",
    ],
)
def test_each_detail_matters(model_dir, name, mutate):
    """Relay with its rope features rotated in the checkpoint's interleaved order as if they
    were neox's, its softmax scale without YaRN's mscale_all_dim, or a routing detail dropped
    computes other logits than transformers: the tests above would catch each."""
    path = model_dir(name)
    want = transformers_logits(path)
    got, _ = prompt_logits(path, mutate(ModelConfig.from_dir(path)))
    assert not close(got, want)


def test_latent_attends_in_the_c_kernels(model_dir, monkeypatch):
    """On CPU the latent's one kv head (4 query heads a group, 48 features) goes to Relay's C
    attention kernels, prompt chunks and decode steps alike (the torch path never runs), and the
    output is transformers' token for token."""
    cpu_kernels_or_skip()
    path = model_dir("v3")
    calls: set[str] = set()
    for fn in ("decode_attention", "extend_attention"):
        real = getattr(cpu_attention, fn)

        def spy(*args, _real=real, _fn=fn, **kwargs):
            out = _real(*args, **kwargs)
            assert out is not False, "the kernel refused the shape: the torch path ran"
            assert inspect.signature(_real).bind(*args, **kwargs).arguments["k"].shape[0] == 1
            calls.add(_fn)
            return out

        monkeypatch.setattr(cpu_attention, fn, spy)
    prompts = random_prompts([25, 31], seed=5)
    engine = Engine(path, dtype="float32", page_size=PS, kv_cache_gb=0.01)
    assert engine.runner.attn.kernel is not None
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == reference(path, prompts)
    assert calls == {"decode_attention", "extend_attention"}


def _tp_logits(rank: int, tp: TPGroup, paths: list[str]) -> list[torch.Tensor]:
    return [prompt_logits(path, tp=tp)[0] for path in paths]


def test_two_ranks_compute_the_logits_of_one(tmp_path, model_dir):
    """--tp 2: q and kv_b_proj split by heads (2 a rank), o_proj row-parallel (V2's bias added
    once), the latent and the routers on every rank, the experts' features split: both ranks'
    logits are one rank's (V2 and V3 in one pair of rank processes)."""
    paths = [model_dir("v2"), model_dir("v3")]
    ones = [prompt_logits(path)[0] for path in paths]
    for rank_logits in run_ranks(_tp_logits, tmp_path, paths):
        for got, one in zip(rank_logits, ones):
            torch.testing.assert_close(got, one, atol=1e-4 * one.abs().max().item(), rtol=0)


def test_ngram_speculation_and_a_regex(model_dir):
    """Verification steps (several new tokens over cached latents) give transformers' greedy
    tokens; a regex-constrained request's text matches it in full."""
    path = model_dir("v2_lite")
    prompts = [p[:6] * 5 for p in random_prompts([20, 25], seed=3)]  # repetitive: proposals match
    engine = Engine(
        path, dtype="float32", page_size=PS, kv_cache_gb=0.01, speculative_algorithm="ngram"
    )
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == reference(path, prompts)
    regex = r"[a-z]{3,8}"
    (out,) = engine.generate(
        [prompts[0]], SamplingParams(temperature=0.0, max_new_tokens=16, regex=regex)
    )
    assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text
    engine.check()


# ---- configs as the checkpoints write them -------------------------------------------------------
V2_LITE_RELEASED = dict(  # deepseek-ai/DeepSeek-V2-Lite's config.json (remote-code names)
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    scoring_func="softmax",
    routed_scaling_factor=1.0,
    vocab_size=102400,
    max_position_embeddings=163840,
    rope_theta=10000,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    bos_token_id=100000,
    eos_token_id=100001,
    tie_word_embeddings=False,
)


def test_released_configs():
    """DeepSeek-V2-Lite's and DeepSeek-V3's config.json: the pool's one head of 512 + 64
    features, the softmax scale with YaRN's mscale squared, the routers and dense first layers;
    what Relay does not implement refused by name."""
    lite = ModelConfig.from_hf_dict(V2_LITE_RELEASED)
    assert (lite.num_kv_heads, lite.head_dim, lite.q_lora_rank) == (1, 576, None)
    mscale = 0.1 * 0.707 * __import__("math").log(40) + 1.0
    assert lite.attention_scale == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)
    assert (lite.moe_routing, lite.mlp_only_layers, lite.moe_renormalize) == ("greedy", [0], False)
    assert lite.shared_expert_intermediate_size == 2 * 1408 and lite.rope_interleave
    assert lite.kv_bytes_per_token(2, tp_size=2) == 27 * 576 * 2  # replicated, not split
    v3 = ModelConfig.from_hf_dict(
        {
            **V2_LITE_RELEASED,
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "q_lora_rank": 1536,
            "n_routed_experts": 256,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 3,
            "moe_intermediate_size": 2048,
            "n_shared_experts": 1,
            "rope_scaling": {
                **V2_LITE_RELEASED["rope_scaling"],
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        }
    )
    assert (v3.moe_routing, v3.moe_n_group, v3.moe_topk_group) == ("noaux_tc", 8, 4)
    assert (v3.mlp_only_layers, v3.moe_renormalize, v3.routed_scaling_factor) == (
        [0, 1, 2],
        True,
        2.5,
    )
    assert v3.rope_interleave and v3.q_lora_rank == 1536 and v3.head_dim == 576
    for change, field in [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"topk_method": "noaux_tc"}, "topk_method"),
        ({"topk_method": "group_limited_greedy", "n_group": 3}, "n_group"),
    ]:
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_hf_dict({**V2_LITE_RELEASED, **change})


@pytest.mark.slow
def test_server_with_two_ranks_serves_v3_as_the_engine_does(model_dir):
    """The server path under --tp 2 (rank processes on shared memory, the latent on both):
    greedy completions of token-id prompts are the text of the offline Engine's tokens, which
    are transformers' (the tests above)."""
    from tests.helpers.server_utils import Server

    path = model_dir("v3")
    prompts = random_prompts([9, 30], seed=4)
    want = Engine(path, dtype="float32", kv_cache_gb=0.05).generate(prompts, GREEDY)
    server = Server(
        "--model-path", path, "--dtype", "float32", "--kv-cache-gb", "0.05", "--tp", "2"
    )
    try:
        with server.client() as c:
            for p, w in zip(prompts, want):
                body = {"prompt": p, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == w.text
    finally:
        server.stop()


def test_v3_multi_token_prediction_layers_are_skipped(model_dir, tmp_path):
    """A V3 checkpoint's layers past num_hidden_layers (num_nextn_predict_layers: its
    multi-token-prediction module) are not loaded, as transformers does not load them: the
    logits are the checkpoint's without them, quantized at load too (layer by layer)."""
    from safetensors.torch import load_file, save_file

    source = model_dir("v3")
    for f in os.listdir(source):
        if f != "model.safetensors":
            os.symlink(os.path.join(source, f), tmp_path / f)
    weights = load_file(os.path.join(source, "model.safetensors"))
    extra = {  # named as DeepSeek-V3's layer 61
        "model.layers.3.eh_proj.weight": torch.randn(64, 128),
        "model.layers.3.self_attn.kv_b_proj.weight": torch.randn(4 * (NOPE + V), RANK),
        "model.layers.3.mlp.experts.0.up_proj.weight": torch.randn(32, 64),
    }
    save_file({**weights, **extra}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    got, _ = prompt_logits(str(tmp_path))
    torch.testing.assert_close(got, prompt_logits(source)[0], atol=0, rtol=0)
    cfg = EngineConfig(dtype="float32", page_size=PS, kv_cache_gb=0.01, quantization="int8")
    ModelRunner(cfg, str(tmp_path), ModelConfig.from_dir(str(tmp_path)))
