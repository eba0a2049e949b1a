"""Finding a standalone draft model and checking that it can draft for the target (no torch:
the launcher checks before it starts any process)."""

from __future__ import annotations

import os

from relay.config import EngineConfig, ModelConfig
from relay.execution.model_files import resolve_model_dir


def draft_model_dir(cfg: EngineConfig, target_dir: str) -> str:
    """The draft's HF directory: the given path (a GGUF is converted), or the target's own."""
    if cfg.speculative_draft_model_path is None:
        return target_dir
    return resolve_model_dir(cfg.speculative_draft_model_path)


def check_draft_model(target: ModelConfig, draft_dir: str, target_dir: str) -> ModelConfig:
    """The draft's config; raises ValueError unless it shares the target's vocabulary."""
    draft = ModelConfig.from_dir(draft_dir)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size}): speculative decoding needs one tokenizer"
        )
    if os.path.realpath(draft_dir) != os.path.realpath(target_dir) and _vocab(draft_dir) != _vocab(
        target_dir
    ):
        raise ValueError(
            "the draft model's tokenizer maps tokens to different ids than the target's: "
            "speculative decoding needs one tokenizer"
        )
    return draft


def _vocab(model_dir: str) -> dict[str, int]:
    from relay.text.tokenizer import Tokenizer

    return Tokenizer(model_dir, without_torch=True).hf.get_vocab()
