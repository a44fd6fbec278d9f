# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""One torch thread per pytest-xdist worker, so that parallel workers share the cores."""

from __future__ import annotations

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_report_header(config) -> str:
    """Which copy of the package the suite tests (an installed wheel, or the tree)."""
    import torchrl_gspo

    return f"torchrl_gspo {torchrl_gspo.__version__}: {torchrl_gspo.__file__}"
