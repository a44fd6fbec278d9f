# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPO's family (LUSPO, GMPO, SAPO, VESPO, off-policy sequence masking, the
two-sided clip) against their formulas written out, on ragged batches with an empty
row, where each clip or gate binds on some sequences and not on others (asserted)."""

from __future__ import annotations

import math

import pytest
import torch
from gspo_testing import BigramActor, dense_batch, lazy_batch, make_rows, padded
from test_rollout import ROLLOUT, decoupled_batch, decoupled_rows

from torchrl_gspo import (
    GMPOLoss,
    GSPOLoss,
    GSPOTokenLoss,
    LUSPOLoss,
    SAPOLoss,
    VESPOLoss,
)

TOL = 1e-12
ADVANTAGES = torch.tensor([-1.0, 0.5, 1.2, -0.8, 1.0, -0.4], dtype=torch.float64)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=TOL)


def grad(loss, actor):
    return torch.autograd.grad(loss, actor.table, retain_graph=True)[0]


def inputs(actor, rows):
    """Current, old log-probs, the loss mask and one advantage per row, padded."""
    current = actor.token_log_probs(padded(rows, "tokens", 0))
    old = padded(rows, "old", 0.0)
    mask = padded(rows, "response", False) & old.isfinite()
    old = torch.where(mask, old, torch.zeros_like(old))
    current_masked = torch.where(mask, current, torch.zeros_like(current))
    advantage = torch.stack([r["advantage"].reshape(()) for r in rows])
    return current_masked, old, mask, advantage


def rows_for(actor, noise, seed=0, advantages=ADVANTAGES):
    return make_rows(actor=actor, noise=noise, seed=seed, advantages=advantages)


def per_token_advantages(rows, seed):
    """Random advantages per token on ``rows``: their lazy batch and padded [B, T]."""
    gen = torch.Generator().manual_seed(seed)
    for row in rows:
        row["advantage"] = torch.randn(row["tokens"].shape[0], 1, generator=gen).double()
    batch = lazy_batch(rows)
    for td, row in zip(batch.unbind(0), rows, strict=True):
        td.set("advantage", row["advantage"])
    return batch, padded(rows, "advantage", 0.0).squeeze(-1)


def batch_of(kind, rows):
    return lazy_batch(rows) if kind == "lazy" else dense_batch(rows)


def assert_matches(out, expected, actor):
    close(out.loss_objective, expected)
    close(grad(out.loss_objective, actor), grad(expected, actor))


# ---------------------------------------------------------------------------------
# LUSPO
# ---------------------------------------------------------------------------------
def oracle_luspo(current, old, mask, advantage, eps):
    """(1/B) sum_i |y_i| * -min(s_i A_i, clip(s_i) A_i); an empty row counts 0."""
    lengths = mask.sum(-1)
    s = ((current - old).sum(-1) / lengths.clamp(min=1)).exp()
    term = -torch.minimum(s * advantage, s.clamp(1 - eps[0], 1 + eps[1]) * advantage)
    return (term * lengths).mean()


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_luspo_matches_its_formula(kind):
    actor = BigramActor()
    rows = rows_for(actor, noise=5e-3)
    current, old, mask, advantage = inputs(actor, rows)
    out = LUSPOLoss(actor, entropy_bonus=False)(batch_of(kind, rows))
    assert_matches(out, oracle_luspo(current, old, mask, advantage, (2e-3, 2.5e-3)), actor)
    assert not mask[2].any()  # the empty row
    assert 0 < out.sequence_clip_fraction < 1  # the clip binds on some sequences only
    assert out.objective_diagnostic is None


# ---------------------------------------------------------------------------------
# GMPO
# ---------------------------------------------------------------------------------
def gmpo_clipped(current, old, mask, advantage, eps):
    log_r = torch.where(mask, current - old, torch.zeros_like(current))
    clipped = log_r.clamp(-eps, eps)
    positive = (advantage > 0).unsqueeze(-1)
    return torch.where(positive, torch.minimum(log_r, clipped), torch.maximum(log_r, clipped))


def oracle_gmpo(current, old, mask, advantage, eps):
    """(1/B) sum_i -A_i exp(mean_t c_it), c_it each token's log-ratio clipped on the
    advantage's side; an empty row counts 0 (TRL's experimental GMPO adds -A_i)."""
    clipped = gmpo_clipped(current, old, mask, advantage, eps)
    term = -advantage * (clipped.sum(-1) / mask.sum(-1).clamp(min=1)).exp()
    return torch.where(mask.any(-1), term, torch.zeros_like(term)).mean()


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_gmpo_matches_its_formula(kind):
    actor = BigramActor()
    # positive advantages on the longer rows, so that both signs clip some tokens
    signs = torch.tensor([1.0, -0.5, 1.2, 0.8, -1.0, -0.4], dtype=torch.float64)
    rows = rows_for(actor, noise=0.6, advantages=signs)
    current, old, mask, advantage = inputs(actor, rows)
    out = GMPOLoss(actor, entropy_bonus=False)(batch_of(kind, rows))
    assert_matches(out, oracle_gmpo(current, old, mask, advantage, 0.4), actor)
    clipped = gmpo_clipped(current, old, mask, advantage, 0.4) != torch.where(
        mask, current - old, torch.zeros_like(current)
    )
    for sign in (advantage > 0, advantage < 0):  # some tokens clipped, some not
        assert clipped[sign].any() and (~clipped & mask)[sign].any()
    close(out.objective_diagnostic, (clipped & mask).sum().double() / mask.sum())


# ---------------------------------------------------------------------------------
# SAPO
# ---------------------------------------------------------------------------------
def oracle_sapo(current, old, mask, advantage, taus=(1.0, 1.05)):
    """-(1/B) sum_i (1/|y_i|) sum_t sigmoid(tau (r - 1)) 4 / tau A, tau by A's sign."""
    advantage = advantage if advantage.ndim == 2 else advantage.unsqueeze(-1)
    r = (current - old).exp()
    tau = torch.where(advantage > 0, *torch.tensor(taus, dtype=r.dtype))  # 1.05 in float64
    term = -torch.sigmoid(tau * (r - 1)) * 4 / tau * advantage
    term = torch.where(mask, term, torch.zeros_like(term))
    return (term.sum(-1) / mask.sum(-1).clamp(min=1)).mean()


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_sapo_matches_its_formula(kind):
    actor = BigramActor()
    rows = rows_for(actor, noise=1.5)
    current, old, mask, advantage = inputs(actor, rows)
    out = SAPOLoss(actor, entropy_bonus=False)(batch_of(kind, rows))
    assert_matches(out, oracle_sapo(current, old, mask, advantage), actor)
    r = (current - old).exp()
    tau = torch.where(advantage > 0, *torch.tensor([1.0, 1.05], dtype=r.dtype)).unsqueeze(-1)
    gate = torch.sigmoid(tau * (r - 1))
    weight = (4 * gate * (1 - gate))[mask]
    assert (weight < 0.5).any() and (weight > 0.99).any()  # saturated and open tokens
    close(out.objective_diagnostic, weight.mean())


