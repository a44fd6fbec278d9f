# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Routing Replay: capture and replay on every supported router family, the checks on
routes, hooks and checkpointing, volatility, and the MoE example."""

from __future__ import annotations

import json

import moe_families
import pytest
import torch
from llm_testing import example, tiny_qwen_moe, training_wrapper, word_tokenizer
from tensordict import TensorDict, lazy_stack
from torch.utils.checkpoint import checkpoint
from torchrl.modules.llm import TransformersWrapper

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


def _recorded():
    """The tiny MoE, its replay and policy, and a ragged batch with recorded routes."""
    model, replay, policy = _model()
    scorer = RecomputeOldLogProbs(policy, out_key="log_probs")
    return model, replay, policy, RecordRoutes(replay, scorer)(_batch(model.config.vocab_size))


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
    model, replay, policy, data = _recorded()
    routes = data.get(("routing", "experts"), as_list=True)
    assert [tuple(r.shape) for r in routes] == [(7, 4, 2), (8, 4, 2), (6, 4, 2), (7, 4, 2)]
    loss_fn = GSPOLoss(policy)
    remove = replay.replay_for(loss_fn)
    subset = data[1:3]
    with replay.capture() as seen:
        out = loss_fn(subset)
    # the subset's forward used exactly its rows' recorded experts
    for row, cached in enumerate(replay.to_rows(seen, [8, 6])):
        assert torch.equal(cached, routes[row + 1])
    # unchanged weights: on-policy up to float rounding of the re-weighting
    assert out.sequence_log_ratio_max_abs < 1e-6
    short = subset.clone()
    short.tensordicts[0].set(("routing", "experts"), routes[1][1:])  # one route short
    with pytest.raises(ValueError, match=r"row\(s\) \[0\]"):
        loss_fn(short)
    remove()  # no replay any more: the routes are not read
    loss_fn(short)


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


def test_routing_volatility_counts_changed_experts():
    """The paper's count: of the k activated experts, those no longer activated."""
    before = [torch.tensor([[[0, 1], [2, 3], [4, 5]]]), torch.tensor([[[0, 1], [1, 2], [3, 0]]])]
    after = [torch.tensor([[[1, 0], [2, 4], [5, 6]]]), torch.tensor([[[2, 3], [1, 2], [0, 3]]])]
    mask = torch.tensor([[True, True, False]])
    # layer 0: token 0 none of 2 gone, token 1 expert 3 gone (1 of 2); token 2 masked
    # layer 1: token 0 experts 0 and 1 gone (2 of 2), token 1 none
    expected = torch.tensor([1 / 4, 2 / 4, 3 / 8], dtype=torch.float64)
    got = routing_volatility(before, after, mask, count="experts")
    torch.testing.assert_close(got, expected)
    # the set count is up to k = 2 times larger: 1 of 2 sets changed in each layer
    sets = routing_volatility(before, after, mask)
    torch.testing.assert_close(sets, torch.tensor([1 / 2, 1 / 2, 1 / 2], dtype=torch.float64))
    with pytest.raises(ValueError, match="count"):
        routing_volatility(before, after, mask, count="tokens")


def test_moe_example_runs_two_steps_of_each_configuration(tmp_path):
    moe_routing = example("moe_routing")
    summary = moe_routing.main(["--steps", "2", "--out", str(tmp_path), "--no-progress"])
    assert set(summary) == {"one_update", *moe_routing.RUNS}
    report = summary["one_update"]["without_replay"]
    assert len(report["set_volatility_per_layer"]) == 4
    # of k = 2 experts, a changed set changes one or two: sets / 2 <= experts <= sets
    sets, experts = report["set_volatility"], report["expert_volatility"]
    assert sets / 2 <= experts <= sets <= 1
    for run in moe_routing.RUNS:
        records = [json.loads(line) for line in (tmp_path / f"metrics_{run}.jsonl").open()]
        assert len(records) == 2
        assert all(0 <= r["expert_volatility"] <= r["set_volatility"] <= 1 for r in records)
    assert (tmp_path / "moe_routing.png").stat().st_size > 0


