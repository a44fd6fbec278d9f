# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Global normalization in one process: gradient accumulation, the stepper, errors."""

from __future__ import annotations

import math

import pytest
import torch
from gspo_testing import BigramActor, build_loss, dense_batch, lazy_batch, make_rows

from torchrl_gspo import (
    GlobalBatchStepper,
    GSPOLoss,
    GSPOTokenLoss,
    SubsequenceLoss,
    all_reduce_diagnostics,
    set_sequence_scale,
)

EPS = (0.02, 0.02)
SHAPES = [(3, 5), (2, 1), (4, 0), (1, 7), (2, 3), (5, 4), (2, 0), (3, 2), (1, 6)]
CUTS = [0, 1, 4, 9]  # three micro-batches of 1, 3 and 5 rows


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def make_loss(actor, loss_cls=GSPOLoss, **kwargs):
    return build_loss(loss_cls, actor, clip_epsilon=EPS, **kwargs)


def grad_of(loss, actor):
    return torch.autograd.grad(loss, actor.table)[0]


def micro_batches(kind, rows):
    make = lazy_batch if kind == "lazy" else dense_batch
    return [make(rows[a:b]) for a, b in zip(CUTS[:-1], CUTS[1:], strict=True)]


@pytest.mark.parametrize("loss_cls", [GSPOLoss, GSPOTokenLoss, SubsequenceLoss])
@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_accumulation_over_unequal_micro_batches_is_the_full_batch_gradient(loss_cls, kind):
    actor = BigramActor()
    rows = make_rows(SHAPES, actor=actor, noise=0.03, seed=1)
    full = grad_of(make_loss(actor, loss_cls)(lazy_batch(rows)).loss_objective, actor)
    micro = micro_batches(kind, rows)
    assert set_sequence_scale(micro) == len(rows)
    loss_fn = make_loss(actor, loss_cls)
    accumulated = sum(grad_of(loss_fn(mb).loss_objective, actor) for mb in micro)
    close(accumulated, full)
    # without it, the mean of the micro-batch means: a different, documented gradient
    plain = [grad_of(loss_fn(mb.exclude("sequence_scale")).loss_objective, actor) for mb in micro]
    documented = sum(plain) / len(plain)
    assert (documented - full).abs().max() > 1e-6
    sizes = [b - a for a, b in zip(CUTS[:-1], CUTS[1:], strict=True)]
    close(sum(g * n for g, n in zip(plain, sizes, strict=True)) / len(rows), full)


def test_one_batch_scaled_by_one_over_b_changes_nothing():
    """c = 1/B on a whole batch is prompt_mean: every loss term, KL terms included."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.03, seed=2, nan_prompt=False)
    batch = lazy_batch(rows)
    for i, row in enumerate(rows):
        batch[i].set(("next", "ref_log_probs", "full"), row["old"] - 0.01)
    kwargs = {"entropy_bonus": True, "kl_to_ref_coeff": 0.1, "kl_to_inference_coeff": 0.2}
    plain = make_loss(actor, **kwargs)(batch)
    scaled_batch = batch.copy()
    set_sequence_scale([scaled_batch])
    scaled = make_loss(actor, **kwargs)(scaled_batch)
    for key in ("loss_objective", "loss_entropy", "loss_kl_to_ref", "loss_kl_to_inference"):
        close(getattr(scaled, key), getattr(plain, key))
    assert "sequence_scale" not in batch.keys()  # the caller's batch was left alone


@pytest.mark.parametrize("clip_norm", [None, 0.05])
def test_stepper_is_one_exact_step_over_its_micro_batches(clip_norm):
    actor = BigramActor()
    rows = make_rows(SHAPES, actor=actor, noise=0.03, seed=3)
    full = grad_of(make_loss(actor, entropy_bonus=False)(lazy_batch(rows)).loss_objective, actor)
    before = actor.table.detach().clone()
    loss_fn = make_loss(actor, entropy_bonus=False)

    class Trainer:  # the part of TorchRL's Trainer the stepper uses
        compute_loss = staticmethod(loss_fn)

    stepper = GlobalBatchStepper(
        torch.optim.SGD([actor.table], lr=1.0), gradient_accumulation_steps=3, clip_norm=clip_norm
    )
    metrics = stepper.step(Trainer(), lazy_batch(rows))
    norm = full.norm()
    close(metrics["grad_norm"], norm)
    factor = 1.0 if clip_norm is None else min(1.0, clip_norm / (float(norm) + 1e-6))
    close(before - actor.table.detach(), factor * full)
    assert actor.table.grad is None or not actor.table.grad.any()
    assert set(metrics.keys()) >= {"loss_objective", "clip_fraction", "ESS", "grad_norm"}


def test_all_reduce_diagnostics_in_one_process_keeps_the_values():
    actor = BigramActor()
    out = make_loss(actor)(lazy_batch(make_rows(actor=actor, noise=0.03, seed=4)))
    glob = all_reduce_diagnostics(out)
    for key in ("clip_fraction", "ESS", "sequence_log_ratio", "sequence_log_ratio_max_abs"):
        assert torch.equal(getattr(glob, key), getattr(out, key)), key
    assert glob.loss_objective is out.loss_objective or torch.equal(
        glob.loss_objective, out.loss_objective
    )


def test_global_normalization_errors():
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.03, seed=5)
    batch = lazy_batch(rows)
    set_sequence_scale([batch])
    with pytest.raises(ValueError, match=r"sequence scale at 'sequence_scale'.*prompt_mean"):
        make_loss(actor, aggregation="token_mean")(batch)
    for bad in (-1.0, math.nan):
        dense = dense_batch(rows)
        dense.set("sequence_scale", torch.full((len(rows),), bad))
        with pytest.raises(ValueError, match="must be finite and >= 0"):
            make_loss(actor)(dense)
    dense = dense_batch(rows)
    dense.set("sequence_scale", torch.ones(len(rows), 2))
    with pytest.raises(ValueError, match=r"sequence scale at 'sequence_scale' has shape \(6, 2\)"):
        make_loss(actor)(dense)
    with pytest.raises(ValueError, match="no sequence on any rank"):
        set_sequence_scale([dense_batch(rows)[:0]])
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be an integer >= 1"):
        GlobalBatchStepper(torch.optim.SGD([actor.table], lr=1.0), gradient_accumulation_steps=0)
    stepper = GlobalBatchStepper(
        torch.optim.SGD([actor.table], lr=1.0), gradient_accumulation_steps=9
    )
    with pytest.raises(ValueError, match=r"3 micro-batch\(es\) of the step hold no row"):
        stepper.step(None, lazy_batch(rows))  # 6 rows for 9 micro-batches
    with pytest.raises(ValueError, match="needs a GSPOLoss output"):
        all_reduce_diagnostics(make_loss(actor)(batch).exclude("stat_tokens"))


@pytest.mark.parametrize("key", ["sequence_scale", ("old_log_probs", "full")])
def test_a_key_on_some_rows_only_raises(key):
    """A lazily stacked batch whose rows do not all hold a key: an error, not the key
    silently ignored (the plain mean, or the rollout log-probs as the old ones)."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.03, seed=6)
    batch = lazy_batch(rows)
    for td, row in list(zip(batch.tensordicts, rows, strict=True))[:3]:
        td.set(key, row["old"].nan_to_num(0.0) if key != "sequence_scale" else torch.ones(()))
    with pytest.raises(ValueError, match=r"on some rows only: rows \[3, 4, 5\] of 6"):
        make_loss(actor)(batch)


