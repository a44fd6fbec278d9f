# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""A batch scored by the current policy (:class:`Scores`), and the weights of its terms.

:func:`score` builds the loss mask, scores the batch and checks the rules on the
scored values (:doc:`/inputs`); an objective reads the :class:`Scores` it returns
(:doc:`/design`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchrl_gspo import _checks
from torchrl_gspo._arguments import Options
from torchrl_gspo._reader import Batch
from torchrl_gspo.rollout import RolloutTerms

__all__ = ["Scores", "loss_weight", "off_policy_keep"]


class Scores(NamedTuple):
    """A batch scored by the current policy: what an objective reads.

    Every ``[B, T]`` tensor is 0 outside ``mask`` and has the accumulation dtype
    (``float32`` for half-precision log-probabilities).

    Attributes:
        current: ``[B, T]`` :math:`\\log\\pi_\\theta`, with gradient.
        old: ``[B, T]`` :math:`\\log\\pi_\\text{old}`.
        rollout: ``[B, T]`` :math:`\\log\\pi_\\text{roll}` (``old`` unless the old
            log-probabilities were recomputed).
        mask: ``[B, T]`` the loss mask.
        lengths: ``[B]`` :math:`|y_i|`, the valid tokens of each sequence.
        token_log_ratio: ``[B, T]`` ``current - old``, the token log-ratios.
        log_ratio: ``[B]`` :math:`\\log s_i`, the mean of ``token_log_ratio`` over each
            sequence's valid tokens.
        advantage: ``[B, 1, 1]`` (one per sequence) or ``[B, T, 1]`` (per token,
            :class:`~torchrl_gspo.GSPOTokenLoss`).
        inputs: ``[B, T]`` the per-token integer inputs an objective asks for
            (``_token_inputs``, :doc:`/design`), in its order, as stored (not
            masked); empty for the others.

    Examples:
        >>> import torch
        >>> from torchrl_gspo import Scores
        >>> current = torch.tensor([[-1.0, -2.0, 0.0]])  # the third token is off the mask
        >>> old = torch.tensor([[-1.1, -2.1, 0.0]])
        >>> mask = torch.tensor([[True, True, False]])
        >>> lengths, token_log_ratio = mask.sum(-1), current - old
        >>> scores = Scores(current, old, old, mask, lengths, token_log_ratio,
        ...                 token_log_ratio.sum(-1) / lengths, torch.ones(1, 1, 1))
        >>> round(float(scores.log_ratio.exp()), 4)  # the sequence ratio s_i = exp(0.1)
        1.1052
    """

    current: torch.Tensor
    old: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    token_log_ratio: torch.Tensor
    log_ratio: torch.Tensor
    advantage: torch.Tensor
    inputs: tuple[torch.Tensor, ...] = ()


def score(
    batch: Batch,
    current: torch.Tensor,
    valid: torch.Tensor,
    options: Options,
    dtype: torch.dtype,
) -> Scores:
    """The batch scored by the current policy on the loss mask, its rules checked.

    Args:
        batch (Batch): the call's inputs.
        current (torch.Tensor): ``[B, T]`` the actor's log-probabilities.
        valid (torch.Tensor): ``[B, T]`` the actor's mask (``dist.mask``).
        options (Options): the loss' keys and options.
        dtype (torch.dtype): the accumulation dtype.

    Returns:
        Scores: every ``[B, T]`` value in ``dtype``, 0 off the mask. A broken input
        rule raises (:func:`torchrl_gspo._checks.check_scored`).
    """
    kept, mask = _loss_mask(batch, current, valid, options)
    masked = torch.where(mask, current.to(dtype), 0.0)
    old = torch.where(mask, batch.old.to(dtype), 0.0)
    rollout = old
    if batch.rollout is not None:
        rollout = torch.where(mask, batch.rollout.to(dtype), 0.0)
    lengths = mask.sum(-1)
    token_log_ratio = masked - old
    log_ratio = token_log_ratio.sum(-1) / lengths.clamp_min(1).to(dtype)
    advantage, varies = batch.advantage, None
    if options.advantage_level == "sequence" and advantage.shape[-2] > 1:
        advantage, varies = sequence_advantage(advantage, mask)
    scores = Scores(
        masked, old, rollout, mask, lengths, token_log_ratio, log_ratio, advantage, batch.inputs
    )
    _checks.check_scored(options.owner, _rules(options, batch, valid, kept, scores, varies))
    return scores


def _loss_mask(
    batch: Batch, current: torch.Tensor, valid: torch.Tensor, options: Options
) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid tokens with finite old (and rollout) log-probs, and the loss mask."""
    if current.shape != batch.old.shape:
        keys = options.keys
        old_key = keys.sample_log_prob if batch.rollout is None else keys.old_log_prob
        raise ValueError(
            f"Shape mismatch detected in {options.owner}: current log-prob shape "
            f"{current.shape} != previous log-prob shape {batch.old.shape} (read at "
            f"{old_key!r}). The actor must score the tokens at {keys.action!r}, one "
            "log-probability each; check that the masking strategy "
            f"(masking_strategy={options.masking_strategy!r}) matches the data."
        )
    kept = valid & batch.old.isfinite()
    if batch.rollout is not None:
        kept = kept & batch.rollout.isfinite()
    if options.masking_strategy == "generic":  # a row's first token has no context
        return kept, kept & (valid.cumsum(-1) != 1)
    return kept, kept


def _rules(
    options: Options,
    batch: Batch,
    valid: torch.Tensor,
    kept: torch.Tensor,
    scores: Scores,
    varies: torch.Tensor | None,
) -> list[_checks.Rule]:
    """The rules on the scored values that apply to this batch, in reporting order."""
    rules = _checks.finite_log_probs(options, batch.old, batch.rollout, valid, kept)
    rules.append(_checks.finite_current(options, scores.current.detach(), scores.mask))
    rules.append(_checks.finite_advantage(options, batch.has_value, scores.mask))
    if varies is not None:
        rules.append(_checks.constant_advantage(options, varies))
    if batch.scale is not None:
        rules.append(_checks.valid_scale(options, batch.scale))
    if batch.response_lengths is not None:
        rules.append(_checks.response_mask(options, scores.lengths, batch.response_lengths))
    rules.append(_checks.finite_log_ratio(options, scores.log_ratio.detach()))
    return rules


def loss_weight(
    scale: torch.Tensor | None, rollout: RolloutTerms | None, keep: torch.Tensor | None
) -> torch.Tensor | None:
    """The weight of the loss terms: the rollout correction's, the global scale's and
    off-policy masking's, multiplied.

    Args:
        scale (torch.Tensor | None): ``[B]`` the sequence scale :math:`c_i`.
        rollout (RolloutTerms | None): the rollout terms, for
            :attr:`~torchrl_gspo.RolloutTerms.loss_weight` (``[B]`` or ``[B, T]``).
        keep (torch.Tensor | None): ``[B]`` or ``[B, T]``, the terms off-policy
            sequence masking keeps (:func:`off_policy_keep`).

    Returns:
        ``[B]`` or ``[B, T]``, ``None`` when none applies. The scale is multiplied
        by :math:`B`: ``prompt_mean``'s mean over the rows then gives
        :math:`\\sum_i c_i \\ell_i`.

    Examples:
        >>> import torch
        >>> from torchrl_gspo.scores import loss_weight
        >>> scale = torch.tensor([0.25, 0.25])  # two rows of a global batch of four
        >>> keep = torch.tensor([True, False])  # the second row's term is dropped
        >>> loss_weight(scale, None, keep)
        tensor([0.5000, 0.0000])
    """
    weight = None if rollout is None else rollout.loss_weight
    if scale is not None:
        scale = scale * scale.shape[0]
        weight = scale if weight is None else times(weight, scale.to(weight.dtype))
    if keep is not None:
        weight = keep if weight is None else times(weight, keep)
    return weight


def off_policy_keep(scores: Scores, threshold: float) -> torch.Tensor:
    """Off-policy sequence masking: which terms stay (DeepSeek-V3.2, Eq. 9).

    A term is dropped when its advantage is negative and its response's mean
    :math:`\\log\\pi_\\text{roll} - \\log\\pi_\\theta` (detached) exceeds ``threshold``.

    Returns:
        ``[B]`` for one advantage per sequence, ``[B, T]`` for per-token advantages.

    Examples:
        >>> import torch
        >>> from torchrl_gspo import Scores
        >>> from torchrl_gspo.scores import off_policy_keep
        >>> mask = torch.ones(2, 2, dtype=torch.bool)
        >>> rollout = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
        >>> current = torch.tensor([[-1.5, -1.5], [-1.5, -1.5]])  # drifted by 0.5 a token
        >>> advantage = torch.tensor([1.0, -1.0]).reshape(2, 1, 1)
        >>> scores = Scores(current, rollout, rollout, mask, mask.sum(-1), current - rollout,
        ...                 (current - rollout).mean(-1), advantage)
        >>> off_policy_keep(scores, threshold=0.25)  # the negative-advantage row is dropped
        tensor([ True, False])
    """
    drift = (scores.rollout - scores.current.detach()).sum(-1)
    far = drift / scores.lengths.clamp_min(1).to(drift.dtype) > threshold
    advantage = scores.advantage.squeeze(-1)  # [B, 1] or [B, T]
    keep = (advantage >= 0) | far.unsqueeze(-1).logical_not()
    return keep.squeeze(-1) if keep.shape[-1] == 1 else keep


def times(weight: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``weight`` times ``keep``, each per sequence ``[B]`` or per token ``[B, T]``."""
    if weight.ndim < keep.ndim:
        weight = weight.unsqueeze(-1)
    elif keep.ndim < weight.ndim:
        keep = keep.unsqueeze(-1)
    return weight * keep


def dropped_tokens(scores: Scores, keep: torch.Tensor) -> torch.Tensor:
    """``[B]`` the valid tokens whose terms ``keep`` drops."""
    if keep.ndim == 1:
        return torch.where(keep, 0, scores.lengths)
    return (scores.mask & ~keep).sum(-1)


def sequence_advantage(advantage: torch.Tensor, mask: torch.Tensor) -> tuple:
    """One advantage per sequence from per-token ones, and the rows where they vary.

    Args:
        advantage (torch.Tensor): ``[B, T, 1]`` per-token advantages.
        mask (torch.Tensor): ``[B, T]`` loss mask.

    Returns:
        ``([B, 1, 1]`` the value on each row's valid tokens (0 on empty rows),
        ``[B]`` whether it varies across them).
    """
    advantage = advantage.squeeze(-1)
    inf = torch.finfo(advantage.dtype).max
    high = torch.where(mask, advantage, -inf).amax(-1)
    low = torch.where(mask, advantage, inf).amin(-1)
    nonempty = mask.any(-1)
    value = torch.where(nonempty, high, 0.0).reshape(-1, 1, 1)
    return value, nonempty & (high != low)
