#!/usr/bin/env bash
# The test suite against torchrl-nightly and tensordict-nightly (forward compatibility:
# GSPOLoss calls GRPOLoss' private helpers, each pinned by test/test_grpo_contract.py).
# Exits with the suite's status.
# Usage: bash scripts/test_nightly.sh                 # the whole suite
#        NIGHTLY_TESTS="test/test_gspo.py" bash scripts/test_nightly.sh  # a part of it
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-nightly
. .venv-nightly/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet torchrl-nightly tensordict-nightly
# the package and its test dependencies, without its pins on torchrl / tensordict
python -m pip install --quiet --no-deps -e .
python -m pip install --quiet "transformers>=5.16.1" "tokenizers>=0.23.3" matplotlib tqdm \
    "pytest>=9.2.0" "pytest-xdist>=3.8.0"
python -c "import torchrl, tensordict; print('torchrl', torchrl.__version__, 'tensordict', tensordict.__version__)"
# shellcheck disable=SC2086
pytest -q ${NIGHTLY_TESTS:-}
