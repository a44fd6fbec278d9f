# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Stale rollouts (asynchronous collection): the policy lag and the recipe of
recomputing the old log-probabilities when the batch is consumed."""

from __future__ import annotations

import pytest
import torch
from gspo_testing import BigramActor, padded
from tensordict import NonTensorData, lazy_stack
from test_rollout import (
    OLD,
    close,
    decoupled_batch,
    decoupled_rows,
    oracle_decoupled,
    oracle_weights,
)
from test_rollout import _TablePolicy as TablePolicy
from torchrl.envs.llm.transforms import PolicyVersion

from torchrl_gspo import GSPOLoss, RecomputeOldLogProbs, SequenceStatistics

STEP = 0.05  # one update moves the token log-probs by ~1e-2, far beyond GSPO's clip
BAND = (0.8, 1.25)  # the recipe's truncation band: its lower end binds on some rows


def rollout_batch(actor, seed=12):
    """Ragged rows and their lazily stacked batch: the engine's log-probs, no old key."""
    rows = decoupled_rows(actor, seed=seed)
    return rows, decoupled_batch("lazy", rows, with_old=False)


def updated(actor, k, seed=0):
    """``actor`` after k updates, each the same step along a fixed direction."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(actor.table.shape, generator=gen, dtype=actor.table.dtype)
    with torch.no_grad():
        actor.table += k * STEP * direction
    return actor


def with_versions(batch, versions):
    """The batch with one policy version per row, as PolicyVersion writes it."""
    rows = [
        td.clone().set("policy_version", torch.tensor(int(v)))
        for td, v in zip(batch.unbind(0), versions, strict=True)
    ]
    return lazy_stack(rows, 0)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_stale_old_log_probs_clip_nearly_everything(k):
    """Without recomputation the engine's log-probs of a policy k updates behind are
    the old policy: GSPO's ratio leaves (3e-4, 4e-4) on nearly every sequence."""
    actor = BigramActor()
    _, batch = rollout_batch(actor)
    updated(actor, k)
    out = GSPOLoss(actor, policy_version=lambda: k)(with_versions(batch, [0] * len(batch)))
    assert out.policy_lag_mean == k and out.policy_lag_max == k
    assert out.clip_fraction > 0.9


@pytest.mark.parametrize("k", [1, 2, 4])
def test_recomputed_at_consumption_the_correction_carries_the_staleness(k):
    """The recipe: at consumption, the old log-probs are recomputed with the trainer's
    current weights. The first minibatch is then on-policy (no clipping); the k-step
    staleness moves into rho = pi_old / pi_roll, which the rollout correction
    weighs (the loss is the oracle's with the current weights as the old policy)."""
    actor = BigramActor()
    rows, batch = rollout_batch(actor)
    updated(actor, k)
    batch = RecomputeOldLogProbs(TablePolicy(actor))(with_versions(batch, [0] * len(rows)))
    loss_fn = GSPOLoss(
        actor,
        rollout_correction="truncate",
        rollout_correction_form="sequence",
        rollout_correction_threshold=BAND,
        policy_version=lambda: k,
    )
    out = loss_fn(batch)
    assert out.clip_fraction == 0 and out.sequence_log_ratio_max_abs == 0
    assert out.policy_lag_mean == k
    for row, old in zip(rows, batch.get(OLD, as_list=True), strict=True):
        row["old"] = old
    expected = oracle_decoupled(actor, rows, (3e-4, 4e-4), "truncate", "sequence", BAND)
    close(out.loss_objective, expected)
    old, rollout = padded(rows, "old", 0.0), padded(rows, "rollout", float("nan"))
    mask = padded(rows, "response", False) & rollout.isfinite()
    rho = oracle_weights(old, rollout, mask, "truncate", "sequence", float("inf"))
    rho = rho[mask.any(-1)]
    assert (rho < BAND[0]).any() and ((rho >= BAND[0]) & (rho <= BAND[1])).any()


