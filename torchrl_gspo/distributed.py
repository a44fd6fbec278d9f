# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPO's objective over the global batch: data-parallel ranks and micro-batches."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrl.trainers import OptimizationStepper

from torchrl_gspo.diagnostics import SequenceStatistics, world_size
from torchrl_gspo.gspo import GSPOLossOutput

__all__ = ["GlobalBatchStepper", "all_reduce_diagnostics", "set_sequence_scale"]


def set_sequence_scale(
    micro_batches: TensorDictBase | Sequence[TensorDictBase],
    *,
    group: dist.ProcessGroup | None = None,
    key: NestedKey = "sequence_scale",
) -> int:
    r"""Makes the loss of a data-parallel, gradient-accumulated step exactly GSPO's.

    GSPO's objective (Eq. 5) is a mean over the sequences of the batch that one
    optimizer step uses. Data-parallel training splits that batch over ranks, whose
    gradients DDP and FSDP *average*, and gradient accumulation over micro-batches,
    whose gradients *add up*; the per-micro-batch mean of
    ``aggregation="prompt_mean"`` then weighs a sequence by
    :math:`1 / (R \cdot B_{r,k})`, which equals :math:`1/N` only when every rank and
    micro-batch holds the same number of rows. This function counts the rows of
    ``micro_batches`` on every rank (one ``all_reduce``) and writes, on every row,

    .. math::

        c = \frac{R}{N}, \qquad N = \sum_{\text{ranks}} \sum_{\text{micro-batches}} B_{r,k},

    where :math:`R` is the size of ``group``. :class:`~torchrl_gspo.GSPOLoss` then
    returns :math:`\sum_i c\,\ell_i` for each micro-batch; summed over the
    micro-batches (no division by their number) and *averaged* over the ranks, as DDP
    and FSDP do, the gradient is that of :math:`\frac{1}{N} \sum_i \ell_i` over the
    global batch (a hand-written ``all_reduce(SUM)`` of the gradients must divide by
    :math:`R`). Rows without a response token count in :math:`N`, as they count in
    ``prompt_mean``'s per-batch mean (TRL counts them too; verl does not).

    Call it once per optimization step, on every rank of ``group``, before the step's
    first forward. Every micro-batch of every rank needs a row (each rank must run
    the same number of forward and backward passes): an empty one raises on every
    rank, after the count, so that no rank waits for the others. Without an
    initialized process group, :math:`R = 1`: exact gradient accumulation over
    micro-batches of any sizes.

    Args:
        micro_batches (TensorDictBase | Sequence[TensorDictBase]): this rank's
            micro-batches of the step, or its one batch. ``key`` is written on each
            row (in place).

    Keyword Args:
        group (ProcessGroup, optional): the data-parallel group. Defaults to the
            default group.
        key (NestedKey, optional): the loss' ``sequence_scale`` key. Defaults to
            ``"sequence_scale"``.

    Returns:
        int: :math:`N`, the global number of sequences of the step.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_gspo import set_sequence_scale
        >>> micro = [TensorDict(batch_size=[3]), TensorDict(batch_size=[1])]
        >>> set_sequence_scale(micro)  # one process: N = 4, c = 1/4
        4
        >>> micro[1]["sequence_scale"]
        tensor([0.2500], dtype=torch.float64)
    """
    if isinstance(micro_batches, TensorDictBase):
        micro_batches = [micro_batches]
    sizes = [mb.batch_size[0] if mb.batch_dims else -1 for mb in micro_batches]
    if min(sizes, default=0) < 0:
        raise ValueError(
            "set_sequence_scale takes micro-batches with a batch dimension (one row per "
            f"sequence); got batch sizes {[tuple(mb.batch_size) for mb in micro_batches]}."
        )
    empty = [k for k, size in enumerate(sizes) if size == 0]
    counts = torch.tensor([float(sum(sizes)), float(len(empty))], dtype=torch.float64)
    world = world_size(group)
    if world > 1:  # the step's count, and whether any rank has an empty micro-batch
        dist.all_reduce(counts, group=group)
    total, empties = int(counts[0].item()), int(counts[1].item())
    if total == 0:
        raise ValueError(
            "set_sequence_scale: the step holds no sequence on any rank; skip the "
            "optimization step."
        )
    if empties:
        raise ValueError(
            f"set_sequence_scale: {empties} micro-batch(es) of the step hold no row "
            f"across the ranks (on this rank: {empty} of {len(sizes)}). Every rank must run "
            "the same number of forward and backward passes, so every micro-batch needs "
            "a row: raise the batch size or lower the number of micro-batches "
            "(gradient_accumulation_steps)."
        )
    for micro_batch in micro_batches:
        device = micro_batch.device
        micro_batch.set(
            key,
            torch.full(micro_batch.batch_size, world / total, dtype=torch.float64, device=device),
        )
    return total


