"""Shared fixtures: tiny random-weight models saved like HF checkpoints, and the default model."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.helpers.tiny_models import tiny_config


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from relay.execution.model_files import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir):
    """A factory: arch name -> directory with a random-weight model and a tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    made: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in made:
            torch.manual_seed(0)
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
            model.save_pretrained(path)
            for name in os.listdir(
                default_model_dir
            ):  # any tokenizer will do: prompts are token ids
                if name.startswith("tokenizer") or name.endswith(".jinja"):
                    shutil.copy(os.path.join(default_model_dir, name), path)
            made[arch] = path
        return made[arch]

    return make
