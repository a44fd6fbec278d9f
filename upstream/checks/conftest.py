# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The checks of the upstream series run on a patched copy of torchrl only.

``scripts/test_upstream.sh`` puts the patched copy first on ``PYTHONPATH`` and names
it in ``UPSTREAM_TORCHRL``; the test helpers of the package's own suite (``test/``)
are shared.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torchrl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test"))

_PATCHED = os.environ.get("UPSTREAM_TORCHRL")
if not _PATCHED or not Path(torchrl.__file__).resolve().is_relative_to(Path(_PATCHED).resolve()):
    raise RuntimeError(
        f"upstream/checks tests the patched torchrl, but torchrl was imported from "
        f"{torchrl.__file__} (UPSTREAM_TORCHRL={_PATCHED!r}): run them with "
        "`bash scripts/test_upstream.sh`."
    )


def pytest_report_header(config) -> str:
    return f"torchrl (patched copy): {torchrl.__file__}"
