# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Every ``>>>`` example in the package's docstrings, run against the imported package."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import torchrl_gspo


def _examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = []
    for info in pkgutil.walk_packages(torchrl_gspo.__path__, prefix="torchrl_gspo."):
        tests += finder.find(importlib.import_module(info.name))
    return sorted(tests, key=lambda test: test.name)


EXAMPLES = _examples()


def test_public_classes_and_functions_have_examples():
    documented = {test.name.rsplit(".", 1)[-1] for test in EXAMPLES}
    assert set(torchrl_gspo.__all__) - {"__version__"} <= documented


@pytest.mark.parametrize("test", EXAMPLES, ids=lambda test: test.name)
def test_docstring_example(test):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    result = runner.run(test, out=report.append)
    assert result.failed == 0, "".join(report)
