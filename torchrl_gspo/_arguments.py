# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Checks of construction arguments: each error names the argument and the fix."""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Sequence

import torch


def real(value, name: str) -> float:
    """``value`` as a Python float, or an error that names the argument."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number, got {value!r} of type {type(value).__name__}."
        )
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} is NaN; pass a real number.")
    return value


def choice(name: str, value, choices: Sequence[str]) -> None:
    """Raises unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}.")


def clip_epsilon(value) -> tuple[float, float]:
    """``(eps_low, eps_high)`` from a number or a pair, with ``0 <= eps_low < 1``."""
    pair = value if isinstance(value, (tuple, list)) else (value,) * 2
    if len(pair) != 2:
        raise ValueError(
            "clip_epsilon must be a number or a pair (eps_low, eps_high), got "
            f"{len(pair)} values: {value!r}."
        )
    low, high = (real(v, "clip_epsilon") for v in pair)
    if not (0.0 <= low < 1.0 and 0.0 <= high < math.inf):
        raise ValueError(
            "clip_epsilon must satisfy 0 <= eps_low < 1 and 0 <= eps_high < inf, so that "
            f"the clip range [1 - eps_low, 1 + eps_high] contains 1; got ({low}, {high})."
        )
    return low, high


def max_log_ratio(value) -> float | None:
    """The clamp of the sequence log-ratio: ``None`` or a real number ``>= 0``."""
    if value is None:
        return None
    value = real(value, "max_log_ratio")
    if value < 0:
        raise ValueError(
            f"max_log_ratio must be >= 0 or None, got {value}: a negative clamp would "
            "move the on-policy sequence ratio (log-ratio 0) below 1."
        )
    return value


# Clip ranges above this are GRPO-scale: sequence-level clipping barely ever binds.
LARGE_EPSILON = 0.01


def warn_off_paper(name: str, given, eps: tuple[float, float], aggregation: str) -> None:
    """Warns about settings that leave GSPO's objective: token_mean, a GRPO-scale range."""
    if aggregation == "token_mean":
        warnings.warn(
            f"{name} with aggregation='token_mean' averages over all tokens of the batch, "
            "which weights each sequence by its length: that is not GSPO's objective "
            "(Eq. 5, a mean over sequences). Use aggregation='prompt_mean' for the "
            "paper's objective.",
            UserWarning,
            stacklevel=3,
        )
    if max(eps) > LARGE_EPSILON:
        warnings.warn(
            f"{name} got clip_epsilon={given}: a token-level (GRPO/PPO-scale) range. "
            "Sequence ratios are geometric means and stay close to 1, so such a range "
            "practically never clips them; the paper uses (3e-4, 4e-4), the default.",
            UserWarning,
            stacklevel=3,
        )
