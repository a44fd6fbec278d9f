# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GMPO: the geometric mean of clipped token ratios."""

from __future__ import annotations

from typing import ClassVar

import torch
from torchrl.modules.llm import LLMWrapperBase
from torchrl.objectives.llm.grpo import LLMLossOutput

from torchrl_gspo.gspo import GSPOLoss, GSPOLossOutput
from torchrl_gspo.scores import Scores

__all__ = ["GMPOLoss", "GMPOLossOutput"]


class GMPOLossOutput(GSPOLossOutput):
    pass


GMPOLossOutput.__doc__ = r"""GMPO loss output: the fields of :class:`~torchrl_gspo.GSPOLossOutput`.

``objective_diagnostic`` is the fraction of valid tokens whose log-ratio the clip
changed; the ``clip_fraction`` fields count the sequences whose geometric-mean
(unclipped) log-ratio leaves :math:`[-\epsilon_\text{low}, \epsilon_\text{high}]`.

Examples:
    >>> from torchrl_gspo import GMPOLossOutput, GSPOLossOutput
    >>> issubclass(GMPOLossOutput, GSPOLossOutput)
    True
"""


class GMPOLoss(GSPOLoss):
    r"""GMPO: Geometric-Mean Policy Optimization.

    GMPO (`arXiv:2507.20673 <https://arxiv.org/abs/2507.20673>`_, Eq. 3) clips each
    token's ratio :math:`r_{i,t} = \pi_\theta / \pi_\text{old}` *before* taking the
    geometric mean over the response, in log space and on the side of the advantage's
    sign:

    .. math::

        J(\theta) = \mathbb{E}\Big[\frac{1}{G} \sum_{i=1}^{G} \hat A_i
            \exp\Big(\frac{1}{|y_i|} \sum_t c_{i,t}\Big)\Big], \qquad
        c_{i,t} = \begin{cases}
            \min(\log r_{i,t}, \operatorname{clip}(\log r_{i,t}, -\epsilon_\text{low},
                \epsilon_\text{high})) & \hat A_i > 0 \\
            \max(\log r_{i,t}, \operatorname{clip}(\log r_{i,t}, -\epsilon_\text{low},
                \epsilon_\text{high})) & \text{otherwise,}
        \end{cases}

    which is the paper's :math:`(\prod_t |\min(r_{i,t} \hat A_i,
    \operatorname{clip}(r_{i,t}, e^{-\epsilon_\text{low}}, e^{\epsilon_\text{high}})
    \hat A_i)|)^{1/|y_i|} \operatorname{sgn}(\hat A_i)`. One advantage per response
    (the paper defines no other); a row with no response token counts 0 in the mean
    over rows. ``max_log_ratio`` clamps the mean clipped log-ratio. Keyword arguments,
    diagnostics and the rollout correction are :class:`~torchrl_gspo.GSPOLoss`' own
    (:doc:`/objectives`).

    Args:
        actor_network (LLMWrapperBase): the policy, as for
            :class:`~torchrl_gspo.GSPOLoss`.

    Keyword Args:
        clip_epsilon (float | tuple[float, float], optional): the clip range *in log
            space*, :math:`(\epsilon_\text{low}, \epsilon_\text{high})`. Defaults to
            the paper's ``0.4`` (the ratio range :math:`(e^{-0.4}, e^{0.4})`).
        **kwargs: :class:`~torchrl_gspo.GSPOLoss`' other keyword arguments.

    Examples:
        >>> from torchrl_gspo import GMPOLoss
        >>> loss_fn = GMPOLoss(entropy_bonus=False)  # pass the training wrapper first
        >>> float(loss_fn.clip_epsilon_low), float(loss_fn.clip_epsilon_high)  # log space
        (0.4, 0.4)

        It is called as :class:`~torchrl_gspo.GSPOLoss`, whose example builds a
        policy and a batch; ``out.objective_diagnostic`` is the clipped fraction.
    """

    output_type: type[LLMLossOutput] = GMPOLossOutput
    wide_clip_epsilon: ClassVar[float] = 1.0

    def __init__(
        self,
        actor_network: LLMWrapperBase | None = None,
        *,
        clip_epsilon: float | tuple[float, float] = 0.4,
        **kwargs,
    ) -> None:
        super().__init__(actor_network, clip_epsilon=clip_epsilon, **kwargs)

    @property
    def _clip_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        # GMPO's range is in log space: (-eps_low, eps_high)
        return -self.clip_epsilon_low, self.clip_epsilon_high

    def _objective(self, scores: Scores) -> tuple[torch.Tensor, torch.Tensor]:
        r""":math:`-\hat A_i` times the geometric mean of the clipped ratios, ``[B, 1, 1]``,
        and ``[B, T]`` 1 on the valid tokens whose log-ratio the clip changed."""
        log_ratio = scores.token_log_ratio  # 0 off the mask, and so is its clip
        low, high = (b.to(log_ratio.dtype) for b in self._clip_bounds)
        bound = log_ratio.clamp(low, high)
        positive = scores.advantage.reshape(-1, 1) > 0
        clipped = torch.where(
            positive, torch.minimum(log_ratio, bound), torch.maximum(log_ratio, bound)
        )
        mean = clipped.sum(-1) / scores.lengths.clamp_min(1).to(log_ratio.dtype)
        if self.max_log_ratio is not None:
            mean = mean.clamp(max=self.max_log_ratio)
        changed = (clipped.detach() != log_ratio.detach()) & scores.mask
        return -scores.advantage * mean.exp().reshape(-1, 1, 1), changed.to(log_ratio.dtype)
