# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPO (Group Sequence Policy Optimization) losses for TorchRL."""

from __future__ import annotations

from torchrl_gspo.diagnostics import SegmentTerms, SequenceStatistics
from torchrl_gspo.distributed import GlobalBatchStepper, all_reduce_diagnostics, set_sequence_scale
from torchrl_gspo.gmpo import GMPOLoss, GMPOLossOutput
from torchrl_gspo.gspo import GSPOLoss, GSPOLossOutput, GSPOTokenLoss, GSPOTokenLossOutput
from torchrl_gspo.luspo import LUSPOLoss, LUSPOLossOutput
from torchrl_gspo.moe import (
    RecordRoutes,
    RoutingReplay,
    decode_sglang_routes,
    record_generation,
    routes_from_engine,
    routing_volatility,
)
from torchrl_gspo.recompute import RecomputeOldLogProbs
from torchrl_gspo.rollout import RolloutCorrection, RolloutTerms, rollout_terms
from torchrl_gspo.sampler_audit import SamplerAudit, SamplerFinding
from torchrl_gspo.sapo import SAPOLoss, SAPOLossOutput
from torchrl_gspo.scores import Scores
from torchrl_gspo.subsequence import SubsequenceLoss, SubsequenceLossOutput
from torchrl_gspo.trust_region import KLEarlyStop
from torchrl_gspo.vespo import VESPOLoss, VESPOLossOutput

__version__ = "0.3.0.dev0"

__all__ = [
    "GMPOLoss",
    "GMPOLossOutput",
    "GlobalBatchStepper",
    "GSPOLoss",
    "GSPOLossOutput",
    "GSPOTokenLoss",
    "GSPOTokenLossOutput",
    "KLEarlyStop",
    "LUSPOLoss",
    "LUSPOLossOutput",
    "RecomputeOldLogProbs",
    "RecordRoutes",
    "RolloutCorrection",
    "RolloutTerms",
    "RoutingReplay",
    "SAPOLoss",
    "SAPOLossOutput",
    "SamplerAudit",
    "SamplerFinding",
    "Scores",
    "SegmentTerms",
    "SequenceStatistics",
    "SubsequenceLoss",
    "SubsequenceLossOutput",
    "VESPOLoss",
    "VESPOLossOutput",
    "all_reduce_diagnostics",
    "decode_sglang_routes",
    "record_generation",
    "rollout_terms",
    "routes_from_engine",
    "routing_volatility",
    "set_sequence_scale",
    "__version__",
]
