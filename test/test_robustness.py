# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Hostile input, construction arguments and concurrency: a clear error or the right value."""

from __future__ import annotations

import copy
import math
import pickle
import threading
import warnings

import pytest
import torch
from gspo_testing import (
    DEFAULT_SHAPES,
    BigramActor,
    LogProbActor,
    build_loss,
    dense_batch,
    fields_of,
    lazy_batch,
    make_rows,
    oracle_gspo_loss,
    padded,
)
from llm_testing import tiny_qwen, training_wrapper, word_tokenizer
from tensordict import TensorDict, lazy_stack
from torchrl.objectives.llm import GRPOLoss

from torchrl_gspo import GSPOLoss, GSPOTokenLoss

LOSSES = [GSPOLoss, GSPOTokenLoss]
PAPER_EPS = (3e-4, 4e-4)
OLD = ("log_probs", "full")


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def grads(loss, actor):
    return torch.autograd.grad(loss, actor.table)[0]


def make_batch(kind, rows, advantage_per_token=False):
    if kind == "lazy":
        return lazy_batch(rows, advantage_per_token)
    return dense_batch(rows, advantage_per_token=advantage_per_token)


def oracle(actor, rows, eps=PAPER_EPS, mask_name="response"):
    tokens = padded(rows, "tokens", 0)
    current = actor.token_log_probs(tokens)
    old = padded(rows, "old", 0.0)
    mask = padded(rows, mask_name, False) & old.isfinite()
    advantage = torch.stack([r["advantage"].reshape(()) for r in rows])
    return oracle_gspo_loss(current, old, mask, advantage, *eps)


def rows_with_old(rows, i, old):
    rows = [dict(r) for r in rows]
    rows[i]["old"] = old
    return rows


# ---------------------------------------------------------------------------------
# Construction arguments: checked at once, the argument named in the message
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_cls", LOSSES)
@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"clip_epsilon": "0.2"}, TypeError, "clip_epsilon must be a real number"),
        ({"clip_epsilon": None}, TypeError, "clip_epsilon must be a real number"),
        ({"clip_epsilon": True}, TypeError, "clip_epsilon must be a real number"),
        ({"clip_epsilon": float("nan")}, ValueError, "clip_epsilon is NaN"),
        ({"clip_epsilon": (3e-4, float("nan"))}, ValueError, "clip_epsilon is NaN"),
        ({"clip_epsilon": (3e-4,)}, ValueError, "clip_epsilon must be a number or a pair"),
        ({"clip_epsilon": (1e-4, 2e-4, 3e-4)}, ValueError, "clip_epsilon must be a number or"),
        ({"clip_epsilon": -1e-4}, ValueError, r"clip_epsilon must satisfy 0 <= eps_low < 1"),
        ({"clip_epsilon": (1.0, 4e-4)}, ValueError, r"clip_epsilon must satisfy"),
        ({"clip_epsilon": (3e-4, math.inf)}, ValueError, r"clip_epsilon must satisfy"),
        ({"max_log_ratio": float("nan")}, ValueError, "max_log_ratio is NaN"),
        ({"max_log_ratio": -1.0}, ValueError, "max_log_ratio must be >= 0 or None"),
        ({"max_log_ratio": "10"}, TypeError, "max_log_ratio must be a real number"),
        ({"masking_strategy": "SFT"}, ValueError, r"masking_strategy must be one of"),
        ({"masking_strategy": "response"}, ValueError, r"masking_strategy must be one of"),
        ({"response_mask_check": "strict"}, ValueError, "response_mask_check must be one of"),
        ({"aggregation": "sequence_sum"}, ValueError, "aggregation must be one of"),
    ],
)
def test_bad_constructor_arguments_raise_at_once(loss_cls, kwargs, error, words):
    with pytest.raises(error, match=words):
        loss_cls(BigramActor(), **kwargs)


