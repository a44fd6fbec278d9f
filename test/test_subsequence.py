# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""SubsequenceLoss against its formula written out with Python loops over rows and
segments, in float64, on ragged rows with holes in the mask and an empty row; its two
limits (one segment: GSPOLoss; one token per segment: GRPO's token surrogate); its
diagnostics over micro-batches; and its errors."""

from __future__ import annotations

import warnings

import pytest
import torch
from gspo_testing import BigramActor, build_loss, dense_batch, lazy_batch, make_rows, padded
from test_gspo import _graphs
from test_rollout import decoupled_batch, decoupled_rows
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from torchrl_gspo import GSPOLoss, SequenceStatistics, SubsequenceLoss
from torchrl_gspo.segments import delimiter_token_ids, equal_bounds

TOL = 1e-12
DELIMITERS = (9, 10)
# row 3 (prompt 1, response 7, the hole at response index 3): two delimiters in a row,
# a delimiter on the hole (it ends nothing) and a delimiter as the last token
ROW3 = [2, 5, 9, 9, 9, 6, 10, 9]
# row 5 (prompt 5, response 4): delimiters in the prompt only end nothing
ROW5 = [9, 9, 1, 2, 3, 4, 5, 6, 7]


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=TOL)


def f64(value):
    return torch.tensor(value, dtype=torch.float64)


def grad(loss, actor):
    return torch.autograd.grad(loss, actor.table, retain_graph=True)[0]


def rows_for(actor, noise, seed=0):
    """make_rows' ragged rows with rows 3 and 5 rewritten, their old log-probs redrawn."""
    rows = make_rows(actor=actor, noise=noise, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for i, tokens in ((3, ROW3), (5, ROW5)):
        row = rows[i]
        assert len(tokens) == len(row["tokens"])
        row["tokens"] = torch.tensor(tokens)
        with torch.no_grad():
            current = actor.token_log_probs(row["tokens"].unsqueeze(0)).squeeze(0).double()
        old = current - noise * torch.randn(len(tokens), generator=gen, dtype=torch.float64)
        row["old"] = torch.where(row["old"].isnan(), row["old"], old)
    # segment ids, not decreasing on the valid tokens; the prompt's (masked) ids are
    # larger than the response's, and row 3's id 3 sits on its hole only (an empty segment)
    for row in rows:
        n = len(row["tokens"])
        p = int(row["response"].long().argmax()) if row["response"].any() else n
        row["ids"] = torch.tensor([100] * p + [(t - p) // 2 for t in range(p, n)])
    rows[3]["ids"] = torch.tensor([100, 0, 1, 1, 3, 4, 4, 5])
    return rows


def segment_ids(rows):
    """Each row's per-token segment ids (``rows_for`` writes them)."""
    return [row["ids"] for row in rows]


def with_ids(batch, rows, kind):
    ids = segment_ids(rows)
    if kind == "lazy":
        for td, value in zip(batch.unbind(0), ids, strict=True):
            td.set("segment_id", value)
        return batch
    width = batch["tokens", "full"].shape[-1]
    batch["segment_id"] = torch.stack(
        [torch.cat([torch.zeros(width - len(v), dtype=v.dtype), v]) for v in ids]
    )
    return batch


def batch_of(kind, rows, ids=False):
    batch = lazy_batch(rows) if kind == "lazy" else dense_batch(rows)
    return with_ids(batch, rows, kind) if ids else batch


def inputs(actor, rows):
    current = actor.token_log_probs(padded(rows, "tokens", 0))
    old = padded(rows, "old", 0.0)
    mask = padded(rows, "response", False) & old.isfinite()
    old = torch.where(mask, old, 0.0)
    advantage = torch.stack([r["advantage"].reshape(()) for r in rows])
    return torch.where(mask, current, 0.0), old, mask, advantage


# ---------------------------------------------------------------------------------
# The oracle: segments found and terms summed with Python loops
# ---------------------------------------------------------------------------------
def groups_of(segments, tokens, ids, valid):
    """The lists of valid positions of one row's segments."""
    n = len(valid)
    if isinstance(segments, int):
        sizes = [n // segments + (k < n % segments) for k in range(segments)]
        starts = [sum(sizes[:k]) for k in range(segments)]
        return [valid[s : s + size] for s, size in zip(starts, sizes, strict=True) if size]
    groups, current = [], []
    for position, t in enumerate(valid):
        if segments == "key" and current and ids[t] != ids[valid[position - 1]]:
            groups.append(current)
            current = []
        current.append(t)
        if segments == "delimiters" and int(tokens[t]) in DELIMITERS:
            groups.append(current)
            current = []
    return groups + ([current] if current else [])


def oracle(actor, rows, segments, combination, normalize, eps, exponent):
    """The loss (prompt_mean), and per segment (clipped below, clipped above, length)."""
    terms, segment_stats = oracle_rows(actor, rows, segments, combination, normalize, eps, exponent)
    return terms.mean(), segment_stats


def oracle_rows(actor, rows, segments, combination, normalize, eps, exponent):
    """Each row's term (0 for an empty row), and its segments' statistics."""
    current, old, mask, advantage = inputs(actor, rows)
    tokens = padded(rows, "tokens", 0)
    ids = padded([{"x": v} for v in segment_ids(rows)], "x", 0) if segments == "key" else None
    terms, segment_stats = [], []
    for i in range(len(rows)):
        valid = mask[i].nonzero().flatten().tolist()
        n, a = len(valid), advantage[i]
        if n == 0:
            terms.append(current.new_zeros(()))
            continue
        row_term, ratio, bound, stats = 0.0, 1.0, 1.0, []
        for group in groups_of(segments, tokens[i], None if ids is None else ids[i], valid):
            length = len(group)
            log_r = sum(current[i, t] - old[i, t] for t in group)
            log_r = log_r / length if normalize else log_r
            scale = (n / length) ** exponent
            low, high = 1 - min(eps[0] * scale, 1.0), 1 + eps[1] * scale
            r = log_r.exp()
            clipped = r.clamp(low, high)
            row_term = row_term - length / n * torch.minimum(r * a, clipped * a)
            ratio, bound = ratio * r, bound * clipped
            stats.append((bool(r < low), bool(r > high), length))
        if combination == "product":
            row_term = -torch.minimum(a * ratio, a * bound)
        terms.append(row_term)
        segment_stats.append(stats)
    return torch.stack(terms), segment_stats


def assert_segment_diagnostics(out, stats, actor, rows):
    flat = [s for row in stats for s in row]
    tokens = sum(length for _, _, length in flat)
    close(out.clip_fraction_low, f64(sum(n for lo, _, n in flat if lo) / tokens))
    close(out.clip_fraction_high, f64(sum(n for _, h, n in flat if h) / tokens))
    clipped = sum(lo or h for lo, h, _ in flat)
    close(out.segment_clip_fraction, f64(clipped / len(flat)))
    whole = sum(all(lo or h for lo, h, _ in row) for row in stats)
    close(out.whole_clip_fraction, f64(whole / len(stats)))
    close(out.segments_per_sequence, f64(len(flat) / len(stats)))
    current, old, mask, _ = inputs(actor, rows)
    log_r = (current - old).detach()
    k3 = [((log_r[i][mask[i]].exp() - 1) - log_r[i][mask[i]]).mean() for i in range(len(rows))]
    close(out.kl_to_old, torch.stack([k for k, m in zip(k3, mask, strict=True) if m.any()]).mean())


MODES = [
    (segments, combination, normalize)
    for segments in (2, 3, "delimiters", "key")
    for combination in ("segment", "product")
    for normalize in (True, False)
]


@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("segments,combination,normalize", MODES)
def test_segments_match_the_formula(kind, segments, combination, normalize):
    actor = BigramActor()
    rows = rows_for(actor, noise=1e-3)
    extra = {"delimiter_ids": DELIMITERS} if segments == "delimiters" else {}
    loss_fn = SubsequenceLoss(
        actor,
        segments=segments,
        combination=combination,
        normalize=normalize,
        entropy_bonus=False,
        **extra,
    )
    out = loss_fn(batch_of(kind, rows, ids=segments == "key"))
    eps = (3e-4, 4e-4)
    expected, stats = oracle(actor, rows, segments, combination, normalize, eps, 0.5)
    close(out.loss_objective, expected)
    close(grad(out.loss_objective, actor), grad(expected, actor))
    assert_segment_diagnostics(out, stats, actor, rows)
    flat = [lo or h for row in stats for lo, h, _ in row]
    assert any(flat) and not all(flat)  # the ranges bind on some segments only
    if segments == "delimiters":  # row 3: [5, 9] [9] [6, 10] [9], the hole ignored
        assert [n for _, _, n in stats[2]] == [2, 1, 2, 1]
    if segments == "key":  # row 3: ids 0 | 1 1 | (3 on the hole) | 4 4 | 5
        assert [n for _, _, n in stats[2]] == [1, 2, 2, 1]


# ---------------------------------------------------------------------------------
# The two limits
# ---------------------------------------------------------------------------------
GSPO_FIELDS = ("clip_fraction", "clip_fraction_low", "clip_fraction_high",
               "sequence_clip_fraction", "ESS", "sequence_log_ratio")  # fmt: skip


def one_segment_losses(actor, aggregation, combination):
    """Each way of asking for one segment per response: K = 1, no delimiter in any
    response, one segment id per row."""
    common = {"combination": combination, "aggregation": aggregation, "entropy_bonus": False}
    return [
        ("K", build_loss(SubsequenceLoss, actor, segments=1, **common)),
        ("delimiters", build_loss(SubsequenceLoss, actor, segments="delimiters",
                                  delimiter_ids=[VOCAB_UNUSED], **common)),
        ("key", build_loss(SubsequenceLoss, actor, segments="key", **common)),
    ]  # fmt: skip


VOCAB_UNUSED = 0  # the padding id: never a response token of make_rows


@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("aggregation", ["prompt_mean", "token_mean", "none"])
@pytest.mark.parametrize("combination", ["segment", "product"])
def test_one_segment_is_gspo(kind, aggregation, combination):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=1e-3, seed=3)
    batch = batch_of(kind, rows)
    ids = [torch.zeros(len(r["tokens"]), dtype=torch.long) for r in rows]
    if kind == "lazy":
        for td, value in zip(batch.unbind(0), ids, strict=True):
            td.set("segment_id", value)
    else:
        batch["segment_id"] = torch.zeros(batch["tokens", "full"].shape, dtype=torch.long)
    gspo = build_loss(GSPOLoss, actor, aggregation=aggregation, entropy_bonus=False)(batch)
    assert 0 < gspo.sequence_clip_fraction < 1
    for name, loss_fn in one_segment_losses(actor, aggregation, combination):
        out = loss_fn(batch)
        close(out.loss_objective, gspo.loss_objective)
        close(grad(out.loss_objective.sum(), actor), grad(gspo.loss_objective.sum(), actor))
        for field in GSPO_FIELDS:
            close(getattr(out, field), getattr(gspo, field))
        close(out.whole_clip_fraction, gspo.sequence_clip_fraction)
        assert float(out.segments_per_sequence) == 1.0, name


def test_one_token_per_segment_is_grpos_token_surrogate():
    """K at least the longest response, a constant range: each token its own ratio."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.3, seed=5)
    current, old, mask, advantage = inputs(actor, rows)
    log_r = current - old
    r = log_r.exp()
    a = advantage.unsqueeze(-1)
    token = -torch.minimum(r * a, r.clamp(0.8, 1.27) * a)
    per_row = torch.where(mask, token, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    expected = per_row.mean()  # the empty row counts 0
    clipped = mask & ((r < 0.8) | (r > 1.27))
    assert clipped.any() and (mask & ~clipped).any()
    for kind in ("lazy", "dense"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a constant range warns about nothing
            loss_fn = SubsequenceLoss(
                actor, segments=16, clip_epsilon=(0.2, 0.27), band_exponent=0.0,
                entropy_bonus=False,
            )  # fmt: skip
        out = loss_fn(batch_of(kind, rows))
        close(out.loss_objective, expected)
        close(grad(out.loss_objective, actor), grad(expected, actor))
        close(out.clip_fraction, clipped.sum().double() / mask.sum())


# ---------------------------------------------------------------------------------
# Diagnostics over micro-batches; the rest of the loss
# ---------------------------------------------------------------------------------
def test_statistics_of_two_micro_batches_are_those_of_the_batch():
    actor = BigramActor()
    rows = rows_for(actor, noise=1e-3, seed=7)
    loss_fn = SubsequenceLoss(actor, segments="key", entropy_bonus=False)
    whole = loss_fn(batch_of("lazy", rows, ids=True))
    parts = [loss_fn(batch_of("lazy", part, ids=True)) for part in (rows[:3], rows[3:])]
    stats = SequenceStatistics.from_output(parts[0]).combine(
        SequenceStatistics.from_output(parts[1])
    )
    expected = whole.statistics.fields()
    for name, value in stats.fields().items():
        close(value, expected[name])
    assert "kl_to_old" in expected and "stat_segments" in expected


def test_rollout_correction_and_off_policy_masking_weigh_each_response():
    """Recomputed old log-probs: the ratio is against them, each response's term is
    weighted by min(rho_i, C), rho_i = exp(mean_t log pi_old / pi_roll), and a term with
    a negative advantage is dropped when mean_t (log pi_roll - log pi_theta) > delta."""
    actor = BigramActor()
    rows = decoupled_rows(actor, seed=2, mismatch=1e-3)
    cap, delta = 1.0002, 0.0
    for kind in ("lazy", "dense"):
        out = SubsequenceLoss(
            actor,
            segments=2,
            rollout_correction="truncate",
            rollout_correction_threshold=cap,
            off_policy_mask_threshold=delta,
            entropy_bonus=False,
        )(decoupled_batch(kind, rows))
        terms, _ = oracle_rows(actor, rows, 2, "segment", True, (3e-4, 4e-4), 0.5)
        current, old, mask, advantage = inputs(actor, rows)
        rollout = torch.where(mask, padded(rows, "rollout", 0.0), 0.0)
        n = mask.sum(-1).clamp(min=1)
        weight = (((old - rollout).sum(-1) / n).exp()).clamp(max=cap)
        drift = (rollout - current.detach()).sum(-1) / n
        keep = (advantage >= 0) | (drift <= delta)
        assert (weight < cap).any() and (weight == cap).any() and not keep.all()
        expected = (weight * keep * terms).mean()
        close(out.loss_objective, expected)
        close(grad(out.loss_objective, actor), grad(expected, actor))


def test_per_token_advantages_that_vary_are_refused_as_by_gspo():
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=1e-3)
    batch = dense_batch(rows, advantage_per_token=True)
    batch["advantage"][0, -1] += 1.0
    with pytest.raises(ValueError, match=r"varies across the valid tokens of batch row\(s\) \[0\]"):
        SubsequenceLoss(actor, entropy_bonus=False)(batch)


def test_equal_bounds_sizes():
    """n valid tokens in K parts: the first n mod K one longer; fewer than K: one each."""
    bounds = equal_bounds(torch.tensor([9, 7, 2, 0]), 4)
    sizes = (bounds[:, 1:] - bounds[:, :-1]).tolist()
    assert sizes == [[3, 2, 2, 2], [2, 2, 2, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert bounds[:, 0].eq(0).all() and bounds[:, -1].tolist() == [9, 7, 2, 0]


# ---------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------
def test_decreasing_segment_ids_name_the_row():
    actor = BigramActor()
    rows = rows_for(actor, noise=1e-3)
    batch = batch_of("lazy", rows, ids=True)
    ids = batch[4]["segment_id"].clone()
    ids[-1] = -1  # the last valid token of row 4
    batch[4].set("segment_id", ids)
    loss_fn = SubsequenceLoss(actor, segments="key", entropy_bonus=False)
    with pytest.raises(
        ValueError, match=r"decrease along the valid tokens of batch row\(s\) \[4\]"
    ):
        loss_fn(batch)


def test_segment_ids_of_the_wrong_shape_or_dtype_are_refused():
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=1e-3)
    loss_fn = SubsequenceLoss(actor, segments="key", entropy_bonus=False)
    batch = dense_batch(rows)
    batch["segment_id"] = torch.zeros(batch["tokens", "full"].shape[0], 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"'segment_id' has shape \[\(6, 3\)\]"):
        loss_fn(batch)
    batch["segment_id"] = torch.zeros(batch["tokens", "full"].shape)
    with pytest.raises(TypeError, match="dtype torch.float32; it must hold integers"):
        loss_fn(batch)
    lazy = lazy_batch(rows)
    for i, td in enumerate(lazy.unbind(0)):
        td.set("segment_id", torch.zeros(len(rows[i]["tokens"]) + (i == 1), dtype=torch.long))
    with pytest.raises(ValueError, match=r"batch row\(s\) \[1\]: shapes \[\(4,\)\]"):
        loss_fn(lazy)
    with pytest.raises(KeyError, match="'segment_id', which is missing"):
        loss_fn(lazy_batch(rows))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"segments": 0}, "K >= 1"),
        ({"segments": True}, "K >= 1"),
        ({"segments": "words"}, "segments must be one of"),
        ({"segments": 2, "delimiter_ids": [3]}, "only applies with segments='delimiters'"),
        ({"segments": "delimiters", "delimiter_ids": [-1]}, r"got \[-1\]"),
        ({"segments": "delimiters"}, "needs delimiter_ids, or an actor with a tokenizer"),
        ({"band_exponent": -0.5}, "band_exponent must be >= 0"),
        ({"combination": "sum"}, "combination must be one of"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SubsequenceLoss(**kwargs)


def test_delimiter_ids_outside_the_vocabulary_are_refused():
    class Actor(BigramActor):
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b.": 1}, unk_token="a"))
        )

    actor = Actor()
    assert SubsequenceLoss(actor, segments="delimiters").delimiter_ids.tolist() == [1]
    with pytest.raises(ValueError, match=r"inside the vocabulary of the tokenizer's 2.*\[2\]"):
        SubsequenceLoss(actor, segments="delimiters", delimiter_ids=[1, 2])


def test_inputs_are_not_modified():
    actor = BigramActor()
    rows = rows_for(actor, noise=1e-3)
    batch = batch_of("lazy", rows, ids=True)
    before = batch.clone()
    SubsequenceLoss(actor, segments="key", entropy_bonus=False)(batch)
    for row, expected in zip(batch.unbind(0), before.unbind(0), strict=True):
        assert set(row.keys(True, True)) == set(expected.keys(True, True))
        for key in expected.keys(True, True):
            torch.testing.assert_close(row[key], expected[key], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("segments", [2, "delimiters", "key"])
@pytest.mark.parametrize("combination", ["segment", "product"])
def test_compiled_forward_is_one_graph_and_matches_eager(segments, combination):
    actor = BigramActor()
    rows = rows_for(actor, noise=1e-3)
    batch = batch_of("dense", rows, ids=segments == "key")
    extra = {"delimiter_ids": DELIMITERS} if segments == "delimiters" else {}
    loss_fn = SubsequenceLoss(
        actor, segments=segments, combination=combination, entropy_bonus=False, **extra
    )
    assert _graphs(loss_fn, batch) == (1, 0)
    eager, compiled = loss_fn(batch), torch.compile(loss_fn)(batch)
    close(compiled.loss_objective, eager.loss_objective)
    close(compiled.clip_fraction, eager.clip_fraction)
    close(grad(compiled.loss_objective, actor), grad(eager.loss_objective, actor))


def test_delimiter_token_ids_needs_characters():
    with pytest.raises(ValueError, match="non-empty strings"):
        delimiter_token_ids(None, characters=[""])
