# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Group Sequence Policy Optimization (GSPO) losses for TorchRL's LLM stack."""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, lazy_stack
from tensordict.utils import NestedKey
from torch import distributions as d
from torchrl.modules.llm import LLMWrapperBase
from torchrl.objectives.llm.grpo import GRPOLoss, LLMLossOutput

__all__ = ["GSPOLoss", "GSPOLossOutput", "GSPOTokenLoss", "GSPOTokenLossOutput"]

# Private entries of a call, plain tensors set on the loss' own shallow copy of the input
# (of a lazily stacked batch: on a copy of its first row only, in a new stack of its rows;
# the other rows lack them, which leaves the stack's keys as they were):
# - the call's statistics buffer, [B, n] (lazily stacked: [1, n]), created by
#   _prepare_input and filled in place by _log_weight (its first row), so that the
#   diagnostics travel with the call and nothing is stored on the module between the
#   two methods;
# - where the (left-aligned) advantage holds a finite value: [B] for one advantage per
#   sequence, [B, T] per token (False on padding).
_STATISTICS = "_gspo_statistics"
_HAS_VALUE = "_gspo_has_value"
_DIAGNOSTICS = (
    "clip_fraction",
    "clip_fraction_low",
    "clip_fraction_high",
    "sequence_clip_fraction",
    "ESS",
    "sequence_log_ratio",
    "sequence_log_ratio_max_abs",
)
# Reported when the old log-probs are recomputed (the old key is present).
_ROLLOUT_DIAGNOSTICS = (
    "rollout_log_ratio_mean_abs",
    "rollout_log_ratio_max_abs",
    "rollout_outside_clip_fraction",
    "rollout_kl",
    "rollout_correction_fraction",
    "rollout_correction_weight",
)
# The diagnostics are computed from sufficient statistics, per call: sums (which add up
# over micro-batches and ranks) and maxima. Sums: tokens and sum of log s_i over the
# non-empty sequences, over those below the clip range and over those above it, then
# the counts of these three sets of sequences; then, when decoupled, sum of
# |log rho_bar_i|, sequences outside the clip range, corrected sequences, sum of
# weights, sum of the k3 terms. Maxima: max |log s_i|, logsumexp of log s_i and of
# 2 log s_i (the ESS); then, when decoupled, max |log rho_bar_i|.
_N_SUMS, _N_MAXIMA = 9, 3
_N_ROLLOUT_SUMS, _N_ROLLOUT_MAXIMA = 5, 1
# Private keys of the decoupled mode, on the loss' own copy: the rollout log-probs
# (moved away from sample_log_prob, which then holds the old ones) and the per-sequence
# correction weights.
_ROLLOUT_LOG_PROB = "_gspo_rollout_log_prob"
_ROLLOUT_WEIGHT = "_gspo_rollout_weight"
# Private key: the per-sequence scale of the global normalisation, times the row count
# (GRPOLoss' prompt_mean then averages it into sum_i scale_i * loss_i).
_SEQUENCE_SCALE = "_gspo_sequence_scale"
_ROLLOUT_CORRECTIONS = ("truncate", "mask")
_ROLLOUT_FORMS = ("geometric", "sequence")
# Default thresholds of the rollout correction. Product ("sequence") form: TRL's cap, 3.
# Geometric form: verl's band for its length-normalised rejection (seq_mean_k1).
_DEFAULT_ROLLOUT_THRESHOLDS = {
    ("truncate", "sequence"): 3.0,
    ("mask", "sequence"): (1 / 3, 3.0),
    ("truncate", "geometric"): 1.001,
    ("mask", "geometric"): (0.999, 1.001),
}
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_AGGREGATIONS = ("prompt_mean", "token_mean", "none")
_MASKING_STRATEGIES = ("sft", "rlhf", "generic")
_RESPONSE_MASK_CHECKS = ("raise", "warn", "ignore")
_RESPONSE_KEY = ("tokens", "response")
_CLIP_BUFFERS = ("clip_epsilon_low", "clip_epsilon_high")
# Clip ranges above this are GRPO-scale: sequence-level clipping barely ever binds.
_LARGE_EPSILON = 0.01


def _diagnostics(sums: torch.Tensor, maxima: torch.Tensor) -> dict[str, torch.Tensor]:
    """The diagnostics of :class:`GSPOLossOutput` from their sufficient statistics.

    The same formulas serve one call (local statistics) and a data-parallel step
    (statistics reduced over ranks by :func:`~torchrl_gspo.all_reduce_diagnostics`).
    """
    # token and log s sums of the non-empty, below and above sequences; their counts
    n_tokens, total, low_tokens, _, high_tokens, _, n_seq, n_low, n_high = sums[:_N_SUMS].unbind()
    max_abs, lse, lse_squares = maxima[:_N_MAXIMA].unbind()
    n_tokens, n_seq = n_tokens.clamp_min(1), n_seq.clamp_min(1)
    clip_low, clip_high = low_tokens / n_tokens, high_tokens / n_tokens
    out = {
        "clip_fraction": clip_low + clip_high,
        "clip_fraction_low": clip_low,
        "clip_fraction_high": clip_high,
        "sequence_clip_fraction": (n_low + n_high) / n_seq,
        # (sum s)^2 / (N sum s^2); 0 when no sequence has a positive weight
        "ESS": (2 * lse - lse_squares).exp().nan_to_num(0.0) / n_seq,
        "sequence_log_ratio": total / n_seq,
        "sequence_log_ratio_max_abs": max_abs,
    }
    if sums.numel() > _N_SUMS:
        sum_abs, n_outside, n_corrected, weight_sum, k3 = sums[_N_SUMS:].unbind()
        out.update(
            rollout_log_ratio_mean_abs=sum_abs / n_seq,
            rollout_log_ratio_max_abs=maxima[_N_MAXIMA],
            rollout_outside_clip_fraction=n_outside / n_seq,
            rollout_kl=k3 / n_tokens,
            rollout_correction_fraction=n_corrected / n_seq,
            rollout_correction_weight=weight_sum / n_seq,
        )
    return out


def _real(value, name: str) -> float:
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


def _checked_clip_epsilon(clip_epsilon) -> tuple[float, float]:
    pair = clip_epsilon if isinstance(clip_epsilon, (tuple, list)) else (clip_epsilon,) * 2
    if len(pair) != 2:
        raise ValueError(
            "clip_epsilon must be a number or a pair (eps_low, eps_high), got "
            f"{len(pair)} values: {clip_epsilon!r}."
        )
    low, high = (_real(value, "clip_epsilon") for value in pair)
    if not (0.0 <= low < 1.0 and 0.0 <= high < math.inf):
        raise ValueError(
            "clip_epsilon must satisfy 0 <= eps_low < 1 and 0 <= eps_high < inf, so that "
            f"the clip range [1 - eps_low, 1 + eps_high] contains 1; got ({low}, {high})."
        )
    return low, high


def _checked_max_log_ratio(max_log_ratio) -> float | None:
    if max_log_ratio is None:
        return None
    value = _real(max_log_ratio, "max_log_ratio")
    if value < 0:
        raise ValueError(
            f"max_log_ratio must be >= 0 or None, got {value}: a negative clamp would "
            "move the on-policy sequence ratio (log-ratio 0) below 1."
        )
    return value


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")


def _checked_rollout_threshold(correction, form, threshold) -> tuple[float, float] | None:
    """The ``(low, high)`` bounds of the correction's ratio; None without correction."""
    if correction is None:
        if threshold is not None:
            raise ValueError(
                "rollout_correction_threshold is set but rollout_correction is None; "
                "pass rollout_correction='truncate' or 'mask'."
            )
        return None
    _check_choice("rollout_correction", correction, _ROLLOUT_CORRECTIONS)
    _check_choice("rollout_correction_form", form, _ROLLOUT_FORMS)
    if threshold is None:
        threshold = _DEFAULT_ROLLOUT_THRESHOLDS[correction, form]
    if correction == "truncate":
        if isinstance(threshold, (tuple, list)):
            raise TypeError(
                "rollout_correction_threshold for 'truncate' is one cap C (w = min(rho, C)), "
                f"got {threshold!r}."
            )
        low, high = 0.0, _real(threshold, "rollout_correction_threshold")
    else:
        if not isinstance(threshold, (tuple, list)) or len(threshold) != 2:
            raise TypeError(
                "rollout_correction_threshold for 'mask' is a pair (C_low, C_high) "
                f"(w = 1[C_low <= rho <= C_high]), got {threshold!r}."
            )
        low, high = (_real(value, "rollout_correction_threshold") for value in threshold)
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(
            "rollout_correction_threshold must satisfy 0 <= C_low <= 1 <= C_high (a cap C "
            "of at least 1 for 'truncate'), so that an engine that agrees with the "
            f"trainer (rho = 1) keeps weight 1; got ({low}, {high})."
        )
    return low, high