def test_numeric_arguments_accept_tensors_and_zero_clamp():
    """A 0-dim tensor is a real number; max_log_ratio=0 keeps the on-policy ratio 1."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.0, seed=3)
    batch = lazy_batch(rows)
    reference = GSPOLoss(actor)(batch)
    eps = torch.tensor(3e-4, dtype=torch.float64)
    out = build_loss(GSPOLoss, actor, clip_epsilon=eps, max_log_ratio=0)(batch)
    assert build_loss(GSPOLoss, actor, clip_epsilon=eps).clip_epsilon_high == 3e-4
    assert torch.equal(out.loss_objective, reference.loss_objective)
    close(out.loss_objective, oracle(actor, rows, eps=(3e-4, 3e-4)))


# ---------------------------------------------------------------------------------
# Old log-probs: one per token, finite on the response
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("delta", [-1, 1])
@pytest.mark.parametrize("strategy", ["generic", "sft"])
def test_ragged_old_log_probs_of_the_wrong_length_raise(delta, strategy):
    """Padding a short row would put a finite 0.0 into the loss: GRPOLoss takes it."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, nan_prompt=False)
    old = rows[3]["old"]
    short = rows_with_old(rows, 3, old[1:] if delta < 0 else torch.cat([old[:1], old]))
    batch = lazy_batch(short)
    n = rows[3]["tokens"].shape[0]
    with pytest.raises(
        ValueError,
        match=rf"at \('log_probs', 'full'\) do not have one value per token in batch "
        rf"row\(s\) \[3\]: shapes \[\({n + delta},\)\] vs token lengths \[{n}\]",
    ):
        build_loss(GSPOLoss, actor, masking_strategy=strategy)(batch)
    if delta < 0:  # what the check prevents: a silently different, finite loss
        grpo = GRPOLoss(actor, masking_strategy=strategy, aggregation="prompt_mean")(batch)
        assert grpo.loss_objective.isfinite().all()


@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("value", [float("nan"), -math.inf, math.inf])
@pytest.mark.parametrize("strategy,mask_name", [("sft", "response"), ("generic", "attention")])
def test_non_finite_old_log_prob_in_the_response_raises(kind, value, strategy, mask_name):
    """Inside the response a non-finite old log-prob is an error, in both layouts."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, nan_prompt=True)
    p = DEFAULT_SHAPES[0][0]  # row 0's prompt is NaN, as vLLM writes it
    old = rows[0]["old"].clone()
    old[p + 1] = value  # inside the response, after a finite value
    batch = make_batch(kind, rows_with_old(rows, 0, old))
    with pytest.raises(
        ValueError,
        match=r"old log-probabilities at \('log_probs', 'full'\) are NaN or infinite on "
        rf"1 valid token\(s\), in batch row\(s\) \[0\].*'{strategy}'",
    ):
        build_loss(GSPOLoss, actor, masking_strategy=strategy)(batch)


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_nan_on_the_first_response_token_raises_with_sft(kind):
    """The 'sft' mask holds no prompt token: a NaN anywhere in it is an error."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, nan_prompt=True)
    old = rows[0]["old"].clone()
    old[3] = float("nan")  # the first response token, right after the NaN prompt
    with pytest.raises(ValueError, match=r"NaN or infinite on 1 valid token\(s\)"):
        GSPOLoss(actor)(make_batch(kind, rows_with_old(rows, 0, old)))


@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("strategy,mask_name", [("rlhf", "assistant"), ("generic", "attention")])
def test_nan_prompt_prefix_is_accepted(kind, strategy, mask_name):
    """Before a row's first finite value, NaN is the prompt (vLLM): dropped, not an error."""
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01, nan_prompt=True, seed=4)
    eps = (0.5, 0.5)
    out = build_loss(GSPOLoss, actor, masking_strategy=strategy, clip_epsilon=eps)(
        make_batch(kind, rows)
    )
    tokens = padded(rows, "tokens", 0)
    current = actor.token_log_probs(tokens)
    old = padded(rows, "old", 0.0)
    mask = padded(rows, mask_name, False) & old.isfinite()
    if strategy == "generic":  # each row's first token has no context: not scored
        for i, row in enumerate(rows):
            mask[i, tokens.shape[-1] - row["tokens"].shape[0]] = False
    advantage = torch.stack([r["advantage"].reshape(()) for r in rows])
    close(out.loss_objective, oracle_gspo_loss(current, old, mask, advantage, *eps))


