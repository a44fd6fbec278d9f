# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPOLoss against an independent oracle, its exact properties and its errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from gspo_testing import (
    UPSTREAM_FIXES,
    BigramActor,
    LogProbActor,
    build_loss,
    dense_batch,
    lazy_batch,
    left_pad,
    make_rows,
    oracle_gspo_loss,
    oracle_sequence_log_ratio,
    padded,
)
from tensordict import TensorDict
from torchrl.objectives.llm import GRPOLoss

from torchrl_gspo import GSPOLoss, GSPOLossOutput, GSPOTokenLoss

TOL = {torch.float64: 1e-12, torch.float32: 1e-6}
PAPER_EPS = (3e-4, 4e-4)


def make_batch(kind: str, rows, advantage_per_token: bool = False):
    if kind == "lazy":
        return lazy_batch(rows, advantage_per_token)
    return dense_batch(rows, advantage_per_token=advantage_per_token)


def oracle_inputs(actor: BigramActor, rows, mask_name: str = "response"):
    """Current log-probs computed independently from the actor's parameters.

    With the all-token mask ("attention", masking_strategy="generic"), the first token
    of each row is not scored: nothing precedes it, so it has no log-prob to compare.
    """
    tokens = padded(rows, "tokens", 0)
    current = actor.token_log_probs(tokens)
    old = padded(rows, "old", 0.0)
    mask = padded(rows, mask_name, False) & old.isfinite()
    if mask_name == "attention":
        width = tokens.shape[-1]
        for i, row in enumerate(rows):  # left-padded: row i starts at width - len(row)
            mask[i, width - row["tokens"].shape[0]] = False
    advantage = torch.stack([r["advantage"].reshape(()) for r in rows])
    return current, old, mask, advantage


def grads(loss: torch.Tensor, actor: BigramActor) -> torch.Tensor:
    return torch.autograd.grad(loss, actor.table)[0]


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected, rtol=TOL[dtype], atol=TOL[dtype])


# ---------------------------------------------------------------------------------
# The oracle: loss and gradient
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize(
    "noise,eps",
    [
        (1e-3, PAPER_EPS),  # paper clip range: sequences clipped on both sides
        (1e-3, (0.5, 0.5)),  # nothing clipped
        (0.3, (0.05, 0.08)),  # far off-policy, asymmetric range
    ],
)
def test_loss_and_gradient_match_oracle(dtype, kind, noise, eps):
    actor = BigramActor(dtype=dtype)
    rows = make_rows(actor=actor, dtype=dtype, noise=noise, seed=1)
    loss_fn = build_loss(GSPOLoss, actor, clip_epsilon=eps, entropy_bonus=False)
    out = loss_fn(make_batch(kind, rows))
    assert isinstance(out, GSPOLossOutput)
    assert out.loss_objective.shape == torch.Size([])

    current, old, mask, advantage = oracle_inputs(actor, rows)
    expected = oracle_gspo_loss(current, old, mask, advantage, *eps)
    assert_close(out.loss_objective, expected, dtype)
    assert_close(grads(out.loss_objective, actor), grads(expected, actor), dtype)


def test_oracle_batches_clip_on_both_sides():
    """The paper-range case above really exercises both clip branches."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=1e-3, seed=1)
    current, old, mask, _ = oracle_inputs(actor, rows)
    seq = oracle_sequence_log_ratio(current, old, mask)[mask.any(-1)]
    assert (seq < math.log1p(-PAPER_EPS[0])).any()
    assert (seq > math.log1p(PAPER_EPS[1])).any()
    assert ((seq > math.log1p(-PAPER_EPS[0])) & (seq < math.log1p(PAPER_EPS[1]))).any()


def _expected_diagnostics(current, old, mask, eps):
    seq = oracle_sequence_log_ratio(current, old, mask).detach()
    lengths = mask.sum(-1).to(seq.dtype)
    nonempty = lengths > 0
    ratio = seq.exp()[nonempty]
    tokens = lengths[nonempty]
    low = ratio < 1 - eps[0]
    high = ratio > 1 + eps[1]
    return {
        "clip_fraction": (tokens * (low | high)).sum() / tokens.sum(),
        "clip_fraction_low": (tokens * low).sum() / tokens.sum(),
        "clip_fraction_high": (tokens * high).sum() / tokens.sum(),
        "sequence_clip_fraction": (low | high).to(seq.dtype).mean(),
        "ESS": ratio.sum() ** 2 / (ratio**2).sum() / ratio.numel(),
        "sequence_log_ratio": seq[nonempty].mean(),
        "sequence_log_ratio_max_abs": seq[nonempty].abs().max(),
    }


@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("noise", [1e-3, 0.3])
def test_diagnostics_match_definitions(kind, noise):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=noise, seed=2)
    out = GSPOLoss(actor)(make_batch(kind, rows))
    current, old, mask, _ = oracle_inputs(actor, rows)
    for name, value in _expected_diagnostics(current, old, mask, PAPER_EPS).items():
        got = getattr(out, name)
        assert got.shape == torch.Size([]) and not got.requires_grad, name
        assert_close(got, value, torch.float64)
    assert out.clip_fraction > 0
    assert out.clip_fraction == out.clip_fraction_low + out.clip_fraction_high
    for name in ("clip_fraction", "ESS", "sequence_log_ratio", "clip_fraction_low"):
        assert not name.startswith("loss_")


def test_clip_fraction_excludes_padding():
    """Padding columns never count, unlike GRPOLoss' mean over all B * T positions."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.3, seed=3)
    narrow = GSPOLoss(actor)(dense_batch(rows))
    wide = GSPOLoss(actor)(dense_batch(rows, width=40))
    assert narrow.clip_fraction == wide.clip_fraction
    assert narrow.ESS == wide.ESS