def test_the_staleness_grows_with_the_lag():
    """The same rollout consumed 1, 2 and 4 updates later: the engine-to-old mismatch
    the correction sees grows with k (the updates share one direction)."""
    mismatch = []
    for k in (1, 2, 4):
        actor = BigramActor()
        _, batch = rollout_batch(actor)
        updated(actor, k)
        batch = RecomputeOldLogProbs(TablePolicy(actor))(batch)
        mismatch.append(float(GSPOLoss(actor)(batch).rollout_log_ratio_mean_abs))
    assert mismatch[0] < mismatch[1] < mismatch[2]


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_policy_lag_statistics_over_mixed_rows(kind):
    """Rows sampled by different versions: the mean and the maximum over the
    non-empty rows (the empty row's lag is left out), on both layouts."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=3)
    versions = torch.tensor([9, 8, 0, 6, 10, 7])  # row 2 has no response token
    batch = decoupled_batch(kind, rows, with_old=False)
    if kind == "lazy":
        batch = with_versions(batch, versions)
    else:
        batch.set("policy_version", versions)
    out = GSPOLoss(actor, policy_version=lambda: 10)(batch)
    nonempty = torch.tensor([len(r["response"].nonzero()) > 0 for r in rows])
    assert not nonempty[2] and nonempty.sum() == 5
    lag = (10 - versions)[nonempty].double()
    close(out.policy_lag_mean, lag.mean())
    assert out.policy_lag_max == lag.max() == 4
    # micro-batches combine exactly
    parts = [
        GSPOLoss(actor, policy_version=lambda: 10)(batch[s]) for s in (slice(0, 3), slice(3, 6))
    ]
    combined = SequenceStatistics.from_output(parts[0]).combine(parts[1].statistics)
    whole = out.statistics.diagnostics()
    for name in ("policy_lag_mean", "policy_lag_max"):
        close(combined.diagnostics()[name], whole[name])


def test_a_batch_newer_than_the_trainer_shows_a_negative_lag():
    """A version function that counts differently from the batch is not hidden: the
    lag is negative; a batch without a response token reports 0."""
    actor = BigramActor()
    rows, batch = rollout_batch(actor)
    out = GSPOLoss(actor, policy_version=lambda: 1)(with_versions(batch, [3] * len(rows)))
    assert out.policy_lag_mean == -2 and out.policy_lag_max == -2
    empty = with_versions(batch[2:3], [3])  # row 2 has no response token
    assert GSPOLoss(actor, policy_version=lambda: 1)(empty).policy_lag_max == 0


def test_the_version_key_is_an_input_key_with_the_argument():
    actor = BigramActor()
    assert "policy_version" not in GSPOLoss(actor).in_keys
    assert "policy_version" in GSPOLoss(actor, policy_version=lambda: 0).in_keys


def test_torchrl_policy_version_is_read_as_it_increments():
    actor = BigramActor()
    _, batch = rollout_batch(actor)
    tracker = PolicyVersion(version_type="int")
    start = tracker.version
    loss_fn = GSPOLoss(actor, policy_version=tracker)
    batch = with_versions(batch, [start] * len(batch))
    assert loss_fn(batch).policy_lag_max == 0
    tracker.increment_version()
    tracker.increment_version()
    assert loss_fn(batch).policy_lag_max == 2


def test_without_policy_version_the_key_is_not_read():
    actor = BigramActor()
    _, batch = rollout_batch(actor)
    out = GSPOLoss(actor)(with_versions(batch, [0] * len(batch)))
    assert out.policy_lag_mean is None and out.policy_lag_max is None


def _uuid_rows(batch):
    rows = [td.clone().set("policy_version", NonTensorData("3f2a")) for td in batch.unbind(0)]
    return lazy_stack(rows, 0)


@pytest.mark.parametrize(
    "change,error,words",
    [
        (lambda b: b, KeyError, r"no 'policy_version'.*track_policy_version=True"),
        (_uuid_rows, TypeError, r"not integers.*version_type='int'"),
        (
            lambda b: with_versions(b, [0] * len(b)).apply(
                lambda x: x.float() if x.ndim == 0 and not x.is_floating_point() else x
            ),
            TypeError,
            "not integers",
        ),
    ],
)
def test_bad_versions_raise(change, error, words):
    actor = BigramActor()
    _, batch = rollout_batch(actor)
    with pytest.raises(error, match=words):
        GSPOLoss(actor, policy_version=lambda: 1)(change(batch))


def test_versions_of_the_wrong_shape_raise():
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=3)
    batch = decoupled_batch("dense", rows, with_old=False)
    batch.set(
        "policy_version",
        torch.zeros(len(rows), 2, dtype=torch.long).index_fill_(1, torch.tensor([1]), 1),
    )
    with pytest.raises(ValueError, match="one integer per row"):
        GSPOLoss(actor, policy_version=lambda: 1)(batch)


@pytest.mark.parametrize("source,error", [(3, TypeError), ("v1", TypeError)])
def test_bad_policy_version_argument_raises(source, error):
    with pytest.raises(error, match="policy_version must be a function"):
        GSPOLoss(BigramActor(), policy_version=source)


def test_a_version_function_that_returns_no_int_raises():
    actor = BigramActor()
    _, batch = rollout_batch(actor)
    with pytest.raises(TypeError, match="must return the trainer's current version as an int"):
        GSPOLoss(actor, policy_version=lambda: "v2")(with_versions(batch, [0] * len(batch)))


def test_the_input_is_not_mutated_and_no_key_is_written():
    actor = BigramActor()
    _, batch = rollout_batch(actor)
    batch = with_versions(batch, [0] * len(batch))
    before = set(batch.keys(True, True))
    GSPOLoss(actor, policy_version=lambda: 1)(batch)
    assert set(batch.keys(True, True)) == before
