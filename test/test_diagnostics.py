# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""SequenceStatistics: exact combination over micro-batches, output fields, aliases."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from gspo_testing import BigramActor, dense_batch, lazy_batch, make_rows
from tensordict import lazy_stack

from torchrl_gspo import (
    GSPOLoss,
    GSPOLossOutput,
    GSPOTokenLoss,
    SequenceStatistics,
    all_reduce_diagnostics,
)
from torchrl_gspo.diagnostics import PREFIX

EPS = (0.02, 0.02)
SHAPES = [(3, 5), (2, 1), (4, 0), (1, 7), (2, 3), (5, 4), (2, 0), (3, 2), (1, 6), (4, 3)]


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def loss(actor, loss_cls=GSPOLoss, **kwargs):
    with pytest.warns(UserWarning, match="practically never clips"):
        return loss_cls(actor, clip_epsilon=(0.02, 0.02), **kwargs)


def with_rollout(rows, seed=0):
    """The rows with recomputed old log-probs, the engine's differing by 1e-3."""
    gen = torch.Generator().manual_seed(seed)
    tds = []
    for row, td in zip(rows, lazy_batch(rows).unbind(0), strict=True):
        td = td.clone()
        old = row["old"].nan_to_num(0.0)
        td.set(("old_log_probs", "full"), old)
        td.set(("log_probs", "full"), old - 1e-3 * torch.randn(old.shape, generator=gen))
        tds.append(td)
    return lazy_stack(tds, 0)