# ----- every supported router family replays bit-identically (R3) -----


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_VARIANTS = [
    (family, norm)
    for family in moe_families.SUPPORTED
    for norm in (
        (False, True)
        if family in ("qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "deepseek_v3")
        else (None,)
    )
]


@pytest.mark.parametrize(("family", "norm"), _VARIANTS)
def test_each_supported_family_replays_bit_identically(family, norm, one_thread):
    model_class, config_class, arguments = moe_families.SUPPORTED[family]
    if norm is not None:
        arguments = {**arguments, "norm_topk_prob": norm}
    model = moe_families.build((model_class, config_class, arguments))
    tokens = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(tokens).logits
    with RoutingReplay(model) as replay:
        assert replay.routers == moe_families.routers(model)
        with torch.no_grad(), replay.capture() as routes:
            captured = model(tokens).logits
        with replay.replay(routes):
            replayed = model(tokens).logits
        assert torch.equal(captured, plain) and torch.equal(replayed, plain)
        replayed.square().sum().backward()  # the routers get gradients through the weights
        assert all(router.weight.grad.abs().sum() > 0 for router in replay.routers)
        # the recorded order of each route is replayed as is (DeepSeek-V3 does not sort)
        flipped = [route.flip(-1) for route in routes]
        with torch.no_grad(), replay.capture() as seen, replay.replay(flipped):
            model(tokens)
        assert all(torch.equal(s, f) for s, f in zip(seen, flipped, strict=True))


@pytest.mark.parametrize("router", sorted(moe_families.REFUSED))
def test_other_routers_are_refused_by_name(router):
    model = moe_families.build(moe_families.REFUSED[router])
    with pytest.raises(ValueError, match=router):
        RoutingReplay(model)


def test_a_model_without_router_is_refused():
    with pytest.raises(ValueError, match="no Mixture-of-Experts router"):
        RoutingReplay(torch.nn.Linear(2, 2))


# ----- layout and per-row checks (R1, R2) -----


def test_routes_of_another_layout_are_refused():
    model, replay, _ = _model()
    tokens = torch.randint(3, model.config.vocab_size, (2, 6))
    with torch.no_grad(), replay.capture() as routes:
        model(tokens)
    with pytest.raises(ValueError, match=r"laid out as \(3, 4\).*\(2, 6, 2\)"):
        with torch.no_grad(), replay.replay(routes):
            model(tokens.reshape(3, 4))  # the same 12 tokens, another layout
    with pytest.raises(ValueError, match="4 MoE layers"):
        with replay.replay(routes[:1]):
            pass


def test_replay_for_checks_each_row_against_its_tokens():
    model, replay, policy, data = _recorded()  # rows 0 and 3: length 7, other tokens
    loss_fn = GSPOLoss(policy)
    replay.replay_for(loss_fn)
    loss_fn(data)  # as recorded: accepted
    swapped = data.clone()
    rows = swapped.tensordicts
    rows[0]["routing"], rows[3]["routing"] = rows[3]["routing"], rows[0]["routing"]
    with pytest.raises(ValueError, match=r"row\(s\) \[0, 3\]"):
        loss_fn(swapped)
    mixed = data.clone()  # rows 1 and 2 have other lengths (8, 6)
    routes = [mixed.tensordicts[i].get(("routing", "experts")) for i in (1, 2)]
    mixed.tensordicts[1].set(("routing", "experts"), routes[1])
    mixed.tensordicts[2].set(("routing", "experts"), routes[0])
    with pytest.raises(ValueError, match=r"row\(s\) \[1, 2\]"):
        loss_fn(mixed)
    # routes without the recorded tokens still have their lengths checked
    bare = data.clone().exclude(("routing", "tokens"))
    bare.tensordicts[2].set(("routing", "experts"), routes[1][:-1])
    with pytest.raises(ValueError, match=r"row\(s\) \[2\]"):
        loss_fn(bare)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((5, 4, 3), r"row 2, layer 0 has top-k 3 where row 0 has 2"),
        ((5, 3, 2), r"row 2 has 3 MoE layers where row 0 has 4 \(layer 3 is missing"),
    ],
)
def test_rows_that_disagree_on_top_k_or_layers_are_refused(shape, message):
    """from_rows pads with row 0's experts: a row of another top-k or layer count is
    named, not left to torch's size error."""
    _, replay, _ = _model()
    rows = [torch.tensor([0, 1]).expand(n, 4, 2) for n in (3, 6)]
    rows.append(torch.arange(shape[-1]).expand(shape))
    with pytest.raises(ValueError, match=message + ".*same model and router top-k"):
        replay.from_rows(rows)


