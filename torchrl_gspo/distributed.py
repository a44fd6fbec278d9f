# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPO's objective over the global batch: data-parallel ranks and micro-batches."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torch import nn
from torchrl.trainers import OptimizationStepper

from torchrl_gspo.diagnostics import SequenceStatistics, world_size
from torchrl_gspo.gspo import GSPOLossOutput

__all__ = ["GlobalBatchStepper", "all_reduce_diagnostics", "set_sequence_scale"]


def set_sequence_scale(
    micro_batches: Sequence[TensorDictBase],
    *,
    group: dist.ProcessGroup | None = None,
    key: NestedKey = "sequence_scale",
) -> int:
    r"""Makes the loss of a data-parallel, gradient-accumulated step exactly GSPO's.

    GSPO's objective (Eq. 5) is a mean over the sequences of the batch that one
    optimiser step uses. Data-parallel training splits that batch over ranks, whose
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
    micro-batches (no division by their number) and averaged by DDP or FSDP, the
    gradient is that of :math:`\frac{1}{N} \sum_i \ell_i` over the global batch.
    Rows without a response token count in :math:`N`, as they count in
    ``prompt_mean``'s per-batch mean (TRL counts them too; verl does not).

    Call it once per optimisation step, on every rank, before the step's first
    forward. Without an initialised process group, :math:`R = 1`: exact gradient
    accumulation over micro-batches of any sizes.

    Args:
        micro_batches (Sequence[TensorDictBase]): this rank's micro-batches of the
            step. ``key`` is written on each (in place).

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
    count = torch.tensor(float(sum(mb.batch_size[0] for mb in micro_batches)), dtype=torch.float64)
    world = world_size(group)
    if world > 1:
        dist.all_reduce(count, group=group)
    total = int(count.item())
    if total == 0:
        raise ValueError(
            "set_sequence_scale: the step holds no sequence on any rank; skip the "
            "optimisation step."
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
    ``sequence_log_ratio_max_abs`` and the ``rollout_*`` fields) describe the batch
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
        >>> from tensordict import TensorDict, lazy_stack
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from torchrl_gspo import GSPOLoss, all_reduce_diagnostics
        >>> _ = torch.manual_seed(0)
        >>> vocab = {f"t{i}": i for i in range(32)}
        >>> tokenizer = PreTrainedTokenizerFast(
        ...     tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t2")),
        ...     pad_token="t0", eos_token="t1")
        >>> config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        >>> policy = TransformersWrapper(Qwen2ForCausalLM(config).eval(), tokenizer=tokenizer,
        ...     input_mode="tokens", generate=False, return_log_probs=True, pad_output=False)
        >>> pairs = [([5, 6, 7], [8, 9, 1]), ([5, 6], [10, 11, 12, 13, 1])]
        >>> data = lazy_stack([
        ...     TensorDict(tokens=TensorDict(prompt=torch.tensor(p), response=torch.tensor(r),
        ...                                  full=torch.tensor(p + r)),
        ...                advantage=torch.tensor([[a]]))
        ...     for (p, r), a in zip(pairs, (1.0, -1.0))])
        >>> with torch.no_grad():
        ...     data = data.set("log_probs", policy(data.copy()).get("log_probs"))
        >>> out = GSPOLoss(policy)(data)
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
    """An optimisation step of TorchRL's trainers with GSPO's global normalisation.

    For :class:`~torchrl.trainers.algorithms.grpo.GRPOTrainer` (pass it as
    ``optimization_stepper``): each sub-batch the trainer samples is one
    optimisation step's batch on this rank. The stepper splits it into
    ``gradient_accumulation_steps`` micro-batches of near-equal sizes, calls
    :func:`set_sequence_scale` on them (one ``all_reduce`` per optimisation step),
    runs forward and backward on each, clips the gradient norm and steps the
    optimiser. The gradient is then exactly that of GSPO's objective over the
    sequences of all ranks' sub-batches, whatever their sizes. It replaces the
    trainer's own ``gradient_accumulation_steps`` (leave that at 1): set the
    replay buffer's batch size to the optimisation step's batch on a rank.

    The trainer's logs receive the mean of the micro-batches' loss terms and of
    GRPOLoss' own fields, the gradient norm, and the sequence-level diagnostics of
    the rank's whole sub-batch (statistics combined over the micro-batches, see
    :class:`~torchrl_gspo.SequenceStatistics`); :func:`all_reduce_diagnostics`
    on these metrics gives the global ones.

    Args:
        optimizer (torch.optim.Optimizer): the optimiser of the (DDP- or
            FSDP-wrapped) model.

    Keyword Args:
        gradient_accumulation_steps (int, optional): micro-batches per optimisation
            step. Each rank's sub-batch must hold at least that many rows.
            Defaults to ``1``.
        clip_norm (float | None, optional): maximum gradient norm, ``None`` for no
            clipping. Defaults to ``1.0``.
        group (ProcessGroup, optional): the data-parallel group. Defaults to the
            default group.

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
    ) -> None:
        super().__init__()
        if isinstance(gradient_accumulation_steps, bool) or gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be an integer >= 1, got "
                f"{gradient_accumulation_steps!r}."
            )
        self.optimizer = optimizer
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.clip_norm = clip_norm
        self.group = group

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])

    def step(self, trainer: Any, sub_batch: TensorDictBase) -> TensorDictBase:
        """One optimisation step on this rank's ``sub_batch``.

        Args:
            trainer (Trainer): the trainer; its ``compute_loss`` runs the loss.
            sub_batch (TensorDictBase): this rank's batch of the step.

        Returns:
            TensorDictBase: the mean of the micro-batches' detached loss terms, the
            sub-batch's diagnostics and ``grad_norm``.
        """
        rows = sub_batch.batch_size[0]
        if rows < self.gradient_accumulation_steps:
            raise ValueError(
                f"GlobalBatchStepper: the sub-batch holds {rows} rows, fewer than "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}; every "
                "micro-batch needs a row. Raise the replay buffer's batch size."
            )
        bounds = torch.arange(rows).tensor_split(self.gradient_accumulation_steps)
        micro_batches = [sub_batch[int(b[0]) : int(b[-1]) + 1].copy() for b in bounds]
        set_sequence_scale(micro_batches, group=self.group)
        outputs = []
        for micro_batch in micro_batches:
            losses = trainer.compute_loss(micro_batch)
            sum(v for k, v in losses.items() if k.startswith("loss_")).backward()
            outputs.append(losses.detach())
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = float("inf") if self.clip_norm is None else self.clip_norm
        grad_norm = nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        keys = [k for k, v in outputs[0].items() if v is not None and v.ndim == 0]
        metrics = TensorDict(
            {k: torch.stack([out.get(k) for out in outputs]).mean() for k in keys},
            batch_size=[],
        )
        # the diagnostics of the step's batch: statistics combined, not averaged
        if outputs[0].get("stat_tokens", None) is not None:
            stats = functools.reduce(
                SequenceStatistics.combine, map(SequenceStatistics.from_output, outputs)
            )
            metrics.update(stats.fields())
        metrics.set("grad_norm", grad_norm.detach())
        return metrics
