# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The private parts of TorchRL's GRPOLoss that GSPOLoss calls: one contract test each.

GSPOLoss owns its forward and orchestrates GRPOLoss' helpers. Each test below pins
one helper's signature and its behavior on a tiny batch, against a formula written
out here, so that the day TorchRL changes one, the failing test names it.

Two contracts change on purpose with the upstream series' first patch (upstream/,
``UPSTREAM_FIXES``): ``_compute_policy_objective`` takes a ``mask`` and counts its
clip fraction over it, and ``_aggregate_loss_value`` returns a 0-dim
``prompt_mean``. Each test pins the contract of the torchrl it runs on.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from gspo_testing import UPSTREAM_FIXES, BigramActor, dense_batch, lazy_batch, make_rows, padded
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
from torchrl.objectives.common import LossModule
from torchrl.objectives.llm import GRPOLoss

from torchrl_gspo import GSPOLoss, GSPOTokenLoss


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.fixture
def tiny():
    actor = BigramActor()
    rows = make_rows([(2, 3), (1, 4), (3, 0)], actor=actor, noise=0.01, seed=1)
    return actor, rows, dense_batch(rows)


def test_get_cur_log_prob(tiny):
    """(tensordict) -> (log-probs [B, T], a distribution with .mask, False); writes nothing."""
    actor, rows, batch = tiny
    assert parameters(GRPOLoss._get_cur_log_prob) == ["self", "tensordict"]
    keys = set(batch.keys(True, True))
    log_prob, dist, composite = GRPOLoss(actor)._get_cur_log_prob(batch)
    assert composite is False and set(batch.keys(True, True)) == keys
    tokens = padded(rows, "tokens", 0)
    mask = padded(rows, "response", False)
    assert torch.equal(dist.mask, mask)
    close(torch.where(mask, log_prob, 0.0), torch.where(mask, actor.token_log_probs(tokens), 0.0))


def test_clip_bounds():
    """A property: (log(1 - eps_low), log(1 + eps_high)) from the clip buffers."""
    loss_fn = GRPOLoss(BigramActor(), clip_epsilon=(0.1, 0.3))
    assert isinstance(inspect.getattr_static(GRPOLoss, "_clip_bounds"), property)
    low, high = loss_fn._clip_bounds
    close(low.double(), torch.tensor(math.log(0.9), dtype=torch.float64), tol=1e-7)
    close(high.double(), torch.tensor(math.log(1.3), dtype=torch.float64), tol=1e-7)
    assert {"clip_epsilon_low", "clip_epsilon_high"} <= dict(loss_fn.named_buffers()).keys()


def test_compute_policy_objective():
    """(log_weight, advantage) -> (-min(r A, clip(r) A), clip fraction), broadcasting."""
    arguments = ["self", "log_weight", "advantage"] + (["mask"] if UPSTREAM_FIXES else [])
    assert parameters(GRPOLoss._compute_policy_objective) == arguments
    loss_fn = GRPOLoss(BigramActor(), clip_epsilon=(0.1, 0.2))
    log_weight = torch.tensor([-0.5, -0.05, 0.0, 0.1, 0.5], dtype=torch.float64).reshape(5, 1, 1)
    advantage = torch.tensor([1.0, -1.0, 2.0, 1.0, -0.5], dtype=torch.float64).reshape(5, 1, 1)
    loss, clip_fraction = loss_fn._compute_policy_objective(log_weight, advantage)
    r = log_weight.exp()
    expected = -torch.minimum(r * advantage, r.clamp(0.9, 1.2) * advantage)
    assert loss.shape == (5, 1, 1)
    close(loss, expected, tol=1e-7)
    close(clip_fraction, torch.tensor(0.4, dtype=torch.float64))
    tokens, _ = loss_fn._compute_policy_objective(log_weight.expand(5, 3, 1), advantage)
    assert tokens.shape == (5, 3, 1)  # a [B, 1, 1] advantage broadcasts over tokens
    if UPSTREAM_FIXES:  # the clip fraction over a mask: 2 of its 3 tokens clip
        mask = torch.tensor([True, False, False, True, True]).reshape(5, 1)
        _, clip_fraction = loss_fn._compute_policy_objective(log_weight, advantage, mask=mask)
        close(clip_fraction, torch.tensor(2 / 3, dtype=torch.float64))


