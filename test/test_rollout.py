# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Decoupled old policy and sequence-level rollout correction, against the oracle."""

from __future__ import annotations

import math

import pytest
import torch
from gspo_testing import (
    BigramActor,
    build_loss,
    dense_batch,
    fields_of,
    lazy_batch,
    left_pad,
    make_rows,
    oracle_gspo_loss,
    padded,
)
from tensordict import TensorDict, lazy_stack
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.objectives.llm import GRPOLoss

from torchrl_gspo import (
    GSPOLoss,
    GSPOTokenLoss,
    RecomputeOldLogProbs,
    RolloutCorrection,
    rollout_terms,
)

TOL = {torch.float64: 1e-12, torch.float32: 1e-6}
PAPER_EPS = (3e-4, 4e-4)
ROLLOUT = ("log_probs", "full")
OLD = ("old_log_probs", "full")
# (mode, form, threshold): each band binds on some sequences (tokens) and not on
# others, checked by test_oracle_cases_exercise_every_branch
MODES = [
    (None, "geometric", None),
    ("truncate", "geometric", 1.0005),
    ("truncate", "sequence", 1.0005),
    ("truncate", "sequence", (0.999, 1.0005)),
    ("truncate", "token", (0.999, 1.001)),
    ("mask", "geometric", (0.9997, 1.0005)),
    ("mask", "sequence", (0.999, 1.0005)),
    ("mask", "token", (0.999, 1.001)),
    ("masked_is", "geometric", (0.9997, 1.0005)),
    ("masked_is", "sequence", 1.0005),
    ("masked_is", "token", (0.999, 1.001)),
]


def close(actual, expected, dtype=torch.float64):
    torch.testing.assert_close(actual, expected, rtol=TOL[dtype], atol=TOL[dtype])


def grads(loss, actor):
    return torch.autograd.grad(loss, actor.table)[0]


def decoupled_rows(actor, dtype=torch.float64, seed=0, mismatch=1e-3, shapes=None):
    """make_rows' rows, whose "old" become the recomputed ones, plus engine log-probs.

    The rollout log-probs differ from the old ones by ``mismatch``-scale noise on every
    token, and are NaN on the prompt of every row (as vLLM reports them).
    """
    kwargs = {} if shapes is None else {"shapes": shapes}
    rows = make_rows(actor=actor, dtype=dtype, noise=1e-3, seed=seed, nan_prompt=False, **kwargs)
    gen = torch.Generator().manual_seed(seed + 100)
    for row in rows:
        n = row["tokens"].shape[0]
        rollout = row["old"] - mismatch * torch.randn(n, generator=gen, dtype=dtype)
        prompt = int((~row["response"]).cumprod(0).sum())  # leading prompt tokens
        rollout[:prompt] = float("nan")
        row["rollout"] = rollout
    return rows


def decoupled_batch(kind, rows, with_old=True, advantage_per_token=False):
    """The rows with the engine's log-probs at ROLLOUT and the trainer's at OLD."""
    if kind == "lazy":
        tds = []
        for row, td in zip(rows, lazy_batch(rows, advantage_per_token).unbind(0), strict=True):
            td = td.clone()
            td.set(ROLLOUT, row["rollout"])
            if with_old:
                td.set(OLD, row["old"])
            tds.append(td)
        return lazy_stack(tds, 0)
    batch = dense_batch(rows, advantage_per_token=advantage_per_token)
    batch.set(ROLLOUT, left_pad([r["rollout"] for r in rows], 0.0))
    if with_old:
        batch.set(OLD, left_pad([r["old"] for r in rows], 0.0))
    return batch


def oracle_token_weights(old, rollout, mask, correction, form, threshold):
    """The weight of each token, [B, T], written out from TRL's and our definitions.

    rho is the product or geometric mean over the loss mask (a sequence form, the
    same weight on every token of the row) or each token's own ratio (the token form);
    then w = clamp(rho, low, high) (truncate), 1[low <= rho <= high] (mask) or
    rho * 1[low <= rho <= high] (masked_is). A cap C is the band (0, C).
    """
    delta = torch.where(mask, old - rollout, torch.zeros_like(old))
    if form == "token":
        rho = delta.exp()
    else:
        log_rho = delta.sum(-1, keepdim=True)
        if form == "geometric":
            log_rho = log_rho / mask.sum(-1, keepdim=True).clamp(min=1)
        rho = log_rho.exp().expand_as(delta)
    if correction is None:
        return torch.ones_like(rho)
    low, high = threshold if isinstance(threshold, tuple) else (0.0, threshold)
    inside = (rho >= low) & (rho <= high)
    if correction == "truncate":
        return rho.clamp(low, high)
    if correction == "mask":
        return inside.to(rho.dtype)
    return torch.where(inside, rho, torch.zeros_like(rho))


