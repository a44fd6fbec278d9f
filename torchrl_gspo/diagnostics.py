# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Sequence-level diagnostics from sufficient statistics that combine exactly."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torchrl.objectives.llm.grpo import LLMLossOutput

from torchrl_gspo import _arguments
from torchrl_gspo.rollout import RolloutTerms

__all__ = ["SegmentTerms", "SequenceDiagnosticsOutput", "SequenceStatistics"]

PREFIX = "stat_"
# How each field combines over micro-batches and ranks; the others are sums.
_MAXIMA = ("log_ratio_max_abs", "rollout_max_abs", "lag_max")
_LOG_SUMS = ("log_ratio_lse", "log_ratio_sq_lse")
_ROLLOUT = (
    "rollout_abs_sum",
    "rollout_outside",
    "rollout_corrected",
    "rollout_weight_sum",
    "rollout_k3_sum",
    "rollout_max_abs",
)
_LAG = ("lag_sum", "lag_max")
_SEGMENTS = ("segments", "clipped_segments", "whole_clipped", "kl_to_old_sum")
_NEWER = _LAG + ("objective_sum", "off_policy_masked") + _SEGMENTS  # not in 0.2's layout
# the fields set only in some calls, each group all set or all None
_OPTIONAL = {
    "rollout": _ROLLOUT,
    "policy lag": _LAG,
    "objective": ("objective_sum",),
    "off-policy mask": ("off_policy_masked",),
    "segment": _SEGMENTS,
}


class SegmentTerms(NamedTuple):
    r"""Per-row counts of an objective with one ratio per segment, for its statistics.

    Each field is ``[B]``; a segment is clipped when its log-ratio leaves its own
    clip range (:class:`~torchrl_gspo.SubsequenceLoss`).

    Attributes:
        low_tokens: the valid tokens in segments below their range.
        high_tokens: the valid tokens in segments above their range.
        segments: the segments that hold a valid token.
        clipped: how many of them are clipped.
        kl_to_old: the mean over the row's valid tokens of
            :math:`(r_t - 1) - \log r_t`, :math:`r_t = \pi_\theta / \pi_\text{old}`.
    """

    low_tokens: torch.Tensor
    high_tokens: torch.Tensor
    segments: torch.Tensor
    clipped: torch.Tensor
    kl_to_old: torch.Tensor


