# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Test helpers for TorchRL's LLM wrappers: a tokenizer and tiny models, built in code."""

from __future__ import annotations

import importlib.util
import string
import sys
from pathlib import Path
from types import ModuleType

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from torchrl.data.llm.history import _CHAT_TEMPLATES
from torchrl.modules.llm import TransformersWrapper
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def word_tokenizer(size: int = 24) -> PreTrainedTokenizerFast:
    """Words ``t0 .. t{size-1}``: ``t0`` pads, ``t1`` ends a sequence, ``t2`` is unknown."""
    vocab = {f"t{i}": i for i in range(size)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t2")),
        pad_token="t0",
        eos_token="t1",
    )


def chatml_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character and ChatML's special tokens, with
    TorchRL's ChatML chat template: any chat history renders and round-trips."""
    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + list(string.printable))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=specials[0],
        eos_token=specials[2],
        additional_special_tokens=[specials[1]],
    )
    tokenizer.chat_template = _CHAT_TEMPLATES["chatml_format"]
    return tokenizer


def allow_only(tokenizer: PreTrainedTokenizerFast, characters: str) -> list[list[int]]:
    """``bad_words_ids`` that ban every token but ``characters`` and end-of-sequence."""
    allowed = {tokenizer.convert_tokens_to_ids(c) for c in characters}
    allowed.add(tokenizer.eos_token_id)
    return [[i] for i in range(len(tokenizer)) if i not in allowed]


def _common(tokenizer: PreTrainedTokenizerFast, tie: bool) -> dict:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": tie,
    }


def tiny_qwen(tokenizer: PreTrainedTokenizerFast, seed: int, tie: bool = True) -> Qwen2ForCausalLM:
    """A random-init two-layer Qwen2 in eval mode."""
    torch.manual_seed(seed)
    config = Qwen2Config(intermediate_size=64, num_hidden_layers=2, **_common(tokenizer, tie))
    return Qwen2ForCausalLM(config).eval()


def tiny_qwen_moe(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3MoeForCausalLM:
    """A random-init four-layer Qwen3-MoE (8 experts, top-2) in eval mode."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        **_common(tokenizer, True),
    )
    return Qwen3MoeForCausalLM(config).eval()


def training_wrapper(model: torch.nn.Module, tokenizer, pad_output: bool = False):
    """TorchRL's training configuration: it scores the sampled tokens, one log-prob each."""
    return TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=False,
        return_log_probs=True,
        pad_output=pad_output,
    )


def example(name: str) -> ModuleType:
    """The example script ``examples/<name>.py`` as a module: for the tests of that example."""
    if name not in sys.modules:
        if str(EXAMPLES) not in sys.path:  # the examples import each other
            sys.path.insert(0, str(EXAMPLES))
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
