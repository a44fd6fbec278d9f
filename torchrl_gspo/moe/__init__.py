# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Routing Replay for Mixture-of-Experts models (:doc:`/moe`).

A product of its own beside the losses: it records which experts each token was routed
to and replays that routing when the batch is scored again. It never imports the loss
stack, and the losses never import it (``test/test_layering.py``). Every name is also
importable from :mod:`torchrl_gspo`.
"""

from __future__ import annotations

from torchrl_gspo.moe.engine_routes import (
    decode_sglang_routes,
    record_generation,
    routes_from_engine,
)
from torchrl_gspo.moe.routing import RecordRoutes, RoutingReplay, routing_volatility

__all__ = [
    "RecordRoutes",
    "RoutingReplay",
    "decode_sglang_routes",
    "record_generation",
    "routes_from_engine",
    "routing_volatility",
]
