# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPO's family and the rollout correction against verl 0.9.1's own functions.

verl's registered policy losses (``get_policy_loss_fn``) are called on the same
response-level tensors, with its ``ActorConfig`` and ``loss_agg_mode`` set
explicitly, and without the trainer's global batch information (local normalization).
verl's sequence means divide the batch by its non-empty rows: the sequence scale
1 / N_non-empty makes GSPOLoss' ``prompt_mean`` that. (They divide each row by its
token count plus 1e-8; with the boolean mask verl's trainer passes, the count plus
1e-8 is computed in float32 and equals the count.) Everything is compared to 1e-12.
Run with ``bash scripts/test_peers.sh``.
"""

from __future__ import annotations

import os

import pytest
import torch
import verl
from gspo_testing import BigramActor, lazy_batch, make_rows
from test_rollout import decoupled_batch, decoupled_rows
from test_trl import FAMILY_ADVANTAGES, completion_tensors, grad
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.trainer.ppo.rollout_corr_helper import (
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from verl.workers.config import ActorConfig

from torchrl_gspo import GMPOLoss, GSPOLoss, GSPOTokenLoss, RolloutCorrection, SAPOLoss, Scores
from torchrl_gspo import rollout_terms as our_rollout_terms


def test_the_installed_verl_is_the_one_compared():
    assert verl.__version__ == os.environ.get("VERL_VERSION", "0.9.1")


def config(**kwargs):
    base = {"strategy": "fsdp", "rollout_n": 1, "ppo_micro_batch_size_per_gpu": 1}
    return ActorConfig(**base, **kwargs)


def verl_loss(name, t, agg, cfg, weights=None, mask=None):
    """verl's registered loss ``name`` on TRL-layout tensors (per-token advantages)."""
    mask = t["completion_mask"].bool() if mask is None else mask
    advantages = t["advantage"].unsqueeze(-1).expand_as(t["current"])
    loss, _ = get_policy_loss_fn(name)(
        t["old"], t["current"], advantages, mask, agg, cfg, rollout_is_weights=weights
    )
    return loss


def tensors(rows, actor):
    t = completion_tensors(rows, actor)
    t["advantage"] = torch.stack([r["advantage"].reshape(()) for r in rows])
    return t


def family(noise, seed=0):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=noise, seed=seed, advantages=FAMILY_ADVANTAGES)
    for row in rows:
        row["rollout"] = row["old"]  # no engine
    return actor, rows


def verl_scale(rows):
    """verl's local seq-mean as a sequence scale: 1 / N, N the non-empty rows."""
    count = sum(bool(row["response"].any()) for row in rows)
    return torch.full((len(rows),), 1 / count, dtype=torch.float64)


