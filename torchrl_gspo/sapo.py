# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""SAPO: a soft, sign-dependent gate instead of a hard clip."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from torchrl.modules.llm import LLMWrapperBase
from torchrl.objectives.llm.grpo import LLMLossOutput

from torchrl_gspo import _arguments
from torchrl_gspo.gspo import GSPOLoss, GSPOLossOutput
from torchrl_gspo.scores import Scores

__all__ = ["SAPOLoss", "SAPOLossOutput"]


class SAPOLossOutput(GSPOLossOutput):
    pass


SAPOLossOutput.__doc__ = r"""SAPO loss output: the fields of :class:`~torchrl_gspo.GSPOLossOutput`.

``objective_diagnostic`` is the mean over valid tokens of the gate's gradient weight
:math:`4\sigma(1 - \sigma)` (1 on-policy; towards 0 where the gate saturates). SAPO
does not clip: the ``clip_fraction`` fields count the sequences whose GSPO ratio
leaves ``clip_epsilon``'s band, a measure of drift.

Examples:
    >>> from torchrl_gspo import GSPOLossOutput, SAPOLossOutput
    >>> issubclass(SAPOLossOutput, GSPOLossOutput)
    True
"""


class SAPOLoss(GSPOLoss):
    r"""SAPO: Soft Adaptive Policy Optimization.

    SAPO (Qwen, `arXiv:2511.20347 <https://arxiv.org/abs/2511.20347>`_, Eqs. 5-6)
    replaces the hard clip by a soft gate on each token's ratio
    :math:`r_{i,t} = \pi_\theta / \pi_\text{old}`:

    .. math::

        J(\theta) = \mathbb{E}\Big[\frac{1}{G} \sum_{i=1}^{G} \frac{1}{|y_i|}
            \sum_t \frac{4}{\tau_{i,t}} \sigma\big(\tau_{i,t} (r_{i,t} - 1)\big)
            \hat A_{i,t}\Big], \qquad
        \tau_{i,t} = \begin{cases} \tau_\text{pos} & \hat A_{i,t} > 0 \\
            \tau_\text{neg} & \text{otherwise.} \end{cases}

    Its gradient weighs :math:`r_{i,t} \nabla \log\pi_\theta` by
    :math:`4\sigma(1 - \sigma)`, 1 on-policy and smoothly smaller as the ratio
    leaves 1. Advantages are read per token or per sequence, as the batch holds them;
    ``max_log_ratio`` clamps each token's log-ratio (the gate is then saturated).
    Keyword arguments and the rollout correction are :class:`~torchrl_gspo.GSPOLoss`'
    own; ``clip_epsilon`` only sets the band of the ``clip_fraction`` diagnostics
    (:doc:`/objectives`).

    Args:
        actor_network (LLMWrapperBase): the policy, as for
            :class:`~torchrl_gspo.GSPOLoss`.

    Keyword Args:
        temperatures (tuple[float, float], optional): :math:`(\tau_\text{pos},
            \tau_\text{neg})`, both positive. Defaults to the paper's ``(1.0, 1.05)``
            (§5.1).
        **kwargs: :class:`~torchrl_gspo.GSPOLoss`' other keyword arguments.

    Examples:
        >>> from torchrl_gspo import SAPOLoss
        >>> loss_fn = SAPOLoss(entropy_bonus=False)  # pass the training wrapper first
        >>> loss_fn.temperatures
        (1.0, 1.05)

        It is called as :class:`~torchrl_gspo.GSPOLoss`, whose example builds a
        policy and a batch; on-policy each token's term is :math:`-2 \hat A / \tau`
        and ``out.objective_diagnostic`` is 1.
    """

    output_type: type[LLMLossOutput] = SAPOLossOutput
    wide_clip_epsilon: ClassVar[float] = math.inf  # no clip: the band is a diagnostic
    advantage_level: ClassVar[Literal["sequence", "token"]] = "token"

    def __init__(
        self,
        actor_network: LLMWrapperBase | None = None,
        *,
        temperatures: tuple[float, float] = (1.0, 1.05),
        **kwargs,
    ) -> None:
        self.temperatures = _arguments.positive_pair(temperatures, "temperatures")
        super().__init__(actor_network, **kwargs)

    def _objective(self, scores: Scores) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The gated term of each token, ``[B, T, 1]``, and ``[B, T]`` the gate's
        gradient weight :math:`4\sigma(1 - \sigma)`, 0 off the mask."""
        # the gate is saturated long before: the clamp only keeps exp() finite (0 * inf
        # would be a NaN gradient), as verl's upper clamp; verl's lower one, at -20, is
        # not taken: the paper's gate is kept there (docs' objectives page)
        cap = 20.0 if self.max_log_ratio is None else min(self.max_log_ratio, 20.0)
        log_ratio = scores.token_log_ratio.clamp(max=cap)
        positive = scores.advantage.squeeze(-1) > 0  # [B, 1] or [B, T]
        pos, neg = (torch.tensor(t, dtype=log_ratio.dtype) for t in self.temperatures)
        tau = torch.where(positive, pos.to(log_ratio.device), neg.to(log_ratio.device))
        gate = torch.sigmoid(tau * log_ratio.expm1())
        weight = torch.where(scores.mask, 4 * gate.detach() * (1 - gate.detach()), 0.0)
        return -(4 * gate / tau).unsqueeze(-1) * scores.advantage, weight