def test_sapo_with_per_token_advantages():
    actor = BigramActor()
    rows = rows_for(actor, noise=1.0, seed=3)
    current, old, mask, _ = inputs(actor, rows)
    batch, advantage = per_token_advantages(rows, seed=5)
    assert ((advantage > 0) & mask).any() and ((advantage < 0) & mask).any()
    out = SAPOLoss(actor, entropy_bonus=False)(batch)
    assert_matches(out, oracle_sapo(current, old, mask, advantage), actor)


# ---------------------------------------------------------------------------------
# VESPO
# ---------------------------------------------------------------------------------
def oracle_vespo(current, rollout, mask, advantage, pos=(2.0, 3.0), neg=(3.0, 2.0)):
    """-(1/sum|y|) sum_it sg[phi(W_i)] A_i log pi, W_i the product of pi / pi_roll,
    phi(W) = exp(lam) W^k exp(-lam W), (k, lam) by the sign of A_i."""
    with torch.no_grad():
        log_r = torch.where(mask, current - rollout, torch.zeros_like(current))
        w = log_r.clamp(-20, 20).sum(-1).clamp(math.log(1e-8), 20).exp()
        k = torch.where(advantage >= 0, pos[0], neg[0]).to(w.dtype)
        lam = torch.where(advantage >= 0, pos[1], neg[1]).to(w.dtype)
        phi = math.e**lam * w**k * torch.exp(-lam * w)
    term = -(phi * advantage).unsqueeze(-1) * current
    return torch.where(mask, term, torch.zeros_like(term)).sum() / mask.sum(), phi


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_vespo_matches_its_formula(kind):
    actor = BigramActor()
    rows = rows_for(actor, noise=0.3)
    current, old, mask, advantage = inputs(actor, rows)
    out = VESPOLoss(actor, entropy_bonus=False)(batch_of(kind, rows))
    expected, phi = oracle_vespo(current, old, mask, advantage)
    assert_matches(out, expected, actor)
    nonempty = mask.any(-1)
    assert (phi[nonempty] < 0.9).any() and (phi[nonempty] > 0.9).any()
    tokens = mask.sum(-1)
    close(out.objective_diagnostic, (phi * tokens).sum() / tokens.sum())


