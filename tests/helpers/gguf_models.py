"""Tiny seeded random-weight models of each architecture Relay reads from GGUF files (hidden 64,
the byte-level vocabulary of gguf_files), transformers' own model read from such a file, its
greedy output, and the fixtures that write Q8_0 and Q4_K_M-like files of them."""

from __future__ import annotations

import os
import shutil

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T

from relay import Engine, SamplingParams
from relay.execution import model_files
from relay.execution.block_rows import ALL_ROWS
from tests.helpers.gguf_files import VOCAB_SIZE, write_gguf

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.3,
    tie_word_embeddings=False,
    pad_token_id=VOCAB_SIZE - 1,  # (Phi-3's default, 32000, is past this vocabulary)
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# Gemma: tied embeddings (llama.cpp writes no output tensor for it), a window of 8 tokens that the
# prompts run past; Gemma 3 with 6 layers, where its fixed pattern makes the 6th global, and that
# layer's rope scaled (as Gemma 3 4B to 27B's: linear).
GEMMA = {**COMMON, "tie_word_embeddings": True, "sliding_window": 8}


def config(name: str):
    import transformers as t

    return {
        "llama": lambda: t.LlamaConfig(**COMMON),
        "llama-q8_0": lambda: t.LlamaConfig(**COMMON),
        # llama.cpp writes Mistral as "llama": transformers reads it back as a Llama, no window
        "mistral": lambda: t.MistralConfig(**COMMON, sliding_window=None),
        "qwen2": lambda: t.Qwen2Config(**COMMON),
        "qwen3": lambda: t.Qwen3Config(**{**COMMON, "head_dim": 32}),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**COMMON, **MOE, shared_expert_intermediate_size=48),
        # norm_topk_prob: as the released models (transformers' reader sets it: llama.cpp's rule)
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**COMMON, **MOE, norm_topk_prob=True),
        "phi3": lambda: t.Phi3Config(**COMMON),
        "gemma2": lambda: t.Gemma2Config(
            **GEMMA, attn_logit_softcapping=4.0, final_logit_softcapping=3.0
        ),
        "gemma3": lambda: t.Gemma3TextConfig(
            **{**GEMMA, "num_hidden_layers": 6},
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    }[name]()


# What each file states that transformers' GGUF reader drops (model_files._UNREAD_GGUF_FIELDS).
TOLD = {
    "qwen3": ("head_dim",),
    "qwen2_moe": ("moe_intermediate_size", "shared_expert_intermediate_size"),
    "qwen3_moe": ("moe_intermediate_size",),
    "gemma2": ("attn_logit_softcapping", "final_logit_softcapping"),
    "gemma3": ("rope_parameters",),
}


def random_model(name: str) -> torch.nn.Module:
    """Seeded random weights; Gemma's norms randomised too (a fresh model's are 0, where 1 + w and
    llama.cpp's stored w + 1 would not differ) and its embedding scaled down by sqrt(hidden), which
    it multiplies by."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(name), dtype=torch.float32)
    if name.startswith("gemma"):
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(0.0, 0.3)
            model.model.embed_tokens.weight /= COMMON["hidden_size"] ** 0.5
    return model


def transformers_on(path: str, name: str):
    """transformers' own model from the GGUF file, told what the file states that it drops."""
    from transformers import AutoModelForCausalLM

    told = {k: getattr(config(name), k) for k in TOLD.get(name, ())}
    folder, file = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file, dtype=torch.float32, **told
    ).eval()


def greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    model.generation_config.eos_token_id = None  # compare full-length outputs
    with torch.inference_mode():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


@pytest.fixture
def q8_0_file(tmp_path):
    """A factory: model name (one of config's) -> a Q8_0 GGUF file of it; each file's
    converted directory is removed from Relay's cache afterwards."""
    made = []

    def make(name: str) -> str:
        path = str(tmp_path / name / f"{name}.gguf")
        os.makedirs(os.path.dirname(path))
        write_gguf(path, random_model(name), qtype=gguf.GGMLQuantizationType.Q8_0)
        made.append(path)
        return path

    yield make
    for path in made:
        shutil.rmtree(model_files.converted_dir(path), ignore_errors=True)


def one_call_engine(path: str) -> Engine:
    """An engine on the file whose decode steps all run in one C call: start-up times the call
    against the layers (which a tiny model's layers can win); eligible is what is tested here."""
    engine = Engine(
        path,
        dtype="float32",
        kv_cache_gb=0.01,
        block_activations="float",
        weight_block_rows=ALL_ROWS,
    )
    assert engine.runner.model.use_decode_layers(engine.runner.attn), "eligible for the C call"
    return engine


Q4_K_M = {
    **{"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q4_K},
    **{"ffn_gate": T.Q5_K, "ffn_up": T.Q5_K, "ffn_down": T.Q6_K},
    **{"output": T.Q6_K, "token_embd": T.Q8_0},
}


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    """A tiny Llama written as llama.cpp writes a Q4_K_M / Q5_K_M file (Q4_K q/k/o, Q6_K v, down and
    output, Q5_K gate/up, Q8_0 embedding; hidden 256 and MLP 512: whole super-blocks), with the
    transformers model's greedy output on it; its converted directory removed afterwards."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**COMMON, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64})
    path = str(tmp_path_factory.mktemp("q4_k_m") / "tiny-q4_k_m.gguf")
    write_gguf(path, AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), qtype=Q4_K_M)
    yield path, cfg
    shutil.rmtree(model_files.converted_dir(path), ignore_errors=True)
