"""Which optional features this installation lacks, and how to get them. The launcher logs
these at start, so a pip user learns that a README feature is off before a request is refused."""

from __future__ import annotations

import importlib.util
import os
import shutil


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def compiler() -> str | None:
    """The C compiler Relay's CPU kernels build with: relay.execution.kernels.cpu.compiler's rule
    (a test holds them equal), not imported from there because that module imports torch, and
    the launcher, relay::http, never does (docs/architecture.md)."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def missing_features() -> list[str]:
    """One line per feature that is off here: what it is, why, and how to turn it on."""
    off = []
    if not _installed("xgrammar"):
        off.append(
            "structured output (response_format, json_schema/regex/ebnf, forced tool calls): "
            "xgrammar is not installed; pip install 'relay[grammar]' (scripts/install.sh installs it)"
        )
    if not _installed("sglang_router"):
        off.append(
            "--dp replicas: sglang-router is not installed; pip install 'sglang-router>=0.3.2,<0.4'"
        )
    if compiler() is None:
        off.append(
            "Relay's C kernels for CPUs: no C compiler (gcc or $CC); the torch paths run instead"
        )
    return off