# ---------------------------------------------------------------------------------
# Exact properties
# ---------------------------------------------------------------------------------
def _rows_with_token_log_ratios(actor, log_ratios, advantage=1.0):
    """One row per entry of ``log_ratios``; old = current - log_ratio on each response token."""
    rows = make_rows(
        [(2, len(lr)) for lr in log_ratios],
        actor=actor,
        advantages=torch.full((len(log_ratios),), advantage, dtype=torch.float64),
        holes=False,
        nan_prompt=False,
    )
    for row, lr in zip(rows, log_ratios, strict=True):
        with torch.no_grad():
            current = actor.token_log_probs(row["tokens"].unsqueeze(0)).squeeze(0)
        row["old"][2:] = current[2:] - torch.tensor(lr, dtype=torch.float64)
    return rows


def test_reciprocal_token_ratios_give_sequence_ratio_one():
    actor = BigramActor()
    rows = _rows_with_token_log_ratios(actor, [[math.log(1.2), math.log(1 / 1.2)]])
    out = GSPOLoss(actor)(lazy_batch(rows))
    # token ratios 1.2 and 1/1.2 are both far outside the clip range, their sequence is not
    assert out.sequence_log_ratio.exp() == 1.0
    assert out.clip_fraction == 0.0
    assert out.loss_objective == -1.0  # -(s * A) with s = 1, A = 1


def test_permuting_tokens_inside_a_sequence_changes_nothing():
    actor = BigramActor()
    values = [[0.3, -0.1, 0.05, 0.2], [-0.4, 0.1, 0.7]]
    permuted = [[0.2, 0.05, 0.3, -0.1], [0.7, -0.4, 0.1]]
    for eps in (PAPER_EPS, (0.5, 0.5)):
        out = build_loss(GSPOLoss, actor, clip_epsilon=eps)(
            lazy_batch(_rows_with_token_log_ratios(actor, values))
        )
        out_p = build_loss(GSPOLoss, actor, clip_epsilon=eps)(
            lazy_batch(_rows_with_token_log_ratios(actor, permuted))
        )
        assert_close(out_p.loss_objective, out.loss_objective, torch.float64)
        assert_close(out_p.sequence_log_ratio, out.sequence_log_ratio, torch.float64)
        assert out_p.clip_fraction == out.clip_fraction


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_adding_padding_changes_nothing(kind):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.05, seed=4)
    batch = lazy_batch(rows) if kind == "lazy" else dense_batch(rows)
    out = build_loss(GSPOLoss, actor, clip_epsilon=0.03)(batch)
    out_wide = build_loss(GSPOLoss, actor, clip_epsilon=0.03)(dense_batch(rows, width=25))
    assert_close(out_wide.loss_objective, out.loss_objective, torch.float64)
    assert_close(
        grads(out_wide.loss_objective, actor), grads(out.loss_objective, actor), torch.float64
    )
    assert out_wide.clip_fraction == out.clip_fraction


def test_on_policy_gradient_equals_grpo_prompt_mean():
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.0, seed=5, nan_prompt=False)
    batch = lazy_batch(rows)
    gspo = build_loss(GSPOLoss, actor, entropy_bonus=False)(batch)
    grpo = GRPOLoss(actor, clip_epsilon=PAPER_EPS, aggregation="prompt_mean", entropy_bonus=False)(
        batch
    )
    assert gspo.sequence_log_ratio_max_abs == 0.0
    assert gspo.clip_fraction == 0.0
    assert_close(gspo.ESS, torch.ones((), dtype=torch.float64), torch.float64)
    assert_close(gspo.loss_objective, grpo.loss_objective.squeeze(-1), torch.float64)
    assert_close(
        grads(gspo.loss_objective, actor), grads(grpo.loss_objective.sum(), actor), torch.float64
    )


@pytest.mark.parametrize("eps", [PAPER_EPS, (0.2, 0.27)])
def test_one_token_responses_equal_grpo(eps):
    actor = BigramActor()
    rows = make_rows([(3, 1), (1, 1), (4, 1), (2, 1), (2, 0)], actor=actor, noise=0.01, seed=6)
    batch = lazy_batch(rows)
    gspo = build_loss(GSPOLoss, actor, clip_epsilon=eps, entropy_bonus=False)(batch)
    grpo = GRPOLoss(actor, clip_epsilon=eps, aggregation="prompt_mean", entropy_bonus=False)(batch)
    assert_close(gspo.loss_objective, grpo.loss_objective.squeeze(-1), torch.float64)
    assert_close(
        grads(gspo.loss_objective, actor), grads(grpo.loss_objective.sum(), actor), torch.float64
    )