def test_vespo_takes_w_against_the_rollout_policy():
    """With recomputed old log-probs, W is the product of pi / pi_roll: the engine's."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=2, mismatch=0.2)
    current, _, _, advantage = inputs(actor, rows)
    rollout = padded(rows, "rollout", float("nan"))
    mask = padded(rows, "response", False) & rollout.isfinite()
    current = torch.where(mask, current, torch.zeros_like(current))
    rollout = torch.where(mask, rollout, torch.zeros_like(rollout))
    out = VESPOLoss(actor, entropy_bonus=False)(decoupled_batch("lazy", rows))
    assert_matches(out, oracle_vespo(current, rollout, mask, advantage)[0], actor)


def test_vespo_refuses_a_rollout_correction():
    with pytest.raises(ValueError, match="leave rollout_correction=None"):
        VESPOLoss(BigramActor(), rollout_correction="truncate")


# ---------------------------------------------------------------------------------
# Off-policy sequence masking
# ---------------------------------------------------------------------------------
def opsm_keep(current, sampling, mask, advantage, delta):
    """Keep a term unless A < 0 and mean_t(log pi_sampling - log pi_theta) > delta."""
    drift = torch.where(mask, sampling - current.detach(), torch.zeros_like(current))
    far = drift.sum(-1) / mask.sum(-1).clamp(min=1) > delta
    return (advantage >= 0) | ~far


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_off_policy_masking_matches_its_formula(kind):
    actor = BigramActor()
    rows = rows_for(actor, noise=0.02, seed=6)
    current, old, mask, advantage = inputs(actor, rows)
    delta = 0.0
    keep = opsm_keep(current, old, mask, advantage, delta)
    eps = (3e-4, 4e-4)
    s = ((current - old).sum(-1) / mask.sum(-1).clamp(min=1)).exp()
    term = -torch.minimum(s * advantage, s.clamp(1 - eps[0], 1 + eps[1]) * advantage)
    expected = torch.where(mask.any(-1) & keep, term, torch.zeros_like(term)).mean()
    out = GSPOLoss(actor, entropy_bonus=False, off_policy_mask_threshold=delta)(
        batch_of(kind, rows)
    )
    assert_matches(out, expected, actor)
    negative = (advantage < 0) & mask.any(-1)
    assert (negative & ~keep).any() and (negative & keep).any()  # masks some, not all
    dropped = torch.where(keep, 0, mask.sum(-1))
    close(out.off_policy_masked_fraction, dropped.sum().double() / mask.sum())


def test_off_policy_masking_reads_the_engine_log_probs():
    """The "sampling" log-probs are the rollout's when the old ones were recomputed."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=2, mismatch=0.3)
    for row, a in zip(rows, ADVANTAGES, strict=True):
        row["advantage"] = a.reshape(1, 1)
    batch = decoupled_batch("lazy", rows)
    current, old, _, advantage = inputs(actor, rows)
    rollout = padded(rows, "rollout", float("nan"))
    mask = padded(rows, "response", False) & rollout.isfinite()
    rollout = torch.where(mask, rollout, 0.0)
    lengths = mask.sum(-1).clamp(min=1)
    drift_rollout = torch.where(mask, rollout - current.detach(), 0.0).sum(-1) / lengths
    drift_old = torch.where(mask, old - current.detach(), 0.0).sum(-1) / lengths
    # a threshold between the two drifts of a negative-advantage row: only the engine's
    # log-probs drop it
    row = int(((advantage < 0) & mask.any(-1) & (drift_rollout > drift_old)).nonzero()[0])
    delta = float((drift_rollout[row] + drift_old[row]) / 2)
    keep = opsm_keep(current, rollout, mask, advantage, delta)
    assert not keep[row] and opsm_keep(current, old, mask, advantage, delta)[row]
    out = GSPOLoss(actor, entropy_bonus=False, off_policy_mask_threshold=delta)(batch)
    dropped = torch.where(keep, 0, mask.sum(-1))
    close(out.off_policy_masked_fraction, dropped.sum().double() / mask.sum())
    assert ROLLOUT in batch.keys(True)