def test_get_entropy(tiny):
    """(dist, adv_shape) -> the entropy of each position, [B, T, 1]."""
    actor, rows, batch = tiny
    assert parameters(GRPOLoss._get_entropy) == ["self", "dist", "adv_shape"]
    loss_fn = GRPOLoss(actor)
    _, dist, _ = loss_fn._get_cur_log_prob(batch)
    entropy = loss_fn._get_entropy(dist, adv_shape=torch.Size([3, 1]))
    tokens = padded(rows, "tokens", 0)
    mask = padded(rows, "response", False)
    logits = actor.logits(batch)
    expected = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    assert entropy.shape == (*tokens.shape, 1)
    close(torch.where(mask, entropy.squeeze(-1), 0.0), torch.where(mask, expected, 0.0))


def test_kl_to_ref(tiny):
    """Reads "_cur_log_prob" from the tensordict given; ref_log_prob= skips the read."""
    actor, rows, batch = tiny
    assert parameters(GRPOLoss._kl_to_ref) == [
        "self",
        "tensordict",
        "key",
        "ref_log_prob",
        "coeff",
        "mask",
        "dist",
    ]
    mask = padded(rows, "response", False)
    current = -torch.rand(mask.shape, dtype=torch.float64)
    ref = current - 0.1 * torch.rand(mask.shape, dtype=torch.float64)
    holder = TensorDict({"_cur_log_prob": current}, batch_size=[3])
    loss, value = GRPOLoss(actor)._kl_to_ref(holder, ref_log_prob=ref, coeff=0.3, mask=mask)
    diff = torch.where(mask, ref, 0.0) - torch.where(mask, current, 0.0)
    expected = (diff.exp() - 1 - diff).mean()  # over all B * T positions
    close(value, expected)
    close(loss, 0.3 * expected)
    with pytest.raises(ValueError, match="must have the same shape"):
        GRPOLoss(actor)._kl_to_ref(holder, ref_log_prob=ref[:, 1:], coeff=0.3, mask=mask)


