# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Routing Replay on a tiny Qwen3-MoE: capture, replay, volatility, the MoE example."""

from __future__ import annotations

import json

import pytest
import torch
from llm_testing import example, tiny_qwen_moe, training_wrapper, word_tokenizer
from tensordict import TensorDict, lazy_stack

from torchrl_gspo import (
    GSPOLoss,
    RecomputeOldLogProbs,
    RecordRoutes,
    RoutingReplay,
    routing_volatility,
)


def _model(seed=0):
    tokenizer = word_tokenizer()
    model = tiny_qwen_moe(tokenizer, seed)
    return model, RoutingReplay(model), training_wrapper(model, tokenizer)


def _batch(vocab, shapes=((4, 3), (2, 6), (5, 1), (3, 4)), seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, (p, r) in enumerate(shapes):
        full = torch.randint(3, vocab, (p + r,), generator=gen)
        tokens = TensorDict(prompt=full[:p], response=full[p:], full=full)
        rows.append(TensorDict(tokens=tokens, advantage=torch.tensor([[(-1.0) ** i]])))
    return lazy_stack(rows, 0)


def test_capture_and_replay_are_exact_on_the_model():
    model, replay, _ = _model()
    vocab = model.config.vocab_size
    tokens = torch.randint(3, vocab, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), replay.capture() as routes:
        logits = model(tokens).logits
    assert replay.num_layers == 4 and [tuple(r.shape) for r in routes] == [(3, 7, 2)] * 4
    # the recorded experts are the router's own top-2 of its probabilities
    hidden = {}
    block = model.model.layers[0].mlp
    block.register_forward_pre_hook(lambda m, args: hidden.setdefault("x", args[0]))
    with torch.no_grad():
        model(tokens)
    probs = torch.softmax(block.gate(hidden["x"].reshape(-1, model.config.hidden_size))[0], -1)
    assert torch.equal(probs.topk(2).indices.reshape(3, 7, 2), routes[0])
    with torch.no_grad(), replay.replay(routes):
        replayed = model(tokens).logits
    assert torch.equal(replayed, logits)  # unchanged weights: the very same forward
    with torch.no_grad(), replay.capture() as again, replay.replay(routes):
        model(tokens)
    assert all(torch.equal(a, r) for a, r in zip(again, routes, strict=True))


def test_replay_forces_the_cached_experts_after_an_update():
    model, replay, _ = _model()
    vocab = model.config.vocab_size
    tokens = torch.randint(3, vocab, (3, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), replay.capture() as before:
        model(tokens)
    with torch.no_grad():
        for block in [layer.mlp for layer in model.model.layers]:
            block.gate.weight.add_(torch.randn_like(block.gate.weight))  # a large update
    with torch.no_grad(), replay.capture() as after:
        plain = model(tokens).logits
    assert routing_volatility(before, after, torch.ones(3, 7, dtype=torch.bool))[-1] > 0.2
    with replay.capture() as forced, replay.replay(before):
        replayed = model(tokens).logits
    assert all(torch.equal(f, b) for f, b in zip(forced, before, strict=True))
    assert (replayed - plain).abs().max() > 1e-3  # the replay changes the log-probs
    replayed.sum().backward()  # the router still gets gradients through the weights
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_routes_travel_with_ragged_rows_through_the_wrapper():
    """Recorded on the whole batch, replayed on a subset padded differently."""
    model, replay, policy = _model()
    data = RecordRoutes(replay, RecomputeOldLogProbs(policy, out_key="log_probs"))(
        _batch(model.config.vocab_size)
    )
    routes = data.get(("routing", "experts"), as_list=True)
    assert [tuple(r.shape) for r in routes] == [(7, 4, 2), (8, 4, 2), (6, 4, 2), (7, 4, 2)]
    loss_fn = GSPOLoss(policy)
    handles = replay.replay_for(loss_fn)
    subset = data[1:3]
    with replay.capture() as seen:
        out = loss_fn(subset)
    # the subset's forward used exactly its rows' recorded experts
    for row, cached in enumerate(replay.to_rows(seen, [8, 6])):
        assert torch.equal(cached, routes[row + 1])
    # unchanged weights: on-policy up to float rounding of the re-weighting
    assert out.sequence_log_ratio_max_abs < 1e-6
    for handle in handles:
        handle.remove()


def test_routing_volatility_counts_changed_sets():
    before = [torch.tensor([[[0, 1], [2, 3], [4, 5]]]), torch.tensor([[[0, 1], [1, 2], [3, 0]]])]
    after = [torch.tensor([[[1, 0], [2, 4], [4, 5]]]), torch.tensor([[[0, 2], [1, 2], [0, 3]]])]
    mask = torch.tensor([[True, True, False]])
    # layer 0: token 0 same set {0,1}, token 1 {2,3} -> {2,4} changed, token 2 masked
    # layer 1: token 0 {0,1} -> {0,2} changed, token 1 same
    expected = torch.tensor([1 / 2, 1 / 2, 1 / 2], dtype=torch.float64)
    torch.testing.assert_close(routing_volatility(before, after, mask), expected)
    mask = torch.ones(1, 3, dtype=torch.bool)  # token 2: layer 0 same, layer 1 {0,3} same
    expected = torch.tensor([1 / 3, 1 / 3, 1 / 3], dtype=torch.float64)
    torch.testing.assert_close(routing_volatility(before, after, mask), expected)


def test_replay_errors():
    model, replay, _ = _model()
    with pytest.raises(ValueError, match="4 MoE layers"):
        with replay.replay([torch.zeros(1, 2, 2, dtype=torch.long)]):
            pass
    with pytest.raises(ValueError, match="replayed routes hold"):
        with torch.no_grad(), replay.replay([torch.zeros(1, 2, 2, dtype=torch.long)] * 4):
            model(torch.ones(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="no top-k router"):
        RoutingReplay(torch.nn.Linear(2, 2))


def test_moe_example_runs_two_steps_of_each_configuration(tmp_path):
    moe_routing = example("moe_routing")
    summary = moe_routing.main(["--steps", "2", "--out", str(tmp_path), "--no-progress"])
    assert set(summary) == {"one_update", *moe_routing.RUNS}
    report = summary["one_update"]["without_replay"]
    assert len(report["volatility_per_layer"]) == 4 and 0 <= report["volatility"] <= 1
    for run in moe_routing.RUNS:
        records = [json.loads(line) for line in (tmp_path / f"metrics_{run}.jsonl").open()]
        assert len(records) == 2 and all(0 <= r["volatility"] <= 1 for r in records)
    assert (tmp_path / "moe_routing.png").stat().st_size > 0