def _rows(tensordict: TensorDictBase) -> list[TensorDictBase] | None:
    """The rows of a batch lazily stacked along dim 0, else None."""
    if isinstance(tensordict, LazyStackedTensorDict) and tensordict.stack_dim == 0:
        return tensordict.tensordicts
    return None


def _private(tensordict: TensorDictBase) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The call's statistics buffer and where advantages have values; ``(None, None)``
    outside forward."""
    rows = _rows(tensordict)
    source = tensordict if rows is None else rows[0]
    statistics = source.get(_STATISTICS, None)
    if statistics is None:
        return None, None
    return statistics[0], source.get(_HAS_VALUE)


def _left_pad(rows: list[torch.Tensor], value: float) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(
        rows, batch_first=True, padding_value=value, padding_side="left"
    )


class GSPOLossOutput(LLMLossOutput):
    clip_fraction_low: torch.Tensor | None = None
    clip_fraction_high: torch.Tensor | None = None
    sequence_clip_fraction: torch.Tensor | None = None
    sequence_log_ratio: torch.Tensor | None = None
    sequence_log_ratio_max_abs: torch.Tensor | None = None
    rollout_log_ratio_mean_abs: torch.Tensor | None = None
    rollout_log_ratio_max_abs: torch.Tensor | None = None
    rollout_outside_clip_fraction: torch.Tensor | None = None
    rollout_kl: torch.Tensor | None = None
    rollout_correction_fraction: torch.Tensor | None = None
    rollout_correction_weight: torch.Tensor | None = None
    diagnostics_sum: torch.Tensor | None = None
    diagnostics_max: torch.Tensor | None = None


# Building a tensorclass replaces the class docstring with the generated signature;
# set it afterwards so that help() and the API docs show it.
GSPOLossOutput.__doc__ = """GSPO loss output: the loss terms, which a trainer sums, and diagnostics.

Every field is a 0-dim tensor (``diagnostics_sum`` and ``diagnostics_max`` are
1-dim); the diagnostics are detached and none of their names starts with
``loss_``, so trainers that sum the ``loss_*`` entries do not pick them up. A
field that does not apply is ``None``. ``clip_fraction`` and ``ESS`` keep
:class:`~torchrl.objectives.llm.LLMLossOutput`'s names but are computed at the
sequence level. In the formulas, :math:`s_i` is the sequence ratio of response
:math:`i`, :math:`|y_i|` its number of valid tokens and the means run over the
non-empty responses of the batch.

What to log, and what healthy values look like with the paper's clip range
(3e-4, 4e-4) and several minibatch updates per rollout:

- ``loss_objective`` and the reward (the trainer's).
- ``clip_fraction``: 0 on the first minibatch of a rollout (on-policy), then
  rising; the paper reports about 0.15 on large models, far more than GRPO's
  ~0.001. A value close to 1 means the updates are too large for the clip range
  (learning rate, number of minibatches): later minibatches carry almost no
  gradient. A value above 0 on the first minibatch means the old log-probs do
  not match the trainer (see the ``rollout_*`` fields and the troubleshooting
  page).
- ``sequence_log_ratio_max_abs``: 0 up to float rounding on the first minibatch;
  of the order of the clip range afterwards.
- ``ESS``: close to 1; a drop means a few responses dominate the ratios.
- ``rollout_outside_clip_fraction`` (with recomputed old log-probs): the share of
  responses that the inference engine's mismatch alone puts outside the clip
  range; near 0 is healthy.

The ``rollout_*`` fields are set when the batch holds the trainer's recomputed
old log-probabilities (the loss' ``old_log_prob`` key) next to the rollout ones
(``sample_log_prob``), and are ``None`` otherwise. They describe
:math:`\\log\\bar\\rho_i = \\frac{1}{|y_i|}\\sum_t (\\log\\pi_\\text{old}
- \\log\\pi_\\text{roll})(y_{i,t})` over the non-empty sequences.

Attributes:
    loss_objective (torch.Tensor): the clipped objective, negated:
        :math:`-\\frac{1}{G}\\sum_i \\min(s_i \\hat A_i, \\operatorname{clip}(s_i)
        \\hat A_i)` with ``aggregation="prompt_mean"``.
    loss_entropy (torch.Tensor): the entropy bonus, :math:`-` ``entropy_coeff``
        times the entropy (GRPOLoss'; ``None`` with ``entropy_bonus=False``).
    loss_kl_to_ref (torch.Tensor): the KL penalty to the reference policy
        (GRPOLoss'; ``None`` without ``kl_to_ref_coeff``).
    loss_kl_to_inference (torch.Tensor): the KL penalty to the inference (rollout)
        policy (GRPOLoss'; ``None`` without ``kl_to_inference_coeff``).
    clip_fraction (torch.Tensor): fraction of valid response tokens whose
        *sequence* ratio lies outside ``[1 - eps_low, 1 + eps_high]``: the
        length-weighted fraction of clipped responses, padding excluded (GRPOLoss'
        field of the same name is a token fraction over all ``B * T`` positions).
        ``clip_fraction == clip_fraction_low + clip_fraction_high``.
    clip_fraction_low (torch.Tensor): the part of ``clip_fraction`` below
        ``1 - eps_low``.
    clip_fraction_high (torch.Tensor): the part above ``1 + eps_high``.
    sequence_clip_fraction (torch.Tensor): fraction of responses outside the clip
        range, every response weighted equally.
    ESS (torch.Tensor): effective sample size of the sequence weights,
        :math:`(\\sum_i s_i)^2 / (N \\sum_i s_i^2)`, 1 when all ratios are equal
        (GRPOLoss': over tokens); 0 when no response has a positive weight.
    sequence_log_ratio (torch.Tensor): mean of the sequence log-ratios
        :math:`\\log s_i` (0 on-policy); :math:`-\\infty` when a sampled token has
        probability 0 under the current policy.
    sequence_log_ratio_max_abs (torch.Tensor): largest :math:`|\\log s_i|`;
        :math:`+\\infty` in that same case.
    kl_approx (torch.Tensor): GRPOLoss' estimate, the mean over all positions of
        the old minus the current log-probabilities (0 outside the loss mask).
    entropy (torch.Tensor): GRPOLoss' mean entropy of the current policy
        (``None`` with ``entropy_bonus=False``).
    kl_to_ref (torch.Tensor): GRPOLoss' KL estimate to the reference policy.
    kl_to_inference (torch.Tensor): GRPOLoss' KL estimate to the inference policy.
    rollout_log_ratio_mean_abs (torch.Tensor): mean :math:`|\\log\\bar\\rho_i|`,
        the engine mismatch per token of a sequence. Compare it with the clip
        range: :math:`\\log(1 + \\epsilon_\\text{high}) \\approx 4 \\cdot 10^{-4}`
        with the paper's values.
    rollout_log_ratio_max_abs (torch.Tensor): largest :math:`|\\log\\bar\\rho_i|`.
    rollout_outside_clip_fraction (torch.Tensor): fraction of sequences whose
        mismatch alone, :math:`\\bar\\rho_i`, lies outside the clip range: the
        share of the clip band spent on the engine before any update.
    rollout_kl (torch.Tensor): token-level estimate of
        :math:`\\mathrm{KL}(\\pi_\\text{roll} \\| \\pi_\\text{old})`, the mean over
        valid tokens of :math:`r - 1 - \\log r` with
        :math:`r = \\pi_\\text{old} / \\pi_\\text{roll}` (the k3 estimator).
    rollout_correction_fraction (torch.Tensor): fraction of sequences that the
        rollout correction masked or truncated (0 without correction).
    rollout_correction_weight (torch.Tensor): mean correction weight
        :math:`w_i` (1 without correction).
    diagnostics_sum (torch.Tensor): the sums the diagnostics are computed from
        (counts of tokens and sequences, sums of log-ratios), which add up over
        micro-batches and ranks. With ``diagnostics_max``, what
        :func:`~torchrl_gspo.all_reduce_diagnostics` reduces; its layout is
        private.
    diagnostics_max (torch.Tensor): the maxima the diagnostics are computed from.

Examples:
    >>> import torch
    >>> from torchrl_gspo import GSPOLossOutput
    >>> out = GSPOLossOutput(loss_objective=torch.tensor(-0.3), clip_fraction=torch.tensor(0.2),
    ...     kl_approx=torch.tensor(0.0), ESS=torch.tensor(0.98), batch_size=[])
    >>> total = sum(v for k, v in out.items() if k.startswith("loss_"))  # what trainers do
    >>> float(total)
    -0.30000001192092896
"""


class GSPOLoss(GRPOLoss):
    r"""GSPO loss: GRPO's clipped objective on a length-normalised sequence ratio.

    Group Sequence Policy Optimization (Zheng et al., Qwen, 2025,
    `arXiv:2507.18071 <https://arxiv.org/abs/2507.18071>`_) replaces GRPO's
    per-token importance ratio by one ratio per response :math:`y_i`, the
    geometric mean of its token ratios (Eq. 7):

    .. math::

        s_i(\theta) = \exp\Big(\frac{1}{|y_i|} \sum_{t=1}^{|y_i|}
            \log \frac{\pi_\theta(y_{i,t} \mid x, y_{i,<t})}
                      {\pi_{\theta_\text{old}}(y_{i,t} \mid x, y_{i,<t})}\Big),

    and maximises (Eq. 5)

    .. math::

        J(\theta) = \mathbb{E}\Big[\frac{1}{G} \sum_{i=1}^{G}
            \min\big(s_i \hat A_i,\ \text{clip}(s_i, 1 - \epsilon_\text{low},
            1 + \epsilon_\text{high}) \hat A_i\big)\Big],

    whose unclipped gradient weights every token of a response equally:
    :math:`s_i \hat A_i \frac{1}{|y_i|} \sum_t \nabla_\theta \log \pi_\theta(y_{i,t})`
    (Eq. 10). :math:`|y_i|` counts the valid (unmasked) tokens, clamped to at
    least 1; the masked-mean form of the ratio follows Hugging Face TRL's
    ``importance_sampling_level="sequence"`` (Apache-2.0).

    Only the importance weight differs from :class:`~torchrl.objectives.llm.GRPOLoss`:
    :meth:`_log_weight` reduces the masked token log-ratios to :math:`\log s_i` and
    broadcasts that value over the sequence, so the clipped surrogate, the masking
    strategies, the entropy bonus and the KL terms are GRPO's own. With one advantage
    per sequence, GRPO's surrogate is evaluated once per sequence (shape
    ``[B, 1, 1]``) rather than once per token: its per-token terms would all be
    equal. With ``aggregation="prompt_mean"`` (per-sequence mean, then mean over
    sequences) this is exactly Eq. 5.

    Numerical care:

    - The sequence reduction accumulates in ``float32`` when log-probabilities are
      ``float16``/``bfloat16`` (``float64`` stays ``float64``), and the returned
      log-weight keeps that dtype; a warning is issued once per loss, because
      half-precision log-probabilities carry rounding noise of the order of the
      clip range (bfloat16's spacing near 1.0 is :math:`2^{-7}`).
    - Before exponentiation the sequence log-ratio is clamped from above at
      ``max_log_ratio`` so that a runaway sequence gives a finite loss and
      gradient (the clamped sequence then has no gradient, as in verl).
    - An empty (all-padding) sequence contributes 0 to the loss. A current
      log-probability of :math:`-\infty` on a valid token (the policy gives a
      sampled token probability 0) makes that sequence's ratio 0: the loss and
      the gradient stay finite; ``sequence_log_ratio`` is then :math:`-\infty`,
      ``sequence_log_ratio_max_abs`` :math:`+\infty` and the inherited
      ``kl_approx`` :math:`+\infty`.

    Three log-probability roles. The rollout log-probabilities, those of the
    policy that sampled the responses (an inference engine's), are read at
    ``sample_log_prob`` (``("log_probs", "full")``, where TorchRL's collectors
    write them). When the batch also holds the trainer's recomputed old
    log-probabilities at ``old_log_prob`` (``("old_log_probs", "full")``, e.g. from
    :class:`~torchrl_gspo.RecomputeOldLogProbs`), the ratio :math:`s_i` uses them
    and the rollout ones serve the optional sequence-level rollout correction
    (``rollout_correction``), the ``rollout_*`` diagnostics and
    ``kl_to_inference_coeff``; ``kl_mask_threshold`` then filters against the old
    ones. Without that key, the rollout log-probabilities are the old policy, as
    in :class:`~torchrl.objectives.llm.GRPOLoss`. With
    :math:`\log\rho_i = \sum_t (\log\pi_\text{old} - \log\pi_\text{roll})(y_{i,t})`
    over the loss mask (``"sequence"`` form) or its mean
    :math:`\log\bar\rho_i` (``"geometric"`` form), the correction multiplies each
    sequence's per-token loss terms (the clipped objective and, when enabled, the
    entropy bonus; not GRPOLoss' batch-mean KL penalties) by the detached weight

    .. math::

        w_i = \min(\rho_i, C) \ \text{("truncate")} \quad\text{or}\quad
        w_i = \mathbb{1}[C_\text{low} \le \rho_i \le C_\text{high}] \
        \text{("mask")},

    following the rollout corrections of TRL (``vllm_importance_sampling_*``) and
    verl (``rollout_is``, ``rollout_rs``).

    Input rules (each violation raises an error that names the key and the fix):

    - Old log-probabilities are constants (a ``RuntimeError`` if they require
      grad, as in :class:`~torchrl.objectives.llm.GRPOLoss`), with one value per
      token: in a lazily stacked batch each row as long as its token row.
    - Non-finite old log-probabilities are legitimate only on the prompt, where
      vLLM writes NaN: positions outside the ``"sft"`` mask, or, with
      ``"rlhf"`` and ``"generic"`` masks, positions before a row's first finite
      value. They are left out of :math:`|y_i|`. Inside a response they raise.
    - The current log-probabilities (the actor's) are never NaN or :math:`+\infty`
      on a valid token.
    - With ``masking_strategy="generic"`` the first token of each row is not
      scored: nothing precedes it, so it has no log-probability (TorchRL's
      :class:`~torchrl.modules.llm.TransformersWrapper` writes 0 for it in its
      log-prob output and a placeholder on its logits path; scoring it would put
      an off-policy token in every sequence ratio).
    - Advantages are finite on every valid token, constants (a ``RuntimeError``
      if they require grad: nothing flows back into the caller's tensor), of any
      real dtype (integers are cast to the default float dtype).
    - The batch has one batch dimension and at least one row (rows with no
      response token are fine). The input tensordict is never modified, and the
      loss keeps no state between calls: one module can serve several threads.

    Missing keys raise :class:`~torchrl.objectives.llm.GRPOLoss`' exception types
    with its leading words (``ValueError("Action key ...")``,
    ``ValueError("Advantage key ...")``, ``KeyError("Couldn't find the log-prob ...")``).

    Diagnostics (see :class:`GSPOLossOutput`): ``clip_fraction`` is the fraction of
    valid response tokens whose *sequence* ratio lies outside
    :math:`[1 - \epsilon_\text{low}, 1 + \epsilon_\text{high}]` (padding excluded),
    i.e. the length-weighted fraction of clipped sequences; ``ESS`` is the
    effective sample size of the sequence weights,
    :math:`(\sum_i s_i)^2 / (N \sum_i s_i^2)` over the :math:`N` non-empty
    sequences, 1.0 when all weights are equal. Expect GSPO to clip a far larger
    fraction of tokens than GRPO (the paper reports about two orders of
    magnitude) while training well. When ``kl_mask_threshold`` is set, the
    diagnostics describe the sequence ratios before that token filter.

    Args:
        actor_network (LLMWrapperBase): the policy, e.g. a
            :class:`~torchrl.modules.llm.TransformersWrapper` with
            ``generate=False`` and ``return_log_probs=True``.

    Keyword Args:
        clip_epsilon (float | tuple[float, float], optional): clip range of the
            sequence ratio, symmetric or ``(eps_low, eps_high)``. Defaults to the
            paper's ``(3e-4, 4e-4)`` (§5.1). A range above 0.01 (GRPO's 0.2, say)
            warns: it would make sequence-level clipping practically a no-op.
        aggregation (Literal["prompt_mean", "token_mean", "none"], optional): loss
            aggregation. ``"prompt_mean"`` (mean over the tokens of each sequence,
            then over sequences) is the paper's objective and returns a 0-dim
            ``loss_objective``. ``"token_mean"`` (global token mean) weights each
            sequence by its length, which is not GSPO's objective: it works but
            warns. ``"none"`` returns per-token losses. ``None`` means the
            default, as in :class:`~torchrl.objectives.llm.GRPOLoss`. Defaults to
            ``"prompt_mean"``.
        max_log_ratio (float | None, optional): upper clamp applied to the
            sequence log-ratio before exponentiation, ``None`` to disable. Must
            not be negative (the on-policy log-ratio is 0). Defaults to ``10.0``.
        masking_strategy (Literal["sft", "rlhf", "generic"], optional): which
            tokens the loss scores, as in :class:`~torchrl.objectives.llm.GRPOLoss`:
            the response (``"sft"``, single turn), the assistant turns
            (``"rlhf"``) or every token after the first (``"generic"``). Any
            other value raises. Defaults to ``"sft"``.
        rollout_correction (Literal["truncate", "mask"] | None, optional): the
            sequence-level rollout correction above; it needs the ``old_log_prob``
            key in the batch (a :class:`KeyError` otherwise). Defaults to ``None``
            (no correction).
        rollout_correction_form (Literal["geometric", "sequence"], optional):
            :math:`\rho_i` as the length-normalised (geometric-mean) ratio
            :math:`\bar\rho_i`, GSPO's own form, or the product over the sequence
            (TRL's and verl's ``"sequence"`` level). Defaults to ``"geometric"``.
        rollout_correction_threshold (float | tuple[float, float] | None, optional):
            ``C >= 1`` for ``"truncate"``, ``(C_low, C_high)`` with
            ``C_low <= 1 <= C_high`` for ``"mask"``. Defaults to ``1.001`` /
            ``(0.999, 1.001)`` (geometric form, verl's length-normalised band) and
            ``3.0`` / ``(1/3, 3.0)`` (sequence form, TRL's cap).
        response_mask_check (Literal["raise", "warn", "ignore"], optional): with
            ``masking_strategy="sft"`` and a lazily stacked batch that carries the
            sampled responses at ``("tokens", "response")``, each row's number of
            valid tokens must equal its response length, since :math:`|y_i|`
            divides every sequence log-ratio. A mismatch (e.g. a training wrapper
            with ``pad_output=True`` on ragged rows, which counts prompt tokens of
            the shorter rows as response) raises, warns or is ignored. Multi-turn
            strategies (``"rlhf"``, ``"generic"``) are not checked. Defaults to
            ``"raise"``.
        **kwargs: every other keyword argument of
            :class:`~torchrl.objectives.llm.GRPOLoss` (``entropy_bonus``,
            ``entropy_coeff``, ``kl_to_ref_coeff``, ``kl_to_inference_coeff``,
            ``kl_mask_threshold``, ...), unchanged.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from torchrl_gspo import GSPOLoss
        >>> _ = torch.manual_seed(0)
        >>> # a tiny random-init causal LM and a word-level tokenizer, built in code
        >>> vocab = {f"t{i}": i for i in range(32)}
        >>> tokenizer = PreTrainedTokenizerFast(
        ...     tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t2")),
        ...     pad_token="t0", eos_token="t1")
        >>> config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        >>> policy = TransformersWrapper(Qwen2ForCausalLM(config).eval(), tokenizer=tokenizer,
        ...     input_mode="tokens", generate=False, return_log_probs=True, pad_output=False)
        >>> # two ragged (prompt, response) pairs, lazily stacked, one advantage each
        >>> pairs = [([5, 6, 7], [8, 9, 1]), ([5, 6], [10, 11, 12, 13, 1])]
        >>> data = lazy_stack([
        ...     TensorDict(tokens=TensorDict(prompt=torch.tensor(p), response=torch.tensor(r),
        ...                                  full=torch.tensor(p + r)),
        ...                advantage=torch.tensor([[a]]))
        ...     for (p, r), a in zip(pairs, (1.0, -1.0))])
        >>> with torch.no_grad():  # "old" log-probs: here the same weights (on-policy)
        ...     data = data.set("log_probs", policy(data.copy()).get("log_probs"))
        >>> loss_fn = GSPOLoss(policy)  # paper defaults: clip (3e-4, 4e-4), prompt_mean
        >>> out = loss_fn(data)
        >>> out.loss_objective.shape
        torch.Size([])
        >>> float(out.clip_fraction), float(out.ESS), float(out.sequence_log_ratio)
        (0.0, 1.0, 0.0)
        >>> out.loss_objective.backward()
    """

    output_type: type[LLMLossOutput] = GSPOLossOutput
    # Whether advantages must be constant over the valid tokens of a sequence.
    _sequence_advantage: bool = True

    def __init__(
        self,
        actor_network: LLMWrapperBase | None = None,
        *,
        clip_epsilon: float | tuple[float, float] = (3e-4, 4e-4),
        aggregation: Literal["prompt_mean", "token_mean", "none"] | None = "prompt_mean",
        max_log_ratio: float | None = 10.0,
        masking_strategy: Literal["sft", "rlhf", "generic"] = "sft",
        response_mask_check: Literal["raise", "warn", "ignore"] = "raise",
        rollout_correction: Literal["truncate", "mask"] | None = None,
        rollout_correction_form: Literal["geometric", "sequence"] = "geometric",
        rollout_correction_threshold: float | tuple[float, float] | None = None,
        **kwargs,
    ) -> None:
        eps_low, eps_high = _checked_clip_epsilon(clip_epsilon)
        rollout_bounds = _checked_rollout_threshold(
            rollout_correction, rollout_correction_form, rollout_correction_threshold
        )
        max_log_ratio = _checked_max_log_ratio(max_log_ratio)
        _check_choice("masking_strategy", masking_strategy, _MASKING_STRATEGIES)
        _check_choice("response_mask_check", response_mask_check, _RESPONSE_MASK_CHECKS)
        aggregation = "prompt_mean" if aggregation is None else aggregation
        _check_choice("aggregation", aggregation, _AGGREGATIONS)
        if aggregation == "token_mean":
            warnings.warn(
                f"{type(self).__name__} with aggregation='token_mean' averages over all "
                "tokens of the batch, which weights each sequence by its length: that is "
                "not GSPO's objective (Eq. 5, a mean over sequences). Use "
                "aggregation='prompt_mean' for the paper's objective.",
                UserWarning,
                stacklevel=2,
            )
        if max(eps_low, eps_high) > _LARGE_EPSILON:
            warnings.warn(
                f"{type(self).__name__} got clip_epsilon={clip_epsilon}: a token-level "
                "(GRPO/PPO-scale) range. Sequence ratios are geometric means and stay "
                "close to 1, so such a range practically never clips them; the paper "
                "uses (3e-4, 4e-4), the default.",
                UserWarning,
                stacklevel=2,
            )
        super().__init__(
            actor_network,
            clip_epsilon=(eps_low, eps_high),
            aggregation=aggregation,
            masking_strategy=masking_strategy,
            **kwargs,
        )
        # GRPOLoss stores the clip range in float32, where 3e-4 is off by ~1e-11:
        # keep the user's values exactly (they stay schedulable buffers; see _apply).
        for name, value in zip(_CLIP_BUFFERS, (eps_low, eps_high), strict=True):
            device = getattr(self, name).device
            setattr(self, name, torch.tensor(value, dtype=torch.float64, device=device))
        self.max_log_ratio = max_log_ratio
        self.response_mask_check = response_mask_check
        self.rollout_correction = rollout_correction
        self.rollout_correction_form = rollout_correction_form
        self._rollout_bounds = rollout_bounds
        # Warn-once flag: it only silences a repeated warning, never changes a result.
        self._warned_half_precision = False

    @dataclass
    class _AcceptedKeys(GRPOLoss._AcceptedKeys):
        r"""Tensordict keys of the loss: GRPOLoss' own, and the old log-probs.

        Attributes:
            old_log_prob (NestedKey): the trainer's recomputed (proximal) old
                log-probabilities, e.g. written by
                :class:`~torchrl_gspo.RecomputeOldLogProbs`. When present in the
                input, the ratio uses them and ``sample_log_prob`` holds the rollout
                (inference-engine) log-probabilities. Defaults to
                ``("old_log_probs", "full")``.
            sequence_scale (NestedKey): one value :math:`c_i` per row, written by
                :func:`~torchrl_gspo.set_sequence_scale` for a data-parallel or
                gradient-accumulated step. When present, the loss terms are
                :math:`\sum_i c_i \ell_i` instead of the per-sequence mean.
                Defaults to ``"sequence_scale"``.
        """

        old_log_prob: NestedKey = ("old_log_probs", "full")
        sequence_scale: NestedKey = "sequence_scale"

    def _set_in_keys(self):
        super()._set_in_keys()
        if self.tensor_keys.old_log_prob not in self._in_keys:
            self._in_keys.append(self.tensor_keys.old_log_prob)

    def _apply(self, fn):
        # The float64 clip buffers become float32 on a device without float64 (MPS),
        # where moving them as they are would fail.
        try:
            fn(torch.zeros((), dtype=torch.float64))
        except (TypeError, RuntimeError):
            for name in _CLIP_BUFFERS:
                self._buffers[name] = self._buffers[name].float()
        return super()._apply(fn)

    @property
    def out_keys(self):
        keys = list(super().out_keys)
        for key in (*_DIAGNOSTICS, *_ROLLOUT_DIAGNOSTICS, "diagnostics_sum", "diagnostics_max"):
            if key not in keys:
                keys.append(key)
        return keys

    @out_keys.setter
    def out_keys(self, values):
        self._out_keys = values

    def forward(self, tensordict: TensorDictBase) -> GSPOLossOutput:
        """Computes the GSPO loss and its sequence-level diagnostics.

        Args:
            tensordict (TensorDictBase): the batch, as for
                :class:`~torchrl.objectives.llm.GRPOLoss`. It is not modified.

        Returns:
            GSPOLossOutput: the loss terms and diagnostics.
        """
        tensordict, statistics = self._prepare_input(tensordict)
        out = super().forward(tensordict)
        n_sums = _N_SUMS
        if statistics.numel() > _N_SUMS + _N_MAXIMA:  # decoupled: recomputed old log-probs
            n_sums += _N_ROLLOUT_SUMS
        sums, maxima = statistics[:n_sums], statistics[n_sums:]
        diagnostics = {"diagnostics_sum": sums, "diagnostics_max": maxima}
        for name, value in {**diagnostics, **_diagnostics(sums, maxima)}.items():
            out.set(name, value)
        return out

    def _prepare_input(self, tensordict: TensorDictBase) -> tuple[TensorDictBase, torch.Tensor]:
        """Validates the inputs; returns a shallow copy and the call's statistics buffer.

        Every input is read once. Advantages that need it are aligned (ragged rows
        read left-padded, like the log-probabilities, so that each value lines up
        with its token; integers cast; NaN padding replaced by 0) and written on the
        copy; where a value is missing is recorded under a private key. The copy
        also carries the (empty) statistics buffer, which :meth:`_log_weight` fills.
        Lazily stacked rows that need no change are not copied: the "copy" is a new
        stack of the same rows whose first row is a copy carrying the private key.
        """
        keys = self.tensor_keys
        name = type(self).__name__
        if tensordict.batch_dims != 1:
            raise ValueError(
                f"{name}: the batch has shape {tuple(tensordict.batch_size)}; the loss "
                "expects one batch dimension, [B, T]. Flatten the batch first, e.g. "
                "tensordict.reshape(-1)."
            )
        rows = _rows(tensordict)

        def read(key: NestedKey):
            if rows is None:
                return tensordict.get(key, None)
            if rows[0].get(key, None) is None:  # the common case of an absent key: one read
                return None
            values = [row.get(key, None) for row in rows]
            return None if any(v is None for v in values) else values

        # The exception types and leading words are GRPOLoss' own.
        tokens = read(keys.action)
        if tokens is None:
            raise ValueError(
                f"Action key {keys.action} not in tensordict. {name} reads the sampled "
                f"tokens there; write them, or point the loss at their key with "
                "loss.set_keys(action=...)."
            )
        advantage = read(keys.advantage)
        if advantage is None:
            raise ValueError(
                f"Advantage key {keys.advantage} not in tensordict. {name} reads one "
                "advantage per sequence there (e.g. from MCAdvantage); write it, or point "
                "the loss at its key with loss.set_keys(advantage=...)."
            )
        log_prob = read(keys.sample_log_prob)
        if log_prob is None:
            raise KeyError(
                f"Couldn't find the log-prob {keys.sample_log_prob} in the input data. "
                f"{name} reads the old (sampling) log-probabilities there, one per token; "
                "write them, or point the loss at their key with "
                "loss.set_keys(sample_log_prob=...)."
            )
        batch = tensordict.batch_size[0]
        if batch == 0:
            raise ValueError(
                f"{name}: the batch is empty (batch size 0), so there is no sequence to "
                "optimise: skip the optimisation step. (Rows with no response token are "
                "fine: they contribute 0 to the loss.)"
            )
        if rows is None:
            shapes, lengths = None, None
            bad_shape = tokens.ndim != 2
        else:
            shapes = [row.shape for row in tokens]
            lengths = [shape[0] if len(shape) == 1 else -1 for shape in shapes]
            bad_shape = min(lengths) < 0
        if bad_shape:
            shape = tokens.shape if rows is None else shapes
            raise ValueError(
                f"{name}: the tokens at {keys.action!r} have shape {tuple(shape)}; the loss "
                "expects one batch dimension, [B, T]. Flatten the batch first, e.g. "
                "tensordict.reshape(-1)."
            )
        self._check_log_probs(keys.sample_log_prob, log_prob, tokens, lengths)
        old = None
        if keys.old_log_prob != keys.sample_log_prob:
            old = read(keys.old_log_prob)
        if old is not None:
            self._check_log_probs(keys.old_log_prob, old, tokens, lengths)
        elif self.rollout_correction is not None:
            raise KeyError(
                f"{name}: rollout_correction={self.rollout_correction!r} needs the "
                f"trainer's recomputed old log-probabilities at {keys.old_log_prob!r}, "
                "which are missing. Write them before the batch is stored, e.g. with "
                "RecomputeOldLogProbs(policy) as the collector's postproc, or point the "
                "loss at their key with loss.set_keys(old_log_prob=...)."
            )
        seq_len = tokens.shape[-1] if rows is None else max(lengths)
        advantage, aligned = self._read_advantage(advantage, batch, seq_len)
        scale = read(keys.sequence_scale)
        if scale is not None:
            scale = self._check_sequence_scale(scale, batch)
        decoupled = old is not None
        n_statistics = _N_SUMS + _N_MAXIMA + decoupled * (_N_ROLLOUT_SUMS + _N_ROLLOUT_MAXIMA)
        statistics = advantage.new_zeros(
            (batch if rows is None else 1, n_statistics),
            dtype=torch.promote_types(advantage.dtype, torch.float32),
        )
        has_value = advantage.isfinite().squeeze(-1)  # [B, T], or [B] for one per sequence
        if has_value.shape[-1] == 1:
            has_value = has_value.squeeze(-1)
        private = {_STATISTICS: statistics, _HAS_VALUE: has_value}
        if rows is not None and not (decoupled or aligned or scale is not None):
            # Nothing to change in the rows: a new stack of the same rows, the first one
            # copied to carry the private entries (copying every row costs far more).
            first = rows[0].copy().update(private)
            return lazy_stack([first, *rows[1:]]), statistics[0]
        tensordict = tensordict.copy()
        if decoupled:
            # The ratio reads sample_log_prob: give it the old log-probs, and keep the
            # rollout ones for the correction, the diagnostics and the KL to inference.
            tensordict.rename_key_(keys.sample_log_prob, _ROLLOUT_LOG_PROB)
            tensordict.rename_key_(keys.old_log_prob, keys.sample_log_prob)
        if aligned:
            tensordict.set(keys.advantage, torch.where(advantage.isfinite(), advantage, 0.0))
        if scale is not None:
            tensordict.set(_SEQUENCE_SCALE, scale * batch)
        (tensordict if rows is None else _rows(tensordict)[0]).update(private)
        return tensordict, statistics[0]

    def _check_sequence_scale(self, scale, batch: int) -> torch.Tensor:
        """The per-sequence scale of the global normalisation, ``[B]``."""
        name, key = type(self).__name__, self.tensor_keys.sequence_scale
        if self.aggregation != "prompt_mean" or self.reduction == "none":
            raise ValueError(
                f"{name}: the batch holds a sequence scale at {key!r} (global "
                "normalisation), which replaces the per-sequence mean of "
                f"aggregation='prompt_mean'; got aggregation={self.aggregation!r}, "
                f"reduction={self.reduction!r}. Use aggregation='prompt_mean'."
            )
        if isinstance(scale, list):
            scale = torch.stack([value.reshape(-1) for value in scale])
        if scale.numel() != batch or scale.requires_grad:
            raise ValueError(
                f"{name}: the sequence scale at {key!r} has shape {tuple(scale.shape)}; "
                f"expected one constant value per row ({batch} values), as "
                "set_sequence_scale writes it."
            )
        scale = scale.reshape(batch)
        if not scale.is_floating_point():
            scale = scale.to(torch.get_default_dtype())
        if not (scale.isfinite() & (scale >= 0)).all():
            raise ValueError(
                f"{name}: the sequence scale at {key!r} must be finite and >= 0, got "
                f"{scale.tolist()}."
            )
        return scale

    def _check_log_probs(
        self,
        key: NestedKey,
        log_prob: torch.Tensor | list[torch.Tensor],
        tokens: torch.Tensor | list[torch.Tensor],
        lengths: list[int] | None,
    ) -> None:
        """Log-probabilities must be constants with one value per token of each row."""
        name = type(self).__name__
        action_key = self.tensor_keys.action
        if lengths is None:
            requires_grad = log_prob.requires_grad
            if log_prob.shape != tokens.shape:
                raise ValueError(
                    f"{name}: the log-probabilities at {key!r} have shape "
                    f"{tuple(log_prob.shape)} but the tokens at {action_key!r} have shape "
                    f"{tuple(tokens.shape)} (both read left-padded). Store one "
                    "log-probability per token, of shape [B, T], e.g. from a no-grad "
                    "forward of the training wrapper (return_log_probs=True)."
                )
        else:
            requires_grad = any(row.requires_grad for row in log_prob)
            wrong = [
                i
                for i, (row, n) in enumerate(zip(log_prob, lengths, strict=True))
                if row.shape != (n,)
            ]
            if wrong:
                raise ValueError(
                    f"{name}: the log-probabilities at {key!r} do not have one value per "
                    f"token in batch row(s) {wrong}: shapes "
                    f"{[tuple(log_prob[i].shape) for i in wrong]} vs token lengths "
                    f"{[lengths[i] for i in wrong]} at {action_key!r}. A shorter row would "
                    "be padded with a finite value that silently enters the loss. Known "
                    "cause: log-probabilities from a wrapper with pad_output=True, padded "
                    "to the longest row. Store one log-probability per token of each row, "
                    "e.g. from a no-grad forward of TransformersWrapper(input_mode='tokens', "
                    "generate=False, return_log_probs=True, pad_output=False)."
                )
        if requires_grad:
            raise RuntimeError(
                f"{name}: the log-probabilities at {key!r} require grad. They must be "
                "constants: compute them under torch.no_grad() or store them with "
                ".detach()."
            )

    def _read_advantage(
        self, advantage: torch.Tensor | list[torch.Tensor], batch: int, seq_len: int
    ) -> tuple[torch.Tensor, bool]:
        """The advantage ``[B, 1, 1]`` or ``[B, T, 1]``, left-aligned with the tokens.

        NaN where a row has no value. Also returns whether it differs from what
        GRPOLoss would read (so that it must be written on the loss' copy).
        """
        name = type(self).__name__
        key = self.tensor_keys.advantage
        rows = advantage if isinstance(advantage, list) else None
        aligned = False
        if rows is not None:
            if all(row.shape == (1, 1) and row.is_floating_point() for row in rows):
                advantage = torch.stack(rows)  # as GRPOLoss reads them
            elif all(row.ndim >= 1 for row in rows):
                # Integer rows are cast before the NaN padding, which they cannot hold.
                dtype = torch.get_default_dtype()
                advantage = _left_pad(
                    [row if row.is_floating_point() else row.to(dtype) for row in rows], math.nan
                )
                aligned = True
            else:
                advantage = None
        if advantage is not None and advantage.requires_grad:
            raise RuntimeError(
                f"{name}: the advantage at {key!r} requires grad, so the loss would "
                "backpropagate into it. Advantages must be constants: compute them under "
                "torch.no_grad() or store them with .detach()."
            )
        if (
            advantage is None
            or advantage.ndim != 3
            or advantage.shape[-1] != 1
            or advantage.shape[0] != batch
            or advantage.shape[-2] > seq_len
        ):
            shape = advantage.shape if advantage is not None else [r.shape for r in rows]
            raise ValueError(
                f"{name}: advantage at {key!r} has shape {tuple(shape)}, expected "
                f"{(batch, 1, 1)} (one value per sequence) or {(batch, seq_len, 1)} (one "
                f"value per token, aligned with {self.tensor_keys.action!r}; shorter rows "
                "are read as covering the last tokens). A [B] or [B, 1] advantage needs "
                "trailing singleton dimensions: advantage.reshape(-1, 1, 1)."
            )
        if not advantage.is_floating_point():
            advantage = advantage.to(torch.get_default_dtype())
            aligned = True
        if 1 < advantage.shape[-2] < seq_len:
            # Rows shorter than the tokens (e.g. response-only) end with them.
            pad = advantage.new_full((batch, seq_len - advantage.shape[-2], 1), math.nan)
            advantage = torch.cat([pad, advantage], dim=-2)
        # Per-token advantages hold NaN padding, which must not reach GRPOLoss.
        return advantage, aligned or advantage.shape[-2] > 1

    def _loss_mask(
        self, valid: torch.Tensor, mask: torch.Tensor, rollout: torch.Tensor | None
    ) -> tuple[torch.Tensor, bool]:
        """The loss mask from GRPOLoss' (``valid`` where the old log-prob is finite).

        Also returns whether it differs from GRPOLoss' mask.
        """
        changed = False
        if rollout is not None:
            mask = mask & rollout.isfinite()
            changed = True
        if self.masking_strategy == "generic":
            # The first attended token has no context, hence no log-prob: TorchRL's
            # wrapper writes 0 for it in its log-prob output and a placeholder on its
            # logits path. Never score it.
            mask = mask & (valid.cumsum(-1) != 1)
            changed = True
        return mask, changed

    def _check_inputs(
        self,
        tensordict: TensorDictBase,
        valid: torch.Tensor,
        base_mask: torch.Tensor,
        mask: torch.Tensor,
        rollout: torch.Tensor | None,
        lengths: torch.Tensor,
        log_ratio: torch.Tensor,
        has_value: torch.Tensor,
    ) -> None:
        """GSPO's input rules, as one flag per row and one synchronisation.

        Non-finite old or rollout log-probs on a valid token are legitimate only on
        the prompt, before a row's first finite value (where vLLM writes NaN); the
        "sft" mask holds no prompt token, so there they are always an error. A NaN
        or +inf current log-prob makes the sequence log-ratio NaN or +inf. The
        details are computed only when a rule is broken.
        """
        # One flag per row, True when the row is fine.
        if self.masking_strategy == "sft":  # the mask is then the kept valid tokens
            ok = valid.sum(-1) == lengths
        else:
            kept = base_mask if rollout is None else base_mask & rollout.isfinite()
            ok = ~(valid & ~kept & (kept.cumsum(-1) > 0)).any(-1)
        ok = ok & (log_ratio < math.inf)  # False for NaN and +inf
        if has_value.ndim == 1:  # one advantage per sequence: finite on every row
            ok = ok & has_value
        else:
            ok = ok & ~(mask & ~has_value).any(-1)
            if self._sequence_advantage:
                advantage = tensordict.get(self.tensor_keys.advantage).squeeze(-1)
                inf = torch.finfo(advantage.dtype).max
                high = torch.where(mask, advantage, -inf).amax(-1)
                low = torch.where(mask, advantage, inf).amin(-1)
                ok = ok & ((lengths == 0) | (high == low))
        response = self._response_mismatch(tensordict, lengths)
        if response is not None and self.response_mask_check == "raise":
            ok = ok & ~response
        problems = ~ok
        if torch.compiler.is_compiling():
            # No data-dependent branch (a graph break) under torch.compile: check in-graph;
            # the eager path below gives the detailed message.
            torch._assert_async(
                ~problems.any(),
                f"{type(self).__name__}: invalid input (non-finite old or rollout "
                "log-probabilities on response tokens, NaN current log-probabilities, or "
                "advantages that are missing, not finite or varying within a sequence); "
                "run the loss eagerly for the details.",
            )
            return
        if problems.any():
            self._raise_bad_input(tensordict, valid, base_mask, rollout, mask, has_value)
            self._raise_response_mismatch(tensordict, lengths, response)
        if response is not None and self.response_mask_check == "warn" and response.any():
            self._raise_response_mismatch(tensordict, lengths, response)

    def _raise_bad_input(
        self,
        tensordict: TensorDictBase,
        valid: torch.Tensor,
        base_mask: torch.Tensor,
        rollout: torch.Tensor | None,
        mask: torch.Tensor,
        has_value: torch.Tensor,
    ) -> None:
        name = type(self).__name__
        keys = self.tensor_keys

        def where(bad: torch.Tensor) -> str:
            rows = bad.any(-1).nonzero().squeeze(-1).tolist()
            return f"{int(bad.sum())} valid token(s), in batch row(s) {rows}"

        kept = base_mask if rollout is None else base_mask & rollout.isfinite()
        bad_old, bad_rollout = valid & ~base_mask, valid & ~kept & base_mask
        if self.masking_strategy != "sft":
            after_first = kept.cumsum(-1) > 0
            bad_old, bad_rollout = bad_old & after_first, bad_rollout & after_first
        for bad, key, role in (
            (bad_old, keys.old_log_prob if rollout is not None else keys.sample_log_prob, "old"),
            (bad_rollout, keys.sample_log_prob, "rollout"),
        ):
            if bad.any():
                raise ValueError(
                    f"{name}: the {role} log-probabilities at {key!r} are NaN or infinite "
                    f"on {where(bad)} of the loss mask "
                    f"(masking_strategy={self.masking_strategy!r}). Non-finite "
                    "log-probabilities are accepted only on the prompt, where vLLM writes "
                    "NaN: before the first finite value of a row, and outside the 'sft' "
                    "mask. Store a finite log-probability for every response token."
                )
        current = tensordict.get("_cur_log_prob")
        bad_current = mask & (current.isnan() | (current == math.inf))
        if bad_current.any():
            raise ValueError(
                f"{name}: the actor returned NaN or +inf log-probabilities on "
                f"{where(bad_current)}. Log-probabilities are at most 0; check the "
                "model's logits (e.g. for overflow in half precision)."
            )
        key = keys.advantage
        if has_value.ndim == 1:
            rows = (~has_value).nonzero().squeeze(-1).tolist()
            if rows:
                raise ValueError(
                    f"{name}: the advantage at {key!r} is NaN or infinite in batch row(s) "
                    f"{rows}. Every sequence needs a finite advantage (GRPO-style group "
                    "advantages are finite: check the reward and the group statistics)."
                )
            return
        uncovered = mask & ~has_value
        if uncovered.any():
            raise ValueError(
                f"{name}: the advantage at {key!r} is NaN, infinite or padding at "
                f"{where(uncovered)}. Every token of the loss mask needs a finite "
                "advantage; ragged rows are read left-padded, aligned with the end of the "
                "tokens."
            )
        advantage = tensordict.get(key).squeeze(-1)
        inf = torch.finfo(advantage.dtype).max
        high = torch.where(mask, advantage, -inf).amax(-1)
        low = torch.where(mask, advantage, inf).amin(-1)
        varying = mask.any(-1) & (high != low)
        if varying.any():
            raise ValueError(
                f"{name}: the advantage at {key!r} varies across the valid tokens of batch "
                f"row(s) {varying.nonzero().squeeze(-1).tolist()}. GSPO needs one advantage "
                "per sequence; for per-token advantages use GSPOTokenLoss (GSPO-token, "
                "paper section 4.3)."
            )

    def _response_mismatch(
        self, tensordict: TensorDictBase, lengths: torch.Tensor
    ) -> torch.Tensor | None:
        """Rows whose "sft" mask count differs from their sampled response's length.

        Checked on lazily stacked batches that carry ``("tokens", "response")``; None
        when not checked.
        """
        rows = _rows(tensordict)
        if self.response_mask_check == "ignore" or self.masking_strategy != "sft" or rows is None:
            return None
        responses = [row.get(_RESPONSE_KEY, None) for row in rows]
        if any(r is None for r in responses):
            return None
        expected = torch.tensor([r.shape[-1] for r in responses], device=lengths.device)
        return lengths != expected

    def _raise_response_mismatch(
        self, tensordict: TensorDictBase, lengths: torch.Tensor, wrong: torch.Tensor | None
    ) -> None:
        if wrong is None or not wrong.any():
            return
        expected = torch.tensor(
            [row.get(_RESPONSE_KEY).shape[-1] for row in _rows(tensordict)], device=lengths.device
        )
        rows = wrong.nonzero().squeeze(-1).tolist()
        message = (
            f"{type(self).__name__}: the 'sft' loss mask does not match the sampled "
            f"responses at {_RESPONSE_KEY!r} in batch row(s) {rows}: valid tokens "
            f"{lengths[wrong].tolist()} vs response lengths {expected[wrong].tolist()}. "
            "GSPO divides each sequence log-ratio by this count, so those ratios are "
            "wrong. Known cause: a training wrapper with pad_output=True on ragged rows. "
            "Working configuration: TransformersWrapper(input_mode='tokens', "
            "generate=False, return_log_probs=True, pad_output=False) on lazily stacked "
            "data. Pass response_mask_check='warn' or 'ignore' to override."
        )
        if self.response_mask_check == "raise":
            raise ValueError(message)
        warnings.warn(message, UserWarning, stacklevel=6)

    def _sequence_log_ratio(
        self, token_log_ratio: torch.Tensor, mask: torch.Tensor | None, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Masked mean of the token log-ratios over each sequence, ``[B]``.

        ``token_log_ratio`` is 0 outside GRPOLoss' mask; ``mask`` (None when it is
        GRPOLoss') removes more. The reduction accumulates in float32 for half
        precision (float64 stays float64).
        """
        dtype = token_log_ratio.dtype
        if dtype in _HALF_DTYPES:
            if not self._warned_half_precision and not torch.compiler.is_compiling():
                warnings.warn(
                    f"{type(self).__name__} received {dtype} log-probabilities. Their "
                    "rounding error is of the order of GSPO's clip range "
                    f"({self.clip_epsilon_low.item():g}, {self.clip_epsilon_high.item():g}); the "
                    "sequence reduction accumulates in float32, but prefer float32 "
                    "log-probabilities (e.g. compute the log-softmax in float32).",
                    UserWarning,
                    stacklevel=4,
                )
                self._warned_half_precision = True
            dtype = torch.float32
        token_log_ratio = token_log_ratio.to(dtype)
        if mask is not None:
            token_log_ratio = torch.where(mask, token_log_ratio, 0.0)
        return token_log_ratio.sum(-1) / lengths.clamp_min(1).to(dtype)

    def _sequence_statistics(
        self, log_ratio: torch.Tensor, lengths: torch.Tensor, bounds: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sums and maxima of the sequence diagnostics (layout: ``_diagnostics``)."""
        low, high = bounds
        tokens = lengths.to(log_ratio.dtype)
        nonempty = lengths > 0
        # rows: non-empty, below the clip range, above it (an empty sequence has log s_i
        # = 0, an empty sum, which lies inside the clip range)
        indicators = torch.stack([nonempty, log_ratio < low, log_ratio > high]).to(log_ratio.dtype)
        weighted = indicators @ torch.stack([tokens, log_ratio], -1)  # [3, (tokens, log s)]
        sums = torch.cat([weighted.flatten(), indicators.sum(-1)])
        weights = torch.where(nonempty, log_ratio, -math.inf)
        lse = torch.stack([weights, 2 * weights]).logsumexp(-1)
        return sums, torch.cat([log_ratio.abs().amax(0, keepdim=True), lse])

    def _rollout_correction(
        self,
        tensordict: TensorDictBase,
        rollout: torch.Tensor,
        mask: torch.Tensor,
        lengths: torch.Tensor,
        dtype: torch.dtype,
        bounds: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Per-sequence rollout-to-old ratio: the correction weights and statistics.

        Returns the detached weights ``[B]`` (None without correction) and the sums
        and maximum of the rollout diagnostics (see ``_N_ROLLOUT_SUMS``).
        """
        old = tensordict.get(
            self.tensor_keys.sample_log_prob,
            as_padded_tensor=True,
            padding_side="left",
            padding_value=0.0,
        )
        delta = torch.where(mask, old.to(dtype) - rollout.to(dtype), 0.0).detach()
        log_rho = delta.sum(-1)
        geometric = log_rho / lengths.clamp_min(1).to(dtype)
        nonempty = lengths > 0
        weight, corrected = None, torch.zeros_like(nonempty)
        if self.rollout_correction is not None:
            low, high = self._rollout_bounds
            log_ratio = geometric if self.rollout_correction_form == "geometric" else log_rho
            if self.rollout_correction == "truncate":
                weight = log_ratio.clamp(max=math.log(high)).exp()
                corrected = log_ratio > math.log(high)
            else:
                log_low = math.log(low) if low > 0 else -math.inf
                inside = (log_ratio >= log_low) & (log_ratio <= math.log(high))
                weight, corrected = inside.to(dtype), ~inside
        clip_low, clip_high = bounds
        outside = (geometric < clip_low) | (geometric > clip_high)
        abs_geometric = torch.where(nonempty, geometric.abs(), 0.0)
        sums = torch.stack(
            [
                abs_geometric,
                outside & nonempty,
                corrected & nonempty,
                torch.where(nonempty, 1.0 if weight is None else weight, 0.0),
                # k3 estimate of KL(rollout || old), summed per sequence
                torch.where(mask, delta.expm1() - delta, 0.0).sum(-1),
            ]
        ).sum(-1)
        return weight, sums, abs_geometric.amax().unsqueeze(0)

    def _log_weight(
        self, tensordict: TensorDictBase, adv_shape: torch.Size
    ) -> tuple[torch.Tensor, d.Distribution, torch.Tensor, torch.Tensor]:
        token_log_weight, dist, kl_approx, base_mask = super()._log_weight(tensordict, adv_shape)
        statistics, has_value = _private(tensordict)
        # A longer buffer means the old log-probs were recomputed (decoupled mode).
        decoupled = statistics is not None and statistics.numel() > _N_SUMS + _N_MAXIMA
        rollout = None
        if decoupled:
            rollout = tensordict.get(
                _ROLLOUT_LOG_PROB, as_padded_tensor=True, padding_side="left", padding_value=0.0
            )
        valid = dist.mask
        mask, changed = self._loss_mask(valid, base_mask, rollout)
        lengths = mask.sum(-1)
        log_ratio = self._sequence_log_ratio(
            token_log_weight.squeeze(-1), mask if changed else None, lengths
        )
        if has_value is not None:  # None when called outside forward
            self._check_inputs(
                tensordict, valid, base_mask, mask, rollout, lengths, log_ratio, has_value
            )
        if statistics is not None:
            bounds = self._clip_bounds
            sums, maxima = self._sequence_statistics(log_ratio.detach(), lengths, bounds)
            if decoupled:
                weight, rollout_sums, rollout_maxima = self._rollout_correction(
                    tensordict, rollout, mask, lengths, log_ratio.dtype, bounds
                )
                if weight is not None:
                    tensordict.set(_ROLLOUT_WEIGHT, weight)
                sums = torch.cat([sums, rollout_sums])
                maxima = torch.cat([maxima, rollout_maxima])
            statistics.copy_(torch.cat([sums, maxima]))
        # -inf (a sampled token of probability 0) becomes the lowest float, whose ratio
        # is 0 as well.
        log_ratio = log_ratio.clamp(min=torch.finfo(log_ratio.dtype).min, max=self.max_log_ratio)
        if adv_shape[-1] == 1:
            # One advantage per sequence: a view of log s_i over all T positions, which
            # GSPOLoss' objective reads once per sequence (GSPO-token's reads every
            # position; _aggregate_loss_value leaves the masked ones out).
            log_weight = log_ratio.reshape(-1, 1, 1).expand(-1, mask.shape[-1], 1)
        else:
            # Per-token advantages (0 on padding): log s_i on the valid tokens, 0 elsewhere.
            log_weight = (log_ratio.unsqueeze(-1) * mask).unsqueeze(-1)
        if changed:
            kl_approx = torch.where(mask.unsqueeze(-1), kl_approx, 0.0)
        return log_weight, dist, kl_approx, mask

    def _kl_to_ref(self, tensordict: TensorDictBase, key: NestedKey, **kwargs):
        # The KL to the inference policy stays with the rollout log-probs when the old
        # ones were recomputed (they then sit at sample_log_prob in the loss' copy).
        if key == self.tensor_keys.sample_log_prob and _ROLLOUT_LOG_PROB in tensordict.keys():
            key = _ROLLOUT_LOG_PROB
        loss, value = super()._kl_to_ref(tensordict, key=key, **kwargs)
        scale = tensordict.get(_SEQUENCE_SCALE, None)
        if scale is not None:
            # A batch mean over positions, not per sequence: it counts as many times
            # as the batch has sequences, as the per-sequence terms do.
            loss = loss * scale.mean()
        return loss, value

    def _compute_policy_objective(
        self, log_weight: torch.Tensor, advantage: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._sequence_advantage and advantage.shape[-2] == 1:
            # log_weight is log s_i at every position: GRPO's clipped surrogate once per
            # sequence, [B, 1, 1], is Eq. 5's term of each sequence.
            log_weight = log_weight[..., :1, :]
        return super()._compute_policy_objective(log_weight, advantage)

    def _aggregate_loss_value(
        self,
        value: torch.Tensor,
        mask: torch.Tensor,
        tensordict: TensorDictBase | None = None,
    ) -> torch.Tensor:
        if tensordict is not None:
            # The rollout correction and the global normalisation weigh each sequence's
            # loss terms.
            for key in (_ROLLOUT_WEIGHT, _SEQUENCE_SCALE):
                weight = tensordict.get(key, None)
                if weight is not None:
                    value = value * weight.to(value.dtype).reshape(-1, *(1,) * (value.ndim - 1))
        if value.shape[-2] != mask.shape[-1]:  # one term per sequence, [B, 1, 1]
            if self.aggregation == "prompt_mean" and self.reduction != "none":
                # The mean over a sequence's valid tokens of its constant term is the
                # term itself; a sequence without valid tokens counts 0.
                return torch.where(mask.any(-1), value.reshape(-1), 0.0).mean()
            value = value.expand(*mask.shape, value.shape[-1])
        elif not self._sequence_advantage:
            # GSPO-token's terms on masked positions read the broadcast log s_i: an
            # overflow there (inf) must not become NaN in GRPOLoss' masked product.
            value = torch.where(mask.unsqueeze(-1), value, 0.0)
        loss = super()._aggregate_loss_value(value, mask, tensordict=tensordict)
        if self.aggregation == "prompt_mean" and self.reduction != "none":
            # GRPOLoss returns shape (1,) here; GSPO's objective is a scalar.
            loss = loss.squeeze(-1)
        return loss


class GSPOTokenLossOutput(GSPOLossOutput):
    pass


GSPOTokenLossOutput.__doc__ = """GSPO-token loss output: the same fields as :class:`GSPOLossOutput`.

Examples:
    >>> import torch
    >>> from torchrl_gspo import GSPOLossOutput, GSPOTokenLossOutput
    >>> out = GSPOTokenLossOutput(loss_objective=torch.tensor(0.1), clip_fraction=torch.tensor(0.0),
    ...     kl_approx=torch.tensor(0.0), ESS=torch.tensor(1.0), batch_size=[])
    >>> isinstance(out, GSPOLossOutput), out.sequence_log_ratio is None
    (True, True)
"""


class GSPOTokenLoss(GSPOLoss):
    r"""GSPO-token: GSPO's sequence ratio with one advantage per token (paper §4.3).

    For per-token advantages :math:`\hat A_{i,t}` (multi-turn, tool use, process
    rewards), GSPO-token (Zheng et al., 2025,
    `arXiv:2507.18071 <https://arxiv.org/abs/2507.18071>`_, Eqs. 13-17) gives every
    valid token the importance weight

    .. math::

        s_{i,t}(\theta) = \text{sg}[s_i(\theta)]
            \frac{\pi_\theta(y_{i,t} \mid x, y_{i,<t})}
                 {\text{sg}[\pi_\theta(y_{i,t} \mid x, y_{i,<t})]},

    where :math:`\text{sg}` stops the gradient and :math:`s_i` is
    :class:`GSPOLoss`' sequence ratio. Its value is exactly :math:`s_i`, so the
    clipping decision is made per sequence value and per token sign of
    :math:`\hat A_{i,t}`, and the objective

    .. math::

        J(\theta) = \mathbb{E}\Big[\frac{1}{G} \sum_{i=1}^{G} \frac{1}{|y_i|}
            \sum_{t=1}^{|y_i|} \min\big(s_{i,t} \hat A_{i,t},\ \text{clip}(s_{i,t},
            1 - \epsilon_\text{low}, 1 + \epsilon_\text{high}) \hat A_{i,t}\big)\Big]

    has, where nothing is clipped, the gradient (Eq. 17)
    :math:`\frac{1}{G} \sum_i s_i \frac{1}{|y_i|} \sum_t \hat A_{i,t} \nabla_\theta
    \log \pi_\theta(y_{i,t})`.

    Equivalence: when :math:`\hat A_{i,t} = \hat A_i` for every token, GSPO-token and
    :class:`GSPOLoss` are identical in loss value, clipping decision and gradient
    (this is tested). Choose :class:`GSPOLoss` for one reward per response: it
    also checks that the advantages are constant over each sequence. Choose
    ``GSPOTokenLoss`` when advantages differ across the tokens of a response.

    Per-token advantages are read like the log-probabilities: a dense
    ``[B, T, 1]`` tensor must be aligned with the left-padded tokens, and lazily
    stacked rows of different lengths are read left-padded, so that each row's
    last value meets its last token (rows may cover the whole sequence or only its
    response). A valid response token with no advantage value (padding or NaN)
    raises a :class:`ValueError`. ``[B, 1, 1]`` sequence advantages work too.

    Defaults, keyword arguments and diagnostics are :class:`GSPOLoss`' own.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from torchrl_gspo import GSPOTokenLoss
        >>> _ = torch.manual_seed(0)
        >>> vocab = {f"t{i}": i for i in range(32)}
        >>> tokenizer = PreTrainedTokenizerFast(
        ...     tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t2")),
        ...     pad_token="t0", eos_token="t1")
        >>> config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        >>> policy = TransformersWrapper(Qwen2ForCausalLM(config).eval(), tokenizer=tokenizer,
        ...     input_mode="tokens", generate=False, return_log_probs=True, pad_output=False)
        >>> # ragged rows; one advantage per response token (e.g. a process reward)
        >>> pairs = [([5, 6, 7], [8, 9, 1]), ([5, 6], [10, 11, 12, 13, 1])]
        >>> data = lazy_stack([
        ...     TensorDict(tokens=TensorDict(prompt=torch.tensor(p), response=torch.tensor(r),
        ...                                  full=torch.tensor(p + r)),
        ...                advantage=torch.linspace(-1.0, 1.0, len(r)).unsqueeze(-1))
        ...     for p, r in pairs])
        >>> with torch.no_grad():
        ...     data = data.set("log_probs", policy(data.copy()).get("log_probs"))
        >>> out = GSPOTokenLoss(policy)(data)
        >>> out.loss_objective.shape, float(out.ESS)
        (torch.Size([]), 1.0)
        >>> out.loss_objective.backward()
    """

    output_type: type[LLMLossOutput] = GSPOTokenLossOutput
    _sequence_advantage: bool = False

    def forward(self, tensordict: TensorDictBase) -> GSPOTokenLossOutput:
        """Computes the GSPO-token loss and its sequence-level diagnostics.

        Args:
            tensordict (TensorDictBase): the batch, as for
                :class:`~torchrl.objectives.llm.GRPOLoss`, with one advantage per
                token or per sequence. It is not modified.

        Returns:
            GSPOTokenLossOutput: the loss terms and diagnostics.
        """
        return super().forward(tensordict)

    def _log_weight(
        self, tensordict: TensorDictBase, adv_shape: torch.Size
    ) -> tuple[torch.Tensor, d.Distribution, torch.Tensor, torch.Tensor]:
        log_weight, dist, kl_approx, mask = super()._log_weight(tensordict, adv_shape)
        # GRPOLoss leaves the masked current log-probs here for its KL terms.
        token = tensordict.get("_cur_log_prob").to(log_weight.dtype).unsqueeze(-1)
        # No gradient on masked tokens, nor on sequences clamped at max_log_ratio
        # (where GSPOLoss has none either).
        keep = mask.unsqueeze(-1)
        if self.max_log_ratio is not None:
            keep = keep & (log_weight.detach() < self.max_log_ratio)
        # A token of probability 0 (log-prob -inf) gives its sequence ratio 0, hence no
        # gradient, as in GSPOLoss: its -inf - (-inf) = NaN becomes 0, gradient included.
        token_grad = (token - token.detach()).nan_to_num(0.0) * keep
        return log_weight.detach() + token_grad, dist, kl_approx, mask
