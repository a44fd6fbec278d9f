# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Rollout correction: a configuration and a pure function."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from torchrl_gspo import _arguments

__all__ = ["RolloutCorrection", "RolloutTerms", "rollout_terms"]

Mode = Literal["truncate", "mask", "masked_is"]
Form = Literal["geometric", "sequence", "token"]
_MODES = ("truncate", "mask", "masked_is")
_FORMS = ("geometric", "sequence", "token")
# Default thresholds, a cap C meaning the band (0, C). Product and per-token ratios:
# TRL's vllm_importance_sampling_clip_max 3.0 (TRL sets no lower bound); the 0/1 mask
# takes the band symmetric in log. Geometric ratio: the band of verl's
# length-normalized rejection (rollout_rs="seq_mean_k1").
_DEFAULTS = {
    **{(mode, "sequence"): 3.0 for mode in ("truncate", "masked_is")},
    **{(mode, "token"): 3.0 for mode in ("truncate", "masked_is")},
    ("mask", "sequence"): (1 / 3, 3.0),
    ("mask", "token"): (1 / 3, 3.0),
    ("truncate", "geometric"): 1.001,
    ("mask", "geometric"): (0.999, 1.001),
    ("masked_is", "geometric"): (0.999, 1.001),
}


@dataclass(frozen=True)
class RolloutCorrection:
    r"""How the rollout-to-old ratio :math:`\rho` weighs the loss terms.

    See :doc:`/inputs` for the three log-probability roles, :doc:`/math` for the
    formulas and :doc:`/migration` for TRL's and verl's names. The ratio is
    :math:`\log\rho_i = \sum_t m_t (\log\pi_\text{old} - \log\pi_\text{roll})`
    (``form="sequence"``, the product), its mean over the sequence's valid tokens
    (``"geometric"``), or each token's own :math:`\log\rho_{i,t}` (``"token"``).
    With the band :math:`[C_\text{low}, C_\text{high}]`, the detached weight is

    - ``"truncate"``: :math:`w = \min(\max(\rho, C_\text{low}), C_\text{high})`;
    - ``"mask"``: :math:`w = \mathbb{1}[C_\text{low} \le \rho \le C_\text{high}]`
      (rejection);
    - ``"masked_is"``: :math:`w = \rho\, \mathbb{1}[C_\text{low} \le \rho \le
      C_\text{high}]` (TRL's ``*_mask`` modes: the ratio stays the weight).

    Args:
        mode (Literal["truncate", "mask", "masked_is"]): the correction.
        form (Literal["geometric", "sequence", "token"]): :math:`\rho` per sequence
            (geometric mean or product of the token ratios) or per token.
        low (float): :math:`C_\text{low}`.
        high (float): :math:`C_\text{high}`.

    Examples:
        >>> from torchrl_gspo import RolloutCorrection
        >>> RolloutCorrection.from_arguments("truncate", "sequence", None)
        RolloutCorrection(mode='truncate', form='sequence', low=0.0, high=3.0)
        >>> RolloutCorrection.from_arguments("masked_is", "token", (0.5, 2.0))
        RolloutCorrection(mode='masked_is', form='token', low=0.5, high=2.0)
        >>> RolloutCorrection.from_arguments(None, "geometric", None) is None
        True
    """

    mode: Mode
    form: Form
    low: float
    high: float

    @classmethod
    def from_arguments(
        cls, mode: Mode | None, form: Form, threshold: float | tuple[float, float] | None
    ) -> RolloutCorrection | None:
        """The correction of :class:`~torchrl_gspo.GSPOLoss`' keyword arguments.

        Args:
            mode: ``rollout_correction``; ``None`` for no correction.
            form: ``rollout_correction_form``.
            threshold: ``rollout_correction_threshold``: a cap :math:`C`, the band
                :math:`(0, C)` (``"truncate"`` and ``"masked_is"``), or a pair
                :math:`(C_\\text{low}, C_\\text{high})` whose ``None`` ends are 0
                and infinity (TRL's ``clip_min`` and ``clip_max``); ``None`` for the
                default.

        Returns:
            The configuration, or ``None`` without correction. Invalid arguments
            raise an error that names the argument.
        """
        if mode is None:
            if threshold is not None:
                raise ValueError(
                    "rollout_correction_threshold is set but rollout_correction is None; "
                    f"pass rollout_correction as one of {_MODES}."
                )
            return None
        _arguments.choice("rollout_correction", mode, _MODES)
        _arguments.choice("rollout_correction_form", form, _FORMS)
        if threshold is None:
            threshold = _DEFAULTS[mode, form]
        name = "rollout_correction_threshold"
        if isinstance(threshold, (tuple, list)) and len(threshold) == 2:
            # None: no bound, as TRL's clip_min / clip_max
            low = 0.0 if threshold[0] is None else _arguments.real(threshold[0], name)
            high = math.inf if threshold[1] is None else _arguments.real(threshold[1], name)
        elif mode != "mask" and not isinstance(threshold, (tuple, list)):
            low, high = 0.0, _arguments.real(threshold, name)
        else:
            raise TypeError(
                f"{name} for {mode!r} is a pair (C_low, C_high)"
                f"{'' if mode == 'mask' else ' or a cap C, the band (0, C)'}; "
                f"got {threshold!r}."
            )
        if not 0.0 <= low <= 1.0 <= high:
            raise ValueError(
                f"{name} must satisfy 0 <= C_low <= 1 <= C_high (a cap C of at least 1), "
                "so that an engine that agrees with the trainer (rho = 1) keeps weight 1; "
                f"got ({low}, {high})."
            )
        return cls(mode, form, low, high)

    def weight(self, log_ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight of each ratio, and whether the correction changed it.

        Args:
            log_ratio (torch.Tensor): :math:`\\log\\rho`, any shape.

        Returns:
            ``(w, changed)``: the weights, and a boolean that is ``True`` where
            :math:`w` differs from :math:`\\rho` (``"truncate"``) or where the ratio
            left the band (``"mask"``, ``"masked_is"``).
        """
        log_low = math.log(self.low) if self.low > 0 else -math.inf
        log_high = math.log(self.high)
        outside = (log_ratio < log_low) | (log_ratio > log_high)
        if self.mode == "truncate":
            return log_ratio.clamp(log_low, log_high).exp(), outside
        if self.mode == "mask":
            return (~outside).to(log_ratio.dtype), outside
        return torch.where(outside, 0.0, log_ratio.exp()), outside


class RolloutTerms(NamedTuple):
    """Results of :func:`rollout_terms`, all detached; ``[B]`` unless stated.

    Attributes:
        log_ratio (torch.Tensor): the geometric rollout log-ratio
            :math:`\\log\\bar\\rho_i` (0 on a row without valid tokens).
        weight (torch.Tensor | None): the weight of each sequence, :math:`w_i`; with
            ``form="token"``, the mean of its tokens' weights (what a sequence-level
            term is multiplied by). ``None`` without a correction.
        corrected (torch.Tensor): the fraction of each sequence's weight that the
            correction changed: 1 or 0 per sequence, the fraction of its valid
            tokens with ``form="token"``.
        k3 (torch.Tensor): :math:`\\sum_t m_t (r_t - 1 - \\log r_t)` with
            :math:`r_t = \\pi_\\text{old} / \\pi_\\text{roll}`, the k3 estimate of
            :math:`\\mathrm{KL}(\\pi_\\text{roll} \\| \\pi_\\text{old})` summed over
            the sequence.
        token_weight (torch.Tensor | None): ``[B, T]`` the weight of each token with
            ``form="token"`` (1 off the mask); else ``None``.
    """

    log_ratio: torch.Tensor
    weight: torch.Tensor | None
    corrected: torch.Tensor
    k3: torch.Tensor
    token_weight: torch.Tensor | None = None

    @property
    def loss_weight(self) -> torch.Tensor | None:
        """The weights of the loss terms (``token_weight``, else ``weight``)."""
        return self.weight if self.token_weight is None else self.token_weight


def rollout_terms(
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    correction: RolloutCorrection | None,
) -> RolloutTerms:
    """The rollout-to-old ratios and their correction weights.

    Args:
        old (torch.Tensor): ``[B, T]`` old log-probabilities.
        rollout (torch.Tensor): ``[B, T]`` rollout log-probabilities (any value,
            NaN included, outside ``mask``).
        mask (torch.Tensor): ``[B, T]`` boolean loss mask.
        correction (RolloutCorrection | None): the correction, ``None`` for none.

    Returns:
        RolloutTerms: the values, in the dtype of ``old``.

    Examples:
        >>> import torch
        >>> from torchrl_gspo import RolloutCorrection, rollout_terms
        >>> old = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
        >>> rollout = old - torch.tensor([[0.5, 0.5], [0.0, 0.0]])
        >>> mask = torch.ones(2, 2, dtype=torch.bool)
        >>> cap = RolloutCorrection.from_arguments("truncate", "sequence", 2.0)
        >>> terms = rollout_terms(old, rollout, mask, cap)
        >>> terms.weight  # rho = (e, 1): the first is capped at 2
        tensor([2., 1.])
        >>> terms.corrected.tolist(), terms.log_ratio.tolist()
        ([1.0, 0.0], [0.5, 0.0])
    """
    delta = torch.where(mask, old - rollout.to(old.dtype), 0.0).detach()
    log_rho = delta.sum(-1)
    lengths = mask.sum(-1).clamp_min(1).to(old.dtype)
    geometric = log_rho / lengths
    k3 = (delta.expm1() - delta).sum(-1)
    if correction is None:
        return RolloutTerms(geometric, None, torch.zeros_like(geometric), k3)
    if correction.form == "token":
        # 0 off the mask: ratio 1, weight 1 (the loss masks those tokens anyway)
        tokens, changed = correction.weight(delta)
        weight = torch.where(mask, tokens, 0.0).sum(-1) / lengths
        weight = torch.where(mask.any(-1), weight, 1.0)  # as the ratio 1 of an empty row
        corrected = (changed & mask).sum(-1) / lengths
        return RolloutTerms(geometric, weight, corrected, k3, tokens)
    log_ratio = geometric if correction.form == "geometric" else log_rho
    weight, changed = correction.weight(log_ratio)
    return RolloutTerms(geometric, weight, changed.to(old.dtype), k3)
