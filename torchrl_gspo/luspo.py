# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""LUSPO: GSPO's per-sequence term weighted by the response length."""

from __future__ import annotations

import torch
from torchrl.modules.llm import LLMWrapperBase
from torchrl.objectives.llm.grpo import LLMLossOutput

from torchrl_gspo.gspo import GSPOLoss, GSPOLossOutput
from torchrl_gspo.scores import Scores

__all__ = ["LUSPOLoss", "LUSPOLossOutput"]


class LUSPOLossOutput(GSPOLossOutput):
    pass


LUSPOLossOutput.__doc__ = """LUSPO loss output: the fields of :class:`~torchrl_gspo.GSPOLossOutput`.

Examples:
    >>> from torchrl_gspo import GSPOLossOutput, LUSPOLossOutput
    >>> issubclass(LUSPOLossOutput, GSPOLossOutput)
    True
"""


class LUSPOLoss(GSPOLoss):
    r"""LUSPO: Length-Unbiased Sequence Policy Optimization.

    LUSPO (`arXiv:2602.05261 <https://arxiv.org/abs/2602.05261>`_) multiplies GSPO's
    clipped term of each response by its length, so that the objective no longer
    favors short responses:

    .. math::

        J(\theta) = \mathbb{E}\Big[\frac{1}{G} \sum_{i=1}^{G} |y_i|
            \min\big(s_i \hat A_i,\ \operatorname{clip}(s_i, 1 - \epsilon_\text{low},
            1 + \epsilon_\text{high}) \hat A_i\big)\Big],

    with :class:`~torchrl_gspo.GSPOLoss`' sequence ratio :math:`s_i` and the mean over
    the rows of the batch (``aggregation="prompt_mean"``; a row with no response token
    counts 0). Keyword arguments, diagnostics and the rollout correction are
    :class:`~torchrl_gspo.GSPOLoss`' own; choosing between the objectives:
    :doc:`/objectives`.

    Args:
        actor_network (LLMWrapperBase): the policy, as for
            :class:`~torchrl_gspo.GSPOLoss`.

    Keyword Args:
        clip_epsilon (float | tuple[float, float], optional): the clip range of
            :math:`s_i`. Defaults to ``(2e-3, 2.5e-3)``, the values TRL's paper index
            quotes from the paper's §5.1.
        **kwargs: :class:`~torchrl_gspo.GSPOLoss`' other keyword arguments.

    Examples:
        >>> from torchrl_gspo import LUSPOLoss
        >>> loss_fn = LUSPOLoss(entropy_bonus=False)  # pass the training wrapper first
        >>> float(loss_fn.clip_epsilon_low), float(loss_fn.clip_epsilon_high)
        (0.002, 0.0025)

        It is called as :class:`~torchrl_gspo.GSPOLoss`, whose example builds a
        policy and a batch; on-policy its loss is the mean of :math:`-|y_i| \hat A_i`.
    """

    output_type: type[LLMLossOutput] = LUSPOLossOutput

    def __init__(
        self,
        actor_network: LLMWrapperBase | None = None,
        *,
        clip_epsilon: float | tuple[float, float] = (2e-3, 2.5e-3),
        **kwargs,
    ) -> None:
        super().__init__(actor_network, clip_epsilon=clip_epsilon, **kwargs)

    def _objective(self, scores: Scores) -> torch.Tensor:
        """GSPO's clipped term of each sequence times its length, ``[B, 1, 1]``."""
        length = scores.lengths.to(scores.log_ratio.dtype).reshape(-1, 1, 1)
        return super()._objective(scores) * length