# ---------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------
def test_ragged_advantages_are_aligned_with_left_padded_tokens():
    """Per-row advantages of the rows' lengths (as MCAdvantage writes them).

    GRPOLoss 0.14 reads them right-padded, so on the shorter rows the response tokens
    (at the right end of the left-padded log-probs) meet padding zeros; GSPOLoss reads
    them left-padded and matches the oracle. With the upstream series' first patch,
    GRPOLoss reads them left-padded too.
    """
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, seed=7, nan_prompt=False)
    batch = lazy_batch(rows, advantage_per_token=True)
    assert batch.get("advantage", as_padded_tensor=True).shape[1] > 1  # ragged
    eps = (0.5, 0.5)
    out = build_loss(GSPOLoss, actor, clip_epsilon=eps, entropy_bonus=False)(batch)
    current, old, mask, advantage = oracle_inputs(actor, rows)
    expected = oracle_gspo_loss(current, old, mask, advantage, *eps)
    assert_close(out.loss_objective, expected, torch.float64)
    assert_close(grads(out.loss_objective, actor), grads(expected, actor), torch.float64)
    # the base class' right-padded read of the same batch is misaligned (0.14)
    base = GRPOLoss(actor, clip_epsilon=eps, aggregation="prompt_mean", entropy_bonus=False)
    dense = dense_batch(rows)  # dense [B,1,1] advantages: no ambiguity for GRPOLoss
    ragged_grpo = base(batch).loss_objective
    dense_grpo = base(dense).loss_objective
    assert torch.allclose(ragged_grpo, dense_grpo) is UPSTREAM_FIXES


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_dense_per_token_constant_advantages(kind):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, seed=8)
    out = GSPOLoss(actor)(make_batch(kind, rows, advantage_per_token=True))
    ref = GSPOLoss(actor)(make_batch(kind, rows))
    assert_close(out.loss_objective, ref.loss_objective, torch.float64)


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_varying_advantage_raises_and_names_gspo_token(kind):
    actor = BigramActor()
    rows = make_rows(actor=actor, seed=9)
    batch = make_batch(kind, rows, advantage_per_token=True)
    advantage = batch.get("advantage", as_padded_tensor=True, padding_side="left").clone()
    # row 0: response tokens are the last 5 positions; give one a different value
    advantage[0, -2] += 1.0
    if kind == "lazy":
        for i, td in enumerate(batch.tensordicts):
            n = td["advantage"].shape[0]
            td.set("advantage", advantage[i, -n:])
    else:
        batch.set("advantage", advantage)
    with pytest.raises(ValueError, match=r"varies across the valid tokens.*\[0\].*GSPOTokenLoss"):
        GSPOLoss(actor)(batch)


def test_advantage_varying_only_on_masked_positions_is_accepted():
    actor = BigramActor()
    rows = make_rows(actor=actor, seed=10)
    batch = dense_batch(rows, advantage_per_token=True)
    advantage = batch["advantage"].clone()
    advantage[:, 0] = 123.0  # a padding / prompt position of every row
    batch.set("advantage", advantage)
    ref = GSPOLoss(actor)(dense_batch(rows))
    assert_close(GSPOLoss(actor)(batch).loss_objective, ref.loss_objective, torch.float64)


@pytest.mark.parametrize("shape", [(6,), (6, 1), (6, 1, 2), (6, 40, 1), (6, 1, 1, 1)])
def test_advantage_of_wrong_shape_raises(shape):
    actor = BigramActor()
    batch = dense_batch(make_rows(actor=actor))
    batch.set("advantage", torch.ones(shape, dtype=torch.float64), inplace=False)
    with pytest.raises(
        ValueError, match=r"advantage at 'advantage' has shape .*reshape\(-1, 1, 1\)"
    ):
        GSPOLoss(actor)(batch)


def test_too_short_advantage_rows_raise():
    """[B, T', 1] with T' < T covers the last T' tokens; uncovered response tokens raise."""
    actor = BigramActor()
    batch = dense_batch(make_rows(actor=actor))
    batch.set("advantage", torch.ones(6, 2, 1, dtype=torch.float64), inplace=False)
    with pytest.raises(ValueError, match=r"NaN, infinite or padding at \d+ valid token"):
        GSPOLoss(actor)(batch)


def test_nan_advantage_on_valid_tokens_raises():
    actor = BigramActor()
    rows = make_rows(actor=actor)
    batch = dense_batch(rows)
    advantage = batch["advantage"].clone()
    advantage[1] = float("nan")
    batch.set("advantage", advantage)
    with pytest.raises(ValueError, match=r"is NaN or infinite in batch row\(s\) \[1\]"):
        GSPOLoss(actor)(batch)


# ---------------------------------------------------------------------------------
# Every GRPOLoss option
# ---------------------------------------------------------------------------------
def test_entropy_bonus_is_grpos():
    actor = BigramActor()
    batch = lazy_batch(make_rows(actor=actor, noise=0.01))
    gspo = build_loss(GSPOLoss, actor, entropy_bonus=True, entropy_coeff=0.1)(batch)
    grpo = GRPOLoss(actor, entropy_bonus=True, entropy_coeff=0.1, aggregation="prompt_mean")(batch)
    assert gspo.loss_entropy.shape == torch.Size([])
    assert_close(gspo.loss_entropy, grpo.loss_entropy.squeeze(-1), torch.float64)
    assert_close(gspo.entropy, grpo.entropy, torch.float64)
    assert_close(
        grads(gspo.loss_entropy, actor), grads(grpo.loss_entropy.sum(), actor), torch.float64
    )


