#!/usr/bin/env bash
# Checks the upstream patch series (upstream/series, upstream/README.md). Its code
# hunks are applied to copies of the installed torchrl 0.14.1, and each check runs
# in fresh processes: two torchrl versions never share one.
#   1. this package's core and contract tests, and upstream/checks/test_equivalence.py
#      (the series' GSPOLoss and GSPOTokenLoss against this package's), on the series;
#   2. GRPOLoss, DAPO and CISPOLoss (upstream/checks/grpo_outputs.py): from the
#      release to the first patch only the listed fields change, each to its expected
#      value; from the first patch to the whole series nothing changes, bit for bit;
#   3. upstream's pinned linters (upstream/requirements-lint.txt) on the patched code.
# With UPSTREAM_RL=<a pytorch/rl checkout at ae9719f>, the test and docs hunks are
# applied to a copy of that checkout's test/, docs/ and scripts/, which then runs
# test/llm/test_llm_objectives.py -k TestLosses (upstream/checks/hub_stand_in.py
# answers the one hub tokenizer it loads), scripts/check-docstring-args and
# scripts/check-sphinx-section-underline; the patched test file is linted too.
# Usage, in the environment where torchrl_gspo and its tests are installed:
#   bash scripts/test_upstream.sh
#   UPSTREAM_RL=../rl bash scripts/test_upstream.sh
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
start=$SECONDS
patches=("$repo"/upstream/series/*.patch)
site=$(python -c "import os, torchrl; print(os.path.dirname(torchrl.__file__))")
version=$(python -c "import torchrl; print(torchrl.__version__)")
if [ "$version" != "0.14.1" ]; then
    echo "the series is made against torchrl 0.14.1; this environment has $version"
    exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT  # kept when a step fails: see run
run() {  # run LABEL COMMAND...: the command's output on failure, its last line on success
    local log="$work/$1.log"
    if "${@:2}" > "$log" 2>&1; then
        echo "$1: $(tail -n 1 "$log" | grep . || echo passed)"
    else
        tail -n 60 "$log"
        echo "$1: FAILED (the whole log: $log)"
        trap - EXIT
        exit 1
    fi
}
patched() {  # patched NAME N: the installed torchrl in $work/NAME with the first N patches
    mkdir -p "$work/$1"
    cp -r "$site" "$work/$1/torchrl"
    local patch
    for patch in "${patches[@]:0:$2}"; do
        (cd "$work/$1" && git apply --include='torchrl/*' "$patch")
    done
    PYTHONPATH="$work/$1" python -c "import torchrl; assert torchrl.__file__.startswith('$work/$1/')"
    # git apply skips paths silently inside another git work tree: check the result
    grep -q "def _clip_fraction" "$work/$1/torchrl/objectives/llm/grpo.py"
}
patched patch1 1
patched series "${#patches[@]}"
series=$work/series
echo "series: ${#patches[@]} patches on torchrl $version ($site), in $work"

run "core, contract and equivalence tests on the series" \
    env UPSTREAM_TORCHRL="$series/torchrl" PYTHONPATH="$series" pytest -q -p no:cacheprovider \
    test/test_gspo.py test/test_gspo_token.py test/test_robustness.py test/test_rollout.py \
    test/test_grpo_contract.py upstream/checks/test_equivalence.py

outputs=upstream/checks/grpo_outputs.py
run "GRPOLoss outputs, release" env -u PYTHONPATH python "$outputs" dump "$work/stock.pt"
run "GRPOLoss outputs, first patch" env PYTHONPATH="$work/patch1" python "$outputs" dump "$work/patch1.pt"
run "GRPOLoss outputs, series" env PYTHONPATH="$series" python "$outputs" dump "$work/series.pt"
run "GRPOLoss outputs compared" python "$outputs" compare "$work/stock.pt" "$work/patch1.pt" "$work/series.pt"

# upstream's linters, at its pins, in their own environment
install_linters() {
    python -m venv "$work/lint-venv" &&
        "$work/lint-venv/bin/python" -m pip install --quiet --upgrade pip &&
        "$work/lint-venv/bin/python" -m pip install --quiet -r upstream/requirements-lint.txt &&
        echo "pinned in upstream/requirements-lint.txt"
}
run "upstream's linters installed" install_linters
lint() {  # lint DIR FILE...: every pinned linter on FILEs, with the settings found in DIR
    # (a function called in `if` ignores `set -e`: every step is chained)
    local bin="$work/lint-venv/bin" file
    (
        cd "$1" &&
            "$bin/ufmt" check "${@:2}" &&
            "$bin/flake8" --config=setup.cfg "${@:2}" &&
            "$bin/autoflake" --check --remove-unused-variables --remove-all-unused-imports \
                "${@:2}" &&
            "$bin/codespell" "${@:2}" || exit 1
        for file in "${@:2}"; do
            if [[ $file == torchrl/* ]]; then
                "$bin/pydocstyle" --config=setup.cfg "$file" || exit 1
            fi
            cp "$file" "$work/pyupgrade.py" || exit 1
            "$bin/pyupgrade" --py311-plus "$work/pyupgrade.py" ||
                { echo "pyupgrade --py311-plus would rewrite $file"; exit 1; }
        done
    ) || return 1
    echo "ufmt (black 22.3.0, usort 1.0.3), flake8 6.1.0 and its plugins, autoflake, codespell,"\
        "pydocstyle, pyupgrade --py311-plus: clean"
}
code=(torchrl/objectives/llm/grpo.py torchrl/objectives/llm/__init__.py)
mkdir -p "$work/lint/torchrl/objectives/llm"
cp upstream/lint/setup.cfg upstream/lint/pyproject.toml "$work/lint/"
for file in "${code[@]}"; do cp "$series/$file" "$work/lint/$file"; done
run "linters on the patched code" lint "$work/lint" "${code[@]}"

if [ -n "${UPSTREAM_RL:-}" ]; then
    head=$(git -C "$UPSTREAM_RL" rev-parse HEAD)
    if [[ $head != ae9719f* ]]; then
        echo "UPSTREAM_RL must be a pytorch/rl checkout at ae9719f; $UPSTREAM_RL is at $head"
        exit 1
    fi
    up=$work/rl
    mkdir -p "$up"
    git -C "$UPSTREAM_RL" archive HEAD test docs scripts setup.cfg pytest.ini pyproject.toml |
        tar -x -C "$up"
    for patch in "${patches[@]}"; do (cd "$up" && git apply --exclude='torchrl/*' "$patch"); done
    run "upstream's TestLosses on the series" env -C "$up" HF_HUB_OFFLINE=1 \
        PYTHONPATH="$series:$repo/upstream/checks" pytest -q -p no:cacheprovider -p hub_stand_in \
        test/llm/test_llm_objectives.py -k TestLosses
    for file in "${code[@]}"; do mkdir -p "$up/$(dirname "$file")"; cp "$series/$file" "$up/$file"; done
    run "upstream's check-docstring-args" env -C "$up" python scripts/check-docstring-args "${code[@]}"
    docs=(docs/source/reference/llms.rst docs/source/reference/llms_objectives.rst)
    run "upstream's check-sphinx-section-underline" env -C "$up" \
        python scripts/check-sphinx-section-underline "${docs[@]}"
    run "linters on the patched tests" lint "$up" test/llm/test_llm_objectives.py
    run "codespell on the patched docs" env -C "$up" "$work/lint-venv/bin/codespell" "${docs[@]}"
fi
echo "upstream checks passed in $((SECONDS - start)) s"
