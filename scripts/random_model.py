"""A random-weight HF checkpoint with a tokenizer next to it (the default model's tokenizer when it is
already converted, else a tiny word-level one): what scripts/gpu_check.py builds and the GPU tests load."""

from __future__ import annotations

import os
import shutil

import torch


def _default_tokenizer_dir() -> str | None:
    """The default model's converted directory, if it already exists (never converts)."""
    try:
        from relay.cache_dir import cache_dir
        from relay.execution import model_files

        gguf = model_files.default_model_file()
        out = os.path.join(cache_dir(), "gguf", model_files._gguf_key(gguf))
        return out if os.path.exists(os.path.join(out, model_files.CONVERTED_MARKER)) else None
    except Exception:
        return None


def save_tokenizer(path: str) -> str:
    """Copy the default model's tokenizer files into path, or write a tiny word-level one."""
    src = _default_tokenizer_dir()
    if src is not None:
        for name in os.listdir(src):
            if name.startswith("tokenizer") or name.endswith(".jinja"):
                shutil.copy(os.path.join(src, name), path)
        return "default model's tokenizer"
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i + 3 for i in range(509)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    return "tiny word-level tokenizer"


def save_random_model(
    path: str, hf_config, device: str = "cpu", dtype=torch.float32, seed: int = 0
) -> str:
    """A random-weight HF checkpoint of hf_config plus a tokenizer; returns path."""
    from transformers import AutoModelForCausalLM

    os.makedirs(path, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype)
    model.save_pretrained(path)
    save_tokenizer(path)
    return path