def assert_same(ours, theirs, actor, rtol=1e-12):
    torch.testing.assert_close(ours, theirs, rtol=rtol, atol=1e-12)
    torch.testing.assert_close(grad(ours, actor), grad(theirs, actor), rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("loss_cls", [GSPOLoss, GSPOTokenLoss])
def test_gspo_seq_mean_token_mean_equals_verl(loss_cls):
    """verl's gspo with seq-mean-token-mean divides by the non-empty rows: GSPOLoss
    with the sequence scale 1 / N_non-empty."""
    actor, rows = family(noise=1e-3)
    t = tensors(rows, actor)
    cfg = config(clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean")
    expected = verl_loss("gspo", t, "seq-mean-token-mean", cfg)
    batch = lazy_batch(rows)
    batch.set("sequence_scale", verl_scale(rows))
    out = loss_cls(actor, entropy_bonus=False)(batch)
    assert_same(out.loss_objective, expected, actor)
    assert 0 < out.sequence_clip_fraction < 1


def test_gspo_token_mean_equals_verl():
    """verl 0.9.1's default aggregation (token-mean): GSPOLoss' token_mean, exactly."""
    actor, rows = family(noise=1e-3)
    t = tensors(rows, actor)
    cfg = config(clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="token-mean")
    expected = verl_loss("gspo", t, "token-mean", cfg)
    with pytest.warns(UserWarning, match="token_mean"):
        loss_fn = GSPOLoss(actor, entropy_bonus=False, aggregation="token_mean")
    assert_same(loss_fn(lazy_batch(rows)).loss_objective, expected, actor)


def test_geo_mean_equals_gmpo():
    """verl's geo_mean (GMPO): the mean over all rows, an empty row counting 0."""
    actor, rows = family(noise=0.6)
    t = tensors(rows, actor)
    cfg = config(clip_ratio_low=0.4, clip_ratio_high=0.4)
    expected = verl_loss("geo_mean", t, "seq-mean-token-mean", cfg)
    out = GMPOLoss(actor, entropy_bonus=False)(lazy_batch(rows))
    assert_same(out.loss_objective, expected, actor)
    assert 0 < out.objective_diagnostic < 1


def test_sapo_equals_verl():
    """verl's sapo (always seq-mean-token-mean over the non-empty rows)."""
    actor, rows = family(noise=1.0)
    t = tensors(rows, actor)
    cfg = config(tau_pos=1.0, tau_neg=1.05)
    expected = verl_loss("sapo", t, "token-mean", cfg)  # verl ignores the mode here
    batch = lazy_batch(rows)
    batch.set("sequence_scale", verl_scale(rows))
    out = SAPOLoss(actor, entropy_bonus=False)(batch)
    assert_same(out.loss_objective, expected, actor)


@pytest.mark.parametrize(
    "threshold,mode,band", [(1.05, "truncate", 1.05), ("0.95_1.05", "masked_is", (0.95, 1.05))]
)
def test_token_rollout_is_with_gspo_token_equals_verl(threshold, mode, band):
    """verl's rollout_is="token" (TIS, or IcePop with "L_U") with its gspo loss:
    GSPOTokenLoss with the token form."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=1, mismatch=0.05)
    for row, advantage in zip(rows, FAMILY_ADVANTAGES, strict=True):
        row["advantage"] = advantage.reshape(1, 1)
    t = tensors(rows, actor)
    mask = t["completion_mask"].bool()
    weights, _ = compute_rollout_correction_weights(
        t["old"] - t["rollout"], mask.double(), rollout_is="token", rollout_is_threshold=threshold
    )
    cfg = config(clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean")
    expected = verl_loss("gspo", t, "seq-mean-token-mean", cfg, weights=weights)
    batch = decoupled_batch("lazy", rows)
    batch.set("sequence_scale", verl_scale(rows))
    loss_fn = GSPOTokenLoss(
        actor,
        entropy_bonus=False,
        rollout_correction=mode,
        rollout_correction_form="token",
        rollout_correction_threshold=band,
    )
    out = loss_fn(batch)
    assert_same(out.loss_objective, expected, actor)
    assert 0 < out.rollout_correction_fraction


@pytest.mark.parametrize(
    "verl_band,mismatch", [("0.999_1.001", 3e-3), ("0.9_1.5", 0.3), ("0.95_1.2", 0.3)]
)
def test_seq_mean_k1_rejects_what_the_reflected_band_rejects(verl_band, mismatch):
    """verl's seq_mean_k1 band (L, U) applies to 1 / rho_bar: rollout_correction="mask"
    with the geometric band (1/U, 1/L) rejects the same rows."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=1, mismatch=mismatch)
    t = tensors(rows, actor)
    mask = t["completion_mask"].bool()
    log_ratio = torch.where(mask, t["old"] - t["rollout"], 0.0)
    kept_mask, _ = compute_rollout_rejection_mask(
        log_ratio, mask.double(), rollout_rs="seq_mean_k1", rollout_rs_threshold=verl_band
    )
    low, high = (float(v) for v in verl_band.split("_"))
    ours = RolloutCorrection.from_arguments("mask", "geometric", (1 / high, 1 / low))
    terms = our_rollout_terms(t["old"], t["rollout"], mask, ours)
    nonempty = mask.any(-1)
    verl_kept = kept_mask.bool().any(-1)
    assert torch.equal(verl_kept[nonempty], terms.weight.bool()[nonempty])
    if verl_band == "0.9_1.5":  # not symmetric in log: the unreflected band differs
        naive = RolloutCorrection.from_arguments("mask", "geometric", (low, high))
        naive_kept = our_rollout_terms(t["old"], t["rollout"], mask, naive).weight.bool()
        assert not torch.equal(verl_kept[nonempty], naive_kept[nonempty])
    assert (~verl_kept & nonempty).any() and (verl_kept & nonempty).any()


def test_sapo_below_minus_20_keeps_the_papers_gate_where_verl_clamps():
    """verl clamps each token's log-ratio to [-20, 20] before its gate; SAPOLoss clamps
    it only from above (where exp() would overflow) and, like TRL, not from below,
    where the gate is the paper's formula: a token at -25 gets the formula's gradient
    (about -4e-12) from SAPOLoss and exactly 0 from verl. The values then differ by at
    most 4 |A| max(sigma') (e^-20 - e^-25) <= 2.1e-9 |A| per token."""
    log_ratio = torch.tensor([[-25.0, -0.1, 0.2]], dtype=torch.float64)
    old = torch.full_like(log_ratio, -1.0)
    current = (old + log_ratio).requires_grad_()
    mask = torch.ones_like(log_ratio, dtype=torch.bool)
    advantage = torch.ones_like(log_ratio)  # A > 0: tau_pos = 1
    theirs, _ = get_policy_loss_fn("sapo")(
        old, current, advantage, mask, "token-mean", config(tau_pos=1.0, tau_neg=1.05)
    )
    (their_grad,) = torch.autograd.grad(theirs, current)
    lengths = mask.sum(-1)
    token_log_ratio = current - old
    scores = Scores(
        current, old, old, mask, lengths, token_log_ratio,
        token_log_ratio.sum(-1) / lengths, advantage[:, :1].reshape(1, 1, 1),
    )  # fmt: skip
    terms, _ = SAPOLoss(entropy_bonus=False)._objective(scores)
    ours = terms.mean()  # the token mean of the row's three terms
    (our_grad,) = torch.autograd.grad(ours, current)
    gate = torch.sigmoid(log_ratio.exp() - 1)
    formula = -4 * gate * (1 - gate) * log_ratio.exp() / 3  # d/dlog r of -4 sigma A / 3
    # torch's expm1 backward takes e^l as expm1(l) + 1: an absolute rounding of one ulp
    # of 1 (2.2e-16), times 4 sigma' / 3 <= 1/3
    torch.testing.assert_close(our_grad, formula, rtol=1e-12, atol=7.4e-17)
    assert their_grad[0, 0] == 0 and our_grad[0, 0] < -1e-12
    torch.testing.assert_close(their_grad[0, 1:], our_grad[0, 1:], rtol=1e-12, atol=0)
    assert abs(float((ours - theirs).detach())) <= 2.1e-9 / 3
