# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Checks of construction arguments (each error names the argument and the fix), the
checked options as the batch functions read them, and the package's warnings,
attributed to the user's line."""

from __future__ import annotations

import functools
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import tensordict
import torch
import torchrl

_INTERNAL = tuple(
    os.path.dirname(module.__file__) + os.sep for module in (torch, tensordict, torchrl)
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


class Options(NamedTuple):
    """A loss' options, as reading, scoring and checking a batch read them.

    Attributes:
        owner: the loss' class name, which every error message starts with.
        keys: the loss' ``tensor_keys``.
        masking_strategy: ``"sft"``, ``"rlhf"`` or ``"generic"``.
        response_mask_check: ``"raise"``, ``"warn"`` or ``"ignore"``.
        rollout_correction: the correction's mode, or ``None``.
        aggregation, reduction: how the loss terms are reduced.
        kl_to_ref_coeff: the KL-to-reference coefficient, or ``None``.
        ref_padding: ``(value, side)`` with which reference log-probs are padded.
        policy_version: the trainer's version as a function, or ``None``.
        advantage_level: ``"sequence"`` or ``"token"``.
        tokenizer: the actor's tokenizer, to name a cause in an error, or ``None``.
        input_mode: the actor's input mode (``"history"``, ``"text"``, ``"tokens"``),
            to name a cause in an error, or ``None``.
        token_inputs: the keys of the per-token inputs the objective reads besides
            the log-probabilities (:attr:`~torchrl_gspo.Scores.inputs`).
    """

    owner: str
    keys: Any
    masking_strategy: str
    response_mask_check: str
    rollout_correction: str | None
    aggregation: str
    reduction: str
    kl_to_ref_coeff: float | None
    ref_padding: tuple[float, str]
    policy_version: Callable[[], int] | None
    advantage_level: str
    tokenizer: Any
    input_mode: str | None = None
    token_inputs: tuple = ()


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """A warning attributed to the first frame outside torch, tensordict, torchrl and
    this package: the user's line, whatever calls the loss."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


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


def _non_negative(value, name: str, why: str) -> float | None:
    """``None``, or ``value`` as a real number ``>= 0``; a negative one raises ``why``."""
    if value is None:
        return None
    value = real(value, name)
    if value < 0:
        raise ValueError(f"{name} must be >= 0 or None, got {value}: {why}.")
    return value


def off_policy_threshold(value) -> float | None:
    """``None``, or the off-policy masking threshold, a real number ``>= 0``."""
    why = "a negative one would drop every negative advantage, on-policy ones included"
    return _non_negative(value, "off_policy_mask_threshold", why)


def max_log_ratio(value) -> float | None:
    """The clamp of the sequence log-ratio: ``None`` or a real number ``>= 0``."""
    why = "a negative clamp would move the on-policy sequence ratio (log-ratio 0) below 1"
    return _non_negative(value, "max_log_ratio", why)


def warn_off_paper(loss, given, eps: tuple[float, float], wide: float, aggregation: str) -> None:
    """Warns about settings that leave the loss' objective: token_mean, a wide clip range."""
    name = type(loss).__name__
    if aggregation == "token_mean" != loss.objective_aggregation:
        warn(
            f"{name} with aggregation='token_mean' averages over all tokens of the batch, "
            f"which weights each sequence by its length: that is not {name}'s objective "
            "(a mean over sequences). Use aggregation='prompt_mean' for the paper's "
            "objective."
        )
    if max(eps) > wide:
        warn(
            f"{name} got clip_epsilon={given}: a token-level (GRPO/PPO-scale) range. "
            "Sequence ratios are geometric means and stay close to 1, so such a range "
            "practically never clips them; the paper uses (3e-4, 4e-4), the default."
        )


def version_source(value):
    """The trainer's version as a function: ``value`` itself, or a ``PolicyVersion``'s."""
    if value is None:
        return None
    if hasattr(value, "increment_version"):  # TorchRL's PolicyVersion: read .version
        return functools.partial(getattr, value, "version")
    if callable(value):
        return value
    raise TypeError(
        "policy_version must be a function returning the trainer's current policy "
        f"version (an int) or TorchRL's PolicyVersion; got {type(value).__name__}."
    )


def positive_pair(value, name: str) -> tuple[float, float]:
    """``(a, b)``, two positive real numbers (an error names the argument)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name} must be a pair of positive numbers, got {value!r}.")
    pair = tuple(real(v, name) for v in value)
    if min(pair) <= 0:
        raise ValueError(f"{name} must be positive, got {pair}.")
    return pair
