# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Subsequence-level ratios: one clipped ratio per segment of a response."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import torch
from tensordict.utils import NestedKey
from torchrl.modules.llm import LLMWrapperBase
from torchrl.objectives.llm.grpo import LLMLossOutput

from torchrl_gspo import _arguments, _checks
from torchrl_gspo.diagnostics import SegmentTerms
from torchrl_gspo.gspo import GSPOLoss, GSPOLossOutput
from torchrl_gspo.scores import Scores
from torchrl_gspo.segments import (
    bounded_sums,
    delimiter_segments,
    delimiter_token_ids,
    equal_bounds,
    id_segments,
    segment_sums,
)

__all__ = ["SubsequenceLoss", "SubsequenceLossOutput"]


class SubsequenceLossOutput(GSPOLossOutput):
    pass


SubsequenceLossOutput.__doc__ = r"""Subsequence loss output: :class:`~torchrl_gspo.GSPOLossOutput`'s
fields, the segments' diagnostics set.

``clip_fraction`` (and its low/high split) counts the valid tokens of clipped
*segments*, each against its own range; ``sequence_clip_fraction``, ``ESS`` and the
``sequence_log_ratio`` fields are GSPO's, on the whole response against
``clip_epsilon``. Every field combines exactly over micro-batches and ranks
(:class:`~torchrl_gspo.SequenceStatistics`).

Attributes:
    segment_clip_fraction (torch.Tensor): the share of segments whose log-ratio
        leaves its range.
    whole_clip_fraction (torch.Tensor): the share of responses whose every segment
        is clipped (for one segment, GSPO's ``sequence_clip_fraction``).
    segments_per_sequence (torch.Tensor): the mean number of segments per response.
    kl_to_old (torch.Tensor): :math:`\frac{1}{N}\sum_i \frac{1}{|y_i|}\sum_t
        (r_{i,t} - 1 - \log r_{i,t})`, the k3 estimate of
        :math:`\mathrm{KL}(\pi_\text{old} \| \pi_\theta)` on the sampled tokens.

Examples:
    >>> from torchrl_gspo import GSPOLossOutput, SubsequenceLossOutput
    >>> issubclass(SubsequenceLossOutput, GSPOLossOutput)
    True
"""


