#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA device (about 10 minutes): the cost table on
# CUDA (3 fresh processes), the oracle tests and a bfloat16-autocast training step on
# CUDA. Run from a clone, in an environment with a CUDA build of torch:
#   bash scripts/gpu_check.sh
# Outputs: outputs/gpu/ (the benchmark's table and JSON, the tests' log).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python -m pip install --quiet -e ".[tests]"
mkdir -p outputs/gpu
pytest -m cuda -n 0 test/test_cuda.py 2>&1 | tee outputs/gpu/test_cuda.log
python benchmarks/bench_loss.py --device cuda --processes 3 --out outputs/gpu