def all_reduce_diagnostics(
    output: GSPOLossOutput, *, group: dist.ProcessGroup | None = None
) -> GSPOLossOutput:
    """The sequence-level diagnostics of a loss output over all ranks.

    :class:`~torchrl_gspo.GSPOLoss`' diagnostics (``clip_fraction`` and its
    low/high split, ``sequence_clip_fraction``, ``ESS``, ``sequence_log_ratio``,
    ``sequence_log_ratio_max_abs``, the ``rollout_*`` and ``policy_lag_*`` fields,
    ``objective_diagnostic`` and ``off_policy_masked_fraction``)
    describe the batch
    of one call on one rank. This function reduces their sufficient statistics
    (the output's ``stat_*`` fields, a :class:`~torchrl_gspo.SequenceStatistics`)
    over ``group`` with :meth:`~torchrl_gspo.SequenceStatistics.all_reduce` (two
    collectives) and recomputes them, so that they equal the values of one call on
    the union of the ranks' batches. The loss terms and GRPOLoss' own fields
    (``kl_approx``, ``entropy``, ``kl_to_ref``, ``kl_to_inference``) stay local.
    To cover the micro-batches of a step, pass an output whose statistics combine
    them (:meth:`~torchrl_gspo.SequenceStatistics.combine`), such as the metrics
    of :class:`GlobalBatchStepper`.

    Call it on every rank of ``group``.

    Args:
        output (GSPOLossOutput): a loss output on this rank, or any tensordict
            holding its ``stat_*`` fields.

    Keyword Args:
        group (ProcessGroup, optional): the data-parallel group. Defaults to the
            default group.

    Returns:
        GSPOLossOutput: a copy of ``output`` with the global statistics and
        diagnostics.

    Examples:
        >>> import torch
        >>> from torchrl_gspo import GSPOLossOutput, SequenceStatistics, all_reduce_diagnostics
        >>> bounds = (torch.tensor(-3e-4), torch.tensor(4e-4))  # a loss' _clip_bounds
        >>> stats = SequenceStatistics.of(torch.tensor([1e-4, -5e-4]), torch.tensor([3, 5]), bounds)
        >>> out = GSPOLossOutput(loss_objective=torch.tensor(0.0), kl_approx=torch.tensor(0.0),
        ...                      **stats.fields(), batch_size=[])  # as a loss returns it
        >>> # one process: the global values are the local ones
        >>> float(all_reduce_diagnostics(out).ESS) == float(out.ESS)
        True
    """
    stats = SequenceStatistics.from_output(output).all_reduce(group)
    out = output.copy()
    for name, value in stats.fields().items():
        out.set(name, value)
    return out


