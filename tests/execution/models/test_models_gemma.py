"""Mistral (sliding window), Gemma 2 and Gemma 3 (text) compute what transformers does.

Tiny seeded random-weight checkpoints made from transformers' config classes, with a sliding
window of 8 tokens so that prompts and generations run far past it: greedy float32 output token
for token through the offline Engine (prompt chunks, again from the prefix cache, under
retraction, under n-gram speculation), a prompt step's logits (soft-capped), bfloat16
next-token agreement, tensor parallelism over 2 CPU ranks, one request through the server, and
the configs as the released checkpoints write them. Gemma's norm weights are randomised too (a
fresh model's are 0, where (1 + w) and w would differ only by a constant), and its embedding
divided by sqrt(hidden_size), which it multiplies by: else the token's own embedding dominates
every layer's output and greedy decoding repeats the last prompt token whatever the layers do.
"""

from __future__ import annotations

import inspect
import os
import shutil

import pytest
import torch

from relay import Engine, SamplingParams
from relay.config import EngineConfig, ModelConfig
from relay.execution.attention import backend_class, resolve_backend_name
from relay.execution.distributed import TPGroup
from relay.execution.kernels import cpu_attention
from relay.execution.model_runner import ModelRunner
from relay.memory.kv_cache import KVCache
from tests.helpers.engine_checks import check_three_ways, random_prompts, reference
from tests.helpers.kernel_helpers import cpu_kernels_or_skip
from tests.helpers.model_families import (
    COMMON,
    LOGIT_PROMPTS,
    PS,
    WINDOW,
    prompt_batch,
    tiny_model_maker,
)
from tests.helpers.ranks import run_ranks
from tests.helpers.tiny_models import TINY_VOCAB


def mistral_config():
    from transformers import MistralConfig

    return MistralConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=False)


def gemma2_config():
    from transformers import Gemma2Config

    # caps small enough to bite on random weights; query_pre_attn_scalar unlike head_dim
    return Gemma2Config(
        **COMMON,
        num_hidden_layers=2,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=3.0,
        tie_word_embeddings=False,
    )


def gemma3_config():
    from transformers import Gemma3TextConfig

    # two sliding layers to one global (the releases: five to one); the global layers' rope scaled
    return Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=3,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    )