def oracle_weights(old, rollout, mask, correction, form, threshold):
    """w_i: the mean over each sequence's valid tokens of its token weights."""
    w = oracle_token_weights(old, rollout, mask, correction, form, threshold)
    w = torch.where(mask, w, torch.zeros_like(w)).sum(-1) / mask.sum(-1).clamp(min=1)
    return torch.where(mask.any(-1), w, torch.ones_like(w))


def oracle_decoupled(actor, rows, eps, correction, form, threshold, aggregation="prompt_mean"):
    """TRL's form: per-token loss w_t * (-min(s_i A_i, clip(s_i) A_i)), then the mean
    over each sequence's valid tokens and over sequences (prompt_mean), or over all
    valid tokens (token_mean); s_i against the recomputed old log-probs."""
    tokens = padded(rows, "tokens", 0)
    current = actor.token_log_probs(tokens)
    old = padded(rows, "old", 0.0)
    rollout = padded(rows, "rollout", float("nan"))
    mask = padded(rows, "response", False) & old.isfinite() & rollout.isfinite()
    advantage = torch.stack([r["advantage"].reshape(()) for r in rows])
    weight = oracle_token_weights(old, rollout, mask, correction, form, threshold)
    seq = torch.where(mask, current - old, torch.zeros_like(current)).sum(-1)
    ratio = (seq / mask.sum(-1).clamp(min=1)).exp()
    per_seq = -torch.minimum(ratio * advantage, ratio.clamp(1 - eps[0], 1 + eps[1]) * advantage)
    per_token = torch.where(mask, per_seq.unsqueeze(-1) * weight, torch.zeros_like(current))
    if aggregation == "prompt_mean":
        return (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if aggregation == "token_mean":
        return per_token.sum() / mask.sum()
    return per_token


def loss(correction, form, threshold, loss_cls=GSPOLoss, actor=None, **kwargs):
    return build_loss(
        loss_cls,
        actor,
        rollout_correction=correction,
        rollout_correction_form=form,
        rollout_correction_threshold=threshold,
        **kwargs,
    )


# ---------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("correction,form,threshold", MODES)
def test_decoupled_loss_and_gradient_match_oracle(dtype, kind, correction, form, threshold):
    actor = BigramActor(dtype=dtype)
    rows = decoupled_rows(actor, dtype=dtype, seed=1)
    eps = (0.01, 0.01)  # sequences on both sides of the clip range, and inside it
    loss_fn = loss(correction, form, threshold, actor=actor, clip_epsilon=eps)
    out = loss_fn(decoupled_batch(kind, rows))
    expected = oracle_decoupled(actor, rows, eps, correction, form, threshold)
    close(out.loss_objective, expected, dtype)
    close(grads(out.loss_objective, actor), grads(expected, actor), dtype)


def test_oracle_cases_exercise_every_branch():
    """Each band of MODES leaves some ratios inside and pushes others out (below the
    lower bound too, where it has one); one row is empty."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=1)
    old, rollout = padded(rows, "old", 0.0), padded(rows, "rollout", float("nan"))
    mask = padded(rows, "response", False) & rollout.isfinite()
    assert not mask.all(-1).all() and (~mask.any(-1)).any()  # an empty row
    rows_kept = mask.any(-1, keepdim=True).expand_as(mask)
    for correction, form, threshold in MODES[1:]:
        rho = oracle_token_weights(old, rollout, mask, "truncate", form, math.inf)
        rho = rho[mask if form == "token" else rows_kept & mask]
        low, high = threshold if isinstance(threshold, tuple) else (0.0, threshold)
        assert (rho > high).any() and ((rho >= low) & (rho <= high)).any(), (correction, form)
        if low > 0:
            assert (rho < low).any(), (correction, form)
        w = oracle_token_weights(old, rollout, mask, correction, form, threshold)[mask]
        if correction == "masked_is":  # kept ratios are weighted by themselves, not 1
            assert (w == 0).any() and ((w > 0) & (w != 1)).any(), form


def test_masked_is_keeps_the_ratio_as_the_weight():
    """TRL's sequence_mask: log rho = 0.5 inside the band weighs e^0.5 = 1.6487,
    where the 0/1 mask weighs 1; outside, both weigh 0."""
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    rollout = old - torch.tensor([[0.25, 0.25], [1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    for mode, expected in (("masked_is", math.exp(0.5)), ("mask", 1.0)):
        correction = RolloutCorrection.from_arguments(mode, "sequence", (0.0, 3.0))
        terms = rollout_terms(old, rollout, mask, correction)
        assert terms.weight.tolist() == [pytest.approx(expected, abs=1e-15), 0.0]
        assert terms.corrected.tolist() == [0.0, 1.0]


def test_token_form_weighs_each_token_by_its_own_ratio():
    """The token form: each token's ratio, truncated from below and above; the
    sequence weight is their mean over the valid tokens, 1 off the mask."""
    old = torch.zeros(2, 4, dtype=torch.float64)
    rollout = -torch.tensor([[-1.0, 0.0, 1.0, 5.0], [3.0, 3.0, 3.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False], [False] * 4])  # the second row empty
    correction = RolloutCorrection.from_arguments("truncate", "token", (0.5, 2.0))
    terms = rollout_terms(old, rollout, mask, correction)
    assert terms.token_weight.tolist() == [[0.5, 1.0, 2.0, 1.0], [1.0] * 4]
    close(terms.weight, torch.tensor([3.5 / 3, 1.0], dtype=torch.float64))
    close(terms.corrected, torch.tensor([2 / 3, 0.0], dtype=torch.float64))
    assert terms.loss_weight is terms.token_weight


@pytest.mark.parametrize(
    "threshold,band",
    [((None, 3.0), (0.0, 3.0)), ((0.5, None), (0.5, math.inf)), (2.0, (0.0, 2.0))],
)
def test_a_none_end_of_the_band_is_no_bound(threshold, band):
    """TRL's clip_min / clip_max of None: no lower / upper bound."""
    correction = RolloutCorrection.from_arguments("masked_is", "sequence", threshold)
    assert (correction.low, correction.high) == band


@pytest.mark.parametrize("correction,form,threshold", MODES)
def test_diagnostics_match_definitions(correction, form, threshold):
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=2)
    out = loss(correction, form, threshold, actor=actor)(decoupled_batch("lazy", rows))
    old, rollout = padded(rows, "old", 0.0), padded(rows, "rollout", float("nan"))
    mask = padded(rows, "response", False) & rollout.isfinite()
    lengths = mask.sum(-1)
    nonempty = lengths > 0
    delta = torch.where(mask, old - rollout, torch.zeros_like(old))
    geometric = (delta.sum(-1) / lengths.clamp(min=1))[nonempty]
    weight = oracle_weights(old, rollout, mask, correction, form, threshold)[nonempty]
    low, high = math.log1p(-PAPER_EPS[0]), math.log1p(PAPER_EPS[1])
    r = delta[mask].exp()
    # the share of each sequence's weight the correction changed: its tokens' ratios
    # (the token form) or its own, outside the band
    rho = oracle_token_weights(old, rollout, mask, "truncate", form, math.inf)
    outside = torch.zeros_like(rho, dtype=torch.bool)
    if correction is not None:
        c_low, c_high = threshold if isinstance(threshold, tuple) else (0.0, threshold)
        outside = (rho < c_low) | (rho > c_high)
    outside = torch.where(mask, outside.double(), 0.0).sum(-1) / lengths.clamp(min=1)
    corrected = outside[nonempty]
    expected = {
        "rollout_log_ratio_mean_abs": geometric.abs().mean(),
        "rollout_log_ratio_max_abs": geometric.abs().max(),
        "rollout_outside_clip_fraction": ((geometric < low) | (geometric > high)).double().mean(),
        "rollout_kl": (r - 1 - r.log()).mean(),
        "rollout_correction_fraction": corrected.mean(),
        "rollout_correction_weight": weight.mean(),
    }
    for name, value in expected.items():
        got = getattr(out, name)
        assert got.shape == () and not got.requires_grad, name
        close(got, value)
    assert 0 < out.rollout_outside_clip_fraction < 1
    if correction is not None:
        assert 0 < out.rollout_correction_fraction < 1