# ---------------------------------------------------------------------------------
# TorchRL's first-token log-prob, through TransformersWrapper
# ---------------------------------------------------------------------------------
def _per_token_terms(loss_cls, policy, data, **kwargs):
    """The loss' per-token terms -min(r A, clip(r) A) (aggregation="none"), [B, T]."""
    kwargs.update(aggregation="none", entropy_bonus=False)
    build = build_loss if loss_cls is not GRPOLoss else lambda cls, *a, **k: cls(*a, **k)
    return build(loss_cls, policy, **kwargs)(data).loss_objective.detach().squeeze(-1)


def test_wrapper_first_token_log_prob_is_not_scored_with_generic_masking():
    """TransformersWrapper writes 0 for each row's first token; its logits path does not.

    Old log-probs from the wrapper's output and current ones from its "generic"
    distribution disagree on that token of every row, so an on-policy batch would be
    off-policy by |log p(first)| / |y_i|. GSPOLoss never scores a row's first token.
    """
    tokenizer = word_tokenizer()
    model = tiny_qwen(tokenizer, seed=0)
    policy = training_wrapper(model, tokenizer)
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (2, 6), (5, 1), (3, 4)]
    rows = []
    for i, (p, r) in enumerate(shapes):
        full = torch.randint(3, len(tokenizer), (p + r,), generator=gen)
        tokens = TensorDict(prompt=full[:p], response=full[p:], full=full)
        rows.append(TensorDict(tokens=tokens, advantage=torch.tensor([[(-1.0) ** i]])))
    data = lazy_stack(rows)
    with torch.no_grad():
        data.set("log_probs", policy(data.copy()).get("log_probs"))
    old = data.get(OLD, as_padded_tensor=True, padding_side="left")
    width = old.shape[-1]
    first = [width - (p + r) for p, r in shapes]
    assert all(old[i, j] == 0.0 for i, j in enumerate(first))  # TorchRL's placeholder

    # GRPOLoss scores that token: with A = +-1 and a range that never clips, its term
    # is -r A, and its token ratio r there is far from 1 on-policy
    wide = {"masking_strategy": "generic", "clip_epsilon": (0.999, 1e3)}
    grpo = _per_token_terms(GRPOLoss, policy, data, **wide)
    assert all((grpo[i, j].abs().log()).abs() > 0.1 for i, j in enumerate(first))

    # GSPOLoss' terms are -s_i A_i on its loss mask and 0 elsewhere
    terms = _per_token_terms(GSPOLoss, policy, data, **wide)
    mask = terms != 0
    assert mask.sum(-1).tolist() == [p + r - 1 for p, r in shapes]
    assert not any(mask[i, j] for i, j in enumerate(first))
    loss_fn = GSPOLoss(policy, masking_strategy="generic", entropy_bonus=False)
    out = loss_fn(data)
    assert out.clip_fraction == 0.0
    assert out.sequence_log_ratio_max_abs < 1e-6  # on-policy

    # The same wrapper with pad_output=True returns rows padded to the longest one:
    # stored on ragged rows they no longer line up with the tokens, and are rejected.
    padded_policy = training_wrapper(model, tokenizer, pad_output=True)
    with torch.no_grad():
        data.set("log_probs", padded_policy(data.copy()).get("log_probs"))
    with pytest.raises(ValueError, match="do not have one value per token"):
        loss_fn(data)


# ---------------------------------------------------------------------------------
# Advantages: finite, constant, any numeric dtype
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_cls", LOSSES)
@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_infinite_advantage_on_a_valid_row_raises(loss_cls, kind, value):
    actor = BigramActor()
    advantages = torch.tensor([1.0, -1.0, 0.5, value, 2.0, -0.3], dtype=torch.float64)
    rows = make_rows(actor=actor, advantages=advantages)
    with pytest.raises(
        ValueError,
        match=r"advantage at 'advantage' is NaN or infinite in batch row\(s\) \[3\]",
    ):
        loss_cls(actor)(make_batch(kind, rows))


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_infinite_sequence_advantage_raises_even_on_an_empty_row(kind):
    """One advantage per sequence must be finite on every row, response or not."""
    actor = BigramActor()
    advantages = torch.tensor([1.0, -1.0, math.inf, 0.2, 2.0, -0.3], dtype=torch.float64)
    rows = make_rows(actor=actor, advantages=advantages, noise=0.01)
    assert DEFAULT_SHAPES[2][1] == 0  # row 2 has no response token
    with pytest.raises(
        ValueError, match=r"advantage at 'advantage' is NaN or infinite in batch row\(s\) \[2\]"
    ):
        GSPOLoss(actor)(make_batch(kind, rows))