@pytest.mark.parametrize("which", ["ref", "inference"])
def test_kl_terms_are_grpos(which):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, nan_prompt=False)
    batch = lazy_batch(rows)
    kwargs = {"entropy_bonus": False}
    if which == "ref":
        ref = [r["old"] - 0.02 for r in rows]
        for i, lp in enumerate(ref):
            batch[i].set(("next", "ref_log_probs", "full"), lp)
        kwargs["kl_to_ref_coeff"] = 0.5
    else:
        kwargs["kl_to_inference_coeff"] = 0.5
    gspo = GSPOLoss(actor, **kwargs)(batch)
    grpo = GRPOLoss(actor, clip_epsilon=PAPER_EPS, aggregation="prompt_mean", **kwargs)(batch)
    loss_key, value_key = f"loss_kl_to_{which}", f"kl_to_{which}"
    assert getattr(gspo, loss_key) is not None
    assert_close(getattr(gspo, loss_key), getattr(grpo, loss_key), torch.float64)
    assert_close(getattr(gspo, value_key), getattr(grpo, value_key), torch.float64)
    current, old, mask, advantage = oracle_inputs(actor, rows)
    expected = oracle_gspo_loss(current, old, mask, advantage, *PAPER_EPS)
    assert_close(gspo.loss_objective, expected, torch.float64)


def _regularizer_batch(kind, rows, decoupled):
    """rows with reference log-probs; decoupled: the trainer's old log-probs next to the
    engine's, which differ by noise and are NaN where the rows' old ones were."""
    gen = torch.Generator().manual_seed(0)
    batch = lazy_batch(rows) if kind == "lazy" else dense_batch(rows)
    refs = [
        r["old"].nan_to_num(0.0) - 0.02 * torch.rand(r["old"].shape, generator=gen) for r in rows
    ]
    olds = [r["old"].nan_to_num(0.0) for r in rows]
    rollouts = [r["old"] - 1e-3 * torch.randn(r["old"].shape, generator=gen) for r in rows]
    entries = {("next", "ref_log_probs", "full"): refs}
    if decoupled:
        entries.update({("old_log_probs", "full"): olds, ("log_probs", "full"): rollouts})
    for key, values in entries.items():
        if kind == "lazy":
            for td, value in zip(batch.tensordicts, values, strict=True):
                td.set(key, value)
        else:
            batch.set(key, left_pad(values, 0.0))
    return batch


# GRPOLoss' and GSPOLoss' masks agree in these modes; they differ by design with
# "generic" (GSPOLoss never scores a row's first token) and with KL-Mask on a
# decoupled batch (GSPOLoss filters against the old log-probs, GRPOLoss against the
# rollout ones it reads as old).
REGULARIZER_MODES = [
    (kind, aggregation, strategy, threshold, decoupled)
    for kind in ("lazy", "dense")
    for aggregation in ("prompt_mean", "token_mean", "none")
    for strategy in ("sft", "rlhf")
    for threshold, decoupled in ((None, False), (2e-5, False), (None, True))
]


@pytest.mark.parametrize("kind,aggregation,strategy,threshold,decoupled", REGULARIZER_MODES)
def test_entropy_and_kl_terms_equal_grpos(kind, aggregation, strategy, threshold, decoupled):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, seed=21)
    batch = _regularizer_batch(kind, rows, decoupled)
    kwargs = {
        "aggregation": aggregation,
        "masking_strategy": strategy,
        "kl_mask_threshold": threshold,
        "entropy_coeff": 0.1,
        "kl_to_ref_coeff": 0.3,
        "kl_to_inference_coeff": 0.2,
    }
    grpo = GRPOLoss(actor, clip_epsilon=PAPER_EPS, **kwargs)(batch)
    gspo = build_loss(GSPOLoss, actor, **kwargs)(batch)
    if threshold is not None:  # the filter drops some tokens, not all
        _, old, mask, _ = oracle_inputs(actor, rows)
        current = actor.token_log_probs(padded(rows, "tokens", 0)).detach()
        kept = mask & (0.5 * (current - old) ** 2 <= threshold)
        assert 0 < kept.sum() < mask.sum()
    for name in ("loss_entropy", "loss_kl_to_ref", "loss_kl_to_inference"):
        ours, theirs = getattr(gspo, name), getattr(grpo, name)
        if aggregation == "prompt_mean":  # GRPOLoss returns shape (1,), GSPOLoss ()
            theirs = theirs.reshape(())
        assert ours.shape == theirs.shape
        assert_close(ours, theirs, torch.float64)
        ours_grad, theirs_grad = (
            torch.autograd.grad(v.sum(), actor.table, retain_graph=True)[0] for v in (ours, theirs)
        )
        assert_close(ours_grad, theirs_grad, torch.float64)
    for name in ("entropy", "kl_to_ref", "kl_to_inference"):
        assert_close(getattr(gspo, name), getattr(grpo, name), torch.float64)


