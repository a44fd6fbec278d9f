# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPOLoss inside TorchRL's LLM stack: a tiny Qwen2 through TransformersWrapper."""

from __future__ import annotations

import copy
import io
import json
import math
import re
import warnings

import pytest
import torch
from llm_testing import allow_only, chatml_tokenizer, example, tiny_qwen, training_wrapper
from tensordict import TensorDict, lazy_stack
from torchrl.modules.llm import TransformersWrapper
from tqdm import tqdm

from torchrl_gspo import GSPOLoss, KLEarlyStop, RecomputeOldLogProbs

ANSWERS = "abcdefgh"  # what a sampled response may hold, besides end-of-turn
gspo_toy = example("gspo_toy")
engine_mismatch = example("engine_mismatch")


def sample_tokens(tokenizer, model, seed: int):
    """Samples up to 8 tokens for each of 8 one-letter prompts, in tokens mode, unpadded,
    restricted to the example's answer letters and end-of-turn token."""
    generator = TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=True,
        pad_output=False,
        generate_kwargs={
            "max_new_tokens": 8,
            "do_sample": True,
            "bad_words_ids": allow_only(tokenizer, ANSWERS),
        },
    )
    torch.manual_seed(seed)
    prompts = [torch.tensor(tokenizer.encode(f"{c}\n")) for c in "abcd" * 2]
    with torch.no_grad():
        return generator(lazy_stack([TensorDict(tokens=TensorDict(prompt=p)) for p in prompts]))


@pytest.fixture(scope="module")
def setup():
    """Ragged responses sampled in tokens mode, with the example's tokenizer and model."""
    tokenizer = chatml_tokenizer()
    model = tiny_qwen(tokenizer, seed=0)
    out = sample_tokens(tokenizer, model, seed=1)
    rows = []
    for i, (p, r) in enumerate(
        zip(
            out.get(("tokens", "prompt"), as_list=True),
            out.get(("tokens", "response"), as_list=True),
            strict=True,
        )
    ):
        rows.append(
            TensorDict(
                tokens=TensorDict(prompt=p, response=r, full=torch.cat([p, r])),
                masks=TensorDict(
                    all_attention_mask=torch.ones(p.numel() + r.numel(), dtype=torch.bool)
                ),
                advantage=torch.tensor([[1.0 if i % 2 else -1.0]]),
            )
        )
    return tokenizer, model, lazy_stack(rows)


def with_old_log_probs(data, policy):
    """A copy of ``data`` with the example's "old" log-probs (no-grad policy forward)."""
    return RecomputeOldLogProbs(policy, out_key="log_probs")(data.copy())


def reference_response_log_probs(model, data):
    """log pi(response tokens), straight from the model's logits, row by row."""
    out = []
    for row in data.unbind(0):
        prompt, full = row["tokens", "prompt"], row["tokens", "full"]
        logits = model(full.unsqueeze(0)).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, full[1:].unsqueeze(-1)).squeeze(-1)
        out.append(lp[prompt.numel() - 1 :])
    return out


def sequence_log_ratios(policy, data, **kwargs):
    """log s_i and the loss mask, read off the loss' per-token terms.

    With A = 1, aggregation="none" and a clip range that never binds, a valid token's
    term is -s_i and a masked position's is 0.
    """
    with pytest.warns(UserWarning, match="practically never clips"):
        loss_fn = GSPOLoss(
            policy, aggregation="none", clip_epsilon=(0.999, 1e3), entropy_bonus=False, **kwargs
        )
    data = data.copy().set("advantage", torch.ones(data.batch_size[0], 1, 1))
    ratio = -loss_fn(data).loss_objective.detach().squeeze(-1)
    mask = ratio != 0
    log_ratio = torch.where(mask, ratio.log(), 0.0)
    return log_ratio.sum(-1) / mask.sum(-1).clamp_min(1), mask


def test_recipe_configuration_gives_the_exact_response_mask(setup):
    tokenizer, model, data = setup
    lengths = [r.numel() for r in data.get(("tokens", "response"), as_list=True)]
    assert len(set(lengths)) > 1 and min(lengths) >= 1  # ragged, EOS included where sampled
    policy = training_wrapper(model, tokenizer)
    data = with_old_log_probs(data, policy)
    seq, mask = sequence_log_ratios(policy, data)
    assert mask.sum(-1).tolist() == lengths
    assert torch.equal(seq, torch.zeros_like(seq))  # on-policy: exactly 0