@pytest.mark.parametrize("loss_cls", LOSSES)
@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("per_token", [False, True])
def test_integer_advantages_equal_float_ones(loss_cls, kind, per_token):
    actor = BigramActor()
    integer = torch.tensor([1, -1, 0, 2, -2, 1])
    rows = make_rows(actor=actor, advantages=integer.double(), noise=0.01)
    expected = loss_cls(actor)(make_batch(kind, rows, per_token))
    int_rows = [dict(r, advantage=r["advantage"].long()) for r in rows]
    batch = make_batch(kind, int_rows, per_token)
    assert not batch.get("advantage", as_list=kind == "lazy")[0].is_floating_point()
    out = loss_cls(actor)(batch)
    assert torch.equal(out.loss_objective, expected.loss_objective)
    assert torch.equal(grads(out.loss_objective, actor), grads(expected.loss_objective, actor))


@pytest.mark.parametrize("loss_cls", LOSSES)
@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_advantage_requiring_grad_raises(loss_cls, kind):
    """Rejected, like GRPOLoss' old log-probs; nothing flows into the caller's tensor."""
    actor = BigramActor()
    rows = make_rows(actor=actor)
    leaf = torch.ones((), dtype=torch.float64, requires_grad=True)
    rows = [dict(r, advantage=r["advantage"] * leaf) for r in rows]
    with pytest.raises(RuntimeError, match=r"advantage at 'advantage' requires grad.*detach"):
        loss_cls(actor)(make_batch(kind, rows))
    assert leaf.grad is None


def test_advantage_rows_longer_than_the_tokens_raise():
    actor = BigramActor()
    rows = make_rows(actor=actor)
    longest = max(r["tokens"].shape[0] for r in rows)
    rows[1] = dict(rows[1], advantage=torch.ones(longest + 1, 1, dtype=torch.float64))
    batch = lazy_batch(rows)
    with pytest.raises(
        ValueError, match=rf"advantage at 'advantage' has shape \(6, {longest + 1}, 1\)"
    ):
        GSPOTokenLoss(actor)(batch)


# ---------------------------------------------------------------------------------
# Current log-probs: -inf is a value, NaN / +inf a broken actor
# ---------------------------------------------------------------------------------
def _minus_inf_rows(actor):
    """Rows where one response bigram has probability 0 under the current policy."""
    rows = make_rows(
        [(2, 4), (3, 3), (2, 5)], actor=actor, noise=0.01, nan_prompt=False, holes=False
    )
    tokens = rows[0]["tokens"]
    prev, tok = int(tokens[3]), int(tokens[4])  # response tokens of row 0
    with torch.no_grad():
        actor.table[prev, tok] = -math.inf
    return rows, (prev, tok)


@pytest.mark.parametrize("advantage_sign", [1.0, -1.0])
def test_minus_inf_current_log_prob_gives_the_oracle_value(advantage_sign):
    """Probability 0 under the current policy: that sequence's ratio is 0."""
    actor = BigramActor()
    rows, _ = _minus_inf_rows(actor)
    rows[0]["advantage"] = rows[0]["advantage"].abs() * advantage_sign
    batch = lazy_batch(rows)
    seq = build_loss(GSPOLoss, actor, entropy_bonus=False)(batch)
    token = build_loss(GSPOTokenLoss, actor, entropy_bonus=False)(batch)
    expected = oracle(actor, rows)
    expected_grad = grads(expected, actor)
    assert expected.isfinite() and expected_grad.isfinite().all()
    for out in (seq, token):
        close(out.loss_objective, expected)
        close(grads(out.loss_objective, actor), expected_grad)
    # diagnostics: ESS and clip fractions finite; the log-ratio statistics say -inf
    assert seq.ESS.isfinite() and 0 < seq.ESS <= 1
    assert seq.clip_fraction_low > 0
    assert seq.sequence_log_ratio == -math.inf
    assert seq.sequence_log_ratio_max_abs == math.inf