def test_kl_to_inference_reads_the_rollout_left_padded():
    """The KL to the inference policy aligns the rollout log-probs with the current ones
    (left-padded) whatever ref_log_prob_padding_side says; GRPOLoss reads them with the
    reference's padding side, which misaligns ragged rows."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, seed=22, nan_prompt=False)
    batch = lazy_batch(rows)
    kwargs = {"kl_to_inference_coeff": 0.2, "entropy_bonus": False}
    left = GSPOLoss(actor, **kwargs)(batch)
    right = GSPOLoss(actor, ref_log_prob_padding_side="right", **kwargs)(batch)
    current = actor.token_log_probs(padded(rows, "tokens", 0)).detach()
    old = padded(rows, "old", 0.0)
    mask = padded(rows, "response", False)
    diff = torch.where(mask, old, 0.0) - torch.where(mask, current, 0.0)
    expected = (diff.exp() - 1 - diff).mean()  # GRPOLoss' estimator, over all positions
    for out in (left, right):
        assert_close(out.kl_to_inference, expected, torch.float64)
        assert_close(out.loss_kl_to_inference, 0.2 * expected, torch.float64)
    grpo = GRPOLoss(actor, ref_log_prob_padding_side="right", **kwargs)(batch)
    assert (grpo.kl_to_inference - expected).abs() > 1e-3


def test_kl_mask_threshold_filters_aggregation_only():
    """KL-Mask drops tokens from the aggregation; the sequence ratio keeps all tokens.

    A sequence whose tokens all fail the threshold contributes 0; the others keep
    their (constant per sequence) GSPO term.
    """
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.05, seed=11, nan_prompt=False)
    # row 0: make every response token drift far from the inference log-probs
    rows[0]["old"][3:] -= 2.0
    threshold = 0.5
    out = build_loss(GSPOLoss, actor, kl_mask_threshold=threshold, clip_epsilon=(0.5, 0.5))(
        lazy_batch(rows)
    )
    current, old, mask, advantage = oracle_inputs(actor, rows)
    kept = mask & (0.5 * (current - old) ** 2 <= threshold)
    assert not kept[0].any() and kept[1:].any(-1).sum() == mask[1:].any(-1).sum()
    expected = oracle_gspo_loss(current, old, mask, advantage, 0.5, 0.5, aggregation_mask=kept)
    assert_close(out.loss_objective, expected, torch.float64)


@pytest.mark.parametrize(
    "strategy,mask_name",
    [("sft", "response"), ("rlhf", "assistant"), ("generic", "attention")],
)
def test_masking_strategies(strategy, mask_name):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, seed=12)
    eps = (0.5, 0.5)
    out = build_loss(GSPOLoss, actor, masking_strategy=strategy, clip_epsilon=eps)(lazy_batch(rows))
    current, old, mask, advantage = oracle_inputs(actor, rows, mask_name)
    expected = oracle_gspo_loss(current, old, mask, advantage, *eps)
    assert_close(out.loss_objective, expected, torch.float64)
    assert_close(grads(out.loss_objective, actor), grads(expected, actor), torch.float64)


def test_set_keys_with_nested_keys():
    tokens_key = ("sample", "tok")
    actor = BigramActor(tokens_key=tokens_key, mask_keys={"sft": ("sample", "mask")})
    rows = make_rows(actor=actor, noise=0.01, seed=13)
    batch = lazy_batch(rows)
    renamed = TensorDict(
        {
            tokens_key: batch.get(("tokens", "full"), as_padded_tensor=True, padding_side="left"),
            ("sample", "mask"): batch.get(
                ("masks", "response"), as_padded_tensor=True, padding_side="left"
            ),
            ("sample", "old_lp"): batch.get(
                ("log_probs", "full"), as_padded_tensor=True, padding_side="left"
            ),
            ("sample", "adv"): dense_batch(rows)["advantage"],
        },
        batch_size=[len(rows)],
    )
    loss_fn = build_loss(GSPOLoss, actor, clip_epsilon=(0.5, 0.5))
    loss_fn.set_keys(
        action=tokens_key, sample_log_prob=("sample", "old_lp"), advantage=("sample", "adv")
    )
    out = loss_fn(renamed)
    current, old, mask, advantage = oracle_inputs(actor, rows)
    expected = oracle_gspo_loss(current, old, mask, advantage, 0.5, 0.5)
    assert_close(out.loss_objective, expected, torch.float64)


@pytest.mark.parametrize("aggregation", ["token_mean", "none"])
def test_other_aggregations(aggregation):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, seed=14)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_fn = GSPOLoss(actor, aggregation=aggregation, clip_epsilon=(0.5, 0.5))
    length_warnings = [w for w in caught if "weights each sequence by its length" in str(w.message)]
    assert len(length_warnings) == (aggregation == "token_mean")
    out = loss_fn(lazy_batch(rows))
    current, old, mask, advantage = oracle_inputs(actor, rows)
    seq = oracle_sequence_log_ratio(current, old, mask)
    per_token = -(seq.exp() * advantage).unsqueeze(-1).expand_as(current)
    per_token = torch.where(mask, per_token, 0.0)
    if aggregation == "token_mean":
        assert out.loss_objective.shape == torch.Size([])
        assert_close(out.loss_objective, per_token.sum() / mask.sum(), torch.float64)
    else:
        assert_close(out.loss_objective.squeeze(-1), per_token, torch.float64)


def test_aggregation_none_means_the_default():
    """GRPOLoss accepts aggregation=None for its default; here that is prompt_mean."""
    actor = BigramActor()
    batch = lazy_batch(make_rows(actor=actor, noise=0.01, seed=14))
    out = build_loss(GSPOLoss, actor, aggregation=None)(batch)
    ref = GSPOLoss(actor)(batch)
    assert out.loss_objective.shape == torch.Size([])
    assert torch.equal(out.loss_objective, ref.loss_objective)


@pytest.mark.parametrize("eps", [0.2, (3e-4, 0.28)])
def test_grpo_scale_clip_range_warns(eps):
    with pytest.warns(UserWarning, match="practically never clips"):
        GSPOLoss(BigramActor(), clip_epsilon=eps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GSPOLoss(BigramActor())


def test_batch_with_two_batch_dimensions_raises():
    actor = BigramActor()
    batch = dense_batch(make_rows([(2, 3)] * 4, actor=actor)).reshape(2, 2)
    with pytest.raises(ValueError, match=r"one batch dimension, \[B, T\].*reshape\(-1\)"):
        GSPOLoss(actor)(batch)


def test_unknown_aggregation_raises():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        GSPOLoss(BigramActor(), aggregation="sequence_sum")


def test_every_option_together():
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, seed=15, nan_prompt=False)
    batch = lazy_batch(rows)
    for i, r in enumerate(rows):
        batch[i].set(("next", "ref_log_probs", "full"), r["old"] - 0.01)
    out = GSPOLoss(
        actor,
        entropy_bonus=True,
        kl_to_ref_coeff=0.1,
        kl_to_inference_coeff=0.1,
        kl_mask_threshold=10.0,
        masking_strategy="rlhf",
    )(batch)
    total = sum(v for k, v in out.items() if k.startswith("loss_"))
    assert total.shape == torch.Size([]) and total.isfinite()
    total.backward()
    assert actor.table.grad.isfinite().all() and actor.table.grad.abs().sum() > 0


def test_compile_matches_eager():
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=1e-3, seed=16)
    batch = dense_batch(rows)
    loss_fn = build_loss(GSPOLoss, actor, entropy_bonus=False)
    eager = loss_fn(batch)
    compiled = torch.compile(loss_fn)(batch)
    assert_close(compiled.loss_objective, eager.loss_objective, torch.float64)
    assert_close(compiled.clip_fraction, eager.clip_fraction, torch.float64)
    assert_close(compiled.ESS, eager.ESS, torch.float64)
    assert_close(
        grads(compiled.loss_objective, actor), grads(eager.loss_objective, actor), torch.float64
    )


def _graphs(loss_fn, batch):
    with warnings.catch_warnings():
        # torch's own, when dynamo inspects the actor's parameters
        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf")
        explained = torch._dynamo.explain(loss_fn)(batch)
    return explained.graph_count, explained.graph_break_count


def test_compiled_forward_is_one_graph():
    """No graph break: GSPO's forward compiles to one graph, GRPOLoss' to more."""
    actor = BigramActor()
    batch = dense_batch(make_rows(actor=actor, noise=1e-3, seed=16))
    grpo = GRPOLoss(actor, entropy_bonus=False, aggregation="prompt_mean")
    assert _graphs(grpo, batch)[0] > 1  # its ESS indexes with a boolean mask
    for loss_cls in (GSPOLoss, GSPOTokenLoss):
        assert _graphs(build_loss(loss_cls, actor, entropy_bonus=False), batch) == (1, 0)


def test_every_path_compiles_to_one_graph():
    """Per-token advantages, recomputed old log-probs with a correction, a sequence
    scale and the KL terms: still one graph, no break. The entropy bonus adds the breaks
    of TorchRL's masked categorical entropy, which GRPOLoss has as well."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=1e-3, seed=17, nan_prompt=False)
    batch = dense_batch(rows, advantage_per_token=True)
    old = batch.get(("log_probs", "full"))
    batch.set(("old_log_probs", "full"), old)
    batch.set(("log_probs", "full"), old - 1e-3)
    batch.set(("next", "ref_log_probs", "full"), old - 0.01)
    batch.set("sequence_scale", torch.full((len(rows),), 1 / len(rows), dtype=torch.float64))
    kwargs = {"kl_to_ref_coeff": 0.1, "kl_to_inference_coeff": 0.1}
    grpo = _graphs(GRPOLoss(actor, aggregation="prompt_mean", **kwargs), batch)
    for loss_cls in (GSPOLoss, GSPOTokenLoss):
        loss_fn = build_loss(loss_cls, actor, rollout_correction="truncate", **kwargs)
        assert _graphs(loss_fn, batch)[0] <= grpo[0], loss_cls  # entropy bonus on
        loss_fn.entropy_bonus = False
        assert _graphs(loss_fn, batch) == (1, 0), loss_cls
        per_token = build_loss(
            loss_cls,
            actor,
            rollout_correction="masked_is",
            rollout_correction_form="token",
            entropy_bonus=False,
            **kwargs,
        )
        assert _graphs(per_token, batch) == (1, 0), loss_cls