def test_set_sequence_scale_takes_one_batch():
    actor = BigramActor()
    batch = lazy_batch(make_rows(actor=actor, noise=0.03, seed=7))
    assert set_sequence_scale(batch) == 6
    assert torch.equal(batch.get("sequence_scale"), torch.full((6,), 1 / 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="with a batch dimension"):
        set_sequence_scale([batch[0]])


class _Trainer:
    """The part of TorchRL's Trainer a stepper uses."""

    def __init__(self, loss_fn, poison=False):
        self.loss_fn, self.poison = loss_fn, poison

    def compute_loss(self, batch):
        out = self.loss_fn(batch)
        if self.poison:
            out.set("loss_objective", out.loss_objective * math.inf)
        return out


def test_stepper_logs_the_rank_share_and_skips_a_non_finite_loss():
    actor = BigramActor()
    rows = make_rows(SHAPES, actor=actor, noise=0.03, seed=8)
    full = make_loss(actor, entropy_bonus=False)(lazy_batch(rows)).loss_objective.detach()
    optimizer = torch.optim.SGD([actor.table], lr=1.0)
    stepper = GlobalBatchStepper(optimizer, gradient_accumulation_steps=3, clip_norm=None)
    before = actor.table.detach().clone()
    poisoned = stepper.step(_Trainer(make_loss(actor, entropy_bonus=False), True), lazy_batch(rows))
    assert poisoned["skipped"] == 1 and stepper.skipped_steps == 1
    assert torch.equal(actor.table.detach(), before)
    metrics = stepper.step(_Trainer(make_loss(actor, entropy_bonus=False)), lazy_batch(rows))
    assert metrics["skipped"] == 0
    close(metrics["loss_objective"], full)  # one process: the share is the whole loss


class _ProjectedActor(BigramActor):
    """The bigram actor with a linear layer on its logits, which autocast runs in its
    dtype (recorded in ``seen``)."""

    seen: list[torch.dtype]

    def logits(self, tensordict):
        logits = super().logits(tensordict)
        projected = torch.nn.functional.linear(logits, torch.eye(logits.shape[-1]))
        self.seen.append(projected.dtype)
        return projected.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stepper_runs_the_loss_under_autocast(dtype):
    """mixed_precision: the forward under autocast, a GradScaler for float16, a finite
    update."""
    actor = _ProjectedActor(dtype=torch.float32)
    actor.seen = []
    rows = make_rows(SHAPES, actor=BigramActor(dtype=torch.float32), noise=0.03, seed=9)
    rows = [{k: v.float() if v.is_floating_point() else v for k, v in r.items()} for r in rows]
    stepper = GlobalBatchStepper(
        torch.optim.SGD([actor.table], lr=0.1),
        gradient_accumulation_steps=2,
        mixed_precision=True,
        autocast_dtype=dtype,
        device_type="cpu",
    )
    assert stepper.scaler.is_enabled() == (dtype == torch.float16)
    before = actor.table.detach().clone()
    metrics = stepper.step(_Trainer(make_loss(actor, entropy_bonus=False)), lazy_batch(rows))
    assert set(actor.seen) == {dtype} and metrics["skipped"] == 0
    step = actor.table.detach() - before
    assert step.isfinite().all() and step.abs().sum() > 0


def test_stepper_refuses_a_model_it_cannot_defer_the_sync_of():
    with pytest.raises(TypeError, match=r"DistributedDataParallel or FSDP2.*got Linear"):
        GlobalBatchStepper(torch.optim.SGD([torch.ones(1)], lr=1.0), model=torch.nn.Linear(1, 1))