class GlobalBatchStepper(OptimizationStepper):
    """An optimization step of TorchRL's trainers with GSPO's global normalization.

    For :class:`~torchrl.trainers.algorithms.grpo.GRPOTrainer` (pass it as
    ``optimization_stepper``): each sub-batch the trainer samples is one
    optimization step's batch on this rank. The stepper splits it into
    ``gradient_accumulation_steps`` micro-batches of near-equal sizes, calls
    :func:`set_sequence_scale` on them (one ``all_reduce`` per step), runs forward and
    backward on each, clips the gradient norm and steps the optimizer. The gradient
    is then exactly that of GSPO's objective over the sequences of all ranks'
    sub-batches, whatever their sizes.

    It replaces the trainer's own stepper, so GRPOTrainer's ``mixed_precision``,
    ``autocast_dtype`` and ``gradient_accumulation_steps`` are not used: give them
    here, and set the replay buffer's batch size to one step's rows on a rank. With
    ``model``, the DDP- or FSDP2-wrapped model, the gradients are reduced once per
    step rather than once per micro-batch (``no_sync`` /
    ``set_requires_gradient_sync``). A non-finite loss on any rank skips the step on
    every rank (the ranks agree first), as TorchRL's own stepper skips it.

    The metrics it returns: each ``loss_*`` term summed over the micro-batches (this
    rank's share: the global loss is the sum of the shares over the ranks divided by
    their number), GRPOLoss' other fields averaged, the sequence-level diagnostics of
    the whole sub-batch (statistics combined, :class:`~torchrl_gspo.SequenceStatistics`;
    :func:`all_reduce_diagnostics` on the metrics gives the global ones),
    ``grad_norm``, and ``skipped`` (1 when a non-finite loss skipped the step).

    Args:
        optimizer (torch.optim.Optimizer): the optimizer of the (DDP- or
            FSDP-wrapped) model.

    Keyword Args:
        gradient_accumulation_steps (int, optional): micro-batches per optimization
            step; each rank's sub-batch must hold at least that many rows. Defaults
            to ``1``.
        clip_norm (float | None, optional): maximum gradient norm, ``None`` for no
            clipping. Defaults to ``1.0``.
        group (ProcessGroup, optional): the data-parallel group. Defaults to the
            default group.
        model (torch.nn.Module, optional): the ``DistributedDataParallel`` or FSDP2
            (``fully_shard``) model, to reduce the gradients once per step. Defaults to
            ``None`` (reduced at every micro-batch's backward).
        mixed_precision (bool, optional): run the forward passes under
            ``torch.autocast``, with a ``torch.amp.GradScaler`` for ``float16``.
            Defaults to ``False``.
        autocast_dtype (torch.dtype, optional): the autocast dtype. Defaults to
            ``torch.bfloat16``.
        device_type (str, optional): the autocast device type. Defaults to that of the
            optimizer's first parameter.

    Examples:
        >>> import torch
        >>> from torchrl_gspo import GlobalBatchStepper
        >>> model = torch.nn.Linear(2, 2)
        >>> stepper = GlobalBatchStepper(torch.optim.Adam(model.parameters()),
        ...     gradient_accumulation_steps=2)
        >>> # trainer = GRPOTrainer(..., optimization_stepper=stepper, replay_buffer=rb)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        gradient_accumulation_steps: int = 1,
        clip_norm: float | None = 1.0,
        group: dist.ProcessGroup | None = None,
        model: nn.Module | None = None,
        mixed_precision: bool = False,
        autocast_dtype: torch.dtype = torch.bfloat16,
        device_type: str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(gradient_accumulation_steps, bool) or gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be an integer >= 1, got "
                f"{gradient_accumulation_steps!r}."
            )
        if model is not None and not _can_defer_sync(model):
            raise TypeError(
                "GlobalBatchStepper(model=...) takes the DistributedDataParallel or FSDP2 "
                f"(fully_shard) model, to reduce its gradients once per step; got "
                f"{type(model).__name__}."
            )
        self.optimizer = optimizer
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.clip_norm = clip_norm
        self.group = group
        self.model = model
        self.mixed_precision = mixed_precision
        self.autocast_dtype = autocast_dtype
        first = next(p for group in optimizer.param_groups for p in group["params"])
        self.device_type = device_type or first.device.type
        use_scaler = mixed_precision and autocast_dtype == torch.float16
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=use_scaler)
        self.skipped_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.scaler.load_state_dict(state_dict.get("scaler", {}))
        self.skipped_steps = state_dict.get("skipped_steps", 0)

    def step(self, trainer: Any, sub_batch: TensorDictBase) -> TensorDictBase:
        """One optimization step on this rank's ``sub_batch``.

        Args:
            trainer (Trainer): the trainer; its ``compute_loss`` runs the loss.
            sub_batch (TensorDictBase): this rank's batch of the step.

        Returns:
            TensorDictBase: the metrics described in the class docstring.
        """
        rows = torch.arange(sub_batch.batch_size[0])
        sizes = [len(part) for part in rows.tensor_split(self.gradient_accumulation_steps)]
        ends = itertools.accumulate(sizes)
        micro_batches = [
            sub_batch[end - n : end].copy() for n, end in zip(sizes, ends, strict=True)
        ]
        set_sequence_scale(micro_batches, group=self.group)  # raises on every rank alike
        outputs = []
        for index, micro_batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            losses = self._forward_backward(trainer, micro_batch, last)
            if losses is None:  # a non-finite loss on some rank: every rank skips
                self.optimizer.zero_grad()
                self.skipped_steps += 1
                return _metrics(outputs, skipped=True)
            outputs.append(losses)
        grad_norm = self._optimizer_step()
        metrics = _metrics(outputs, skipped=False)
        metrics.set("grad_norm", grad_norm)
        return metrics

    def _forward_backward(
        self, trainer: Any, micro_batch: TensorDictBase, last: bool
    ) -> TensorDictBase | None:
        """The micro-batch's detached losses, or None if a rank's loss is not finite."""
        with self._gradient_sync(last):
            autocast = torch.autocast(
                self.device_type, dtype=self.autocast_dtype, enabled=self.mixed_precision
            )
            with autocast:
                losses = trainer.compute_loss(micro_batch)
                loss = sum(v for k, v in losses.items() if k.startswith("loss_"))
            finite = torch.isfinite(loss.detach()).to(torch.float64).reshape(1)
            if world_size(self.group) > 1:
                dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=self.group)
            if not finite.item():
                return None
            self.scaler.scale(loss).backward()
        return losses.detach()

    @contextlib.contextmanager
    def _gradient_sync(self, last: bool) -> Iterator[None]:
        """Defers the model's gradient reduction to the step's last micro-batch."""
        if last or self.model is None:
            yield
        elif isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield
        else:
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)

    def _optimizer_step(self) -> torch.Tensor:
        self.scaler.unscale_(self.optimizer)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = float("inf") if self.clip_norm is None else self.clip_norm
        grad_norm = nn.utils.clip_grad_norm_(params, max_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        return grad_norm.detach()


def _can_defer_sync(model: nn.Module) -> bool:
    return isinstance(model, DistributedDataParallel) or hasattr(
        model, "set_requires_gradient_sync"
    )


def _metrics(outputs: list[TensorDictBase], skipped: bool) -> TensorDictBase:
    """Loss terms summed (the rank's share), other fields averaged, diagnostics combined."""
    metrics = TensorDict({"skipped": torch.tensor(float(skipped))}, batch_size=[])
    if not outputs:
        return metrics
    keys = [k for k, v in outputs[0].items() if v is not None and v.ndim == 0]
    for key in keys:
        values = torch.stack([out.get(key) for out in outputs])
        metrics.set(key, values.sum() if key.startswith("loss_") else values.mean())
    if outputs[0].get("stat_tokens", None) is not None:
        stats = functools.reduce(
            SequenceStatistics.combine, map(SequenceStatistics.from_output, outputs)
        )
        metrics.update(stats.fields())
    return metrics
