# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Sequence-level rollout correction: a configuration and a pure function."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from torchrl_gspo import _arguments

__all__ = ["RolloutCorrection", "RolloutTerms", "rollout_terms"]

# Default thresholds. Product ("sequence") form: TRL's cap 3.0 (TRL's default band has
# no lower bound; (1/3, 3) is the band symmetric in log). Geometric form: verl's band
# of its length-normalised rejection (seq_mean_k1).
_DEFAULTS = {
    ("truncate", "sequence"): 3.0,
    ("mask", "sequence"): (1 / 3, 3.0),
    ("truncate", "geometric"): 1.001,
    ("mask", "geometric"): (0.999, 1.001),
}


@dataclass(frozen=True)
class RolloutCorrection:
    r"""How the rollout-to-old ratio :math:`\rho_i` of a sequence weighs its loss terms.

    See :doc:`/inputs` for the three log-probability roles and :doc:`/math` for the
    formulas. With :math:`\log\rho_i = \sum_t m_t (\log\pi_\text{old} -
    \log\pi_\text{roll})` (``form="sequence"``, the product) or its mean over the
    sequence's valid tokens (``form="geometric"``), the detached weight is
    :math:`w_i = \min(\rho_i, C_\text{high})` (``"truncate"``) or
    :math:`w_i = \mathbb{1}[C_\text{low} \le \rho_i \le C_\text{high}]` (``"mask"``).

    Args:
        mode (Literal["truncate", "mask"]): the correction.
        form (Literal["geometric", "sequence"]): :math:`\rho_i` as the geometric
            mean or the product of the token ratios.
        low (float): :math:`C_\text{low}` (0 for ``"truncate"``).
        high (float): :math:`C_\text{high}`, the cap of ``"truncate"``.

    Examples:
        >>> from torchrl_gspo import RolloutCorrection
        >>> RolloutCorrection.from_arguments("truncate", "sequence", None)
        RolloutCorrection(mode='truncate', form='sequence', low=0.0, high=3.0)
        >>> RolloutCorrection.from_arguments(None, "geometric", None) is None
        True
    """

    mode: Literal["truncate", "mask"]
    form: Literal["geometric", "sequence"]
    low: float
    high: float

    @classmethod
    def from_arguments(
        cls,
        mode: Literal["truncate", "mask"] | None,
        form: Literal["geometric", "sequence"],
        threshold: float | tuple[float, float] | None,
    ) -> RolloutCorrection | None:
        """The correction of :class:`~torchrl_gspo.GSPOLoss`' keyword arguments.

        Args:
            mode: ``rollout_correction``; ``None`` for no correction.
            form: ``rollout_correction_form``.
            threshold: ``rollout_correction_threshold``; ``None`` for the default.

        Returns:
            The configuration, or ``None`` without correction. Invalid arguments
            raise an error that names the argument.
        """
        if mode is None:
            if threshold is not None:
                raise ValueError(
                    "rollout_correction_threshold is set but rollout_correction is None; "
                    "pass rollout_correction='truncate' or 'mask'."
                )
            return None
        _arguments.choice("rollout_correction", mode, ("truncate", "mask"))
        _arguments.choice("rollout_correction_form", form, ("geometric", "sequence"))
        if threshold is None:
            threshold = _DEFAULTS[mode, form]
        name = "rollout_correction_threshold"
        if mode == "truncate":
            if isinstance(threshold, (tuple, list)):
                raise TypeError(
                    f"{name} for 'truncate' is one cap C (w = min(rho, C)), got {threshold!r}."
                )
            low, high = 0.0, _arguments.real(threshold, name)
        else:
            if not isinstance(threshold, (tuple, list)) or len(threshold) != 2:
                raise TypeError(
                    f"{name} for 'mask' is a pair (C_low, C_high) "
                    f"(w = 1[C_low <= rho <= C_high]), got {threshold!r}."
                )
            low, high = (_arguments.real(value, name) for value in threshold)
        if not 0.0 <= low <= 1.0 <= high:
            raise ValueError(
                f"{name} must satisfy 0 <= C_low <= 1 <= C_high (a cap C of at least 1 for "
                "'truncate'), so that an engine that agrees with the trainer (rho = 1) "
                f"keeps weight 1; got ({low}, {high})."
            )
        return cls(mode, form, low, high)


class RolloutTerms(NamedTuple):
    """Per-sequence results of :func:`rollout_terms`, all detached, each ``[B]``.

    Attributes:
        log_ratio (torch.Tensor): the geometric rollout log-ratio
            :math:`\\log\\bar\\rho_i` (0 on a row without valid tokens).
        weight (torch.Tensor | None): the weights :math:`w_i`; ``None`` without a
            correction.
        corrected (torch.Tensor): whether the correction changed :math:`w_i` from
            :math:`\\rho_i` (truncated) or from 1 (masked).
        k3 (torch.Tensor): :math:`\\sum_t m_t (r_t - 1 - \\log r_t)` with
            :math:`r_t = \\pi_\\text{old} / \\pi_\\text{roll}`, the k3 estimate of
            :math:`\\mathrm{KL}(\\pi_\\text{roll} \\| \\pi_\\text{old})` summed over
            the sequence.
    """

    log_ratio: torch.Tensor
    weight: torch.Tensor | None
    corrected: torch.Tensor
    k3: torch.Tensor


def rollout_terms(
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    correction: RolloutCorrection | None,
) -> RolloutTerms:
    """The rollout-to-old ratio of each sequence, and its correction weight.

    Args:
        old (torch.Tensor): ``[B, T]`` old log-probabilities.
        rollout (torch.Tensor): ``[B, T]`` rollout log-probabilities (any value,
            NaN included, outside ``mask``).
        mask (torch.Tensor): ``[B, T]`` boolean loss mask.
        correction (RolloutCorrection | None): the correction, ``None`` for none.

    Returns:
        RolloutTerms: per-sequence values, in the dtype of ``old``.

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
        ([True, False], [0.5, 0.0])
    """
    delta = torch.where(mask, old - rollout.to(old.dtype), 0.0).detach()
    log_rho = delta.sum(-1)
    geometric = log_rho / mask.sum(-1).clamp_min(1).to(old.dtype)
    k3 = (delta.expm1() - delta).sum(-1)
    if correction is None:
        return RolloutTerms(geometric, None, torch.zeros_like(mask[:, 0]), k3)
    log_ratio = geometric if correction.form == "geometric" else log_rho
    log_high = math.log(correction.high)
    if correction.mode == "truncate":
        weight = log_ratio.clamp(max=log_high).exp()
        return RolloutTerms(geometric, weight, log_ratio > log_high, k3)
    log_low = math.log(correction.low) if correction.low > 0 else -math.inf
    inside = (log_ratio >= log_low) & (log_ratio <= log_high)
    return RolloutTerms(geometric, inside.to(old.dtype), ~inside, k3)
