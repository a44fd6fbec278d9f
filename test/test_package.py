# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The installed package: its public names and its type-information marker."""

from __future__ import annotations

from pathlib import Path

import torchrl_gspo


def test_package_ships_py_typed():
    assert (Path(torchrl_gspo.__file__).parent / "py.typed").is_file()


def test_public_names_resolve():
    for name in torchrl_gspo.__all__:
        assert getattr(torchrl_gspo, name) is not None, name