class SubsequenceLoss(GSPOLoss):
    r"""One clipped ratio per segment of a response: between GRPO's tokens and GSPO's sequence.

    A response :math:`y_i` is split into segments :math:`k` of :math:`L_{i,k}` valid
    tokens (``segments``), each with its own ratio, the geometric mean of its token
    ratios (``normalize=True``) or their product (``normalize=False``, the literal
    subsequence likelihood ratio):

    .. math::

        \log r_{i,k} = \frac{1}{L_{i,k}} \sum_{t \in k} \log
            \frac{\pi_\theta(y_{i,t} \mid x, y_{i,<t})}{\pi_\text{old}(y_{i,t} \mid x, y_{i,<t})}.

    Each segment has its own clip range, GSPO's ``clip_epsilon`` at the response's
    full length scaled by the segment's length (the mean of :math:`L` roughly
    independent log-ratios spreads as :math:`L^{-1/2}`; FSPO,
    `arXiv:2509.09177 <https://arxiv.org/abs/2509.09177>`_):

    .. math::

        \epsilon_{i,k} = \epsilon \Big(\frac{|y_i|}{L_{i,k}}\Big)^{p},

    with :math:`p` = ``band_exponent`` (``0``: one constant range), the lower end
    capped at 1. ``combination="segment"`` (the default) clips each segment's term
    and weighs it by its length (SSPO's subsentence ratio, Yang et al.,
    `arXiv:2511.04256 <https://arxiv.org/abs/2511.04256>`_):

    .. math::

        J_\text{segment}(\theta) = \mathbb{E}\Big[\frac{1}{G} \sum_i \frac{1}{|y_i|}
            \sum_k L_{i,k} \min\big(r_{i,k} \hat A_i,\ \operatorname{clip}(r_{i,k},
            1 - \epsilon_{i,k}, 1 + \epsilon_{i,k}) \hat A_i\big)\Big];

    ``combination="product"`` puts the product of the ratios inside PPO's
    pessimistic bound:

    .. math::

        J_\text{product}(\theta) = \mathbb{E}\Big[\frac{1}{G} \sum_i \min\big(\hat A_i
            \prod_k r_{i,k},\ \hat A_i \prod_k \operatorname{clip}(r_{i,k})\big)\Big],

    whose gradient on the clipped side, :math:`\hat A_i \prod_k
    \operatorname{clip}(r_{i,k}) \sum_{k \text{ inside}} \nabla \log r_{i,k}`, flows
    through the unclipped factors only. With one segment both are
    :class:`~torchrl_gspo.GSPOLoss` exactly; with one token per segment and
    ``band_exponent=0``, ``"segment"`` is GRPO's clipped token surrogate averaged
    over each response (both tested). A segment with no valid token counts nothing;
    ``max_log_ratio`` clamps each segment's log-ratio (``"segment"``) or their sum
    (``"product"``). One advantage per response, as :class:`~torchrl_gspo.GSPOLoss`
    takes it. SSPO's entropy-adaptive ranges are not implemented: no readable copy
    of their formula was found, and none is given its name here. The diagnostics
    add the segments' (:class:`SubsequenceLossOutput`); choosing between the
    objectives: :doc:`/objectives`.

    Args:
        actor_network (LLMWrapperBase): the policy, as for
            :class:`~torchrl_gspo.GSPOLoss`.

    Keyword Args:
        segments (int | Literal["delimiters", "key"], optional): :math:`K \ge 1`
            nearly equal segments of each response's valid tokens (the first
            :math:`|y_i| \bmod K` one token longer; a response shorter than
            :math:`K` has one token per segment); ``"delimiters"``: a segment ends
            after each valid token whose id is in ``delimiter_ids``; ``"key"``: the
            integer segment ids at the ``segment_id`` key, laid out as the tokens,
            not decreasing along a row's valid tokens (masked positions are
            ignored). Defaults to ``4``.
        delimiter_ids (Collection[int] | None, optional): the ids that end a
            segment, with ``segments="delimiters"``; ``None`` takes
            :func:`~torchrl_gspo.segments.delimiter_token_ids` of the actor's
            tokenizer. Defaults to ``None``.
        combination (Literal["segment", "product"], optional): a clipped term per
            segment, or the product of the ratios in one bound. Defaults to
            ``"segment"``.
        normalize (bool, optional): a segment's ratio is the geometric mean of its
            token ratios (``True``) or their product. Defaults to ``True``.
        clip_epsilon (float | tuple[float, float], optional): the range at the
            response's full length, GSPO's. Defaults to ``(3e-4, 4e-4)``.
        band_exponent (float, optional): :math:`p \ge 0`. Defaults to ``0.5``.
        **kwargs: :class:`~torchrl_gspo.GSPOLoss`' other keyword arguments.

    Examples:
        >>> from torchrl_gspo import SubsequenceLoss
        >>> loss_fn = SubsequenceLoss(segments=2, entropy_bonus=False)  # actor first
        >>> loss_fn.segments, loss_fn.combination, loss_fn.band_exponent
        (2, 'segment', 0.5)

        It is called as :class:`~torchrl_gspo.GSPOLoss`, whose example builds a
        policy and a batch; ``out.segments_per_sequence`` is then 2.0.
    """

    output_type: type[LLMLossOutput] = SubsequenceLossOutput

    def __init__(
        self,
        actor_network: LLMWrapperBase | None = None,
        *,
        segments: int | Literal["delimiters", "key"] = 4,
        delimiter_ids: Collection[int] | None = None,
        combination: Literal["segment", "product"] = "segment",
        normalize: bool = True,
        clip_epsilon: float | tuple[float, float] = (3e-4, 4e-4),
        band_exponent: float = 0.5,
        **kwargs,
    ) -> None:
        _arguments.choice("combination", combination, ("segment", "product"))
        self.segments = _segments(segments, delimiter_ids)
        self.combination, self.normalize = combination, bool(normalize)
        self.band_exponent = _band_exponent(band_exponent)
        # a constant range is a segment's, not a whole response's: no GSPO-scale warning
        self.wide_clip_epsilon = 1.0 if self.band_exponent == 0 else GSPOLoss.wide_clip_epsilon
        super().__init__(actor_network, clip_epsilon=clip_epsilon, **kwargs)
        ids = None
        if self.segments == "delimiters":
            ids = _delimiters(delimiter_ids, getattr(actor_network, "tokenizer", None))
        self.register_buffer("delimiter_ids", ids)

    @dataclass
    class _AcceptedKeys(GSPOLoss._AcceptedKeys):
        r"""Tensordict keys: :class:`~torchrl_gspo.GSPOLoss`' own, and:

        Attributes:
            segment_id (NestedKey): the per-token segment ids, read with
                ``segments="key"``. Defaults to ``"segment_id"``.
        """

        segment_id: NestedKey = "segment_id"

    def _set_in_keys(self):
        super()._set_in_keys()
        self._in_keys.extend(k for k in self._token_inputs() if k not in self._in_keys)

    def _token_inputs(self) -> tuple[NestedKey, ...]:
        if self.segments == "delimiters":
            return (self.tensor_keys.action,)
        return (self.tensor_keys.segment_id,) if self.segments == "key" else ()

    def _segment_sums(self, scores: Scores) -> tuple[torch.Tensor, torch.Tensor]:
        """Each segment's sum of token log-ratios and its valid tokens, ``[B, K]`` for
        ``K`` equal segments, ``[B, T]`` (0 past a row's last segment) otherwise."""
        log_ratio, mask = scores.token_log_ratio, scores.mask
        if isinstance(self.segments, int):
            bounds = equal_bounds(scores.lengths, self.segments)
            length = (bounds[:, 1:] - bounds[:, :-1]).to(log_ratio.dtype)
            return bounded_sums(log_ratio, mask, bounds), length
        if self.segments == "delimiters":
            index = delimiter_segments(mask, scores.inputs[0], self.delimiter_ids)
        else:
            index = self._id_index(scores)
        return segment_sums(log_ratio, index), segment_sums(mask.to(log_ratio.dtype), index)

    def _id_index(self, scores: Scores) -> torch.Tensor:
        """``[B, T]`` the segments of the ids at the key; decreasing ids raise."""
        index, decreasing = id_segments(scores.mask, scores.inputs[0])
        key = self.tensor_keys.segment_id
        rule = _checks.Rule(
            decreasing,
            lambda: ValueError(
                f"{type(self).__name__}: the segment ids at {key!r} decrease along the "
                f"valid tokens of batch row(s) {decreasing.nonzero().squeeze(-1).tolist()}. "
                "Number each row's segments in order (e.g. 0, 0, 1, 1, 2), so that a "
                "segment is a run of tokens."
            ),
        )
        _checks.check_scored(type(self).__name__, [rule])
        return index

    def _objective(self, scores: Scores) -> tuple[torch.Tensor, None, SegmentTerms]:
        """Each response's clipped value, ``[B, 1, 1]``, and its segments' counts."""
        log_ratio, length = self._segment_sums(scores)
        size = length.clamp_min(1)
        if self.normalize:
            log_ratio = log_ratio / size
        n = scores.lengths.clamp_min(1).to(length.dtype).unsqueeze(-1)
        # the range's two ends in log space, each segment's; a segment without a valid
        # token has log-ratio 0, inside its range
        band = torch.stack([-self.clip_epsilon_low, self.clip_epsilon_high]).to(length.dtype)
        scale = (n / size) ** self.band_exponent
        low, high = (band * scale.unsqueeze(-1)).clamp(min=-1.0).log1p().unbind(-1)
        below, above = log_ratio < low, log_ratio > high
        token_log_ratio = scores.token_log_ratio.detach()
        # 0 off the mask; exp - 1 rather than expm1, six times slower on a CPU: the
        # rounding of exp (1e-7 in float32) is far below any bound on the mean
        k3 = token_log_ratio.exp() - 1 - token_log_ratio
        counts = SegmentTerms(
            low_tokens=(length * below).sum(-1),
            high_tokens=(length * above).sum(-1),
            segments=(length > 0).sum(-1),
            clipped=(below | above).sum(-1),
            kl_to_old=k3.sum(-1) / n.squeeze(-1),
        )
        advantage = scores.advantage.reshape(-1, 1)
        lowest = torch.finfo(log_ratio.dtype).min  # a token of probability 0 gives -inf
        bound = log_ratio.clamp(low, high)
        if self.combination == "product":  # an empty segment's log-ratio and bound are 0
            log_ratio, bound = log_ratio.sum(-1, keepdim=True), bound.sum(-1, keepdim=True)
            bound = bound.clamp(lowest, self.max_log_ratio)
        log_ratio = log_ratio.clamp(lowest, self.max_log_ratio)
        gain = torch.minimum(log_ratio.exp() * advantage, bound.exp() * advantage)
        if self.combination == "segment":  # each segment weighted by its share of tokens
            gain = (gain * length).sum(-1, keepdim=True) / n
        return -gain.reshape(-1, 1, 1), None, counts