@pytest.mark.parametrize("loss_cls", LOSSES)
@pytest.mark.parametrize("value", [float("nan"), math.inf])
def test_nan_or_positive_infinite_current_log_prob_raises(loss_cls, value):
    """Log-probs are at most 0: NaN or +inf from the actor is a bug, not a value."""
    current = -torch.rand(3, 6, dtype=torch.float64)
    old = current - 1e-3
    current[1, 4] = value
    data = TensorDict(
        {
            ("tokens", "full"): torch.ones(3, 6, dtype=torch.long),
            OLD: old,
            "advantage": torch.ones(3, 1, 1, dtype=torch.float64),
        },
        batch_size=[3],
    )
    actor = LogProbActor(current, torch.ones(3, 6, dtype=torch.bool))
    with pytest.raises(
        ValueError,
        match=r"actor returned NaN or \+inf log-probabilities on 1 valid token\(s\), "
        r"in batch row\(s\) \[1\]",
    ):
        build_loss(loss_cls, actor, entropy_bonus=False)(data)


def test_all_sequences_of_probability_zero_give_ess_zero():
    actor = BigramActor()
    rows, (prev, tok) = _minus_inf_rows(actor)
    rows = rows[:1]
    out = build_loss(GSPOLoss, actor, entropy_bonus=False)(lazy_batch(rows))
    assert out.ESS == 0.0 and out.loss_objective.isfinite()


# ---------------------------------------------------------------------------------
# The empty batch
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_cls", LOSSES)
def test_batch_of_size_zero_raises(loss_cls):
    actor = BigramActor()
    batch = dense_batch(make_rows(actor=actor))[:0]
    assert batch.batch_size == (0,)
    with pytest.raises(ValueError, match=r"batch is empty \(batch size 0\).*skip"):
        loss_cls(actor)(batch)


# ---------------------------------------------------------------------------------
# The caller's data is never touched
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_cls", LOSSES)
@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_locked_input_works_and_is_unchanged(loss_cls, kind):
    actor = BigramActor()
    rows = make_rows(actor=actor, noise=0.01)
    batch = make_batch(kind, rows)
    before = batch.clone()
    batch.lock_()
    out = build_loss(loss_cls, actor, kl_to_inference_coeff=0.1)(batch)
    close(out.loss_objective, oracle(actor, rows))
    for key in before.keys(True, True):
        a = before.get(key, as_padded_tensor=True)
        b = batch.get(key, as_padded_tensor=True)
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), key