CONFIGS = {"mistral": mistral_config, "gemma2": gemma2_config, "gemma3": gemma3_config}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return tiny_model_maker(tmp_path_factory, default_model_dir, CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_output_equals_transformers(model_dir, name):
    """Prompts of 3 to 40 tokens (the window is 8) and 16 new tokens: through prompt chunks of 24
    tokens, again from the prefix cache (chunks that start mid-sequence), and in a pool small
    enough to force retraction (Gemma's; Mistral's requests wait for room there instead)."""
    config = CONFIGS[name]()
    small = 40 * PS * (config.num_hidden_layers * 2 * 16 * 2 * 4) / (1 << 30)  # ~40 pages
    check_three_ways(
        model_dir(name),
        random_prompts(TINY_VOCAB, [3, 9, 13, 25, 31, 40]),
        small,
        # Mistral's requests give back the pages behind their window (its every layer slides):
        # even 14 pages, the longest request's, never run out (test_sliding_window_kv retracts).
        retracts=name != "mistral",
        page_size=PS,
        chunked_prefill_size=24,
        kv_cache_gb=0.01,
    )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_windows_and_caps_attend_in_the_c_kernels(model_dir, name, monkeypatch):
    """On CPU every layer's window and the soft-cap go to Relay's C attention kernels, prompt
    chunks and decode steps alike, and the output is still transformers' token for token: what
    the tests above compare is the kernels' attention, not the torch path's."""
    cpu_kernels_or_skip()
    path = model_dir(name)
    calls: set[tuple[str, int | None, float | None]] = set()
    for fn in ("decode_attention", "extend_attention"):
        real = getattr(cpu_attention, fn)

        def spy(*args, _real=real, _fn=fn, **kwargs):
            bound = inspect.signature(_real).bind(*args, **kwargs).arguments
            out = _real(*args, **kwargs)
            assert out is not False, "the kernel refused the shape: the torch path ran"
            calls.add((_fn, bound.get("window"), bound.get("softcap")))
            return out

        monkeypatch.setattr(cpu_attention, fn, spy)
    prompts = random_prompts(TINY_VOCAB, [25, 31], seed=5)
    eng = Engine(path, dtype="float32", page_size=PS, kv_cache_gb=0.01)
    assert eng.runner.attn.kernel is not None
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference(path, prompts, 8)
    mc = ModelConfig.from_dir(path)
    want = {
        (fn, w, mc.attn_logit_softcap)
        for fn in ("decode_attention", "extend_attention")
        for w in mc.layer_windows
    }
    assert calls == want and WINDOW in mc.layer_windows


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_ngram_speculation_verifies_within_the_window(model_dir, name):
    """Verification steps (several new tokens after a cached prefix) see each layer's window too."""
    path = model_dir(name)
    prompts = [
        p[:6] * 5 for p in random_prompts(TINY_VOCAB, [20, 25, 31], seed=3)
    ]  # repetitive: proposals match
    expected = reference(path, prompts, 16)
    eng = Engine(
        path, dtype="float32", page_size=PS, kv_cache_gb=0.01, speculative_algorithm="ngram"
    )
    outs = eng.generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == expected
    eng.check()


def runner_logits(path: str, dtype: str = "float32", tp: TPGroup | None = None) -> torch.Tensor:
    cfg = EngineConfig(dtype=dtype, page_size=PS, kv_cache_gb=0.01, tp_size=tp.size if tp else 1)
    runner = ModelRunner(cfg, path, ModelConfig.from_dir(path), *([tp] if tp else []))
    batch, tables = prompt_batch(LOGIT_PROMPTS)
    return runner.step_logits(batch, tables)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prompt_logits_are_transformers_logits(model_dir, name):
    """Last-token logits of prompts of 7, 19 and 33 tokens: Gemma 2's final soft-cap included."""
    from transformers import AutoModelForCausalLM

    path = model_dir(name)
    got = runner_logits(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        want = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in LOGIT_PROMPTS])
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)
    if name == "gemma2":
        assert want.abs().max() < 3.0, "the final soft-cap (3.0) bounds the logits"


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_bfloat16_predicts_the_next_token_transformers_does(model_dir, name):
    """Teacher-forced: each token Relay picks in bfloat16 is transformers' bfloat16 top token or
    tied with it (Gemma 2's final cap of 3.0 leaves many bfloat16 logits tied at the top: there
    transformers' own bfloat16 argmax disagrees with its float32 one on 1 token in 5)."""
    from transformers import AutoModelForCausalLM

    path = model_dir(name)
    prompts = random_prompts(TINY_VOCAB, [6, 11, 23, 40], seed=2)
    outs = Engine(path, dtype="bfloat16", page_size=PS, kv_cache_gb=0.01).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    agree = total = 0
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            logits = model(torch.tensor([p + o.token_ids[:-1]])).logits[0, len(p) - 1 :]
            mine = logits.gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
            agree += (
                (mine == logits.max(-1).values).sum().item()
            )  # transformers' top token, or tied with it
            total += len(o.token_ids)
    assert agree / total >= 0.9, (
        f"{agree}/{total} next-token predictions agree with transformers (bf16)"
    )


def _tp_logits(rank: int, tp: TPGroup, path: str) -> torch.Tensor:
    return runner_logits(path, tp=tp)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_ranks_compute_the_logits_of_one(tmp_path, model_dir, name):
    """--tp 2: heads, MLP features and the vocabulary split over two CPU ranks (norms, windows and
    caps on every rank): both ranks' logits are one rank's."""
    path = model_dir(name)
    one = runner_logits(path)
    for got in run_ranks(_tp_logits, tmp_path, path):
        torch.testing.assert_close(got, one, atol=1e-4 * one.abs().max().item(), rtol=0)


