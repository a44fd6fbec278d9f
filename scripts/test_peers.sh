#!/usr/bin/env bash
# The peer tests (peers/): GSPOLoss against TRL's own GRPOTrainer code on the same
# tensors, in their own environment (TRL pins its own transformers and accelerate).
# Usage: bash scripts/test_peers.sh [trl version]
set -euo pipefail
cd "$(dirname "$0")/.."
export TRL_VERSION="${1:-1.16.0}"
rm -rf .venv-peers
python3 -m venv .venv-peers
. .venv-peers/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet ".[tests]" "trl==${TRL_VERSION}"
python -c "import torch, trl, transformers; print('torch', torch.__version__, 'trl', trl.__version__, 'transformers', transformers.__version__)"
pytest -q peers
