# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""VESPO: a detached gamma weight of the sequence ratio on a REINFORCE term."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from torchrl.modules.llm import LLMWrapperBase
from torchrl.objectives.llm.grpo import LLMLossOutput

from torchrl_gspo import _arguments
from torchrl_gspo.gspo import GSPOLoss, GSPOLossOutput
from torchrl_gspo.scores import Scores

__all__ = ["VESPOLoss", "VESPOLossOutput"]

_LOG_W_RANGE = (math.log(1e-8), 20.0)  # the clamp of log W (and of each token's log-ratio: +-20)


class VESPOLossOutput(GSPOLossOutput):
    pass


VESPOLossOutput.__doc__ = r"""VESPO loss output: the fields of :class:`~torchrl_gspo.GSPOLossOutput`
(the same as for GSPO).

``objective_diagnostic`` is the mean over valid tokens of :math:`\phi(W_i)` (1
on-policy). VESPO does not clip: the ``clip_fraction`` fields count the sequences
whose GSPO ratio leaves ``clip_epsilon``'s band, a measure of drift.

Examples:
    >>> from torchrl_gspo import GSPOLossOutput, VESPOLossOutput
    >>> issubclass(VESPOLossOutput, GSPOLossOutput)
    True
"""


class VESPOLoss(GSPOLoss):
    r"""VESPO: a variance-reducing gamma weight of the sequence importance ratio.

    VESPO (`arXiv:2602.10693 <https://arxiv.org/abs/2602.10693>`_) weighs a
    REINFORCE term by a detached function of the product ratio of the response
    against the policy that sampled it:

    .. math::

        L(\theta) = -\frac{1}{\sum_i |y_i|} \sum_{i,t}
            \operatorname{sg}[\phi(W_i)]\, \hat A_i \log\pi_\theta(y_{i,t}), \qquad
        W_i = \prod_t \frac{\pi_\theta(y_{i,t})}{\pi_\text{roll}(y_{i,t})}, \qquad
        \phi(W) = e^{\lambda} W^k e^{-\lambda W},

    with :math:`\phi(1) = 1` and :math:`(k, \lambda)` chosen by the sign of
    :math:`\hat A_i`. :math:`W_i` is taken against the rollout log-probabilities
    (``sample_log_prob``): VESPO corrects the off-policy rollout itself, so the
    ``rollout_correction`` argument is refused. Each token's log-ratio is clamped to
    :math:`\pm 20` and :math:`\log W_i` to :math:`[\log 10^{-8}, 20]`. The mean is
    over all valid tokens (``aggregation="token_mean"``, the default here, as in the
    authors' code), which takes no sequence scale: with :func:`set_sequence_scale` or
    :class:`~torchrl_gspo.GlobalBatchStepper` pass ``aggregation="prompt_mean"``.
    One advantage per response. Choosing between the objectives:
    :doc:`/objectives`.

    Args:
        actor_network (LLMWrapperBase): the policy, as for
            :class:`~torchrl_gspo.GSPOLoss`.

    Keyword Args:
        shape_positive (tuple[float, float], optional): :math:`(k, \lambda)` for
            :math:`\hat A_i \ge 0`. Defaults to the authors' ``(2.0, 3.0)``.
        shape_negative (tuple[float, float], optional): :math:`(k, \lambda)` for
            :math:`\hat A_i < 0`. Defaults to the authors' ``(3.0, 2.0)``.
        aggregation (Literal["token_mean", "prompt_mean", "none"], optional): defaults
            to ``"token_mean"``.
        **kwargs: :class:`~torchrl_gspo.GSPOLoss`' other keyword arguments.

    Examples:
        >>> from torchrl_gspo import VESPOLoss
        >>> loss_fn = VESPOLoss(entropy_bonus=False)  # pass the training wrapper first
        >>> loss_fn.shapes, loss_fn.aggregation
        (((2.0, 3.0), (3.0, 2.0)), 'token_mean')

        It is called as :class:`~torchrl_gspo.GSPOLoss`, whose example builds a
        policy and a batch; on-policy :math:`W_i = 1`, :math:`\phi = 1` and
        ``out.objective_diagnostic`` is 1.
    """

    output_type: type[LLMLossOutput] = VESPOLossOutput
    wide_clip_epsilon: ClassVar[float] = math.inf  # no clip: the band is a diagnostic
    objective_aggregation: ClassVar[str] = "token_mean"

    def __init__(
        self,
        actor_network: LLMWrapperBase | None = None,
        *,
        shape_positive: tuple[float, float] = (2.0, 3.0),
        shape_negative: tuple[float, float] = (3.0, 2.0),
        aggregation: Literal["token_mean", "prompt_mean", "none"] | None = "token_mean",
        **kwargs,
    ) -> None:
        if kwargs.get("rollout_correction") is not None:
            raise ValueError(
                "VESPOLoss takes W against the rollout log-probabilities, which corrects "
                "the off-policy rollout itself: leave rollout_correction=None."
            )
        self.shapes = (
            _arguments.positive_pair(shape_positive, "shape_positive"),
            _arguments.positive_pair(shape_negative, "shape_negative"),
        )
        aggregation = "token_mean" if aggregation is None else aggregation
        super().__init__(actor_network, aggregation=aggregation, **kwargs)

    def _phi(self, scores: Scores) -> torch.Tensor:
        r"""``[B]`` the detached weight :math:`\phi(W_i)`."""
        low, high = _LOG_W_RANGE
        log_ratio = (scores.current.detach() - scores.rollout).clamp(-high, high)
        log_w = log_ratio.sum(-1).clamp(low, high)  # both 0 off the mask
        positive = scores.advantage.reshape(-1) >= 0
        shapes = torch.tensor(self.shapes, dtype=log_w.dtype, device=log_w.device)
        k, lam = torch.where(positive.unsqueeze(-1), shapes[0], shapes[1]).unbind(-1)
        return (lam + k * log_w - lam * log_w.exp()).exp()

    def _objective(self, scores: Scores) -> tuple[torch.Tensor, torch.Tensor]:
        r""":math:`-\phi(W_i) \hat A_i \log\pi_\theta` per token, ``[B, T, 1]``, and
        ``[B, T]`` :math:`\phi(W_i)` on each valid token."""
        phi = self._phi(scores)
        current = scores.current  # -inf (a token of probability 0): the lowest float
        current = current.clamp(min=torch.finfo(current.dtype).min)
        terms = -(phi.reshape(-1, 1, 1) * scores.advantage) * current.unsqueeze(-1)
        return terms, torch.where(scores.mask, phi.unsqueeze(-1), 0.0)
