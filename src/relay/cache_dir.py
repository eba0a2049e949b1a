"""Relay's cache folder ($RELAY_CACHE_DIR, default ~/.cache/relay): converted GGUF models
(relay.execution.model_files) and built CPU kernels (relay.execution.kernels.cpu)."""

from __future__ import annotations

import os


def cache_dir() -> str:
    return os.environ.get("RELAY_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "relay"
    )