def test_loss_gradients_and_an_optimizer_step(setup):
    tokenizer, model, data = setup
    model = copy.deepcopy(model)
    policy = training_wrapper(model, tokenizer)
    data = with_old_log_probs(data, policy)
    out = GSPOLoss(policy)(data)
    assert out.loss_objective.isfinite() and out.clip_fraction == 0.0
    out.loss_objective.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.isfinite().all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0
    before = [p.detach().clone() for p in model.parameters()]
    torch.optim.Adam(model.parameters(), lr=1e-2).step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_off_policy_ratios_match_the_models_own_log_probs(setup):
    tokenizer, model, data = setup
    model = copy.deepcopy(model)
    policy = training_wrapper(model, tokenizer)
    data = with_old_log_probs(data, policy)
    with torch.no_grad():
        old = reference_response_log_probs(model, data)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = GSPOLoss(policy)
    loss_fn(data).loss_objective.backward()
    optimizer.step()
    with torch.no_grad():
        new = reference_response_log_probs(model, data)
        expected = torch.stack([(n - o).mean() for n, o in zip(new, old, strict=True)])
        seq, mask = sequence_log_ratios(policy, data)
        out = loss_fn(data)
    torch.testing.assert_close(seq, expected, rtol=1e-4, atol=1e-5)
    assert (seq.abs() > 1e-3).all()  # off-policy now
    lengths = mask.sum(-1).double()
    low, high = math.log1p(-3e-4), math.log1p(4e-4)  # the default clip range
    clipped = (expected < low) | (expected > high)
    assert 0 < out.clip_fraction <= 1
    assert torch.isclose(out.clip_fraction.double(), (lengths * clipped).sum() / lengths.sum())


def test_pad_output_training_wrapper_is_detected(setup):
    """pad_output=True ignores left padding: short rows get prompt tokens as response."""
    tokenizer, model, data = setup
    bad = training_wrapper(model, tokenizer, pad_output=True)
    with pytest.raises(ValueError, match="needs the training wrapper"):
        RecomputeOldLogProbs(bad)
    # its log-prob rows are padded to the longest one: not one value per token
    with torch.no_grad():
        padded_old = data.copy().set("log_probs", bad(data.copy()).get("log_probs"))
    with pytest.raises(ValueError, match="do not have one value per token.*pad_output=True"):
        GSPOLoss(bad)(padded_old)
    # with correct old log-probs, its "sft" mask still counts prompt tokens as response
    data = with_old_log_probs(data, training_wrapper(model, tokenizer))
    with pytest.raises(ValueError, match="does not match the sampled responses.*pad_output=True"):
        GSPOLoss(bad)(data)
    with pytest.warns(UserWarning, match="does not match the sampled responses"):
        GSPOLoss(bad, response_mask_check="warn")(data)
    # the check is for single-turn "sft" only: other strategies' masks legitimately
    # differ from the response, and the same (bad) data goes through unchecked
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GSPOLoss(bad, masking_strategy="generic")(data).loss_objective.isfinite()
    # ... and "ignore" switches the check off
    assert GSPOLoss(bad, response_mask_check="ignore")(data).loss_objective.isfinite()


