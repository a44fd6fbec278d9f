#!/usr/bin/env bash
# The peer tests (peers/): the losses against TRL's own GRPOTrainer code and verl's
# own policy-loss functions on the same tensors, in their own environment (TRL pins
# its own transformers and accelerate).
# Usage: bash scripts/test_peers.sh [trl version] [verl version]
set -euo pipefail
cd "$(dirname "$0")/.."
export TRL_VERSION="${1:-1.16.0}"
export VERL_VERSION="${2:-0.9.1}"
rm -rf .venv-peers
python3 -m venv .venv-peers
. .venv-peers/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet ".[tests]" "trl==${TRL_VERSION}"
# verl's policy losses are plain torch: verl itself without its dependency pins
# (they would replace this environment's transformers and tensordict), and what its
# modules import (ray, omegaconf, codetiming)
python -m pip install --quiet --no-deps "verl==${VERL_VERSION}"
python -m pip install --quiet ray omegaconf codetiming
python -c "import torch, trl, verl, transformers; print('torch', torch.__version__, 'trl', trl.__version__, 'verl', verl.__version__, 'transformers', transformers.__version__)"
pytest -q peers
