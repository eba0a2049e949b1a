"""What the model-family tests (Mistral, Gemma, Granite, OLMo 2, StarCoder 2, the MoE models, the
sliding-window KV) share: a tiny shape with a sliding window of WINDOW tokens, a maker of seeded
random checkpoints from config classes (norms randomised, Gemma's embedding scaled down), and a
prompt step of LOGIT_PROMPTS built by hand for comparing logits."""

from __future__ import annotations

import os
import shutil

import torch

from tests.helpers.engine_checks import random_prompts
from tests.helpers.tiny_models import TINY_VOCAB

WINDOW = 8
PS = 4
COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.3,
    eos_token_id=TINY_VOCAB - 1,
    bos_token_id=1,
    pad_token_id=0,
    sliding_window=WINDOW,
)


def tiny_model_maker(tmp_path_factory, default_model_dir, configs: dict, finish=None):
    """A factory: name -> the directory of a seeded random model of configs[name]() (its norms
    randomised, Gemma's embedding scaled down by sqrt(hidden), which it multiplies by: else the
    embedding drowns the layers; then finish(model), where given, under no_grad), made once; the
    default model's tokenizer files beside it (the prompts are token ids: any tokenizer will do)."""
    from transformers import AutoModelForCausalLM

    made: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in made:
            torch.manual_seed(0)
            path = str(tmp_path_factory.mktemp(name))
            config = configs[name]()
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "norm" in n:
                        p.normal_(0.0, 0.3)
                if config.model_type.startswith("gemma"):
                    model.model.embed_tokens.weight /= config.hidden_size**0.5
                if finish is not None:
                    finish(model)
            model.save_pretrained(path)
            for f in os.listdir(default_model_dir):
                if f.startswith("tokenizer"):
                    shutil.copy(os.path.join(default_model_dir, f), path)
            made[name] = path
        return made[name]

    return make


def prompt_batch(prompts: list[list[int]]):
    from relay.step import BatchInput

    tables, first = [], 1
    for p in prompts:
        n = -(-len(p) // PS)
        tables.append(list(range(first, first + n)))
        first += n
    n = len(prompts)
    batch = BatchInput(
        step=0,
        sids=list(range(n)),
        input_ids=[t for p in prompts for t in p],
        prefix_lens=[0] * n,
        extend_lens=[len(p) for p in prompts],
        page_starts=[0] * n,
        new_pages=tables,
        sample=[True] * n,
        output_lens=[0] * n,
    )
    return batch, tables


LOGIT_PROMPTS = random_prompts(TINY_VOCAB, [7, 19, 33], seed=5)