def test_off_policy_masking_per_token_advantage():
    """GSPO-token: a token with a negative advantage in a far sequence is dropped."""
    actor = BigramActor()
    rows = rows_for(actor, noise=0.02, seed=6)
    current, old, mask, _ = inputs(actor, rows)
    batch, advantage = per_token_advantages(rows, seed=7)
    drift = torch.where(mask, old - current.detach(), torch.zeros_like(current))
    far = (drift.sum(-1) / mask.sum(-1).clamp(min=1) > 0.0).unsqueeze(-1)
    keep = (advantage >= 0) | ~far
    out = GSPOTokenLoss(actor, entropy_bonus=False, off_policy_mask_threshold=0.0)(batch)
    plain = GSPOTokenLoss(actor, entropy_bonus=False, aggregation="none")(batch)
    terms = plain.loss_objective.squeeze(-1)
    expected = (torch.where(keep & mask, terms, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    assert_matches(out, expected, actor)
    assert (far.squeeze(-1) & mask.any(-1)).any() and (mask & ~keep).any()


# ---------------------------------------------------------------------------------
# Two-sided clip
# ---------------------------------------------------------------------------------
def test_two_sided_clip_is_max_log_ratio():
    """INTELLECT-2's / TRL's delta: min(s, delta) in the unclipped term, for both signs,
    equals max_log_ratio=log(delta) when delta >= 1 + eps_high."""
    actor = BigramActor()
    rows = rows_for(actor, noise=0.05, seed=4)
    current, old, mask, advantage = inputs(actor, rows)
    eps, delta = (3e-4, 4e-4), 1.01
    s = ((current - old).sum(-1) / mask.sum(-1).clamp(min=1)).exp()
    term = -torch.minimum(
        torch.minimum(s, torch.full_like(s, delta)) * advantage,
        s.clamp(1 - eps[0], 1 + eps[1]) * advantage,
    )
    expected = torch.where(mask.any(-1), term, torch.zeros_like(term)).mean()
    out = GSPOLoss(actor, entropy_bonus=False, max_log_ratio=math.log(delta))(lazy_batch(rows))
    assert_matches(out, expected, actor)
    above = (s > delta) & mask.any(-1)
    assert (above & (advantage < 0)).any() and (~above & mask.any(-1)).any()


@pytest.mark.parametrize(
    "loss_cls,kwargs,error,words",
    [
        (SAPOLoss, {"temperatures": (1.0, 0.0)}, ValueError, "temperatures must be positive"),
        (SAPOLoss, {"temperatures": 1.0}, TypeError, "temperatures must be a pair"),
        (VESPOLoss, {"shape_negative": (3.0, -1.0)}, ValueError, "shape_negative must be"),
        (GSPOLoss, {"off_policy_mask_threshold": "0.1"}, TypeError, "off_policy_mask_threshold"),
        (GSPOLoss, {"off_policy_mask_threshold": -0.1}, ValueError, "must be >= 0"),
    ],
)
def test_bad_objective_arguments_raise(loss_cls, kwargs, error, words):
    with pytest.raises(error, match=words):
        loss_cls(BigramActor(), **kwargs)


@pytest.mark.parametrize("loss_cls", [LUSPOLoss, GMPOLoss, SAPOLoss])
def test_family_takes_the_sequence_scale_and_the_rollout_correction(loss_cls):
    """With recomputed old log-probs, a rollout correction and a sequence scale c_i
    (data parallelism, :doc:`scaling`): the loss is sum_i c_i l_i, l_i the mean over
    row i's valid tokens of its corrected terms (read with aggregation="none")."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=3, mismatch=0.01)
    for row, advantage in zip(rows, ADVANTAGES, strict=True):
        row["advantage"] = advantage.reshape(1, 1)
    batch = decoupled_batch("lazy", rows)
    kwargs = {"entropy_bonus": False, "rollout_correction": "truncate"}
    terms = loss_cls(actor, aggregation="none", **kwargs)(batch).loss_objective.squeeze(-1)
    rollout = padded(rows, "rollout", float("nan"))
    mask = padded(rows, "response", False) & rollout.isfinite()
    per_row = torch.where(mask, terms, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    scale = torch.linspace(0.05, 0.3, len(rows), dtype=torch.float64)
    batch.set("sequence_scale", scale)
    out = loss_cls(actor, **kwargs)(batch)
    assert_matches(out, (scale * per_row).sum(), actor)
    assert 0 < out.rollout_correction_fraction < 1


@pytest.mark.parametrize("loss_cls", [GMPOLoss, SAPOLoss])
def test_without_max_log_ratio_a_huge_ratio_stays_finite(loss_cls):
    """max_log_ratio=None: GMPO leaves the mean unclamped, SAPO still caps each token's
    log-ratio at 20 (its gate is saturated long before): no error, no NaN gradient."""
    actor = BigramActor(dtype=torch.float32)
    rows = make_rows(actor=actor, noise=1e-3, seed=1, dtype=torch.float32)
    rows[0]["old"] = rows[0]["old"] - 100.0  # a log-ratio of +100 on row 0's tokens
    out = loss_cls(actor, entropy_bonus=False, max_log_ratio=None)(lazy_batch(rows))
    gradient = grad(out.loss_objective, actor)
    assert gradient.isfinite().all() and not out.loss_objective.isnan()


def test_the_family_compiles_to_one_graph():
    from test_gspo import _graphs

    actor = BigramActor()
    batch = dense_batch(rows_for(actor, noise=1e-2))
    for loss_cls in (LUSPOLoss, GMPOLoss, SAPOLoss, VESPOLoss):
        assert _graphs(loss_cls(actor, entropy_bonus=False), batch) == (1, 0), loss_cls
    masked = GSPOLoss(actor, entropy_bonus=False, off_policy_mask_threshold=0.0)
    assert _graphs(masked, batch) == (1, 0)


def test_the_new_statistics_combine_over_micro_batches():
    actor = BigramActor()
    rows = rows_for(actor, noise=0.6)
    batch = lazy_batch(rows)
    loss_fn = GMPOLoss(actor, entropy_bonus=False, off_policy_mask_threshold=0.0)
    whole = loss_fn(batch)
    parts = [loss_fn(batch[part]) for part in (slice(0, 2), slice(2, 6))]
    combined = parts[0].statistics.combine(parts[1].statistics).diagnostics()
    for name in ("objective_diagnostic", "off_policy_masked_fraction"):
        close(combined[name], getattr(whole, name))
    assert 0 < whole.objective_diagnostic < 1 and 0 < whole.off_policy_masked_fraction < 1
