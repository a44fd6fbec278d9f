#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA device (at most 10 minutes): the oracle tests
# and a bfloat16-autocast training step on CUDA, then the cost table on CUDA (3 fresh
# processes). Needs no network: run it from a clone with a Python whose torch has CUDA,
# and with torchrl, tensordict, transformers, tokenizers, pytest and pytest-xdist
# installed, or carried as wheels in WHEELS=<folder>:
#   bash scripts/gpu_check.sh                      # or: WHEELS=wheels bash scripts/gpu_check.sh
# Outputs: outputs/gpu/ (the tests' log, the benchmark's table and JSON).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install --quiet --no-index --find-links "$WHEELS" \
        torchrl tensordict transformers tokenizers pytest pytest-xdist tqdm matplotlib
fi
python3 -m pip install --quiet --no-deps --no-build-isolation -e .
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
mkdir -p outputs/gpu
timeout 240 python3 -m pytest -m cuda -n 0 -p no:cacheprovider test/test_cuda.py 2>&1 \
    | tee outputs/gpu/test_cuda.log
timeout 330 python3 benchmarks/bench_loss.py --device cuda --processes 3 --out outputs/gpu