# ---------------------------------------------------------------------------------
# Exact properties
# ---------------------------------------------------------------------------------
def _grad_and_fields(out, actor):
    return grads(out.loss_objective, actor), fields_of(out)


@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("correction,form,threshold", MODES)
@pytest.mark.parametrize("loss_cls", [GSPOLoss, GSPOTokenLoss])
def test_old_equal_to_rollout_is_todays_loss_bit_for_bit(
    kind, correction, form, threshold, loss_cls
):
    """Without the old key: today's loss. With old == rollout: the same, bit for bit."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=3)
    for row in rows:
        row["rollout"] = row["old"].clone()
        row["rollout"][: int((~row["response"]).cumprod(0).sum())] = float("nan")
    plain = loss_cls(actor)(decoupled_batch(kind, rows, with_old=False))
    assert plain.rollout_log_ratio_mean_abs is None and plain.rollout_kl is None
    decoupled = loss(correction, form, threshold, loss_cls, actor)(decoupled_batch(kind, rows))
    grad_plain, fields_plain = _grad_and_fields(plain, actor)
    grad_dec, fields_dec = _grad_and_fields(decoupled, actor)
    assert torch.equal(grad_plain, grad_dec)
    assert set(fields_plain) < set(fields_dec)  # the decoupled call adds rollout fields
    for name, value in fields_plain.items():
        assert torch.equal(value, fields_dec[name]), name
    assert decoupled.rollout_log_ratio_max_abs == 0 and decoupled.rollout_kl == 0
    assert decoupled.rollout_correction_weight == 1
    assert decoupled.rollout_correction_fraction == 0


def test_without_old_key_the_loss_is_the_plain_oracle():
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=4)
    out = GSPOLoss(actor)(decoupled_batch("lazy", rows, with_old=False))
    # the ratio is then taken against the rollout log-probs (NaN on the prompt)
    tokens = padded(rows, "tokens", 0)
    rollout = padded(rows, "rollout", float("nan"))
    mask = padded(rows, "response", False) & rollout.isfinite()
    advantage = torch.stack([r["advantage"].reshape(()) for r in rows])
    current = actor.token_log_probs(tokens)
    close(out.loss_objective, oracle_gspo_loss(current, rollout, mask, advantage, *PAPER_EPS))


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_thresholds_that_never_bind(kind):
    """A mask band that never binds is the uncorrected decoupled loss, bit for bit; a
    truncation cap that never binds is the full importance weight w_i = rho_i."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=5)
    batch = decoupled_batch(kind, rows)
    uncorrected = GSPOLoss(actor)(batch)
    wide = loss("mask", "sequence", (0.0, math.inf), actor=actor)(batch)
    assert torch.equal(wide.loss_objective, uncorrected.loss_objective)
    assert wide.rollout_correction_fraction == 0 and wide.rollout_correction_weight == 1
    for form in ("geometric", "sequence"):
        full = loss("truncate", form, math.inf, actor=actor)(batch)
        close(
            full.loss_objective,
            oracle_decoupled(actor, rows, PAPER_EPS, "truncate", form, math.inf),
        )
        assert full.rollout_correction_fraction == 0