def test_stripped_context_is_detected(setup):
    """A row whose ("tokens", "full") is shorter than its prompt followed by its
    response lost tokens after sampling: the loss would score another context. The
    old log-probs are recomputed on the stripped rows, so every other rule holds and
    only this one can fire."""
    tokenizer, model, data = setup
    rows = [row.clone() for row in data.tensordicts]
    for i in (1, 3):  # the first prompt token stripped from the sequence only
        full = rows[i]["tokens", "full"][1:]
        rows[i]["tokens"] = rows[i]["tokens"].exclude("full").set("full", full)
        rows[i]["masks", "all_attention_mask"] = torch.ones(full.numel(), dtype=torch.bool)
    policy = training_wrapper(model, tokenizer)
    stripped = with_old_log_probs(lazy_stack(rows), policy)
    found = [rows[i]["tokens", "full"].numel() for i in (1, 3)]
    expected = [
        data[i]["tokens", "prompt"].numel() + data[i]["tokens", "response"].numel() for i in (1, 3)
    ]
    assert found == [n - 1 for n in expected]
    message = "- row(s) [1, 3]: shorter than prompt + response: ids were removed after "
    message += f"sampling ({found} tokens vs {expected})"
    with pytest.raises(ValueError, match=re.escape(message)):
        GSPOLoss(policy)(stripped)
    with pytest.raises(ValueError, match="not the prompt .* followed by the response"):
        GSPOLoss(policy, masking_strategy="generic")(stripped)  # any mask: the context
    with pytest.warns(UserWarning) as caught:  # and the mask check warns too
        GSPOLoss(policy, response_mask_check="warn")(stripped)
    # this tokenizer's pad is not its end of turn: the cause is not claimed to be pad = eos
    assert any("Cause: not known here" in str(w.message) for w in caught)
    assert not any("pads with its end of turn" in str(w.message) for w in caught)
    assert GSPOLoss(policy, response_mask_check="ignore")(stripped).loss_objective.isfinite()
    assert GSPOLoss(policy)(with_old_log_probs(data, policy)).loss_objective.isfinite()


