# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The series' ``torchrl.objectives.llm.GSPOLoss`` against ``torchrl_gspo.GSPOLoss``.

Both run on the same batches in one process, on the patched torchrl. The two differ
by design in one place: the series keeps GRPOLoss' float32 clip buffers, where
``torchrl_gspo`` stores them in float64. The tolerances below follow from that.

- The clip decision: a log-ratio closer to a bound than the float32 rounding of the
  bound may be decided differently. The batches are checked to hold none, so the
  clip fractions must be *equal*.
- The loss: a clipped term is ``exp(bound) * A`` with a bound off by at most
  ``delta`` (computed below), so it differs by at most ``max|A| * exp(bound) *
  delta``; the series also averages a sequence's term over its tokens (``n``
  additions of one value, then a division), which adds at most ``2 * T`` roundings
  of the largest term.
- The gradient, the ESS and the sequence statistics: the same operations on the
  same log-ratios (bit-identical: the same masked sums), up to the rounding of a
  few float64 operations; ``RTOL`` allows 64 of them.
"""

from __future__ import annotations

import math

import pytest
import torch
from gspo_testing import (
    BigramActor,
    make_rows,
    oracle_sequence_log_ratio,
    padded,
    ragged_batch,
)
from torchrl.objectives.llm import GSPOLoss as UpstreamGSPOLoss
from torchrl.objectives.llm import GSPOTokenLoss as UpstreamGSPOTokenLoss

from torchrl_gspo import GSPOLoss, GSPOTokenLoss

EPS = (3e-4, 4e-4)
RTOL = 64 * 2.0**-52
# ragged rows (prompt, response): lengths 0 (an empty row) to 9, holes in the longer
SHAPES = ((3, 5), (2, 1), (4, 0), (1, 7), (2, 3), (5, 4), (2, 9), (3, 2))


def bound_error() -> float:
    """The largest distance between a float32 clip bound and the exact one."""
    exact = (math.log1p(-EPS[0]), math.log1p(EPS[1]))
    rounded = (torch.tensor(-EPS[0]).log1p().item(), torch.tensor(EPS[1]).log1p().item())
    return max(abs(a - b) for a, b in zip(exact, rounded, strict=True))


def sequence_log_ratios(actor, rows) -> torch.Tensor:
    """log s_i of every row with a valid token, from the actor and the rows."""
    tokens = padded(rows, "tokens", 0)
    old = padded(rows, "old", 0.0)
    mask = padded(rows, "response", False) & old.isfinite()
    with torch.no_grad():
        current = actor.token_log_probs(tokens)
    return oracle_sequence_log_ratio(current, old, mask)[mask.any(-1)]


def run(loss_cls, actor, data, aggregation):
    kwargs = {"clip_epsilon": EPS, "aggregation": aggregation, "entropy_bonus": False}
    if aggregation == "token_mean" and loss_cls in (GSPOLoss, GSPOTokenLoss):
        with pytest.warns(UserWarning, match="weights each sequence by its length"):
            loss_fn = loss_cls(actor, **kwargs)
    else:
        loss_fn = loss_cls(actor, **kwargs)
    out = loss_fn(data)
    grad = torch.autograd.grad(out.loss_objective, list(actor.parameters()))
    return out, torch.cat([g.flatten() for g in grad])


CASES = [
    (GSPOLoss, UpstreamGSPOLoss, False),
    (GSPOTokenLoss, UpstreamGSPOTokenLoss, True),
]


@pytest.mark.parametrize("ours, theirs, per_token", CASES, ids=["gspo", "gspo-token"])
@pytest.mark.parametrize("layout", ["dense", "lazy"])
@pytest.mark.parametrize("aggregation", ["prompt_mean", "token_mean"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_series_equals_the_package(ours, theirs, per_token, layout, aggregation, seed):
    """Loss, gradient, clip fractions, ESS and sequence log-ratio, on ragged batches
    with holes, an empty row and NaN prompt log-probabilities."""
    actor = BigramActor(seed=seed)
    rows = make_rows(SHAPES, seed=seed, actor=actor, noise=8e-4, holes=True, nan_prompt=True)
    data = ragged_batch(rows, layout, per_token, seed)
    expected, expected_grad = run(ours, actor, data, aggregation)
    actual, actual_grad = run(theirs, actor, data, aggregation)

    # equal clip decisions need every log s_i farther from a bound than the bounds'
    # float32 rounding delta
    delta = bound_error()
    assert 0 < delta < 1e-9
    bounds = torch.tensor([math.log1p(-EPS[0]), math.log1p(EPS[1])], dtype=torch.float64)
    log_ratio = sequence_log_ratios(actor, rows)
    assert (log_ratio.unsqueeze(-1) - bounds).abs().min() > 1e3 * delta
    assert (log_ratio < bounds[0]).any() and (log_ratio > bounds[1]).any()
    assert ((log_ratio > bounds[0]) & (log_ratio < bounds[1])).any()

    advantage = data.get("advantage", as_padded_tensor=True).abs().max().item()
    width = data.get(("tokens", "full"), as_padded_tensor=True).shape[-1]
    tol = advantage * math.exp(bounds[1].item()) * delta + 2 * width * 2.0**-52 * advantage
    torch.testing.assert_close(actual.loss_objective, expected.loss_objective, rtol=0, atol=tol)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=RTOL, atol=0)
    assert torch.equal(actual.clip_fraction, expected.clip_fraction)
    assert torch.equal(actual.sequence_clip_fraction, expected.sequence_clip_fraction)
    for key in ("ESS", "sequence_log_ratio", "kl_approx"):
        torch.testing.assert_close(getattr(actual, key), getattr(expected, key), rtol=RTOL, atol=0)