SEQUENCE_MODES = [m for m in MODES[1:] if m[1] != "token"]
TOKEN_MODES = [m for m in MODES if m[1] == "token"]


@pytest.mark.parametrize("correction,form,threshold", SEQUENCE_MODES)
def test_gspo_token_equals_gspo_with_sequence_advantages(correction, form, threshold):
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=6)
    batch = decoupled_batch("lazy", rows, advantage_per_token=True)
    seq = loss(correction, form, threshold, GSPOLoss, actor)(batch)
    tok = loss(correction, form, threshold, GSPOTokenLoss, actor)(batch)
    close(tok.loss_objective, seq.loss_objective)
    close(grads(tok.loss_objective, actor), grads(seq.loss_objective, actor))
    assert torch.equal(tok.rollout_correction_weight, seq.rollout_correction_weight)


@pytest.mark.parametrize("correction,form,threshold", TOKEN_MODES)
def test_gspo_token_weighs_each_token_term_by_its_own_weight(correction, form, threshold):
    """Per-token weights on GSPO-token's per-token terms: w_t times the clipped term of
    s_it = sg(s_i) pi_t / sg(pi_t), then the mean over tokens and sequences. The value
    equals GSPOLoss' (whose sequence term takes the mean weight); the gradient differs,
    each token's own weight against the mean weight on every token."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=6)
    batch = decoupled_batch("lazy", rows, advantage_per_token=True)
    eps = (0.01, 0.01)
    tok = loss(correction, form, threshold, GSPOTokenLoss, actor, clip_epsilon=eps)(batch)
    seq = loss(correction, form, threshold, GSPOLoss, actor, clip_epsilon=eps)(batch)
    current = actor.token_log_probs(padded(rows, "tokens", 0))
    old, rollout = padded(rows, "old", 0.0), padded(rows, "rollout", float("nan"))
    mask = padded(rows, "response", False) & rollout.isfinite()
    advantage = torch.stack([r["advantage"].reshape(()) for r in rows]).unsqueeze(-1)
    weight = oracle_token_weights(old, rollout, mask, correction, form, threshold)
    log_ratio = torch.where(mask, current - old, torch.zeros_like(current))
    log_s = (log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).detach()
    s_t = (log_s + current - current.detach()).exp()
    term = -torch.minimum(s_t * advantage, s_t.clamp(1 - eps[0], 1 + eps[1]) * advantage)
    term = torch.where(mask, weight * term, torch.zeros_like(term))
    expected = (term.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    expected_grad = torch.autograd.grad(expected, actor.table, retain_graph=True)[0]
    close(tok.loss_objective, expected)
    close(grads(tok.loss_objective, actor), expected_grad)
    close(seq.loss_objective, expected)
    assert not torch.allclose(grads(seq.loss_objective, actor), expected_grad)


@pytest.mark.parametrize("aggregation", ["token_mean", "none"])
@pytest.mark.parametrize(
    "correction,form,threshold",
    [("truncate", "sequence", 1.0005), ("masked_is", "token", (0.999, 1.001))],
)
def test_other_aggregations_weight_each_term(aggregation, correction, form, threshold):
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=7)
    eps = (0.01, 0.01)
    loss_fn = loss(
        correction, form, threshold, actor=actor, clip_epsilon=eps, aggregation=aggregation
    )
    out = loss_fn(decoupled_batch("lazy", rows))
    expected = oracle_decoupled(actor, rows, eps, correction, form, threshold, aggregation)
    close(out.loss_objective.reshape(expected.shape), expected)


@pytest.mark.parametrize("form", ["geometric", "token"])
def test_compile_matches_eager_with_correction(form):
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=8)
    batch = decoupled_batch("dense", rows)
    loss_fn = loss("masked_is", form, (0.9995, 1.0005), actor=actor, entropy_bonus=False)
    eager = loss_fn(batch)
    compiled = torch.compile(loss_fn)(batch)
    for name in ("loss_objective", "rollout_correction_weight", "rollout_kl", "ESS"):
        close(getattr(compiled, name), getattr(eager, name))
    close(grads(compiled.loss_objective, actor), grads(eager.loss_objective, actor))


def test_kl_to_inference_stays_with_the_rollout_log_probs():
    """GRPOLoss' KL to the inference policy reads sample_log_prob: the engine's."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=9)
    kwargs = {"kl_to_inference_coeff": 0.3, "entropy_bonus": False}
    decoupled = GSPOLoss(actor, **kwargs)(decoupled_batch("lazy", rows))
    grpo = GRPOLoss(actor, **kwargs)(decoupled_batch("lazy", rows, with_old=False))
    close(decoupled.kl_to_inference, grpo.kl_to_inference)
    close(decoupled.loss_kl_to_inference, grpo.loss_kl_to_inference)