def world_size(group: dist.ProcessGroup | None) -> int:
    """The size of ``group``; 1 without an initialized process group.

    A rank outside ``group`` raises: collectives there would not involve it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"this rank (global rank {dist.get_rank()}) is not in the process group "
            f"{group!r}: call the data-parallel functions with a group that holds it."
        )
    return dist.get_world_size(group)


class SequenceStatistics(NamedTuple):
    r"""Sufficient statistics of GSPO's sequence-level diagnostics.

    Each field is a 0-dim tensor over the non-empty sequences :math:`i` of a batch,
    with :math:`|y_i|` valid tokens and sequence log-ratio :math:`\log s_i`. Sums
    and counts add up, maxima take the maximum and the log-sum-exp fields combine
    with ``logaddexp``, so that :meth:`combine` (micro-batches) and
    :meth:`all_reduce` (ranks) give exactly the statistics of one call on the union
    of the batches; :meth:`diagnostics` turns them into
    :class:`~torchrl_gspo.GSPOLossOutput`'s fields. A loss output carries them as
    its ``stat_*`` fields (:meth:`from_output`). The ``rollout_*`` fields are
    ``None`` unless the old log-probabilities were recomputed, the ``lag_*`` fields
    unless the loss reports the policy lag, ``objective_sum`` unless the objective
    has a diagnostic of its own (:doc:`/objectives`), ``off_policy_masked`` unless
    off-policy sequence masking is on, and the segment fields unless the objective
    has one ratio per segment (:class:`~torchrl_gspo.SubsequenceLoss`, whose
    ``low_tokens`` and ``high_tokens`` count the tokens of clipped segments).

    Attributes:
        tokens: :math:`\sum_i |y_i|`.
        log_ratio_sum: :math:`\sum_i \log s_i`.
        low_tokens: :math:`\sum_i |y_i|` over sequences below the clip range.
        low_log_ratio_sum: :math:`\sum_i \log s_i` over the same.
        high_tokens: :math:`\sum_i |y_i|` over sequences above the clip range.
        high_log_ratio_sum: :math:`\sum_i \log s_i` over the same.
        sequences: the number :math:`N` of non-empty sequences.
        low_sequences: how many lie below the clip range.
        high_sequences: how many lie above it.
        log_ratio_max_abs: :math:`\max_i |\log s_i|` (maximum).
        log_ratio_lse: :math:`\log\sum_i s_i` (log-sum-exp).
        log_ratio_sq_lse: :math:`\log\sum_i s_i^2` (log-sum-exp).
        rollout_abs_sum: :math:`\sum_i |\log\bar\rho_i|`.
        rollout_outside: sequences whose :math:`\bar\rho_i` lies outside the clip
            range.
        rollout_corrected: sequences the rollout correction changed.
        rollout_weight_sum: :math:`\sum_i w_i`.
        rollout_k3_sum: :math:`\sum_{i,t} (r_t - 1 - \log r_t)`,
            :math:`r_t = \pi_\text{old} / \pi_\text{roll}`.
        rollout_max_abs: :math:`\max_i |\log\bar\rho_i|` (maximum).
        lag_sum: :math:`\sum_i (v - v_i)`, the trainer's policy version :math:`v`
            minus the version :math:`v_i` that sampled sequence :math:`i`.
        lag_max: :math:`\max_i (v - v_i)` (maximum; 0 without a sequence).
        objective_sum: the sum over valid tokens of the objective's own per-token
            diagnostic value (:doc:`/objectives`).
        off_policy_masked: the valid tokens that off-policy sequence masking drops.
        segments: :math:`\sum_i K_i`, the segments that hold a valid token.
        clipped_segments: how many of them are clipped.
        whole_clipped: the sequences whose every segment is clipped.
        kl_to_old_sum: :math:`\sum_i \frac{1}{|y_i|}\sum_t (r_{i,t} - 1 - \log r_{i,t})`.

    Examples:
        >>> import torch
        >>> from torchrl_gspo import SequenceStatistics
        >>> bounds = (torch.tensor(-0.1), torch.tensor(0.1))
        >>> log_ratio = torch.tensor([0.0, 0.2, -0.3, 0.05])
        >>> lengths = torch.tensor([3, 1, 2, 2])
        >>> whole = SequenceStatistics.of(log_ratio, lengths, bounds)
        >>> parts = SequenceStatistics.of(log_ratio[:2], lengths[:2], bounds).combine(
        ...     SequenceStatistics.of(log_ratio[2:], lengths[2:], bounds))
        >>> d, d_parts = whole.diagnostics(), parts.diagnostics()
        >>> all(torch.allclose(d[k], d_parts[k]) for k in d)
        True
        >>> round(float(d["clip_fraction"]), 4)  # 3 of 8 tokens in clipped sequences
        0.375
    """

    tokens: torch.Tensor
    log_ratio_sum: torch.Tensor
    low_tokens: torch.Tensor
    low_log_ratio_sum: torch.Tensor
    high_tokens: torch.Tensor
    high_log_ratio_sum: torch.Tensor
    sequences: torch.Tensor
    low_sequences: torch.Tensor
    high_sequences: torch.Tensor
    log_ratio_max_abs: torch.Tensor
    log_ratio_lse: torch.Tensor
    log_ratio_sq_lse: torch.Tensor
    rollout_abs_sum: torch.Tensor | None = None
    rollout_outside: torch.Tensor | None = None
    rollout_corrected: torch.Tensor | None = None
    rollout_weight_sum: torch.Tensor | None = None
    rollout_k3_sum: torch.Tensor | None = None
    rollout_max_abs: torch.Tensor | None = None
    lag_sum: torch.Tensor | None = None
    lag_max: torch.Tensor | None = None
    objective_sum: torch.Tensor | None = None
    off_policy_masked: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    clipped_segments: torch.Tensor | None = None
    whole_clipped: torch.Tensor | None = None
    kl_to_old_sum: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        log_ratio: torch.Tensor,
        lengths: torch.Tensor,
        bounds: tuple[torch.Tensor, torch.Tensor],
        rollout: RolloutTerms | None = None,
        lag: torch.Tensor | None = None,
        objective: torch.Tensor | None = None,
        masked: torch.Tensor | None = None,
        segments: SegmentTerms | None = None,
    ) -> SequenceStatistics:
        """The statistics of one batch.

        Args:
            log_ratio (torch.Tensor): ``[B]`` sequence log-ratios :math:`\\log s_i`
                (0 on rows without valid tokens); detached.
            lengths (torch.Tensor): ``[B]`` valid-token counts :math:`|y_i|`.
            bounds (tuple[torch.Tensor, torch.Tensor]): the clip range in log space,
                :math:`(\\log(1 - \\epsilon_\\text{low}), \\log(1 + \\epsilon_\\text{high}))`.
            rollout (RolloutTerms, optional): the rollout terms of a call with
                recomputed old log-probabilities.
            lag (torch.Tensor, optional): ``[B]`` each row's policy lag
                :math:`v - v_i`.
            objective (torch.Tensor, optional): ``[B]`` each row's sum of the
                objective's per-token diagnostic values.
            masked (torch.Tensor, optional): ``[B]`` each row's valid tokens dropped
                by off-policy sequence masking.
            segments (SegmentTerms, optional): an objective's per-segment counts;
                its clipped tokens replace those of the sequences.

        Returns:
            SequenceStatistics: in the dtype of ``log_ratio``.
        """
        low, high = bounds
        nonempty = lengths > 0
        # rows: non-empty, below the clip range, above it (an empty row's log s_i is 0,
        # inside the range); columns: tokens and log s_i, summed over each set (a
        # select, not a product: log s_i may be -inf)
        groups = torch.stack([nonempty, log_ratio < low, log_ratio > high])
        tokens = lengths.to(log_ratio.dtype)
        weighted = torch.where(groups.unsqueeze(-1), torch.stack([tokens, log_ratio], -1), 0.0)
        sums = torch.cat([weighted.sum(-2).flatten(), groups.sum(-1).to(log_ratio.dtype)])
        weights = torch.where(nonempty, log_ratio, -math.inf)
        lse = torch.stack([weights, 2 * weights]).logsumexp(-1)
        stats = cls(*sums.unbind(), log_ratio.abs().amax(), *lse.unbind())
        stats = stats._replace(**_optional_sums(nonempty, log_ratio, lag, objective, masked))
        if segments is not None:
            stats = stats._replace(**_segment_sums(nonempty, log_ratio.dtype, segments))
        if rollout is None:
            return stats
        clip = (rollout.log_ratio < low) | (rollout.log_ratio > high)
        weight = torch.ones_like(tokens) if rollout.weight is None else rollout.weight
        rollout_sums = [rollout.log_ratio.abs(), clip, rollout.corrected, weight]
        rollout_sums = torch.stack([v.to(log_ratio.dtype) for v in rollout_sums])
        rollout_sums = torch.where(nonempty, rollout_sums, 0.0).sum(-1)
        return stats._replace(
            **dict(zip(_ROLLOUT[:4], rollout_sums.unbind(), strict=True)),
            rollout_k3_sum=rollout.k3.sum().to(log_ratio.dtype),
            rollout_max_abs=rollout.log_ratio.abs().amax().to(log_ratio.dtype),
        )

    def combine(self, other: SequenceStatistics) -> SequenceStatistics:
        """The statistics of the union of two batches (e.g. two micro-batches).

        Args:
            other (SequenceStatistics): the other batch's statistics, of the same
                kind (both with or both without ``rollout_*`` fields, and ``lag_*``
                fields).

        Returns:
            SequenceStatistics: sums added, maxima maximized, log-sum-exps combined
            with ``logaddexp``.
        """
        for kind, names in _OPTIONAL.items():
            if (getattr(self, names[0]) is None) != (getattr(other, names[0]) is None):
                raise ValueError(
                    f"SequenceStatistics.combine: one batch has {kind} statistics and the "
                    "other has not (recomputed old log-probabilities, a policy version); "
                    "combine outputs of calls in the same mode."
                )
        combined = {}
        for name, a, b in zip(self._fields, self, other, strict=True):
            if a is None:
                combined[name] = None
            elif name in _MAXIMA:
                combined[name] = torch.maximum(a, b)
            elif name in _LOG_SUMS:
                combined[name] = torch.logaddexp(a, b)
            else:
                combined[name] = a + b
        return type(self)(**combined)

    def all_reduce(self, group: dist.ProcessGroup | None = None) -> SequenceStatistics:
        """The statistics over all ranks of ``group`` (two collectives).

        Call it on every rank of ``group``. Without an initialized process group it
        returns the statistics unchanged.

        Args:
            group (ProcessGroup, optional): the process group. Defaults to the
                default group.

        Returns:
            SequenceStatistics: the statistics of the union of the ranks' batches.
        """
        if world_size(group) == 1:
            return self
        names = [n for n, v in zip(self._fields, self, strict=True) if v is not None]
        maxima = [n for n in names if n in _MAXIMA or n in _LOG_SUMS]
        sums = [n for n in names if n not in maxima]
        local = torch.stack([getattr(self, n) for n in maxima])
        top = local.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        # log-sum-exp over ranks: shift by the global maximum, add, take the log back
        lse = torch.tensor([n in _LOG_SUMS for n in maxima], device=local.device)
        shifted = torch.where(lse, (local - top).exp().nan_to_num(0.0), 0.0)
        reduced = torch.cat([torch.stack([getattr(self, n) for n in sums]), shifted])
        dist.all_reduce(reduced, group=group)
        top = torch.where(lse, top + reduced[len(sums) :].log(), top)
        values = dict(zip(sums, reduced[: len(sums)].unbind(), strict=True))
        values.update(zip(maxima, top.unbind(), strict=True))
        return self._replace(**values)

    def diagnostics(self) -> dict[str, torch.Tensor]:
        """The diagnostic fields of :class:`~torchrl_gspo.GSPOLossOutput`.

        Returns:
            dict[str, torch.Tensor]: ``clip_fraction`` and its low/high split,
            ``sequence_clip_fraction``, ``ESS``, ``sequence_log_ratio``,
            ``sequence_log_ratio_max_abs`` and, with rollout statistics, the
            ``rollout_*`` fields, with lag statistics ``policy_lag_mean`` and
            ``policy_lag_max``, and ``objective_diagnostic`` and
            ``off_policy_masked_fraction`` when their statistics are set; their
            definitions are on the output class.
        """
        tokens, sequences = self.tokens.clamp_min(1), self.sequences.clamp_min(1)
        low, high = self.low_tokens / tokens, self.high_tokens / tokens
        out = {
            "clip_fraction": low + high,
            "clip_fraction_low": low,
            "clip_fraction_high": high,
            "sequence_clip_fraction": (self.low_sequences + self.high_sequences) / sequences,
            # (sum s)^2 / (N sum s^2); 0 when no sequence has a positive weight
            "ESS": (2 * self.log_ratio_lse - self.log_ratio_sq_lse).exp().nan_to_num(0.0)
            / sequences,
            "sequence_log_ratio": self.log_ratio_sum / sequences,
            "sequence_log_ratio_max_abs": self.log_ratio_max_abs,
        }
        if self.rollout_k3_sum is not None:
            out.update(
                rollout_log_ratio_mean_abs=self.rollout_abs_sum / sequences,
                rollout_log_ratio_max_abs=self.rollout_max_abs,
                rollout_outside_clip_fraction=self.rollout_outside / sequences,
                rollout_kl=self.rollout_k3_sum / tokens,
                rollout_correction_fraction=self.rollout_corrected / sequences,
                rollout_correction_weight=self.rollout_weight_sum / sequences,
            )
        if self.lag_sum is not None:
            out.update(policy_lag_mean=self.lag_sum / sequences, policy_lag_max=self.lag_max)
        if self.objective_sum is not None:
            out["objective_diagnostic"] = self.objective_sum / tokens
        if self.off_policy_masked is not None:
            out["off_policy_masked_fraction"] = self.off_policy_masked / tokens
        if self.segments is not None:
            out.update(
                segment_clip_fraction=self.clipped_segments / self.segments.clamp_min(1),
                whole_clip_fraction=self.whole_clipped / sequences,
                segments_per_sequence=self.segments / sequences,
                kl_to_old=self.kl_to_old_sum / sequences,
            )
        return out

    def fields(self) -> dict[str, torch.Tensor]:
        """The statistics and the diagnostics, named as the output's fields.

        Returns:
            dict[str, torch.Tensor]: ``stat_<name>`` for each statistic that is set,
            and :meth:`diagnostics`.
        """
        stats = {PREFIX + n: v for n, v in zip(self._fields, self, strict=True) if v is not None}
        return {**stats, **self.diagnostics()}

    @classmethod
    def from_output(cls, output) -> SequenceStatistics:
        """The statistics carried by a loss output's ``stat_*`` fields.

        Args:
            output (GSPOLossOutput): an output of :class:`~torchrl_gspo.GSPOLoss`
                or one of its subclasses, or a tensordict holding its ``stat_*``
                fields.

        Returns:
            SequenceStatistics: the statistics of the call that produced it.
        """
        values = {n: output.get(PREFIX + n, None) for n in cls._fields}
        if any(values[n] is None for n in cls._fields if n not in _ROLLOUT + _NEWER):
            raise ValueError(
                f"SequenceStatistics.from_output needs a GSPOLoss output, with its "
                f"{PREFIX}* fields; got {type(output).__name__} without them."
            )
        return cls(**values)


def _optional_sums(nonempty, log_ratio, lag, objective, masked) -> dict[str, torch.Tensor]:
    """The policy-lag, objective and off-policy-mask statistics that are given."""
    out = {}
    if lag is not None:
        lag = lag.to(log_ratio.device, log_ratio.dtype)
        top = torch.where(nonempty, lag, -math.inf).amax()
        out["lag_sum"] = torch.where(nonempty, lag, 0.0).sum()
        out["lag_max"] = torch.where(nonempty.any(), top, 0.0)
    for name, value in (("objective_sum", objective), ("off_policy_masked", masked)):
        if value is not None:
            out[name] = torch.where(nonempty, value.to(log_ratio.dtype), 0.0).sum()
    return out


def _segment_sums(nonempty, dtype, terms: SegmentTerms) -> dict[str, torch.Tensor]:
    """The segment statistics and the clipped tokens, summed over non-empty rows."""
    values = torch.stack([v.to(dtype) for v in terms])
    low, high, segments, clipped, kl = torch.where(nonempty, values, 0.0).sum(-1).unbind()
    whole = (nonempty & (terms.clipped == terms.segments)).sum().to(dtype)
    return {
        "low_tokens": low,
        "high_tokens": high,
        "segments": segments,
        "clipped_segments": clipped,
        "whole_clipped": whole,
        "kl_to_old_sum": kl,
    }


class SequenceDiagnosticsOutput(LLMLossOutput):
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
    policy_lag_mean: torch.Tensor | None = None
    policy_lag_max: torch.Tensor | None = None
    objective_diagnostic: torch.Tensor | None = None
    off_policy_masked_fraction: torch.Tensor | None = None
    segment_clip_fraction: torch.Tensor | None = None
    whole_clip_fraction: torch.Tensor | None = None
    segments_per_sequence: torch.Tensor | None = None
    kl_to_old: torch.Tensor | None = None
    stat_tokens: torch.Tensor | None = None
    stat_log_ratio_sum: torch.Tensor | None = None
    stat_low_tokens: torch.Tensor | None = None
    stat_low_log_ratio_sum: torch.Tensor | None = None
    stat_high_tokens: torch.Tensor | None = None
    stat_high_log_ratio_sum: torch.Tensor | None = None
    stat_sequences: torch.Tensor | None = None
    stat_low_sequences: torch.Tensor | None = None
    stat_high_sequences: torch.Tensor | None = None
    stat_log_ratio_max_abs: torch.Tensor | None = None
    stat_log_ratio_lse: torch.Tensor | None = None
    stat_log_ratio_sq_lse: torch.Tensor | None = None
    stat_rollout_abs_sum: torch.Tensor | None = None
    stat_rollout_outside: torch.Tensor | None = None
    stat_rollout_corrected: torch.Tensor | None = None
    stat_rollout_weight_sum: torch.Tensor | None = None
    stat_rollout_k3_sum: torch.Tensor | None = None
    stat_rollout_max_abs: torch.Tensor | None = None
    stat_lag_sum: torch.Tensor | None = None
    stat_lag_max: torch.Tensor | None = None
    stat_objective_sum: torch.Tensor | None = None
    stat_off_policy_masked: torch.Tensor | None = None
    stat_segments: torch.Tensor | None = None
    stat_clipped_segments: torch.Tensor | None = None
    stat_whole_clipped: torch.Tensor | None = None
    stat_kl_to_old_sum: torch.Tensor | None = None

    @property
    def statistics(self) -> SequenceStatistics:
        """The call's :class:`~torchrl_gspo.SequenceStatistics` (its ``stat_*`` fields)."""
        return SequenceStatistics.from_output(self)

    @property
    def diagnostics_sum(self) -> torch.Tensor | None:
        """The sums of the ``stat_*`` fields as one tensor; deprecated, removed in 0.4."""
        _warn_legacy("diagnostics_sum")
        return self._get_legacy(sums=True)

    @diagnostics_sum.setter
    def diagnostics_sum(self, value: torch.Tensor) -> None:
        _warn_legacy("diagnostics_sum")
        self._set_legacy(value, sums=True)

    @property
    def diagnostics_max(self) -> torch.Tensor | None:
        """The maxima and log-sum-exps of the ``stat_*`` fields; deprecated, removed in 0.4."""
        _warn_legacy("diagnostics_max")
        return self._get_legacy(sums=False)

    @diagnostics_max.setter
    def diagnostics_max(self, value: torch.Tensor) -> None:
        _warn_legacy("diagnostics_max")
        self._set_legacy(value, sums=False)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # a tensorclass honors the property setters of the class' own __dict__ only
        for name in ("diagnostics_sum", "diagnostics_max"):
            setattr(cls, name, SequenceDiagnosticsOutput.__dict__[name])

    def _get_legacy(self, sums: bool) -> torch.Tensor | None:
        values = [self.get(PREFIX + n, None) for n in _legacy_names(sums)]
        values = [v for v in values if v is not None]
        return torch.stack(values) if values else None

    def _set_legacy(self, value: torch.Tensor, sums: bool) -> None:
        # 0.2's layout: the main statistics, then the rollout ones when decoupled
        names = _legacy_names(sums)
        main = len([n for n in names if n not in _ROLLOUT])
        if value.ndim != 1 or value.numel() not in (main, len(names)):
            raise ValueError(
                f"0.2's {'diagnostics_sum' if sums else 'diagnostics_max'} holds {main} or "
                f"{len(names)} values, got shape {tuple(value.shape)}."
            )
        for name, entry in zip(names, value.unbind(), strict=False):
            setattr(self, PREFIX + name, entry)


def _legacy_names(sums: bool) -> list[str]:
    """The statistics in 0.2's ``diagnostics_sum`` (or ``diagnostics_max``) order."""
    names = [n for n in SequenceStatistics._fields if n not in _NEWER]
    return [n for n in names if (n in _MAXIMA + _LOG_SUMS) != sums]


def _warn_legacy(name: str) -> None:
    _arguments.warn(
        f"GSPOLossOutput.{name} is deprecated and will be removed in 0.4: read the named "
        "statistics instead (output.statistics, or its stat_* fields).",
        DeprecationWarning,
    )


SequenceDiagnosticsOutput.__doc__ = """An LLM loss output with GSPO's sequence-level diagnostics.

The base of :class:`~torchrl_gspo.GSPOLossOutput`: the fields that
:meth:`~torchrl_gspo.SequenceStatistics.fields` fills, whose definitions are on the
:doc:`/diagnostics` page.

Examples:
    >>> import torch
    >>> from torchrl_gspo import GSPOLossOutput
    >>> from torchrl_gspo.diagnostics import SequenceDiagnosticsOutput
    >>> issubclass(GSPOLossOutput, SequenceDiagnosticsOutput)
    True
"""
