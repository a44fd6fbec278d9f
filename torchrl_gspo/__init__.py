# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPO (Group Sequence Policy Optimization) losses for TorchRL."""

from __future__ import annotations

from torchrl_gspo.gspo import GSPOLoss, GSPOLossOutput, GSPOTokenLoss, GSPOTokenLossOutput
from torchrl_gspo.recompute import RecomputeOldLogProbs

__version__ = "0.1.0"

__all__ = [
    "GSPOLoss",
    "GSPOLossOutput",
    "GSPOTokenLoss",
    "GSPOTokenLossOutput",
    "RecomputeOldLogProbs",
    "__version__",
]