def test_set_keys_moves_both_roles():
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=10)
    batch = decoupled_batch("lazy", rows)
    batch.rename_key_(ROLLOUT, ("engine", "lp"))
    batch.rename_key_(OLD, ("trainer", "lp"))
    loss_fn = loss("truncate", "geometric", 1.0005, actor=actor)
    loss_fn.set_keys(sample_log_prob=("engine", "lp"), old_log_prob=("trainer", "lp"))
    assert ("trainer", "lp") in loss_fn.in_keys
    out = loss_fn(batch)
    close(
        out.loss_objective,
        oracle_decoupled(actor, rows, PAPER_EPS, "truncate", "geometric", 1.0005),
    )


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_input_is_not_mutated(kind):
    actor = BigramActor()
    batch = decoupled_batch(kind, decoupled_rows(actor, seed=11))
    before = batch.clone()
    loss("mask", "geometric", (0.999, 1.001), actor=actor, kl_to_inference_coeff=0.1)(batch)
    assert set(batch.keys(True, True)) == set(before.keys(True, True))
    for key in before.keys(True, True):
        a = before.get(key, as_padded_tensor=True)
        b = batch.get(key, as_padded_tensor=True)
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), key


# ---------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------
def test_correction_without_old_key_raises():
    actor = BigramActor()
    batch = decoupled_batch("lazy", decoupled_rows(actor), with_old=False)
    with pytest.raises(
        KeyError,
        match=r"old log-probabilities at \('old_log_probs', 'full'\).*RecomputeOldLogProbs",
    ):
        loss("truncate", "geometric", None, actor=actor)(batch)