# ----- checkpointing (R4) -----


def _checkpointed(model, use_reentrant):
    """Each MoE block's forward run under torch.utils.checkpoint."""
    for layer in model.model.layers:
        forward = layer.mlp.forward
        layer.mlp.forward = lambda x, f=forward: checkpoint(f, x, use_reentrant=use_reentrant)
    return model


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad:UserWarning")
def test_checkpointed_moe_layers_are_refused_in_a_replay(use_reentrant):
    model, replay, _ = _model()
    tokens = torch.randint(3, model.config.vocab_size, (2, 6))
    with torch.no_grad(), replay.capture() as routes:
        model(tokens)
    _checkpointed(model, use_reentrant)
    inputs = model.get_input_embeddings()(tokens).detach().requires_grad_()
    plain = model(inputs_embeds=inputs).logits  # checkpointed, not replayed
    with pytest.raises(RuntimeError, match="replayed MoE layer ran under gradient checkpointing"):
        with replay.replay(routes):
            model(inputs_embeds=inputs)
    with torch.no_grad(), replay.replay(routes):  # no gradient, no recomputation: allowed
        model(inputs_embeds=inputs)
    # the plain forward's recomputation, after those replays, routes as its forward did
    plain.sum().backward()
    reference, _, _ = _model()
    expected = reference.get_input_embeddings()(tokens).detach().requires_grad_()
    reference(inputs_embeds=expected).logits.sum().backward()
    torch.testing.assert_close(inputs.grad, expected.grad, rtol=0, atol=0)


def test_transformers_gradient_checkpointing_is_refused_at_replay():
    model, replay, policy, data = _recorded()
    routes = replay.from_rows(data.get(("routing", "experts"), as_list=True))
    # transformers >= 5.24 renames gradient_checkpointing_enable
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    model.train()
    with pytest.raises(RuntimeError, match="the model uses gradient checkpointing"):
        with replay.replay(routes):
            pass
    loss_fn = GSPOLoss(policy)
    replay.replay_for(loss_fn)
    with pytest.raises(RuntimeError, match="the model uses gradient checkpointing"):
        loss_fn(data)
    with torch.no_grad(), replay.replay(routes):  # no backward, no recomputation
        model(data.get(("tokens", "full"), as_padded_tensor=True, padding_side="left"))


# ----- hooks (R5) -----


def test_hooks_are_removed_and_contexts_do_not_nest():
    model = tiny_qwen_moe(word_tokenizer(), 0)
    routers = moe_families.routers(model)
    blocks = [layer.mlp for layer in model.model.layers]
    with RoutingReplay(model) as replay:
        assert all(len(r._forward_hooks) == 1 for r in routers)
        assert all(len(b._forward_pre_hooks) == 1 for b in blocks)
        tokens = torch.randint(3, model.config.vocab_size, (2, 6))
        with torch.no_grad(), replay.capture() as routes:
            with pytest.raises(RuntimeError, match="does not nest"):
                with replay.capture():
                    pass
            model(tokens)  # the outer capture still records
        assert len(routes) == 4
        with replay.replay(routes):
            with pytest.raises(RuntimeError, match="replays do not nest"):
                with replay.replay(routes):
                    pass
        loss_fn = GSPOLoss(training_wrapper(model, word_tokenizer()))
        own = dict(loss_fn._forward_pre_hooks)  # TorchRL's LossModule has one
        replay.replay_for(loss_fn)
        assert len(loss_fn._forward_pre_hooks) == len(own) + 1
    assert not any(r._forward_hooks for r in routers)
    assert not any(b._forward_pre_hooks for b in blocks)
    assert loss_fn._forward_pre_hooks == own and not loss_fn._forward_hooks
    # a removed replay would record and force nothing: it refuses
    for use in (replay.capture, lambda: replay.replay(routes)):
        with pytest.raises(RuntimeError, match="hooks were removed"):
            with use():
                pass
    with pytest.raises(RuntimeError, match="hooks were removed"):
        replay.replay_for(loss_fn)


