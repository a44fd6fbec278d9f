# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPOTokenLoss: equivalence with GSPOLoss, the per-token oracle and Eq. 17."""

from __future__ import annotations

import pytest
import torch
from gspo_testing import (
    BigramActor,
    build_loss,
    dense_batch,
    lazy_batch,
    left_pad,
    make_rows,
    padded,
)
from tensordict import TensorDict, lazy_stack

from torchrl_gspo import GSPOLoss, GSPOTokenLoss, GSPOTokenLossOutput

TOL = 1e-12
PAPER_EPS = (3e-4, 4e-4)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=TOL)


def grads(loss, actor):
    return torch.autograd.grad(loss, actor.table)[0]


def per_token_batch(rows, advantages):
    """Lazily stacked ragged rows whose advantage rows have one distinct value per token."""
    tds = []
    for row, adv in zip(rows, advantages, strict=True):
        td = lazy_batch([row])[0]
        td.set("advantage", adv.unsqueeze(-1))
        tds.append(td)
    return lazy_stack(tds, 0)


def distinct_advantages(rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(r["tokens"].shape[0], generator=gen, dtype=torch.float64) for r in rows]


def oracle_inputs(actor, rows):
    tokens = padded(rows, "tokens", 0)
    current = actor.token_log_probs(tokens)
    old = padded(rows, "old", 0.0)
    mask = padded(rows, "response", False) & old.isfinite()
    return current, old, mask


def oracle_gspo_token(current, old, mask, advantage, eps_low, eps_high):
    """Eqs. 13-16 written out: s_it = sg[s_i] * pi / sg[pi], per-token clipped min."""
    log_ratio = torch.where(mask, current - old, torch.zeros_like(current))
    seq = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(seq.detach() + current - current.detach())
    per_token = -torch.minimum(
        ratio * advantage, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantage
    )
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    per_seq = per_token.sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.mean()


@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("noise,eps", [(1e-3, PAPER_EPS), (1e-3, (0.5, 0.5)), (0.3, (0.05, 0.08))])
@pytest.mark.parametrize("per_token_layout", [False, True])
def test_sequence_advantages_identical_to_gspo(kind, noise, eps, per_token_layout):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=noise, seed=1)
    make = lazy_batch if kind == "lazy" else dense_batch
    batch = make(rows, advantage_per_token=per_token_layout)
    token = build_loss(GSPOTokenLoss, actor, clip_epsilon=eps)(batch)
    seq = build_loss(GSPOLoss, actor, clip_epsilon=eps)(batch)
    assert isinstance(token, GSPOTokenLossOutput)
    close(token.loss_objective, seq.loss_objective)
    close(grads(token.loss_objective, actor), grads(seq.loss_objective, actor))
    for name in ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "ESS"):
        assert torch.equal(getattr(token, name), getattr(seq, name)), name
    if eps == PAPER_EPS:  # both clip sides are exercised
        assert token.clip_fraction_low > 0 and token.clip_fraction_high > 0


def test_token_ratio_value_is_the_sequence_ratio():
    """The stop-gradient rewrite leaves every token's weight equal to s_i.

    With A = 1 on every token and a clip range that never binds, each valid token's
    term (aggregation="none") is -s_it: it equals GSPOLoss' -s_i, one value per
    sequence, and the oracle's.
    """
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.05, seed=2, advantages=torch.ones(6, dtype=torch.float64))
    batch = lazy_batch(rows, advantage_per_token=True)
    kwargs = {"clip_epsilon": (0.5, 0.5), "aggregation": "none", "entropy_bonus": False}
    with pytest.warns(UserWarning, match="practically never clips"):
        token = -GSPOTokenLoss(actor, **kwargs)(batch).loss_objective.detach().squeeze(-1)
    with pytest.warns(UserWarning, match="practically never clips"):
        seq = -GSPOLoss(actor, **kwargs)(batch).loss_objective.detach().squeeze(-1)
    current, old, mask = oracle_inputs(actor, rows)
    assert torch.equal(token, seq)
    assert torch.equal(token != 0, mask)
    assert token[mask].unique().numel() == mask.any(-1).sum()  # one value per sequence
    with torch.no_grad():
        log_ratio = torch.where(mask, current - old, 0.0)
        s = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)).exp()
    close(token, torch.where(mask, s.unsqueeze(-1), 0.0))