def _segments(segments, delimiter_ids) -> int | str:
    """``segments`` checked: an int >= 1, ``"delimiters"`` or ``"key"``."""
    if isinstance(segments, str):
        _arguments.choice("segments", segments, ("delimiters", "key"))
    elif isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(
            f"segments must be a number of segments K >= 1, 'delimiters' or 'key'; got "
            f"{segments!r}. segments=1 is GSPO; a response shorter than K gets one token "
            "per segment."
        )
    if delimiter_ids is not None and segments != "delimiters":
        raise ValueError(
            f"delimiter_ids only applies with segments='delimiters', got segments={segments!r}: "
            "pass segments='delimiters', or leave delimiter_ids out."
        )
    return segments


def _band_exponent(value) -> float:
    """The band's exponent, a real number >= 0."""
    value = _arguments.real(value, "band_exponent")
    if value < 0:
        raise ValueError(
            f"band_exponent must be >= 0, got {value}: a negative one would give longer "
            "segments wider ranges. 0 is one constant range, 0.5 the 1/sqrt(L) rule."
        )
    return value


def _delimiters(ids: Collection[int] | None, tokenizer) -> torch.Tensor:
    """The delimiter ids as a tensor, each inside the tokenizer's vocabulary."""
    if ids is None:
        if tokenizer is None:
            raise ValueError(
                "segments='delimiters' needs delimiter_ids, or an actor with a tokenizer "
                "to find them (torchrl_gspo.segments.delimiter_token_ids)."
            )
        ids = delimiter_token_ids(tokenizer)
    ids = torch.as_tensor(list(ids), dtype=torch.long)
    size = None if tokenizer is None else len(tokenizer)
    outside = ids[(ids < 0) | (ids >= (size if size is not None else torch.iinfo(torch.long).max))]
    if outside.numel() or ids.numel() == 0:
        where = "" if size is None else f" of the tokenizer's {size}"
        raise ValueError(
            f"delimiter_ids must be ids inside the vocabulary{where}, at least one; got "
            f"{outside.tolist() or 'none'}. Find them with "
            "torchrl_gspo.segments.delimiter_token_ids(tokenizer)."
        )
    return ids