@pytest.mark.slow
def test_server_serves_gemma2_as_transformers_does(model_dir):
    """The server path: greedy completions of token-id prompts, past the window, are the text of
    transformers' tokens (the Engine's, which are transformers' token for token)."""
    from tests.helpers.server_utils import assert_served_completions_equal

    path = model_dir("gemma2")
    prompts = random_prompts(TINY_VOCAB, [9, 30], seed=4)
    want = Engine(path, dtype="float32", kv_cache_gb=0.05).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    )
    assert [w.token_ids for w in want] == reference(path, prompts, 10)
    assert_served_completions_equal(path, prompts, want)


# ---- configs as the checkpoints write them -------------------------------------------------------
def test_released_gemma3_config_reads_its_two_ropes_and_layer_pattern():
    """google/gemma-3-*'s text config: rope_theta and rope_scaling for the global layers,
    rope_local_base_freq for the sliding ones, sliding_window_pattern (no layer_types)."""
    released = dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=262208,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=1024,
        sliding_window_pattern=6,
        query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh",
    )
    mc = ModelConfig.from_hf_dict(released)
    assert mc.layer_windows == [1024] * 5 + [None] + [1024] * 5 + [None]
    assert (mc.rope_theta, mc.rope_scaling["factor"], mc.local_rope_theta) == (1e6, 8.0, 1e4)
    assert mc.qk_norm and mc.tie_word_embeddings and mc.attn_logit_softcap is None
    assert mc.attention_scale == 256**-0.5
    # google/gemma-3-4b-it: a multimodal config whose text_config leaves most fields to the defaults
    multimodal = ModelConfig.from_hf_dict(
        dict(
            architectures=["Gemma3ForConditionalGeneration"],
            model_type="gemma3",
            eos_token_id=[1, 106],
            text_config=dict(
                hidden_size=2560,
                intermediate_size=10240,
                model_type="gemma3_text",
                num_hidden_layers=34,
                rope_scaling={"factor": 8.0, "rope_type": "linear"},
                sliding_window=1024,
            ),
        )
    )
    assert (
        multimodal.architecture,
        multimodal.num_heads,
        multimodal.num_kv_heads,
        multimodal.head_dim,
    ) == ("Gemma3ForCausalLM", 8, 4, 256)
    assert multimodal.eos_token_ids == [1, 106] and multimodal.vocab_size == 262208
    assert multimodal.layer_windows == ([1024] * 5 + [None]) * 5 + [1024] * 4
    assert (
        multimodal.rope_theta,
        multimodal.rope_scaling["factor"],
        multimodal.local_rope_theta,
    ) == (1e6, 8.0, 1e4)
    written = ModelConfig.from_hf_dict(
        gemma3_config().to_dict()
    )  # transformers 5's per-layer-type ropes
    assert (written.rope_theta, written.rope_scaling["factor"], written.local_rope_theta) == (
        1e5,
        4.0,
        1e3,
    )
    assert written.layer_windows == [WINDOW, WINDOW, None]


def test_gemma2_and_mistral_configs():
    from transformers import Gemma2Config, MistralConfig

    g2 = ModelConfig.from_hf_dict(Gemma2Config(num_hidden_layers=4).to_dict())
    assert g2.layer_windows == [4096, None, 4096, None]
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.query_pre_attn_scalar) == (
        50.0,
        30.0,
        256,
    )
    assert g2.masks_attention(8192) and not g2.qk_norm
    assert ModelConfig.from_hf_dict(MistralConfig(num_hidden_layers=2).to_dict()).layer_windows == [
        4096,
        4096,
    ]
    unwindowed = ModelConfig.from_hf_dict(
        MistralConfig(num_hidden_layers=2, sliding_window=None).to_dict()
    )
    assert unwindowed.layer_windows == [] and not unwindowed.masks_attention(1 << 20)
    windowed = ModelConfig.from_hf_dict(MistralConfig(num_hidden_layers=2).to_dict())
    # a window no shorter than the context never hides a key: the fast attention paths stay
    assert windowed.attention_windows(4096) == [] and windowed.attention_windows(4097) == [
        4096,
        4096,
    ]