@pytest.mark.parametrize("noise,eps", [(1e-3, PAPER_EPS), (1e-3, (0.5, 0.5)), (0.3, (0.05, 0.08))])
def test_per_token_advantages_match_oracle(noise, eps):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=noise, seed=3)
    advantages = distinct_advantages(rows)
    out = build_loss(GSPOTokenLoss, actor, clip_epsilon=eps)(per_token_batch(rows, advantages))
    current, old, mask = oracle_inputs(actor, rows)
    advantage = left_pad(advantages, 0.0)
    expected = oracle_gspo_token(current, old, mask, advantage, *eps)
    close(out.loss_objective, expected)
    close(grads(out.loss_objective, actor), grads(expected, actor))


def test_unclipped_gradient_is_eq17():
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=1e-3, seed=4)
    advantages = distinct_advantages(rows, seed=1)
    out = build_loss(GSPOTokenLoss, actor, clip_epsilon=(0.5, 0.5))(
        per_token_batch(rows, advantages)
    )
    current, old, mask = oracle_inputs(actor, rows)
    advantage = left_pad(advantages, 0.0)
    with torch.no_grad():
        log_ratio = torch.where(mask, current - old, 0.0)
        s = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)).exp()
    # Eq. 17 (for the loss, i.e. minus the objective): per sequence
    # s_i / |y_i| * sum_t A_it grad log pi(y_it), then the mean over sequences
    surrogate = torch.where(mask, advantage * current, 0.0).sum(-1)
    surrogate = s * surrogate / mask.sum(-1).clamp(min=1)
    eq17 = grads(-surrogate.mean(), actor)
    close(grads(out.loss_objective, actor), eq17)