def pipeline_args(**overrides):
    args = gspo_toy.parse_args(["--prompts", "2", "--group-size", "4", "--no-progress"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_collected_batch_rewards_advantages_and_mask():
    """ChatEnv -> LLMCollector -> ReplayBuffer(MCAdvantage), as the example builds them."""
    args = pipeline_args(steps=1)
    pipeline = gspo_toy.build_pipeline("gspo", args)
    tokenizer = gspo_toy.build_tokenizer()
    next(iter(pipeline.collector))  # one batch, written into the buffer
    pipeline.collector.shutdown()
    data = pipeline.buffer[:]
    assert data.batch_size == (args.prompts * args.group_size,)

    queries = list(data["query"])
    prompts = data.get(("tokens", "prompt"), as_list=True)
    responses = data.get(("tokens", "response"), as_list=True)
    fulls = data.get(("tokens", "full"), as_list=True)
    rewards = torch.stack([r.reshape(()) for r in data.get(("next", "reward"), as_list=True)])
    advantages = torch.stack([a.reshape(()) for a in data.get("advantage", as_list=True)])
    for query, prompt, response, full in zip(queries, prompts, responses, fulls, strict=True):
        # the prompt is TorchRL's ChatML rendering of the query; full = prompt + sampled tokens
        chatml = f"<|im_start|>user\n{query}<|im_end|>\n<|im_start|>assistant\n"
        assert tokenizer.decode(prompt) == chatml
        assert torch.equal(full, torch.cat([prompt, response]))
    # the reward, written out: the share of the answer's characters equal to the query
    answers = [tokenizer.decode(r).removesuffix("<|im_end|>") for r in responses]
    expected = [a.count(q) / len(a) if a else 0.0 for q, a in zip(queries, answers, strict=True)]
    torch.testing.assert_close(rewards, torch.tensor(expected))
    # groups: args.group_size consecutive rows share a query; the advantage is the reward
    # standardized within its group (unbiased std), 0 where the group's rewards are equal
    spreads = []
    for group in range(args.prompts):
        rows = slice(group * args.group_size, (group + 1) * args.group_size)
        assert len(set(queries[rows])) == 1
        r = rewards[rows].double()
        mean = r.sum() / r.numel()
        std = ((r - mean) ** 2).sum().div(r.numel() - 1).sqrt()
        expected = (r - mean) / std if std > 0 else torch.zeros_like(r)
        torch.testing.assert_close(advantages[rows].double(), expected, rtol=1e-5, atol=1e-6)
        spreads.append(float(std))
    assert max(spreads) > 0  # not only all-equal groups

    # the training wrapper's "sft" mask is exactly the sampled response; on-policy ratio 0
    lengths = [r.numel() for r in responses]
    assert len(set(lengths)) > 1
    seq, mask = sequence_log_ratios(pipeline.loss_fn.actor_network, data)
    assert mask.sum(-1).tolist() == lengths
    assert torch.equal(seq, torch.zeros_like(seq))


def test_grpo_trainer_runs_gspo_loss_with_off_policy_minibatches():
    """GRPOTrainer(loss_module=GSPOLoss(...)): 4 minibatches per batch, later ones off-policy.

    Also checks the example's per-step metrics against the batches and loss outputs
    seen here.
    """
    args = pipeline_args(steps=2)
    assert args.minibatches == 4
    pipeline = gspo_toy.build_pipeline("gspo", args)
    outputs, batches, buffer_sizes = [], [], []
    pipeline.loss_fn.register_forward_hook(
        lambda module, inputs, out: outputs.append((inputs[0].batch_size, out.detach()))
    )
    postproc = pipeline.collector.postproc
    pipeline.collector.postproc = lambda data: batches.append(data) or postproc(data)
    # runs after GRPOTrainer's own post_steps op, which empties the buffer
    pipeline.trainer.register_op("post_steps", lambda: buffer_sizes.append(len(pipeline.buffer)))
    metrics = gspo_toy.StepMetrics("gspo", io.StringIO(), tqdm(disable=True))
    pipeline.loss_fn.register_forward_hook(metrics.on_loss)
    pipeline.trainer.register_op("post_steps_log", metrics.on_step_end)
    before = [p.detach().clone() for p in pipeline.model.parameters()]
    pipeline.trainer.train()

    assert len(outputs) == args.steps * args.minibatches
    assert all(size == (2,) for size, _ in outputs)  # 8 rows per batch, 4 minibatches
    assert all(out.loss_objective.isfinite() for _, out in outputs)
    first = [out for i, (_, out) in enumerate(outputs) if i % args.minibatches == 0]
    later = [out for i, (_, out) in enumerate(outputs) if i % args.minibatches != 0]
    # the first minibatch of each batch is on-policy: the old log-probs were computed
    # with the same weights, on a differently padded batch (float rounding only)
    assert all(out.sequence_log_ratio_max_abs < 1e-5 for out in first)
    assert all(out.sequence_log_ratio_max_abs > 1e-3 for out in later)
    assert any(out.clip_fraction > 0 for out in later)
    assert buffer_sizes == [0] * args.steps  # emptied after each batch
    after = list(pipeline.model.parameters())
    assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))

    # the example's records: one per batch, from that batch's rewards and its 4 outputs
    assert len(batches) == len(metrics.records) == args.steps
    for step, (batch, record) in enumerate(zip(batches, metrics.records, strict=True)):
        rewards = torch.cat([r.reshape(-1) for r in batch.get(("next", "reward"), as_list=True)])
        assert record["reward"] == pytest.approx(rewards.mean().item())
        lengths = [r.numel() for r in batch.get(("tokens", "response"), as_list=True)]
        assert record["response_length"] == pytest.approx(sum(lengths) / len(lengths))
        outs = [out for _, out in outputs[step * 4 : (step + 1) * 4]]
        clip = [float(out.clip_fraction) for out in outs]
        assert record["clip_fraction"] == pytest.approx(sum(clip) / 4)
        assert record["clip_fraction_off_policy"] == pytest.approx(sum(clip[1:]) / 3)
        assert record["ESS"] == pytest.approx(sum(float(out.ESS) for out in outs) / 4)


def test_grpo_clip_fraction_rescaled_to_valid_tokens():
    """The example's GRPO clip fraction equals a direct count over the response tokens."""
    args = pipeline_args(steps=1)
    pipeline = gspo_toy.build_pipeline("grpo", args)
    next(iter(pipeline.collector))
    pipeline.collector.shutdown()
    data = pipeline.buffer[:]
    with torch.no_grad():
        old = reference_response_log_probs(pipeline.model, data)
    optimizer = torch.optim.Adam(pipeline.model.parameters(), lr=1e-2)
    pipeline.loss_fn(data).loss_objective.backward()
    optimizer.step()
    with torch.no_grad():
        new = reference_response_log_probs(pipeline.model, data)
        out = pipeline.loss_fn(data)
    ratios = torch.cat([(n - o).exp() for n, o in zip(new, old, strict=True)])
    expected = ((ratios < 0.8) | (ratios > 1.27)).double().mean().item()
    assert 0 < expected < 1
    got = gspo_toy.valid_token_clip_fraction(out, data, "grpo")
    assert got == pytest.approx(expected)
    assert float(out.clip_fraction) < expected  # GRPOLoss's own value counts padding too


