# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The package's two products stay apart, and every public import of 0.3's layout works.

Routing Replay (``torchrl_gspo/moe/``) never imports the loss stack, and no module of
the loss stack imports ``moe/``; read from the modules' own import statements.
"""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

import torchrl_gspo

PACKAGE = Path(torchrl_gspo.__file__).parent
# the modules that only re-export: the package's namespace and the deprecated paths
REEXPORTS = {"__init__.py", "routing.py", "engine_routes.py"}
# __all__ at commit a2f9213, each name with the module it was imported from
OLD_PATHS = {
    "torchrl_gspo.diagnostics": ["SequenceStatistics"],
    "torchrl_gspo.distributed": [
        "GlobalBatchStepper",
        "all_reduce_diagnostics",
        "set_sequence_scale",
    ],
    "torchrl_gspo.engine_routes": [
        "decode_sglang_routes",
        "record_generation",
        "routes_from_engine",
    ],
    "torchrl_gspo.gmpo": ["GMPOLoss", "GMPOLossOutput"],
    "torchrl_gspo.gspo": ["GSPOLoss", "GSPOLossOutput", "GSPOTokenLoss", "GSPOTokenLossOutput"],
    "torchrl_gspo.luspo": ["LUSPOLoss", "LUSPOLossOutput"],
    "torchrl_gspo.recompute": ["RecomputeOldLogProbs"],
    "torchrl_gspo.rollout": ["RolloutCorrection", "RolloutTerms", "rollout_terms"],
    "torchrl_gspo.routing": ["RecordRoutes", "RoutingReplay", "routing_volatility"],
    "torchrl_gspo.sapo": ["SAPOLoss", "SAPOLossOutput"],
    "torchrl_gspo.scores": ["Scores"],
    "torchrl_gspo.vespo": ["VESPOLoss", "VESPOLossOutput"],
}
MOVED = {"torchrl_gspo.routing", "torchrl_gspo.engine_routes"}


def imported(path: Path) -> set[str]:
    """The absolute module names a file imports (``from x import y`` gives ``x`` and
    ``x.y``: ``y`` may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.split(".")[0] == "torchrl_gspo"}


def test_moe_imports_nothing_of_the_loss_stack():
    files = sorted((PACKAGE / "moe").glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "routing.py", "engine_routes.py"}
    for path in files:
        outside = {n for n in imported(path) if not n.startswith("torchrl_gspo.moe")}
        assert not outside, f"{path.name} imports {outside}"


def test_the_loss_stack_imports_nothing_of_moe():
    files = [p for p in PACKAGE.glob("*.py") if p.name not in REEXPORTS]
    assert len(files) >= 10
    for path in files:
        moe = {n for n in imported(path) if n.startswith("torchrl_gspo.moe")}
        assert not moe, f"{path.name} imports {moe}"


def test_the_layering_check_sees_an_import(tmp_path):
    """The check reads both spellings of an import of ``moe/``."""
    probe = tmp_path / "probe.py"
    probe.write_text("from torchrl_gspo import moe\nimport torchrl_gspo.moe.routing\n")
    assert imported(probe) >= {"torchrl_gspo.moe", "torchrl_gspo.moe.routing"}


@pytest.mark.parametrize(("module", "names"), list(OLD_PATHS.items()))
def test_every_public_name_of_0_3_imports_from_its_old_path(module, names):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module(module)
        values = [getattr(old, name) for name in names]
    deprecated = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    deprecated = [w for w in deprecated if module in str(w.message)]
    for name, value in zip(names, values, strict=True):
        assert getattr(torchrl_gspo, name) is value and name in torchrl_gspo.__all__
    if module in MOVED:  # the moved modules warn once per name, naming the new path
        assert len(deprecated) == len(names)
        assert all("torchrl_gspo.moe" in str(w.message) for w in deprecated)
        for name, value in zip(names, values, strict=True):
            assert getattr(torchrl_gspo.moe, name) is value
    else:
        assert not deprecated


def test_an_unknown_name_on_a_moved_path_raises_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with pytest.raises(AttributeError):
            importlib.import_module("torchrl_gspo.routing").NotAName  # noqa: B018
