# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The tests TorchRL's own suite would ask of a new GRPOLoss variant.

Modelled on ``TestLosses`` in TorchRL's ``test/llm/test_llm_objectives.py``: TorchRL's
mock transformer behind ``TransformersWrapper`` in history mode, and data built like its
``_mock_data_grpo``, here with a ChatML tokenizer built in code (no download) and, for
``GSPOLoss``, one advantage per sequence.
"""

from __future__ import annotations

import pytest
import torch
from gspo_testing import fields_of
from llm_testing import chatml_tokenizer
from tensordict import MetaData, TensorDict
from torchrl.data import History
from torchrl.modules.llm import TransformersWrapper
from torchrl.modules.llm.policies.common import ChatHistory, Masks

from torchrl_gspo import GSPOLoss, GSPOLossOutput, GSPOTokenLoss, GSPOTokenLossOutput


@pytest.fixture
def mock_transformer_model():
    """TorchRL's mock transformer (an embedding used as logits), as in its conftest."""
    from torchrl.testing import MockTransformerModel

    def _make_model(vocab_size: int = 1024, device="cpu") -> MockTransformerModel:
        return MockTransformerModel(vocab_size, torch.device(device))

    return _make_model


def _mock_data_gspo(
    vocab_size: int, tokenizer, per_token_advantage: bool = False, batch_size: int = 2
) -> TensorDict:
    prompt = History(
        role=["system", "user"],
        content=["You are a useful assistant.", "abc"],
        batch_size=(2,),
    )
    response = History(role=["assistant"], content=["abba"], batch_size=(1,))
    full_history = prompt.extend(response, inplace=False)
    history = ChatHistory(prompt=prompt, response=response, full=full_history)
    history = history.expand((batch_size,))
    next_history = ChatHistory(prompt=full_history).expand((batch_size,))
    tokens_full = history.to_tokens(tokenizer)
    next_tokens = next_history.to_tokens(tokenizer)
    seq_len = tokens_full.get("full", as_padded_tensor=True, padding_side="left").shape[-1]

    if per_token_advantage:
        advantage = torch.randn(batch_size, seq_len, 1)
    else:  # GSPOLoss: one advantage per sequence
        advantage = torch.randn(batch_size, 1, 1)
    masks = Masks(
        all_attention_mask=torch.ones(batch_size, seq_len, dtype=torch.bool),
        all_assistant_mask=None,  # computed by the wrapper
        padded=MetaData(True),
    )
    return TensorDict(
        {
            "advantage": advantage,
            "history": history,
            "tokens": tokens_full % vocab_size,
            "masks": masks,
            "next": {
                "history": next_history,
                "tokens": next_tokens % vocab_size,
                "reward": torch.randn(batch_size, seq_len, 1),
                "done": torch.zeros(batch_size, seq_len, 1, dtype=torch.bool),
            },
            "log_probs": torch.randn_like(tokens_full, dtype=torch.float32),
        },
        batch_size=(batch_size,),
    )


def _check_output(loss_vals, output_type):
    assert isinstance(loss_vals, output_type), type(loss_vals)
    fields = fields_of(loss_vals)
    # the loss terms with the entropy bonus (on by default), and every diagnostic
    expected = {"loss_objective", "loss_entropy", "entropy", "kl_approx"}
    assert expected | set(loss_vals.statistics.fields()) <= set(fields)
    for name, value in fields.items():
        assert value.shape == (), (name, value.shape)
        assert torch.isfinite(value), name
    assert 0 <= loss_vals.clip_fraction <= 1
    assert loss_vals.clip_fraction == loss_vals.clip_fraction_low + loss_vals.clip_fraction_high
    assert 0 < loss_vals.ESS <= 1


class TestGSPOLosses:
    @pytest.mark.parametrize("eps", [(3e-4, 4e-4), 3e-4], ids=["paper", "symmetric"])
    def test_gspo(self, mock_transformer_model, eps):
        vocab_size = 1024
        model = mock_transformer_model(vocab_size=vocab_size)
        tokenizer = chatml_tokenizer()
        actor_network = TransformersWrapper(
            model, tokenizer=tokenizer, generate=False, pad_output=True, input_mode="history"
        )
        loss_fn = GSPOLoss(actor_network, clip_epsilon=eps)
        data = _mock_data_gspo(vocab_size, tokenizer)
        loss_vals = loss_fn(data)
        _check_output(loss_vals, GSPOLossOutput)
        loss_vals.loss_objective.backward()
        assert model.embedding.weight.grad.isfinite().all()

    def test_gspo_token(self, mock_transformer_model):
        vocab_size = 1024
        model = mock_transformer_model(vocab_size=vocab_size)
        tokenizer = chatml_tokenizer()
        actor_network = TransformersWrapper(
            model, tokenizer=tokenizer, generate=False, pad_output=True, input_mode="history"
        )
        loss_fn = GSPOTokenLoss(actor_network)
        data = _mock_data_gspo(vocab_size, tokenizer, per_token_advantage=True)
        loss_vals = loss_fn(data)
        _check_output(loss_vals, GSPOTokenLossOutput)
        # GSPOLoss refuses the same per-token advantages (by design)
        with pytest.raises(ValueError, match="GSPOTokenLoss"):
            GSPOLoss(actor_network)(data)

    def test_failure_missing_entries(self, mock_transformer_model):
        vocab_size = 1024
        model = mock_transformer_model(vocab_size=vocab_size)
        tokenizer = chatml_tokenizer()
        actor_network = TransformersWrapper(
            model, tokenizer=tokenizer, generate=False, pad_output=True, input_mode="history"
        )
        loss_fn = GSPOLoss(actor_network)
        data = _mock_data_gspo(vocab_size, tokenizer)

        missing = data.clone().exclude(("log_probs", "full"))
        with pytest.raises(KeyError, match="Couldn't find the log-prob"):
            loss_fn(missing)
        with pytest.raises(ValueError, match="Advantage key"):
            loss_fn(data.clone().exclude("advantage"))
        with pytest.raises(ValueError, match="Action key"):
            loss_fn(data.clone().exclude(("tokens", "full")))

        # optional reference log-probs: not needed without a KL-to-reference term ...
        assert ("next", "ref_log_probs", "full") not in data.keys(True)
        assert isinstance(loss_fn(data), GSPOLossOutput)
        # ... and GRPOLoss' own error when the term asks for them
        with_kl = GSPOLoss(actor_network, kl_to_ref_coeff=0.1)
        with pytest.raises(KeyError, match="Couldn't find the ref log-prob"):
            with_kl(data)