# ---------------------------------------------------------------------------------
# No state between calls: threads and exceptions
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_cls", LOSSES)
def test_concurrent_calls_get_their_own_diagnostics(loss_cls):
    """Two threads share one loss module, 50 calls each, on different batches."""
    actor = BigramActor()
    loss_fn = build_loss(loss_cls, actor, entropy_bonus=False)
    batches = [
        lazy_batch(make_rows(actor=actor, noise=1e-3, seed=1)),
        dense_batch(make_rows([(2, 9), (3, 2), (1, 6)], actor=actor, noise=0.3, seed=2)),
    ]
    with torch.no_grad():
        expected = [loss_fn(b) for b in batches]
    assert expected[0].clip_fraction != expected[1].clip_fraction
    failures, barrier = [], threading.Barrier(2)

    def work(i):
        barrier.wait()
        for _ in range(50):
            try:
                with torch.no_grad():
                    out = loss_fn(batches[i])
                for name, value in fields_of(expected[i]).items():
                    if not torch.equal(getattr(out, name), value):
                        failures.append((i, name))
            except Exception as err:  # noqa: BLE001 - reported below
                failures.append((i, repr(err)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


class _FailingActor(BigramActor):
    """Raises inside GRPOLoss.forward (while computing the current log-probs)."""

    fail = False

    def _get_sft_dist(self, tensordict, **kwargs):
        if self.fail:
            raise RuntimeError("actor failed")
        return super()._get_sft_dist(tensordict, **kwargs)


def test_an_exception_mid_forward_leaves_no_state():
    actor = _FailingActor()
    rows = make_rows(actor=actor, noise=1e-3, seed=5)
    loss_fn = GSPOLoss(actor)
    reference = GSPOLoss(actor)(lazy_batch(rows))
    attributes = set(vars(loss_fn))
    actor.fail = True
    with pytest.raises(RuntimeError, match="actor failed"):
        loss_fn(lazy_batch(rows))
    actor.fail = False
    # a failure in the loss' own checks, after the actor ran, leaves nothing either
    bad = rows_with_old(rows, 0, rows[0]["old"].clone().fill_(float("nan")))
    with pytest.raises(ValueError, match="NaN or infinite"):
        loss_fn(lazy_batch(bad))
    assert set(vars(loss_fn)) == attributes
    out = loss_fn(lazy_batch(rows))
    for name, value in fields_of(reference).items():
        assert torch.equal(getattr(out, name), value), name


def test_warn_once_flag_does_not_change_results():
    gen = torch.Generator().manual_seed(0)
    current = (-torch.rand(3, 20, generator=gen) - 0.5).to(torch.bfloat16)
    old = (current.float() * (1 + 1e-3 * torch.randn(3, 20, generator=gen))).to(torch.bfloat16)
    mask = torch.ones(3, 20, dtype=torch.bool)
    data = TensorDict(
        {
            ("tokens", "full"): torch.ones(3, 20, dtype=torch.long),
            OLD: old,
            "advantage": torch.tensor([1.0, -1.0, 0.5]).reshape(3, 1, 1),
        },
        batch_size=[3],
    )
    loss_fn = GSPOLoss(LogProbActor(current, mask), entropy_bonus=False)
    with pytest.warns(UserWarning, match="bfloat16"):
        first = loss_fn(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = loss_fn(data)
    for name, value in fields_of(first).items():
        assert torch.equal(getattr(second, name), value), name


# ---------------------------------------------------------------------------------
# Module behavior: devices, dtypes, copies, state
# ---------------------------------------------------------------------------------
def test_clip_buffers_become_float32_where_float64_is_missing(monkeypatch):
    """Simulates MPS: a conversion (Module.to) that refuses float64 tensors."""
    to = torch.Tensor.to

    def no_float64(tensor, *args, **kwargs):
        if tensor.dtype == torch.float64:
            raise TypeError("Cannot convert a MPS Tensor to float64 dtype")
        return to(tensor, *args, **kwargs)

    actor = BigramActor(dtype=torch.float32)
    loss_fn = GSPOLoss(actor)
    assert loss_fn.clip_epsilon_low.dtype == torch.float64
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "to", no_float64)
        loss_fn.to("cpu")
    assert loss_fn.clip_epsilon_low.dtype == torch.float32
    assert loss_fn.clip_epsilon_low == torch.tensor(3e-4, dtype=torch.float32)
    rows = make_rows(actor=actor, dtype=torch.float32, noise=1e-3, seed=1)
    out = loss_fn(lazy_batch(rows))
    close(out.loss_objective, oracle(actor, rows), tol=1e-6)
    # a device with float64 keeps the exact values
    exact = GSPOLoss(actor).to("cpu")
    assert exact.clip_epsilon_low.dtype == torch.float64 and exact.clip_epsilon_low == 3e-4


def _same_loss(a, b, batch):
    out_a, out_b = a(batch), b(batch)
    for name, value in fields_of(out_a).items():
        assert torch.equal(getattr(out_b, name), value), name


@pytest.mark.parametrize("loss_cls", LOSSES)
def test_copies_and_state_behave_as_grpos(loss_cls):
    """deepcopy, pickle, state_dict, .double() and .to_empty, next to GRPOLoss."""
    actor = BigramActor()
    batch = lazy_batch(make_rows(actor=actor, noise=1e-3, seed=6))
    loss_fn = build_loss(loss_cls, actor, entropy_bonus=False)
    grpo = GRPOLoss(actor, clip_epsilon=PAPER_EPS, entropy_bonus=False)
    for clone in (copy.deepcopy(loss_fn), pickle.loads(pickle.dumps(loss_fn))):
        assert type(clone) is loss_cls and clone.clip_epsilon_high == 4e-4
        _same_loss(clone, loss_fn, batch)
    state = loss_fn.state_dict()
    assert set(state) == set(grpo.state_dict())
    fresh = loss_cls(BigramActor(seed=1), entropy_bonus=False, clip_epsilon=0.001)
    fresh.load_state_dict(state)
    assert fresh.clip_epsilon_low == 3e-4 and fresh.clip_epsilon_low.dtype == torch.float64
    _same_loss(fresh, loss_fn, batch)
    assert loss_cls(BigramActor(dtype=torch.float32)).double().actor_network.table.dtype == (
        torch.float64
    )
    empty = loss_cls(BigramActor()).to_empty(device="cpu")  # torch's recurse argument
    assert empty.clip_epsilon_low.dtype == torch.float64
    assert empty.actor_network.table.shape == actor.table.shape


# ---------------------------------------------------------------------------------
# Warnings point at the caller's line; dtypes of mixed-precision inputs
# ---------------------------------------------------------------------------------
def _half_batch(actor_dtype, old_dtype):
    gen = torch.Generator().manual_seed(0)
    current = -torch.rand(3, 20, generator=gen) - 0.5
    old = current * (1 + 1e-3 * torch.randn(3, 20, generator=gen))
    data = TensorDict(
        {
            ("tokens", "full"): torch.ones(3, 20, dtype=torch.long),
            OLD: old.to(old_dtype),
            "advantage": torch.tensor([1.0, -1.0, 0.5]).reshape(3, 1, 1),
        },
        batch_size=[3],
    )
    actor = LogProbActor(current.to(actor_dtype), torch.ones(3, 20, dtype=torch.bool))
    return actor, data


@pytest.mark.parametrize("loss_cls", LOSSES)
def test_warnings_point_at_the_callers_line(loss_cls):
    with pytest.warns(UserWarning, match="practically never clips") as caught:
        loss_cls(BigramActor(), clip_epsilon=0.2)
    with pytest.warns(UserWarning, match="weights each sequence by its length") as more:
        loss_cls(BigramActor(), aggregation="token_mean")
    actor, data = _half_batch(torch.bfloat16, torch.bfloat16)
    with pytest.warns(UserWarning, match="bfloat16 log-probabilities") as half:
        loss_cls(actor, entropy_bonus=False)(data)
    out = loss_cls(BigramActor())(lazy_batch(make_rows(actor=BigramActor(), noise=0.01)))
    with pytest.warns(DeprecationWarning, match="diagnostics_sum is deprecated") as old:
        _ = out.diagnostics_sum
    for record in (*caught, *more, *half, *old):
        assert record.filename == __file__, (str(record.message)[:40], record.filename)


@pytest.mark.parametrize(
    "actor_dtype,old_dtype,expected,warns",
    [
        (torch.float32, torch.float64, torch.float64, False),
        (torch.float64, torch.float32, torch.float64, False),
        (torch.bfloat16, torch.float32, torch.float32, True),
        (torch.float32, torch.float16, torch.float32, True),
        (torch.bfloat16, torch.float64, torch.float64, True),
    ],
)
def test_log_ratios_accumulate_in_the_promoted_dtype(actor_dtype, old_dtype, expected, warns):
    """At least float32, the wider of the actor's and the old log-probs' dtypes; either
    in half precision warns."""
    actor, data = _half_batch(actor_dtype, old_dtype)
    loss_fn = GSPOLoss(actor, entropy_bonus=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = loss_fn(data)
    assert len(caught) == warns
    half = actor_dtype if actor_dtype in (torch.bfloat16, torch.float16) else old_dtype
    assert all(f"received {half} log-probabilities" in str(w.message) for w in caught)
    assert out.sequence_log_ratio.dtype == expected == out.loss_objective.dtype
    current = actor.log_probs.detach().to(expected)
    old = data.get(OLD).to(expected)
    mask = torch.ones_like(current, dtype=torch.bool)
    advantage = data.get("advantage").reshape(-1).to(expected)
    close(out.loss_objective, oracle_gspo_loss(current, old, mask, advantage, *PAPER_EPS))


@pytest.mark.parametrize("loss_cls", LOSSES)
def test_an_overflowing_sequence_log_ratio_raises(loss_cls):
    """Finite log-probs whose differences overflow float32: an error, not a silent loss."""
    current = -torch.rand(3, 6)
    old = current.clone()
    old[1, 2:] = -3e38  # finite, absurd: current - old sums to +inf in float32
    data = TensorDict(
        {("tokens", "full"): torch.ones(3, 6, dtype=torch.long), OLD: old},
        batch_size=[3],
    )
    data.set("advantage", torch.ones(3, 1, 1))
    actor = LogProbActor(current, torch.ones(3, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"not finite in batch row\(s\) \[1\].*overflow"):
        loss_cls(actor, entropy_bonus=False)(data)
