# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The experts an inference engine routed each token to, as per-row routes."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["decode_sglang_routes", "routes_from_engine"]


def decode_sglang_routes(encoded: str | bytes, num_layers: int, top_k: int) -> torch.Tensor:
    """SGLang's ``meta_info["routed_experts"]`` as ``[rows, num_layers, top_k]``.

    SGLang (``--enable-return-routed-experts``) returns the routes as the base64
    encoding of a flattened int32 buffer over all decoder layers.

    Args:
        encoded (str | bytes): the base64 string.
        num_layers (int): the model's decoder layers (``num_hidden_layers``).
        top_k (int): experts per token (``num_experts_per_tok``).

    Returns:
        torch.Tensor: int32 routes, one row per routed position.

    Examples:
        >>> import base64
        >>> import numpy as np
        >>> from torchrl_gspo import decode_sglang_routes
        >>> raw = np.arange(12, dtype=np.int32)  # 3 positions, 2 layers, top-2
        >>> decode_sglang_routes(base64.b64encode(raw.tobytes()), 2, 2).shape
        torch.Size([3, 2, 2])
    """
    raw = base64.b64decode(encoded)
    if len(raw) % (4 * num_layers * top_k):
        raise ValueError(
            f"decode_sglang_routes: {len(raw) / 4:g} int32 values do not split into rows of "
            f"{num_layers} layers x top-{top_k}; pass the model's num_hidden_layers and "
            "num_experts_per_tok."
        )
    if not raw:  # a one-token sequence: no routed position
        return torch.empty(0, num_layers, top_k, dtype=torch.int32)
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(-1, num_layers, top_k)


def routes_from_engine(
    routes: Any,
    num_tokens: int,
    moe_layers: Sequence[int],
    *,
    start: int = 0,
    earlier: torch.Tensor | None = None,
) -> torch.Tensor:
    """An engine's routes of one sequence as per-row routes ``[n, layers, k]``.

    vLLM (``CompletionOutput.routed_experts``) and SGLang (after
    :func:`decode_sglang_routes`) return one route per position ``start .. n - 2`` of
    a sequence of ``n`` tokens (prompt and response), over all decoder layers: the
    last token was never fed to the model, and dense layers hold meaningless values
    (0). Row ``j`` is the route of token ``start + j``, whose forward gives the
    log-probability of token ``start + j + 1``. This keeps the MoE layers, takes the
    rows before ``start`` from ``earlier`` (the routes of the previous turn, in this
    format), and gives the last token experts ``0 .. k - 1``: its forward only
    predicts a token after the sequence, so it changes no log-probability of the
    sequence. The result is the format :class:`~torchrl_gspo.RecordRoutes` writes,
    which :meth:`~torchrl_gspo.RoutingReplay.replay_for` replays (:doc:`/moe`).

    Args:
        routes (numpy.ndarray | torch.Tensor): ``[n - 1 - start, num_layers, k]``
            integer expert indices (vLLM: a numpy uint8 or uint16 array, SGLang: int32).
        num_tokens (int): ``n``, the sequence's tokens.
        moe_layers (Sequence[int]): the decoder-layer indices of the MoE layers, in
            order (:attr:`RoutingReplay.num_layers` of them).

    Keyword Args:
        start (int, optional): the first routed position (vLLM's
            ``routed_experts_prompt_start``, SGLang's ``routed_experts_start_len``).
            Defaults to 0.
        earlier (torch.Tensor, optional): ``[>= start, layers, k]`` the routes of the
            first ``start`` tokens; required when ``start > 0``.

    Returns:
        torch.Tensor: int64 ``[n, len(moe_layers), k]``.

    Examples:
        >>> import numpy as np
        >>> from torchrl_gspo import routes_from_engine
        >>> engine = np.zeros((4, 3, 2), dtype=np.uint8)  # 5 tokens, 3 layers, top-2
        >>> engine[:, 1] = [[2, 3]] * 4  # layer 1 is the MoE layer
        >>> routes_from_engine(engine, 5, [1])[:, 0].tolist()  # the last token: 0, 1
        [[2, 3], [2, 3], [2, 3], [2, 3], [0, 1]]
    """
    routes = torch.as_tensor(routes).to(torch.int64)
    expected = num_tokens - 1 - start
    layers = list(moe_layers)
    top = max(layers, default=-1)
    if routes.ndim != 3 or routes.shape[0] != expected or top >= routes.shape[1]:
        raise ValueError(
            f"routes_from_engine: the engine's routes have shape {tuple(routes.shape)}; "
            f"expected [{expected}, >{top}, top_k]: one row per "
            f"position {start} .. {num_tokens - 2} of the {num_tokens} tokens (none for "
            "the last), over all decoder layers. Pass the sequence's token count and the "
            "start offset the engine used."
        )
    routes = routes[:, layers]
    last = torch.arange(routes.shape[-1]).expand(1, len(layers), -1)
    if start == 0:
        return torch.cat([routes, last])
    if earlier is None or earlier.shape[0] < start or earlier.shape[1:] != routes.shape[1:]:
        raise ValueError(
            f"routes_from_engine: start={start} needs the routes of the first {start} "
            f"tokens as earlier=[>= {start}, {len(layers)}, {routes.shape[-1]}] (the "
            "previous turn's routes, in this format)."
        )
    return torch.cat([earlier[:start].to(routes.dtype), routes, last])