def test_qwen2_and_phi3_windows_follow_transformers():
    """Qwen2 slides only where use_sliding_window, from max_window_layers on (its released configs
    name a window they do not use); Phi-3 slides on every layer where sliding_window is set."""
    from transformers import Phi3Config, Qwen2Config

    on = Qwen2Config(
        use_sliding_window=True, sliding_window=8, max_window_layers=1, num_hidden_layers=3
    ).to_dict()
    assert ModelConfig.from_hf_dict(on).layer_windows == [None, 8, 8]
    released = {k: v for k, v in on.items() if k != "layer_types"}
    assert ModelConfig.from_hf_dict(released).layer_windows == [None, 8, 8]
    assert ModelConfig.from_hf_dict({**released, "use_sliding_window": False}).layer_windows == []
    assert ModelConfig.from_hf_dict(
        Phi3Config(num_hidden_layers=2, sliding_window=2047).to_dict()
    ).layer_windows == [2047, 2047]


def test_what_relay_does_not_implement_is_refused_by_name():
    from transformers import Gemma2Config

    cfg = Gemma2Config(num_hidden_layers=2).to_dict()
    with pytest.raises(ValueError, match="hidden_activation 'silu'"):
        ModelConfig.from_hf_dict({**cfg, "hidden_activation": "silu"})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict({**cfg, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict({**cfg, "layer_types": ["sliding_attention"]})


def test_backends_that_cannot_mask_refuse_and_auto_picks_torch():
    """Sliding windows and soft-caps are applied by the torch backend only: auto picks it on
    CUDA for such a model, and a backend that cannot apply them refuses at start."""
    cuda = torch.device("cuda")
    assert resolve_backend_name("auto", cuda, torch.bfloat16, masked=True) == "torch"

    class NoMasks(backend_class("torch", torch.device("cpu"))):
        masks_scores = False
        name = "nomasks"

    kv = KVCache(2, 4, PS, 2, 16, torch.float32, torch.device("cpu"), layout="HND")
    with pytest.raises(ValueError, match="nomasks attention backend applies no sliding window"):
        NoMasks(kv=kv, num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, windows=[8, None])
    with pytest.raises(ValueError, match="soft-capping"):
        NoMasks(kv=kv, num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, softcap=50.0)


def test_gemma3_multimodal_checkpoint_serves_its_text_tower(tmp_path, default_model_dir):
    """A Gemma3ForConditionalGeneration checkpoint (a tiny SigLIP vision tower beside the text
    model): Relay loads its text tower and skips the vision weights; prompt logits and greedy
    output of text prompts are transformers' (the whole model's, given token ids only)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(0)
    vision = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    model = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=gemma3_config().to_dict(),
            vision_config=vision.to_dict(),
            mm_tokens_per_image=4,
        )
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and "vision" not in n:
                p.normal_(0.0, 0.3)
        model.get_input_embeddings().weight /= COMMON["hidden_size"] ** 0.5
    path = str(tmp_path)
    model.eval().save_pretrained(path)
    for f in os.listdir(default_model_dir):
        if f.startswith("tokenizer"):
            shutil.copy(os.path.join(default_model_dir, f), path)
    mc = ModelConfig.from_dir(path)
    assert mc.architecture == "Gemma3ForCausalLM" and mc.layer_windows == [WINDOW, WINDOW, None]
    with torch.inference_mode():
        want = torch.stack(
            [model(input_ids=torch.tensor([p])).logits[0, -1] for p in LOGIT_PROMPTS]
        )
    got = runner_logits(path)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)
    prompts = random_prompts(TINY_VOCAB, [5, 20, 33], seed=6)
    with torch.inference_mode():
        expected = [
            model.generate(
                torch.tensor([p]),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    outs = Engine(path, dtype="float32", page_size=PS, kv_cache_gb=0.01).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == expected