def test_ragged_per_token_advantages_are_aligned():
    """Distinct per-token values on a ragged lazy batch, full-length and response-only rows."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=1e-3, seed=5)
    advantages = distinct_advantages(rows, seed=2)
    eps = (0.5, 0.5)
    full = build_loss(GSPOTokenLoss, actor, clip_epsilon=eps)(per_token_batch(rows, advantages))
    current, old, mask = oracle_inputs(actor, rows)
    expected = oracle_gspo_token(current, old, mask, left_pad(advantages, 0.0), *eps)
    close(full.loss_objective, expected)
    # response-only advantage rows (prompt length p dropped) end with the tokens too
    prompt_lengths = [int((~r["response"]).cumprod(0).sum()) for r in rows]
    response_only = [a[p:] for a, p in zip(advantages, prompt_lengths, strict=True)]
    out = build_loss(GSPOTokenLoss, actor, clip_epsilon=eps)(per_token_batch(rows, response_only))
    close(out.loss_objective, expected)
    # a dense, left-padded [B, T, 1] layout gives the same
    dense = dense_batch(rows)
    dense.set("advantage", left_pad(advantages, 0.0).unsqueeze(-1))
    close(build_loss(GSPOTokenLoss, actor, clip_epsilon=eps)(dense).loss_objective, expected)


def test_advantage_rows_shorter_than_the_response_raise():
    """Rows that end with the tokens but do not reach back to the first response token."""
    actor = BigramActor()
    rows = make_rows(actor=actor, seed=6)
    advantages = distinct_advantages(rows)
    lengths = [int(r["response"].sum()) for r in rows]
    short = [a[-(n - 1) :] if n >= 2 else a for a, n in zip(advantages, lengths, strict=True)]
    with pytest.raises(ValueError, match=r"NaN, infinite or padding at \d+ valid token"):
        GSPOTokenLoss(actor)(per_token_batch(rows, short))


def test_right_padded_dense_advantages_with_nan_padding_raise():
    """A dense [B, T, 1] advantage padded on the wrong side (with NaN) is caught."""
    actor = BigramActor()
    rows = make_rows(actor=actor, seed=6)
    advantages = distinct_advantages(rows)
    width = max(a.shape[0] for a in advantages)
    right = torch.stack(
        [torch.cat([a, a.new_full((width - a.shape[0],), float("nan"))]) for a in advantages]
    )
    batch = dense_batch(rows)
    batch.set("advantage", right.unsqueeze(-1))
    with pytest.raises(ValueError, match=r"NaN, infinite or padding at \d+ valid token"):
        GSPOTokenLoss(actor)(batch)


def test_nan_per_token_advantage_raises():
    actor = BigramActor()
    rows = make_rows(actor=actor, seed=7)
    advantages = distinct_advantages(rows)
    advantages[0][-1] = float("nan")
    with pytest.raises(ValueError, match=r"row\(s\) \[0\]"):
        GSPOTokenLoss(actor)(per_token_batch(rows, advantages))


def test_per_token_advantages_rejected_by_gspo_loss():
    actor = BigramActor()
    rows = make_rows(actor=actor, seed=8)
    batch = per_token_batch(rows, distinct_advantages(rows))
    with pytest.raises(ValueError, match="GSPOTokenLoss"):
        GSPOLoss(actor)(batch)
    assert GSPOTokenLoss(actor)(batch).loss_objective.isfinite()


@pytest.mark.parametrize("shift", [20.0, -20.0])
def test_identical_to_gspo_beyond_max_log_ratio(shift):
    """Sequences clamped at max_log_ratio get no gradient in either loss."""
    actor = BigramActor()
    rows = make_rows([(2, 3), (2, 4), (3, 2)], actor=actor, nan_prompt=False, seed=11)
    rows[0]["old"][2:] -= shift  # log s_0 = shift: clamped when positive
    batch = lazy_batch(rows)
    token = GSPOTokenLoss(actor)(batch)
    seq = GSPOLoss(actor)(batch)
    assert token.sequence_log_ratio_max_abs > 10
    close(token.loss_objective, seq.loss_objective)
    close(grads(token.loss_objective, actor), grads(seq.loss_objective, actor))


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_overflowing_ratio_without_clamp_is_inf_not_nan(kind):
    """max_log_ratio=None and log s_0 = 1000: s_0 overflows to inf. With A_0 = -1 the
    term -min(s A, clip(s) A) is +inf, so the loss is +inf in both losses; the masked
    positions of the row must not turn it into NaN."""
    actor = BigramActor()
    advantages = torch.tensor([-1.0, 1.0, -1.0], dtype=torch.float64)
    rows = make_rows([(2, 3), (2, 4), (3, 2)], actor=actor, seed=11, advantages=advantages)
    rows[0]["old"][2:] -= 1e3
    make = lazy_batch if kind == "lazy" else dense_batch
    for loss_cls in (GSPOLoss, GSPOTokenLoss):
        out = build_loss(loss_cls, actor, max_log_ratio=None)(make(rows))
        assert out.loss_objective == float("inf"), loss_cls.__name__


def test_extreme_log_ratios_are_finite():
    actor = BigramActor()
    rows = make_rows([(2, 3), (2, 4)], actor=actor, nan_prompt=False)
    for row in rows:
        row["old"][2:] -= 1e3
    advantages = [-torch.ones(5, dtype=torch.float64), -torch.ones(6, dtype=torch.float64)]
    out = GSPOTokenLoss(actor)(per_token_batch(rows, advantages))
    assert out.loss_objective.isfinite()
    assert grads(out.loss_objective, actor).isfinite().all()


def test_input_is_not_mutated():
    actor = BigramActor()
    rows = make_rows(actor=actor, seed=9)
    batch = per_token_batch(rows, distinct_advantages(rows))
    before = [td.clone() for td in batch.tensordicts]
    GSPOTokenLoss(actor)(batch)
    for td, ref in zip(batch.tensordicts, before, strict=True):
        assert set(td.keys(True, True)) == set(ref.keys(True, True))
        assert isinstance(td, TensorDict)
        for key in ref.keys(True, True):
            assert torch.equal(td[key].nan_to_num(7.0), ref[key].nan_to_num(7.0)), key
