# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""A pytest plugin that runs upstream's LLM objective tests without the hub.

TorchRL's ``test/llm/test_llm_objectives.py`` builds its mock data with
``AutoTokenizer.from_pretrained("Qwen/Qwen2.5-0.5B")``, a download. This plugin
answers that one name with a byte-level tokenizer built in memory (its ids differ
from Qwen's; its name keeps TorchRL's Qwen chat template) and leaves every other
name to transformers. Load it with ``-p hub_stand_in`` and ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

STAND_IN_FOR = "Qwen/Qwen2.5-0.5B"
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@functools.cache
def byte_level_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """One token per byte, plus the chat template's special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate((*SPECIAL, *alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        name_or_path=name,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
    )


def pytest_configure(config):
    original = AutoTokenizer.from_pretrained.__func__

    def from_pretrained(cls, name, *args, **kwargs):
        if name == STAND_IN_FOR:
            return byte_level_tokenizer(name)
        return original(cls, name, *args, **kwargs)

    AutoTokenizer.from_pretrained = classmethod(from_pretrained)
