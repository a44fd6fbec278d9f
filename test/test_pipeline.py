# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPOLoss inside TorchRL's LLM stack: a tiny Qwen2 through TransformersWrapper."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from torchrl.modules.llm import TransformersWrapper

from torchrl_gspo import GSPOLoss

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
spec = importlib.util.spec_from_file_location("gspo_toy", EXAMPLES / "gspo_toy.py")
gspo_toy = importlib.util.module_from_spec(spec)
sys.modules["gspo_toy"] = gspo_toy
spec.loader.exec_module(gspo_toy)


@pytest.fixture(scope="module")
def setup():
    tokenizer = gspo_toy.build_tokenizer()
    model = gspo_toy.build_model(len(tokenizer), seed=0)
    generator = TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=True,
        pad_output=False,
        generate_kwargs={"max_new_tokens": 8, "do_sample": True, "bad_words_ids": [[0]]},
    )
    torch.manual_seed(1)
    prompts = [torch.tensor([4 + i % 4, 3]) for i in range(8)]
    with torch.no_grad():
        out = generator(lazy_stack([TensorDict(tokens=TensorDict(prompt=p)) for p in prompts]))
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


def training_wrapper(model, tokenizer, pad_output=False):
    return TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=False,
        return_log_probs=True,
        pad_output=pad_output,
    )


def with_old_log_probs(data, policy):
    data = data.copy()
    with torch.no_grad():
        data.set("log_probs", policy(data.copy()).get("log_probs"))
    return data


def reference_response_log_probs(model, data):
    """log pi(response tokens), straight from the model's logits, row by row."""
    out = []
    for row in data.unbind(0):
        prompt, full = row["tokens", "prompt"], row["tokens", "full"]
        logits = model(full.unsqueeze(0)).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, full[1:].unsqueeze(-1)).squeeze(-1)
        out.append(lp[prompt.numel() - 1 :])
    return out


def sequence_log_ratios(loss_fn, data):
    lw, _, _, mask = loss_fn._log_weight(
        loss_fn._with_aligned_advantage(data), torch.Size([data.batch_size[0], 1])
    )
    lw = lw.squeeze(-1)
    return torch.where(mask, lw, 0.0).sum(-1) / mask.sum(-1).clamp_min(1), mask


def test_recipe_configuration_gives_the_exact_response_mask(setup):
    tokenizer, model, data = setup
    lengths = [r.numel() for r in data.get(("tokens", "response"), as_list=True)]
    assert len(set(lengths)) > 1 and min(lengths) >= 1  # ragged, EOS included where sampled
    policy = training_wrapper(model, tokenizer)
    data = with_old_log_probs(data, policy)
    loss_fn = GSPOLoss(policy)
    seq, mask = sequence_log_ratios(loss_fn, data)
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
        seq, mask = sequence_log_ratios(loss_fn, data)
        out = loss_fn(data)
    torch.testing.assert_close(seq, expected, rtol=1e-4, atol=1e-5)
    assert (seq.abs() > 1e-3).all()  # off-policy now
    lengths = mask.sum(-1).double()
    low, high = loss_fn._clip_bounds
    clipped = (expected < low) | (expected > high)
    assert 0 < out.clip_fraction <= 1
    assert torch.isclose(out.clip_fraction.double(), (lengths * clipped).sum() / lengths.sum())


def test_pad_output_training_wrapper_is_detected(setup):
    """pad_output=True ignores left padding: short rows get prompt tokens as response."""
    tokenizer, model, data = setup
    bad = training_wrapper(model, tokenizer, pad_output=True)
    data = with_old_log_probs(data, bad)
    with pytest.raises(ValueError, match="pad_output=True"):
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


def _chat_setup():
    """A character tokenizer with ChatML special tokens and a tiny Qwen2, built in code."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*specials, *string.ascii_lowercase, "\n", " "])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        eos_token_id=2,
    )
    model = Qwen2ForCausalLM(config).eval()
    # favour the end-of-turn token so that responses end at different lengths
    eos_bias = torch.zeros(len(vocab))
    eos_bias[vocab["<|im_end|>"]] = 2.0
    model.lm_head.register_forward_hook(lambda module, args, output: output + eos_bias)
    return tokenizer, model, vocab


def test_history_mode_with_rlhf_masking():
    """History input (ChatML template), masking_strategy="rlhf".

    What the rlhf mask covers: the assistant tokens between the template's generation
    markers, i.e. the sampled response *without* its final end-of-turn token (the
    template writes ``<|im_end|>`` outside the markers). Whitespace is banned from
    sampling because the history round trip strips it, which would change the tokens.
    """
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory

    tokenizer, model, vocab = _chat_setup()
    eos = vocab["<|im_end|>"]
    common = {"tokenizer": tokenizer, "input_mode": "history", "pad_output": False}
    common["chat_template_name"] = "chatml_format"
    banned = [[vocab["<pad>"]], [vocab["<|im_start|>"]], [vocab[" "]], [vocab["\n"]]]
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
    seq, mask = sequence_log_ratios(loss_fn, data)
    expected = [r.numel() - int(int(r[-1]) == eos) for r in responses]
    assert mask.sum(-1).tolist() == expected
    assert torch.equal(seq, torch.zeros_like(seq))  # on-policy

    out = loss_fn(data)
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