def test_example_runs_and_writes_its_files(tmp_path):
    summary = gspo_toy.main(["--steps", "2", "--out", str(tmp_path), "--no-progress"])
    for name in ("gspo", "grpo"):
        lines = (tmp_path / f"metrics_{name}.jsonl").read_text().splitlines()
        assert len(lines) == 2
        record = json.loads(lines[0])
        for key in (
            "reward",
            "loss",
            "clip_fraction",
            "ESS",
            "sequence_log_ratio",
            "response_length",
        ):
            assert key in record
    assert (tmp_path / "gspo_vs_grpo.png").stat().st_size > 0
    assert set(summary) >= {"gspo", "grpo"}
    token = gspo_toy.main(
        ["--steps", "1", "--loss", "gspo-token", "--out", str(tmp_path), "--no-progress"]
    )
    assert token["gspo-token"]["steps"] == 1
    with pytest.raises(SystemExit):  # 4 x 8 responses do not split into 3 minibatches
        gspo_toy.parse_args(["--minibatches", "3"])


@pytest.mark.parametrize("name", ["luspo", "gmpo", "sapo", "vespo", "sspo"])
def test_example_trains_each_objective_of_the_family(name, tmp_path):
    """examples/gspo_toy.py --loss NAME: one collected batch, four updates, through
    TorchRL's GRPOTrainer, with the objective's own diagnostic logged."""
    args = ["--steps", "1", "--loss", name, "--prompts", "2", "--group-size", "4"]
    summary = gspo_toy.main([*args, "--out", str(tmp_path), "--no-progress"])
    assert summary[name]["steps"] == 1
    record = json.loads((tmp_path / f"metrics_{name}.jsonl").read_text().splitlines()[0])
    assert math.isfinite(record["loss"]) and 0 <= record["clip_fraction"] <= 1