@pytest.mark.parametrize("delta", [-1, 1])
def test_old_key_of_the_wrong_length_raises(delta):
    actor = BigramActor()
    rows = decoupled_rows(actor)
    rows[4]["old"] = (
        rows[4]["old"][1:] if delta < 0 else torch.cat([rows[4]["old"][:1], rows[4]["old"]])
    )
    with pytest.raises(
        ValueError,
        match=r"at \('old_log_probs', 'full'\) do not have one value per token in "
        r"batch row\(s\) \[4\]",
    ):
        GSPOLoss(actor)(decoupled_batch("lazy", rows))


def test_dense_old_key_of_the_wrong_shape_raises():
    actor = BigramActor()
    batch = decoupled_batch("dense", decoupled_rows(actor))
    batch.set(OLD, batch.get(OLD)[:, 1:])
    with pytest.raises(
        ValueError, match=r"log-probabilities at \('old_log_probs', 'full'\) have shape"
    ):
        GSPOLoss(actor)(batch)


@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("which,key", [("rollout", ROLLOUT), ("old", OLD)])
def test_non_finite_log_probs_inside_the_response_raise(kind, which, key):
    actor = BigramActor()
    rows = decoupled_rows(actor)
    rows[0][which] = rows[0][which].clone()
    rows[0][which][4] = float("nan")  # row 0: prompt 3, response from position 3
    with pytest.raises(
        ValueError,
        match=rf"the {which} log-probabilities at {key!r}".replace("(", r"\(").replace(")", r"\)"),
    ):
        GSPOLoss(actor)(decoupled_batch(kind, rows))


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"rollout_correction": "clip"}, ValueError, "rollout_correction must be one of"),
        (
            {"rollout_correction": "mask", "rollout_correction_form": "product"},
            ValueError,
            "rollout_correction_form must be one of",
        ),
        (
            {"rollout_correction": "truncate", "rollout_correction_threshold": float("nan")},
            ValueError,
            "rollout_correction_threshold is NaN",
        ),
        (
            {"rollout_correction": "truncate", "rollout_correction_threshold": -2.0},
            ValueError,
            "0 <= C_low <= 1 <= C_high",
        ),
        (
            {"rollout_correction": "truncate", "rollout_correction_threshold": 0.5},
            ValueError,
            "0 <= C_low <= 1 <= C_high",
        ),
        (
            {"rollout_correction": "masked_is", "rollout_correction_threshold": (1.1, 2.0)},
            ValueError,
            "0 <= C_low <= 1 <= C_high",
        ),
        (
            {"rollout_correction": "truncate", "rollout_correction_threshold": (0.5, 2.0, 3.0)},
            TypeError,
            r"pair \(C_low, C_high\) or a cap C",
        ),
        (
            {"rollout_correction": "mask", "rollout_correction_threshold": 2.0},
            TypeError,
            r"pair \(C_low, C_high\)",
        ),
        (
            {"rollout_correction": "mask", "rollout_correction_threshold": (2.0, 0.5)},
            ValueError,
            "0 <= C_low <= 1 <= C_high",
        ),
        (
            {"rollout_correction": "mask", "rollout_correction_threshold": (-0.1, 2.0)},
            ValueError,
            "0 <= C_low <= 1 <= C_high",
        ),
        (
            {"rollout_correction": "mask", "rollout_correction_threshold": (0.5, "2")},
            TypeError,
            "rollout_correction_threshold must be a real number",
        ),
        ({"rollout_correction_threshold": 2.0}, ValueError, "rollout_correction is None"),
    ],
)
def test_bad_correction_arguments_raise(kwargs, error, words):
    with pytest.raises(error, match=words):
        GSPOLoss(BigramActor(), **kwargs)


