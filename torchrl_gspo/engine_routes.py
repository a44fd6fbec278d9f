# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Deprecated: moved to :mod:`torchrl_gspo.moe.engine_routes`; this path is removed in 0.4."""

from __future__ import annotations

import warnings

from torchrl_gspo.moe import engine_routes as _moved


def __getattr__(name: str):
    value = getattr(_moved, name)  # an unknown name raises AttributeError here
    warnings.warn(
        f"torchrl_gspo.engine_routes is deprecated and will be removed in 0.4: import {name} from "
        "torchrl_gspo.moe (or torchrl_gspo).",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