def test_held_hooks_are_removed_alone_or_with_the_replay():
    model = tiny_qwen_moe(word_tokenizer(), 0)
    replay = RoutingReplay(model)
    held = [replay.hold([model.register_forward_hook(lambda *a: None)]) for _ in range(2)]
    assert len(model._forward_hooks) == 2
    held[0]()  # one helper's hooks alone; the replay and the other helper stay
    assert len(model._forward_hooks) == 1 and replay.num_layers == 4
    with torch.no_grad(), replay.capture() as routes:
        model(torch.randint(3, model.config.vocab_size, (1, 4)))
    assert len(routes) == 4
    replay.remove()
    assert not model._forward_hooks


def test_replay_for_inside_a_replay_is_refused_and_keeps_the_outer_one():
    model, replay, policy, data = _recorded()
    loss_fn = GSPOLoss(policy)
    replay.replay_for(loss_fn)
    loss_fn(tensordict=data)  # the batch passed by keyword is replayed too
    tokens = torch.randint(3, model.config.vocab_size, (2, 6))
    with torch.no_grad(), replay.capture() as routes:
        model(tokens)
    flipped = [route.flip(-1) for route in routes]
    with torch.no_grad(), replay.replay(flipped):
        with pytest.raises(RuntimeError, match="a replay is already running"):
            loss_fn(data)
        with replay.capture() as seen:  # the outer replay still forces its routes
            model(tokens)
    assert all(torch.equal(s, f) for s, f in zip(seen, flipped, strict=True))
    with pytest.raises(KeyError, match="no routes at \\('routing', 'experts'\\)"):
        loss_fn(data.exclude("routing"))


# ----- route dtypes (R6) -----


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_any_integer_dtype_replays_on_the_eager_experts(dtype):
    model, replay, _ = _model()
    model.set_experts_implementation("eager")
    tokens = torch.randint(3, model.config.vocab_size, (2, 6))
    with torch.no_grad(), replay.capture() as routes:
        plain = model(tokens).logits
    assert all(r.dtype == torch.uint8 for r in routes)  # 8 experts fit in a byte
    with torch.no_grad(), replay.replay([r.to(dtype) for r in routes]):
        assert torch.equal(model(tokens).logits, plain)


def test_recorded_routes_take_the_smallest_integer_dtype():
    config = moe_families.SUPPORTED["qwen3_moe"]
    wide = (*config[:2], {**config[2], "num_experts": 300, "moe_intermediate_size": 4})
    model = moe_families.build(wide)
    with RoutingReplay(model) as replay, torch.no_grad(), replay.capture() as routes:
        model(torch.zeros(1, 3, dtype=torch.long))
    assert all(r.dtype == torch.int16 for r in routes)  # 300 experts: more than a byte


@pytest.mark.parametrize(
    ("route", "message"),
    [
        ([3, 3], "names an expert twice"),
        ([0, 8], r"in \[0, 8\)"),
        ([-1, 2], r"in \[0, 8\)"),
    ],
)
def test_invalid_routes_are_refused(route, message):
    model, replay, _ = _model()
    routes = [torch.tensor(route).expand(1, 2, 2)] * 4
    with pytest.raises(ValueError, match=message):
        with replay.replay(routes):
            pass
    with pytest.raises(ValueError, match="integer"):
        with replay.replay([r.float() for r in routes]):
            pass


# ----- RecordRoutes' inputs (R7) -----


def test_record_routes_errors():
    model, replay, policy = _model()
    data = _batch(model.config.vocab_size)
    scorer = RecomputeOldLogProbs(policy, out_key="log_probs")
    with pytest.raises(TypeError, match="lazily stacked"):
        dense = TensorDict(tokens=TensorDict(full=torch.ones(2, 5, dtype=torch.long)))
        RecordRoutes(replay, scorer)(dense.auto_batch_size_(1))
    scored = scorer(data.clone())
    with pytest.raises(ValueError, match="already holds 'log_probs'"):
        RecordRoutes(replay, scorer)(scored)
    packed = TransformersWrapper(
        model,
        tokenizer=word_tokenizer(),
        input_mode="tokens",
        generate=False,
        return_log_probs=True,
        pad_model_input=False,
    )
    with pytest.raises(ValueError, match="pad_model_input"):
        RecordRoutes(replay, RecomputeOldLogProbs(packed, out_key="log_probs"))(data)
