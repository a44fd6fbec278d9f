# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""A trust region as an early stop: no more updates on a batch once the KL to the old
policy exceeds a bound."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torchrl.trainers import TrainerHookBase

from torchrl_gspo import _arguments
from torchrl_gspo.diagnostics import world_size

__all__ = ["KLEarlyStop"]


class KLEarlyStop(TrainerHookBase):
    r"""Stops the updates on a collected batch once ``kl_to_old`` exceeds :math:`\delta`.

    The trust region :math:`\mathbb{E}_s[\mathrm{KL}(\pi_\text{old} \| \pi_\theta)] \le
    \delta` of the subsequence objective, enforced as PPO implementations enforce a
    target KL: each minibatch's loss reports ``kl_to_old`` (the k3 estimate on the
    sampled tokens, :class:`~torchrl_gspo.SubsequenceLoss`); the update whose value
    exceeds :math:`\delta` is the batch's last, and the trainer's remaining minibatch
    updates of that batch, in every remaining epoch, are skipped. The next collected
    batch updates again. Under ``torch.distributed`` the ranks agree (the largest
    rank's flag decides), so that no rank waits in a collective the others skip.

    It reads each loss output through a forward hook on the trainer's loss module,
    so it works with every optimization stepper (TorchRL's,
    :class:`~torchrl_gspo.GlobalBatchStepper`, whose micro-batches each count), and
    decides at the next minibatch drawn, the same step on every rank.

    Args:
        delta (float): :math:`\delta > 0`.

    Attributes:
        updates (int): the updates allowed so far.
        stops (int): the epochs of a batch that the bound cut short.

    Examples:
        >>> from torchrl_gspo import KLEarlyStop
        >>> stop = KLEarlyStop(delta=0.01)  # then stop.register(trainer)
        >>> stop.delta, stop.updates, stop.stops
        (0.01, 0, 0)
    """

    def __init__(self, delta: float) -> None:
        delta = _arguments.real(delta, "delta")
        if not delta > 0:
            raise ValueError(f"delta must be > 0, got {delta}: the bound on kl_to_old.")
        self.delta = delta
        self.updates = 0
        self.stops = 0
        self._exceeded = False

    def register(self, trainer, name: str = "kl_early_stop") -> None:
        """Registers its hooks on ``trainer``: a batch's start, each minibatch drawn
        (after the replay buffer's sampler) and each call of the loss module."""
        trainer.register_op("pre_optim_steps", self.start_batch)
        trainer.register_op("process_optim_batch", self.check)
        trainer.loss_module.register_forward_hook(self.read)
        trainer.register_module(name, self)

    def start_batch(self) -> None:
        """A new collected batch updates again."""
        self._exceeded = False

    def check(self, sub_batch: TensorDictBase) -> None:
        """Ends the epoch's updates (``StopIteration``) once a loss call of the batch
        exceeded the bound on any rank."""
        exceeded = torch.tensor([float(self._exceeded)])
        if world_size(None) > 1:
            exceeded = exceeded.to(sub_batch.device or "cpu")
            dist.all_reduce(exceeded, op=dist.ReduceOp.MAX)
        if exceeded.item():
            self._exceeded = True
            self.stops += 1
            raise StopIteration
        self.updates += 1

    def read(self, module, args, output) -> None:
        """A forward hook: reads the loss output's ``kl_to_old``."""
        kl = output.get("kl_to_old", None)
        if kl is None:
            raise KeyError(
                f"KLEarlyStop needs the loss output's kl_to_old, which {type(module).__name__} "
                "does not report: SubsequenceLoss does."
            )
        self._exceeded = self._exceeded or bool(kl.detach() > self.delta)

    def state_dict(self) -> dict:
        return {"updates": self.updates, "stops": self.stops}

    def load_state_dict(self, state_dict: dict) -> None:
        self.updates, self.stops = state_dict["updates"], state_dict["stops"]