def test_the_policy_lag_is_read_outside_the_graph():
    """The trainer's version is a Python int that changes every update: it is read in
    eager mode (one graph break), so that a new version neither recompiles nor is
    taken as a constant."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=1e-3, seed=17, nan_prompt=False)
    batch = dense_batch(rows)
    batch.set("policy_version", torch.zeros(len(rows), dtype=torch.long))
    version = {"now": 0}
    loss_fn = build_loss(
        GSPOLoss, actor, entropy_bonus=False, policy_version=lambda: version["now"]
    )
    assert _graphs(loss_fn, batch) == (2, 1)
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn)
    compiled(batch)
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    for now in range(1, 12):  # more versions than dynamo's recompile limit (8)
        version["now"] = now
        assert compiled(batch).policy_lag_max == now
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames  # nothing recompiled


@pytest.mark.parametrize("optional", ["sequence_scale", "old_log_prob"])
def test_a_compiled_loss_sees_an_optional_key_that_appears(optional):
    """A graph traced on a batch without an optional input must not serve a batch that
    holds it with as many keys (another key in its place): TensorDict's
    ``get(key, None)`` and a failing membership test of a nested key are not guarded
    under torch.compile, the list of the keys is. Reusing the graph would silently
    ignore the input. The policy lag's graph break ends the first graph after the
    batch reading, so that graph is guarded by the reads alone."""
    torch._dynamo.reset()
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=1e-3, seed=16, nan_prompt=False)
    loss_fn = build_loss(GSPOLoss, actor, entropy_bonus=False, policy_version=lambda: 0)
    compiled = torch.compile(loss_fn)
    without, with_key = dense_batch(rows), dense_batch(rows)
    for batch in (without, with_key):
        batch.set("policy_version", torch.zeros(len(rows), dtype=torch.long))
    without.set("unrelated", torch.zeros(len(rows)))  # as many keys as `with_key`
    if optional == "sequence_scale":
        with_key.set("sequence_scale", torch.tensor([3.0, 0.0, 1.0, 1.0, 1.0, 1.0]) / 6)
    else:
        with_key.set(("old_log_probs", "full"), with_key.get(("log_probs", "full")) + 0.01)
    assert len(list(without.keys())) == len(list(with_key.keys()))
    compiled(without)
    expected, got = loss_fn(with_key), compiled(with_key)
    assert (expected.loss_objective - loss_fn(without).loss_objective).abs() > 1e-3
    torch.testing.assert_close(got.loss_objective, expected.loss_objective, rtol=0, atol=1e-12)
    torch._dynamo.reset()


@pytest.mark.parametrize("bad", ["advantage", "old_log_prob", "sequence_scale"])
def test_compiled_loss_still_rejects_bad_input(bad):
    """In-graph checks: a NaN advantage, a NaN old log-prob inside a response, a
    negative sequence scale."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=1e-3, seed=16)
    batch = dense_batch(rows)
    if bad == "advantage":
        advantage = batch["advantage"].clone()
        advantage[1] = float("nan")
        batch.set("advantage", advantage)
    elif bad == "sequence_scale":
        batch.set("sequence_scale", torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0, 1.0]) / 6)
    else:
        old = batch["log_probs", "full"].clone()
        old[0, -1] = float("nan")  # row 0's last token is a response token
        batch.set(("log_probs", "full"), old)
    with pytest.raises(RuntimeError, match="invalid input"):
        torch.compile(build_loss(GSPOLoss, actor, entropy_bonus=False))(batch)


