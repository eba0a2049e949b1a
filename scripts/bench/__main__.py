"""`python -m scripts.bench SUBCOMMAND [flags]`: each subcommand's module parses its own flags."""

from __future__ import annotations

import importlib
import sys

from scripts import bench

SUBCOMMANDS = {
    "serving": "serving",
    "compare": "compare",
    "hf": "hf",
    "offline": "offline",
    "goodput": "goodput",
    "structured": "structured",
    "dp": "dp",
    "scheduler": "scheduler",
    "hardening": "hardening",
    "busy-host": "busy_host",
    "gguf-sizes": "gguf_sizes",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SUBCOMMANDS:
        print(bench.__doc__, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module = importlib.import_module(f"scripts.bench.{SUBCOMMANDS[argv[0]]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
