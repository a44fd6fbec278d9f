#!/usr/bin/env bash
# The test suite on the versions vLLM pins (vLLM 0.33.0: torch==2.14.0,
# transformers>=5.16.1,<5.21): the oldest transformers of that range and torch 2.14.
# Usage: bash scripts/test_vllm_versions.sh [torch version] [transformers version]
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${1:-2.14.1}"
TRANSFORMERS_VERSION="${2:-5.16.1}"
python3 -m venv .venv-vllm-versions
. .venv-vllm-versions/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==${TORCH_VERSION}"
python -m pip install --quiet -e ".[tests]" "transformers==${TRANSFORMERS_VERSION}"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
pytest -q