@pytest.mark.parametrize("loss_cls", [GSPOLoss, GSPOTokenLoss])
@pytest.mark.parametrize("layout", ["lazy", "dense", "decoupled"])
@pytest.mark.parametrize("cuts", [[0, 5, 10], [0, 1, 4, 9, 10], [0, 3, 7, 10]])
def test_split_and_combine_is_the_union_for_every_field(loss_cls, layout, cuts):
    actor = BigramActor()
    rows = make_rows(SHAPES, actor=actor, noise=0.03, seed=1)
    loss_fn = loss(actor, loss_cls, rollout_correction="mask" if layout == "decoupled" else None)

    if layout == "decoupled":
        batch = with_rollout(rows)
    else:
        batch = lazy_batch(rows) if layout == "lazy" else dense_batch(rows)
    union = loss_fn(batch)
    parts = [loss_fn(batch[a:b]).statistics for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    combined = functools.reduce(SequenceStatistics.combine, parts).fields()
    expected = union.statistics.fields()
    assert set(combined) == set(expected)
    assert (layout == "decoupled") == ("rollout_kl" in expected)
    for name, value in expected.items():
        close(combined[name], value)
        assert torch.equal(value, getattr(union, name)), name


def test_maximum_over_micro_batches_would_be_wrong():
    """Log-sum-exp entries combine with logaddexp; an elementwise max breaks the ESS."""
    log_ratio = torch.linspace(-1e-3, 1e-3, 10, dtype=torch.float64)
    lengths = torch.full((10,), 4)
    bounds = (torch.tensor(math.log1p(-3e-4)), torch.tensor(math.log1p(4e-4)))
    whole = SequenceStatistics.of(log_ratio, lengths, bounds)
    a, b = (SequenceStatistics.of(x, lengths[:5], bounds) for x in log_ratio.split(5))
    s = log_ratio.exp()
    oracle = s.sum() ** 2 / (10 * (s**2).sum())
    close(whole.diagnostics()["ESS"], oracle)
    close(a.combine(b).diagnostics()["ESS"], oracle)
    maxed = a.combine(b)._replace(  # sums added, log-sum-exps maximized
        log_ratio_lse=torch.maximum(a.log_ratio_lse, b.log_ratio_lse),
        log_ratio_sq_lse=torch.maximum(a.log_ratio_sq_lse, b.log_ratio_sq_lse),
    )
    assert abs(float(maxed.diagnostics()["ESS"]) - float(oracle)) > 0.4  # about 0.5


def test_combine_rejects_mixed_modes_and_all_reduce_without_group_is_identity():
    actor = BigramActor()
    rows = make_rows(SHAPES, actor=actor, noise=0.03, seed=2)
    plain = loss(actor)(lazy_batch(rows)).statistics
    decoupled = loss(actor)(with_rollout(rows)).statistics
    with pytest.raises(ValueError, match="one batch has rollout statistics"):
        plain.combine(decoupled)
    assert plain.all_reduce() is plain
    with pytest.raises(ValueError, match="needs a GSPOLoss output"):
        SequenceStatistics.from_output(loss(actor)(lazy_batch(rows)).exclude("stat_sequences"))


def test_output_declares_every_statistic_and_diagnostic():
    declared = {f.name for f in dataclasses.fields(GSPOLossOutput)}
    assert {PREFIX + name for name in SequenceStatistics._fields} <= declared
    actor = BigramActor()
    out = loss(actor)(with_rollout(make_rows(SHAPES, actor=actor, noise=0.03, seed=3)))
    assert set(out.statistics.fields()) <= declared
    assert all(getattr(out, name) is not None for name in out.statistics.fields())
    assert not any(name.startswith("loss_") for name in out.statistics.fields())


@pytest.mark.parametrize("decoupled", [False, True])
def test_deprecated_aliases_keep_the_old_layout(decoupled):
    """diagnostics_sum / diagnostics_max of 0.2: the old positional layout, with a warning."""
    actor = BigramActor()
    rows = make_rows(SHAPES, actor=actor, noise=0.03, seed=4)
    out = loss(actor)(with_rollout(rows) if decoupled else lazy_batch(rows))
    s = out.statistics
    sums = [
        s.tokens,
        s.log_ratio_sum,
        s.low_tokens,
        s.low_log_ratio_sum,
        s.high_tokens,
        s.high_log_ratio_sum,
        s.sequences,
        s.low_sequences,
        s.high_sequences,
    ]
    maxima = [s.log_ratio_max_abs, s.log_ratio_lse, s.log_ratio_sq_lse]
    if decoupled:
        sums += [
            s.rollout_abs_sum,
            s.rollout_outside,
            s.rollout_corrected,
            s.rollout_weight_sum,
            s.rollout_k3_sum,
        ]
        maxima += [s.rollout_max_abs]
    with pytest.warns(DeprecationWarning, match="diagnostics_sum is deprecated"):
        assert torch.equal(out.diagnostics_sum, torch.stack(sums))
    with pytest.warns(DeprecationWarning, match="diagnostics_max is deprecated"):
        assert torch.equal(out.diagnostics_max, torch.stack(maxima))


def test_statistics_match_their_definitions():
    """Each statistic written out from the sequence log-ratios and lengths."""
    log_ratio = torch.tensor([0.0, 0.2, -0.3, 0.05, -math.inf, 0.0], dtype=torch.float64)
    lengths = torch.tensor([3, 1, 2, 2, 5, 0])
    low, high = -0.1, 0.1
    s = SequenceStatistics.of(log_ratio, lengths, (torch.tensor(low), torch.tensor(high)))
    nonempty = lengths > 0
    below, above = (log_ratio < low) & nonempty, (log_ratio > high) & nonempty
    n = lengths.double()
    expected = {
        "tokens": n.sum(),
        "log_ratio_sum": log_ratio[nonempty].sum(),
        "low_tokens": n[below].sum(),
        "low_log_ratio_sum": log_ratio[below].sum(),
        "high_tokens": n[above].sum(),
        "high_log_ratio_sum": log_ratio[above].sum(),
        "sequences": nonempty.double().sum(),
        "low_sequences": below.double().sum(),
        "high_sequences": above.double().sum(),
        "log_ratio_max_abs": log_ratio.abs().max(),
        "log_ratio_lse": log_ratio[nonempty].exp().sum().log(),
        "log_ratio_sq_lse": (2 * log_ratio[nonempty]).exp().sum().log(),
    }
    for name, value in expected.items():
        close(getattr(s, name), value)
    assert s.rollout_k3_sum is None


def test_the_0_2_micro_batch_recipe_still_runs_with_a_warning():
    """0.2's docs: sum diagnostics_sum, maximize diagnostics_max over micro-batches, set
    them on an output, all_reduce_diagnostics. The aliases write through to the stat_*
    fields; the counts-based diagnostics are then the union's (the ESS is not: that is
    why the recipe is deprecated)."""
    actor = BigramActor()
    rows = make_rows(SHAPES, actor=actor, noise=0.03, seed=5)
    loss_fn = loss(actor)
    union = loss_fn(lazy_batch(rows))
    parts = [loss_fn(lazy_batch(rows[a:b])) for a, b in ((0, 4), (4, 10))]
    with pytest.warns(DeprecationWarning, match="deprecated"):
        sums = sum(out.diagnostics_sum for out in parts)
        maxima = torch.maximum(*(out.diagnostics_max for out in parts))
    merged = parts[0].copy()
    with pytest.warns(DeprecationWarning, match="deprecated"):
        merged.diagnostics_sum, merged.diagnostics_max = sums, maxima
    merged = all_reduce_diagnostics(merged)
    for name in ("clip_fraction", "sequence_clip_fraction", "sequence_log_ratio"):
        close(getattr(merged, name), getattr(union, name))
    assert merged.stat_tokens == union.stat_tokens


def test_deprecated_aliases_refuse_a_layout_of_another_length():
    actor = BigramActor()
    out = loss(actor)(lazy_batch(make_rows(SHAPES, actor=actor, noise=0.03, seed=6)))
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="holds 9 or 14 values"):
        out.diagnostics_sum = torch.zeros(10)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="holds 3 or 4 values"):
        out.diagnostics_max = torch.zeros(3, 1)