# ---------------------------------------------------------------------------------
# Bad and awkward input
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "key,name,error,torchrl_words",
    [
        (("tokens", "full"), "action", ValueError, "Action key"),
        (("log_probs", "full"), "sample_log_prob", KeyError, "Couldn't find the log-prob"),
        ("advantage", "advantage", ValueError, "Advantage key"),
    ],
)
def test_missing_key_raises(key, name, error, torchrl_words):
    """GRPOLoss' exception type and leading words, then the fix (set_keys)."""
    actor = BigramActor()
    batch = dense_batch(make_rows(actor=actor)).exclude(key)
    with pytest.raises(error, match=rf"^[\"']?{torchrl_words}.*set_keys\({name}="):
        GSPOLoss(actor)(batch)
    with pytest.raises(error, match=torchrl_words):
        GRPOLoss(actor)(batch)


def test_old_log_probs_requiring_grad_raise():
    actor = BigramActor()
    batch = dense_batch(make_rows(actor=actor))
    batch.set(("log_probs", "full"), batch["log_probs", "full"].clone().requires_grad_())
    with pytest.raises(RuntimeError, match=r"\('log_probs', 'full'\) require grad.*no_grad"):
        GSPOLoss(actor)(batch)
    with pytest.raises(RuntimeError, match="requires grad"):  # GRPOLoss' type
        GRPOLoss(actor)(batch)


def test_log_prob_shape_mismatch_raises():
    actor = BigramActor()
    batch = dense_batch(make_rows(actor=actor))
    width = batch["tokens", "full"].shape[-1]
    batch.set(("log_probs", "full"), batch["log_probs", "full"][:, 1:])
    with pytest.raises(
        ValueError, match=rf"shape \(6, {width - 1}\) but the tokens.*\(6, {width}\)"
    ):
        GSPOLoss(actor)(batch)