def test_example_refuses_vespo_data_parallel(monkeypatch):
    """VESPO's token mean takes no sequence scale, which GlobalBatchStepper writes."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        gspo_toy.parse_args(["--loss", "vespo"])
    gspo_toy.parse_args(["--loss", "sapo"])  # the others run data-parallel


def test_history_mode_with_rlhf_masking():
    """History input (ChatML template), masking_strategy="rlhf".

    What the rlhf mask covers: the assistant tokens between the template's generation
    markers, i.e. the sampled response *without* its final end-of-turn token (the
    template writes ``<|im_end|>`` outside the markers). Sampling is restricted to the
    example's answer letters and end-of-turn token: whitespace, for one, would not survive
    the history round trip.
    """
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory

    tokenizer = chatml_tokenizer()
    model = tiny_qwen(tokenizer, seed=0)
    eos = tokenizer.eos_token_id
    # favor the end-of-turn token so that responses end at different lengths
    eos_bias = torch.zeros(len(tokenizer))
    eos_bias[eos] = 2.0
    model.lm_head.register_forward_hook(lambda module, args, output: output + eos_bias)
    common = {"tokenizer": tokenizer, "input_mode": "history", "pad_output": False}
    common["chat_template_name"] = "chatml_format"
    banned = allow_only(tokenizer, ANSWERS)
    generator = TransformersWrapper(
        model,
        generate=True,
        generate_kwargs={"max_new_tokens": 10, "do_sample": True, "bad_words_ids": banned},
        **common,
    )
    policy = TransformersWrapper(model, generate=False, return_log_probs=True, **common)
    prompts = History.from_chats([[{"role": "user", "content": c}] for c in "abcdefgh"])
    torch.manual_seed(3)
    with torch.no_grad():
        out = generator(
            lazy_stack([TensorDict(history=ChatHistory(prompt=h)) for h in prompts.unbind(0)])
        )
    responses = out.get(("tokens", "response"), as_list=True)
    assert len({r.numel() for r in responses}) > 1
    assert any(int(r[-1]) == eos for r in responses)

    data = lazy_stack(
        [TensorDict(history=ChatHistory(full=h)) for h in out["history"].full.unbind(0)]
    )
    data.set("advantage", torch.tensor([1.0, -1.0] * 4).reshape(8, 1, 1))
    with torch.no_grad():
        forward = policy(data.copy())
    for key in ("log_probs", "tokens", "masks"):
        data.set(key, forward.get(key))
    loss_fn = GSPOLoss(policy, masking_strategy="rlhf")
    seq, mask = sequence_log_ratios(policy, data, masking_strategy="rlhf")
    expected = [r.numel() - int(int(r[-1]) == eos) for r in responses]
    assert mask.sum(-1).tolist() == expected
    assert torch.equal(seq, torch.zeros_like(seq))  # on-policy

    # TorchRL's "rlhf" distribution writes ("tokens", "full") on the tensordict it is
    # given: the loss hands it a copy, and the caller's rows keep their very tensors
    rows_before = [
        {k: (v, v.clone()) for k, v in row.items(True, True) if isinstance(v, torch.Tensor)}
        for row in data.tensordicts
    ]
    out = loss_fn(data)
    for row, before in zip(data.tensordicts, rows_before, strict=True):
        after = {k: v for k, v in row.items(True, True) if isinstance(v, torch.Tensor)}
        assert after.keys() == before.keys()
        for key, (tensor, values) in before.items():
            assert after[key] is tensor and torch.equal(tensor, values), key
    assert out.loss_objective.isfinite()
    out.loss_objective.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and sum(g.abs().sum() for g in grads) > 0
    before = [p.detach().clone() for p in model.parameters()]
    torch.optim.Adam(model.parameters(), lr=1e-2).step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    # the next minibatch is off-policy
    after = loss_fn(data)
    assert after.sequence_log_ratio_max_abs > 0


def test_grpo_trainer_with_a_bfloat16_engine_and_recomputed_old_log_probs():
    """ChatEnv -> LLMCollector(postproc: the engine's and the trainer's log-probs) ->
    ReplayBuffer(MCAdvantage) -> GRPOTrainer(GSPOLoss): both roles reach the loss."""
    args = pipeline_args(steps=2)
    pipeline = gspo_toy.build_pipeline("gspo", args, engine_dtype=torch.bfloat16)
    assert pipeline.engine is not pipeline.model
    assert next(pipeline.engine.parameters()).dtype == torch.bfloat16
    calls = []
    pipeline.loss_fn.register_forward_hook(
        lambda module, inputs, out: calls.append((inputs[0], out.detach()))
    )
    pipeline.trainer.train()
    assert len(calls) == args.steps * args.minibatches
    for i, (data, out) in enumerate(calls):
        keys = data.keys(include_nested=True)
        assert ("log_probs", "full") in keys and ("old_log_probs", "full") in keys
        # the mismatch diagnostic, recomputed: mean over sequences of |mean_t (old - engine)|
        responses = data.get(("tokens", "response"), as_list=True)
        engine = data.get(("log_probs", "full"), as_list=True)
        old = data.get(("old_log_probs", "full"), as_list=True)
        log_rho = torch.stack(
            [
                (o[-len(r) :].double() - e[-len(r) :].double()).mean()
                for r, e, o in zip(responses, engine, old, strict=True)
            ]
        )
        assert out.rollout_log_ratio_mean_abs > 0
        torch.testing.assert_close(
            out.rollout_log_ratio_mean_abs.double(), log_rho.abs().mean(), rtol=1e-5, atol=1e-7
        )
        if i % args.minibatches == 0:  # on-policy with respect to the recomputed old
            assert out.sequence_log_ratio_max_abs < 1e-5
    # the engine followed the trainer after each batch (bfloat16 rounding of its weights)
    for p_engine, p_model in zip(
        pipeline.engine.parameters(), pipeline.model.parameters(), strict=True
    ):
        assert torch.equal(p_engine, p_model.detach().to(torch.bfloat16))


def test_engine_mismatch_example_runs_and_writes_its_files(tmp_path):
    summary = engine_mismatch.main(["--steps", "2", "--out", str(tmp_path), "--no-progress"])
    assert set(summary) == set(engine_mismatch.RUNS)
    for name in engine_mismatch.RUNS:
        records = [json.loads(line) for line in (tmp_path / f"metrics_{name}.jsonl").open()]
        assert len(records) == 2
        # one engine log-ratio per non-empty response of the batch (4 x 8 here)
        assert 0 < len(records[0]["log_rho"]) <= 32
        assert records[0]["outside_clip_band"] == engine_mismatch.outside_band(
            records[0]["log_rho"]
        )
    # without recomputation the first minibatch is off-policy by the engine mismatch
    assert summary["gspo-recomputed"]["clip_fraction_first_minibatch_mean"] == 0.0
    assert summary["gspo-corrected"]["correction_fraction_mean"] is not None
    assert (tmp_path / "engine_mismatch.png").stat().st_size > 0


def _sample_with_eos_bias(tokenizer, model):
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.eos_token_id] = 3.0  # end early, often
    handle = model.lm_head.register_forward_hook(lambda module, args, output: output + bias)
    out = sample_tokens(tokenizer, model, seed=0)
    handle.remove()
    return out.get(("tokens", "response"), as_list=True)


def test_pad_token_equal_to_eos_loses_the_sampled_eos():
    """With pad == EOS, TorchRL drops every sampled EOS from the response (it takes it for
    padding), so |y_i| misses the last token. A distinct pad token keeps it."""
    from transformers import PreTrainedTokenizerFast

    base = chatml_tokenizer()
    same = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        pad_token="<|im_end|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    assert same.pad_token_id == same.eos_token_id
    responses = _sample_with_eos_bias(same, tiny_qwen(same, seed=0))
    # rows that stopped before the token budget did sample EOS, yet none holds it
    assert any(r.numel() < 8 for r in responses)
    assert not any((r == same.eos_token_id).any() for r in responses)

    # the fix: a distinct pad token (here a new one; a reserved, never-sampled token
    # of the vocabulary works too), with the model's embeddings resized to it
    same.add_special_tokens({"pad_token": "<|pad|>"})
    assert same.pad_token_id != same.eos_token_id
    model = tiny_qwen(same, seed=0)
    responses = _sample_with_eos_bias(same, model)
    stopped = [r for r in responses if r.numel() < 8]
    assert stopped and all(int(r[-1]) == same.eos_token_id for r in stopped)


def test_kl_early_stop_under_grpo_trainer():
    """KLEarlyStop on the toy's GRPOTrainer, 2 epochs of 4 minibatches per batch, 2
    batches: the first minibatch is on-policy (kl_to_old about 0), the second's
    kl_to_old exceeds delta after one Adam step, so it is each batch's last update and
    the other 6 of the batch's 8 are skipped; the next batch updates again. The updates
    are counted by an independent optimizer hook."""
    args = pipeline_args(steps=2, minibatches=4)
    pipeline = gspo_toy.build_pipeline("sspo", args)
    pipeline.trainer.num_epochs = 2
    stop = KLEarlyStop(delta=1e-6)
    stop.register(pipeline.trainer)
    kls, steps = [], []
    pipeline.loss_fn.register_forward_hook(lambda m, a, out: kls.append(float(out.kl_to_old)))
    pipeline.trainer.optimizer.register_step_post_hook(lambda *_: steps.append(1))
    pipeline.trainer.train()
    assert len(steps) == stop.updates == 2 * 2  # 2 updates per batch, of 2 x 4
    assert stop.stops == 2 * 2  # each batch's two epochs were cut short
    assert len(kls) == 4 and kls[0] < 1e-6 < kls[1] and kls[2] < 1e-6 < kls[3]
    gspo = gspo_toy.build_pipeline("gspo", pipeline_args(steps=1))
    KLEarlyStop(0.01).register(gspo.trainer)
    with pytest.raises(KeyError, match="GSPOLoss does not report: SubsequenceLoss does"):
        gspo.trainer.train()
    with pytest.raises(ValueError, match="delta must be > 0"):
        KLEarlyStop(0.0)