# ---------------------------------------------------------------------------------
# RecomputeOldLogProbs
# ---------------------------------------------------------------------------------
class _TablePolicy(torch.nn.Module):
    """Stands in for the training wrapper: the bigram actor's log-probs, "log_probs" out."""

    input_mode, generate, return_log_probs, pad_output = "tokens", False, True, False

    def __init__(self, actor, shorten=False):
        super().__init__()
        self.actor, self.shorten, self.calls = actor, shorten, 0

    def forward(self, tensordict):
        self.calls += 1
        rows = []
        for tokens in tensordict.get(("tokens", "full"), as_list=True):
            lp = self.actor.token_log_probs(tokens.unsqueeze(0)).squeeze(0)
            rows.append(TensorDict(full=lp[1:] if self.shorten else lp))
        return TensorDict(log_probs=lazy_stack(rows, 0), batch_size=tensordict.batch_size)


def _rollout_batch(actor):
    rows = decoupled_rows(actor, seed=12)
    tds = []
    for row, td in zip(rows, decoupled_batch("lazy", rows, with_old=False).unbind(0), strict=True):
        td = td.clone()
        p = int((~row["response"]).cumprod(0).sum())
        td.set(("tokens", "response"), row["tokens"][p:])
        tds.append(td)
    return rows, lazy_stack(tds, 0)


def test_recompute_writes_old_key_and_keeps_the_rollout():
    actor = BigramActor()
    rows, batch = _rollout_batch(actor)
    policy = _TablePolicy(actor)
    out = RecomputeOldLogProbs(policy)(batch)
    for row, old, rollout in zip(
        rows, out.get(OLD, as_list=True), out.get(ROLLOUT, as_list=True), strict=True
    ):
        assert torch.equal(
            old, actor.token_log_probs(row["tokens"].unsqueeze(0)).squeeze(0).detach()
        )
        assert torch.equal(rollout.nan_to_num(7.0), row["rollout"].nan_to_num(7.0))
    assert not out.get(OLD, as_list=True)[0].requires_grad
    # already present: left as it is (a sample-time pass changes nothing)
    assert RecomputeOldLogProbs(policy)(out) is out and policy.calls == 1


def test_recompute_as_a_replay_buffer_transform():
    actor = BigramActor()
    _, batch = _rollout_batch(actor)
    policy = _TablePolicy(actor)
    buffer = ReplayBuffer(storage=LazyStackStorage(16), transform=RecomputeOldLogProbs(policy))
    buffer.extend(batch)
    assert policy.calls == 1  # computed on write
    stored = buffer[:]
    assert OLD in stored.keys(True)
    with torch.no_grad():
        actor.table.add_(1.0)  # an update after the write changes nothing stored
    sample = buffer.sample(len(batch))
    assert policy.calls == 1
    for old in sample.get(OLD, as_list=True):
        assert old.isfinite().all()


def test_recompute_checks_what_it_writes():
    actor = BigramActor()
    _, batch = _rollout_batch(actor)
    with pytest.raises(
        ValueError, match=r"do not cover the sampled tokens.*row\(s\) \[0, 1, 2, 3, 4, 5\]"
    ):
        RecomputeOldLogProbs(_TablePolicy(actor, shorten=True))(batch)


@pytest.mark.parametrize(
    "setting",
    [
        ("generate", True),
        ("pad_output", True),
        ("input_mode", "history"),
        ("return_log_probs", False),
    ],
)
def test_recompute_rejects_a_non_training_wrapper(setting):
    policy = _TablePolicy(BigramActor())
    setattr(policy, *setting)
    with pytest.raises(ValueError, match=rf"needs the training wrapper \({setting[0]}="):
        RecomputeOldLogProbs(policy)