def test_nan_old_log_probs_are_excluded():
    """vLLM writes NaN on prompt positions; with the all-token mask they must drop out."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, seed=17, nan_prompt=True)
    out = build_loss(GSPOLoss, actor, masking_strategy="generic", clip_epsilon=(0.5, 0.5))(
        lazy_batch(rows)
    )
    assert out.loss_objective.isfinite() and out.ESS.isfinite()
    current, old, mask, advantage = oracle_inputs(actor, rows, "attention")
    assert (~old.isfinite() & padded(rows, "attention", False)).any()
    expected = oracle_gspo_loss(current, old, mask, advantage, 0.5, 0.5)
    assert_close(out.loss_objective, expected, torch.float64)
    assert grads(out.loss_objective, actor).isfinite().all()


def test_all_padding_row_contributes_zero():
    actor = BigramActor()
    rows = make_rows([(3, 4), (4, 0), (2, 2)], actor=actor, noise=0.01, seed=18)
    out = build_loss(GSPOLoss, actor, clip_epsilon=(0.5, 0.5))(lazy_batch(rows))
    current, old, mask, advantage = oracle_inputs(actor, rows)
    assert not mask[1].any()
    per_seq = -(oracle_sequence_log_ratio(current, old, mask).exp() * advantage)
    assert_close(out.loss_objective, (per_seq[0] + per_seq[2]) / 3, torch.float64)
    assert grads(out.loss_objective, actor).isfinite().all()


def test_all_empty_batch_is_finite():
    actor = BigramActor()
    rows = make_rows([(3, 0), (2, 0)], actor=actor)
    out = GSPOLoss(actor)(lazy_batch(rows))
    assert out.loss_objective == 0.0
    assert out.clip_fraction == 0.0 and out.ESS == 0.0


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_extreme_log_ratios_are_finite(sign, advantage):
    actor = BigramActor()
    rows = make_rows(
        [(2, 3), (2, 4)],
        actor=actor,
        advantages=torch.tensor([advantage, -advantage], dtype=torch.float64),
        nan_prompt=False,
    )
    for row in rows:
        row["old"][2:] -= sign * 1e3
    out = GSPOLoss(actor)(lazy_batch(rows))
    assert out.loss_objective.isfinite()
    assert grads(out.loss_objective, actor).isfinite().all()
    assert out.clip_fraction == 1.0 and out.ESS.isfinite()


@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("per_token", [False, True])
def test_input_is_not_mutated(kind, per_token):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, seed=19)
    batch = make_batch(kind, rows, advantage_per_token=per_token)
    before = batch.clone()
    build_loss(GSPOLoss, actor, kl_to_inference_coeff=0.1)(batch)
    assert set(batch.keys(True, True)) == set(before.keys(True, True))
    if kind == "lazy":  # a key set on one row only would not show in the stack's keys
        for row, row_before in zip(batch.tensordicts, before.tensordicts, strict=True):
            assert set(row.keys(True, True)) == set(row_before.keys(True, True))
    for key in before.keys(True, True):
        a = before.get(key, as_padded_tensor=True)
        b = batch.get(key, as_padded_tensor=True)
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), key


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_missing_ref_log_prob_raises_grpos_error(kind):
    """GRPOLoss' exception type and leading words, from both losses."""
    actor = BigramActor()
    batch = make_batch(kind, make_rows(actor=actor, noise=0.01, seed=1))
    with pytest.raises(KeyError, match="Couldn't find the ref log-prob"):
        GRPOLoss(actor, kl_to_ref_coeff=0.1)(batch)
    with pytest.raises(KeyError, match="Couldn't find the ref log-prob"):
        build_loss(GSPOLoss, actor, kl_to_ref_coeff=0.1)(batch)


def test_bfloat16_matches_float32_on_the_same_values():
    """bf16 log-probs are reduced in float32: same result as float32 on the same values.

    Current and old log-probs are bf16-representable and within a factor 2 of each
    other, so each token difference is exact (Sterbenz lemma); what remains is the
    accumulation over 300 tokens per sequence, which must match float32.
    """
    gen = torch.Generator().manual_seed(0)
    batch, width = 4, 300
    current = (-torch.rand(batch, width, generator=gen) - 0.5).to(torch.bfloat16)
    # per-row drift: clipped high, inside the range, clipped low, (empty row)
    drift = torch.tensor([1e-3, -1e-4, -2e-3, 0.0]).unsqueeze(-1)
    factor = 1 + drift + 1e-3 * torch.randn(batch, width, generator=gen)
    old = (current.float() * factor).to(torch.bfloat16)
    mask = torch.ones(batch, width, dtype=torch.bool)
    mask[1, :100] = False
    mask[3, :] = False
    advantage = torch.tensor([1.0, -1.0, 0.5, 2.0]).reshape(batch, 1, 1)

    def run(dtype):
        actor = LogProbActor(current.to(dtype), mask)
        data = TensorDict(
            {
                ("tokens", "full"): torch.ones(batch, width, dtype=torch.long),
                ("log_probs", "full"): old.to(dtype),
                "advantage": advantage,
            },
            batch_size=[batch],
        )
        return build_loss(GSPOLoss, actor, entropy_bonus=False), data

    loss16, data16 = run(torch.bfloat16)
    with pytest.warns(UserWarning, match="bfloat16 log-probabilities"):
        out16 = loss16(data16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss16(data16)  # the warning is issued once per loss
    loss32, data32 = run(torch.float32)
    out32 = loss32(data32)
    assert out16.loss_objective.dtype == torch.float32
    assert 0 < out32.clip_fraction < 1
    assert out16.clip_fraction == out32.clip_fraction
    torch.testing.assert_close(
        out16.sequence_log_ratio, out32.sequence_log_ratio, rtol=0, atol=1e-7
    )
    torch.testing.assert_close(out16.loss_objective, out32.loss_objective, rtol=1e-6, atol=1e-7)
    expected = oracle_gspo_loss(
        current.double(), old.double(), mask, advantage.reshape(-1).double(), *PAPER_EPS
    )
    torch.testing.assert_close(out16.loss_objective.double(), expected, rtol=1e-6, atol=1e-7)


def test_out_keys_round_trip():
    """GRPOLoss' out_keys, then each GSPO output field once; an assignment is kept as
    it is (before, the getter appended the fields again after every assignment)."""
    from dataclasses import fields

    from torchrl.objectives.llm.grpo import LLMLossOutput

    base = list(GRPOLoss(entropy_bonus=False).out_keys)
    grpo_fields = {f.name for f in fields(LLMLossOutput)}
    ours = [f.name for f in fields(GSPOLossOutput) if f.name not in base + list(grpo_fields)]
    loss_fn = GSPOLoss(entropy_bonus=False)
    assert loss_fn.out_keys == base + ours and len(set(loss_fn.out_keys)) == len(base + ours)
    chosen = ["loss_objective", "clip_fraction"]
    loss_fn.out_keys = chosen
    assert loss_fn.out_keys == chosen
    loss_fn.out_keys = loss_fn.out_keys
    assert loss_fn.out_keys == chosen