@pytest.mark.parametrize("aggregation", ["prompt_mean", "token_mean", "none"])
def test_aggregate_loss_value(tiny, aggregation):
    """(value [B, T, 1], mask [B, T], tensordict) -> the aggregated loss."""
    actor, rows, batch = tiny
    assert parameters(GRPOLoss._aggregate_loss_value) == ["self", "value", "mask", "tensordict"]
    mask = padded(rows, "response", False)
    value = torch.randn(*mask.shape, 1, dtype=torch.float64)
    loss_fn = GRPOLoss(actor, aggregation=aggregation)
    out = loss_fn._aggregate_loss_value(value, mask, tensordict=batch)
    masked = torch.where(mask, value.squeeze(-1), 0.0)
    if aggregation == "prompt_mean":  # (1,) in 0.14, 0-dim with the upstream series
        shape = () if UPSTREAM_FIXES else (1,)
        assert out.shape == shape
        close(out, (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean().reshape(shape))
    elif aggregation == "token_mean":
        assert out.shape == ()
        close(out, masked.sum() / mask.sum())
    else:
        close(out, masked.unsqueeze(-1))


def test_keys_attributes_and_base_class():
    """The keys, the attributes GRPOLoss.__init__ sets, and LossModule's cache eraser."""
    fields = {f.name: f.default for f in dataclasses.fields(GRPOLoss._AcceptedKeys)}
    assert fields["advantage"] == "advantage"
    assert fields["action"] == ("tokens", "full")
    assert fields["sample_log_prob"] == ("log_probs", "full")
    assert fields["ref_log_probs"] == ("next", "ref_log_probs", "full")
    loss_fn = GRPOLoss(
        BigramActor(),
        aggregation="prompt_mean",
        kl_mask_threshold=0.5,
        kl_to_ref_coeff=0.1,
        kl_to_inference_coeff=0.2,
        masking_strategy="rlhf",
        entropy_coeff=0.3,
    )
    for name, value in {
        "aggregation": "prompt_mean",
        "reduction": "mean",
        "kl_mask_threshold": 0.5,
        "kl_to_ref_coeff": 0.1,
        "kl_to_inference_coeff": 0.2,
        "masking_strategy": "rlhf",
        "entropy_bonus": True,
        "entropy_coeff": 0.3,
        "ref_log_prob_padding_side": "left",
        "ref_log_prob_padding_value": 0.0,
    }.items():
        assert getattr(loss_fn, name) == value, name
    assert parameters(GRPOLoss._set_in_keys) == ["self"] and isinstance(loss_fn._in_keys, list)
    assert parameters(LossModule._erase_cache) == ["self"]
    assert parameters(LossModule._apply) == ["self", "fn"]  # no `recurse`: see GSPOLoss._apply


# ---------------------------------------------------------------------------------
# What GSPOLoss writes: nothing; _kl_to_ref gets a throwaway tensordict
# ---------------------------------------------------------------------------------
def _spy(monkeypatch, owner, name, record):
    """Replaces ``owner.name`` by a wrapper that calls ``record(self, *args)`` first."""
    original = getattr(owner, name)

    def wrapper(self, *args, **kwargs):
        record(self, *args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


@pytest.mark.parametrize("loss_cls", [GSPOLoss, GSPOTokenLoss])
@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_forward_writes_no_key_on_the_batch_or_a_copy(monkeypatch, loss_cls, kind):
    """No set, delete or rename on any tensordict during a call; the one copy made is
    the batch's shallow copy handed to the actor (which may write on it, as TorchRL's
    "rlhf" path does), and _kl_to_ref gets a throwaway tensordict."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, seed=2, nan_prompt=False)
    if kind == "lazy":
        batch = lazy_batch(rows)
        for row, td in zip(rows, batch.tensordicts, strict=True):
            td.set(("next", "ref_log_probs", "full"), row["old"] - 0.01)
    else:
        batch = dense_batch(rows)
        batch.set(("next", "ref_log_probs", "full"), padded(rows, "old", 0.0) - 0.01)
    writes, copied, handed = [], [], {}
    for cls in (TensorDict, LazyStackedTensorDict):
        for name in ("_set_str", "_set_tuple", "del_", "rename_key_"):
            _spy(monkeypatch, cls, name, lambda td, *a, n=name: writes.append((n, a[:1])))
    for cls in (TensorDictBase, LazyStackedTensorDict):
        for name in ("copy", "clone"):
            _spy(monkeypatch, cls, name, lambda td, *a: copied.append(td is batch))
    for name in ("_get_cur_log_prob", "_kl_to_ref"):
        record = handed.setdefault(name, [])
        _spy(monkeypatch, GRPOLoss, name, lambda loss, td, *a, r=record: r.append(td))
    loss_fn = loss_cls(actor, kl_to_ref_coeff=0.1, kl_to_inference_coeff=0.1)
    out = loss_fn(batch)
    monkeypatch.undo()
    assert writes == []
    assert copied and all(copied)  # copies of the batch itself, nothing else
    (given,) = handed["_get_cur_log_prob"]
    assert given is not batch and set(given.keys(True, True)) == set(batch.keys(True, True))
    holders = handed["_kl_to_ref"]
    assert len(holders) == 2 and all(set(h.keys()) == {"_cur_log_prob"} for h in holders)
    assert out.loss_kl_to_ref is not None and out.loss_kl_to_inference is not None
