"""The launcher's model directory, with a GGUF file's first-use conversion done in a child process.

Converting (relay.execution.model_files.convert_gguf) imports torch and transformers' GGUF
reader; done in the launcher, which then becomes relay::http for the server's whole life, it
would leave libtorch mapped there (~200 MB resident) after every first start of a GGUF model,
the default model's included. A child converts instead, and exits; the launcher then finds the
converted directory in the cache. Everything else (a directory, a hub repo id, a GGUF already
converted) resolves here as before.
"""

from __future__ import annotations

import os
import subprocess
import sys

from procs.common import child_pythonpath
from relay.execution.model_files import (
    ModelFileError,
    converted_dir,
    default_model_file,
    resolve_model_dir,
    serves,
)

# The child: converts, and on a refusal prints its one-line message (for the launcher to log) and
# exits 2; anything else is a traceback on stderr and exit status 1.
_CONVERT = """
import sys
from procs.common import setup_logging
from relay.execution.model_files import ModelFileError, resolve_model_dir
setup_logging(sys.argv[2], sys.argv[3])
try:
    resolve_model_dir(sys.argv[1])
except ModelFileError as e:
    print(e)
    sys.exit(2)
"""


def resolve_model_dir_apart(
    model_path: str | None, log_level: str = "INFO", label: str = "http"
) -> str:
    """resolve_model_dir(model_path), converting a GGUF file not yet converted in a child
    process (its log lines tagged `label`); ModelFileError as resolve_model_dir raises it."""
    path = default_model_file() if model_path is None else os.path.expanduser(model_path)
    if needs_conversion(path):
        out = subprocess.run(
            [sys.executable, "-c", _CONVERT, path, log_level, label],
            env={**os.environ, "PYTHONPATH": child_pythonpath()},
            stdout=subprocess.PIPE,
            text=True,
        )
        said = out.stdout.strip().splitlines()
        if out.returncode == 2 and said:
            raise ModelFileError(said[-1])
        if out.returncode != 0:
            raise ModelFileError(f"converting {path} failed (exit status {out.returncode})")
    return resolve_model_dir(model_path)


def needs_conversion(path: str) -> bool:
    """A GGUF file whose converted directory is not in the cache yet."""
    return path.endswith(".gguf") and os.path.isfile(path) and not serves(converted_dir(path))
