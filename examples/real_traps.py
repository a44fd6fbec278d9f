# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Two traps of a real tokenizer and chat template, measured on SmolLM2-135M-Instruct.

- ``pad-mass``: the probability that the full distribution gives the banned pad token
  (``<|endoftext|>``) at each sampled position. Banning it truncates the sampler, so
  the responses are not drawn from exactly the distribution that the loss scores; this
  measures by how much.
- ``rlhf-mask``: what TorchRL's ``"rlhf"`` mask holds, against the sampled ids, on
  single-turn and two-turn dialogs. The history-mode training wrapper re-renders the
  dialog and re-tokenizes it; each sampled response is compared with its run of the
  assistant mask: ``exact``, ``eos_left_out`` (the sampled end of turn is not in the
  mask), ``eos_appended`` (an end of turn never sampled is in it) or ``other_ids``
  (the same text came back as other ids, or whitespace was stripped). Responses that
  ended with the end of turn and responses cut at the length limit are counted apart.

Usage::

    python examples/real_traps.py pad-mass --prompts 32 --max-new-tokens 24
    python examples/real_traps.py rlhf-mask --dialogs 16 --max-new-tokens 16 --seed 0

Each prints a JSON object; the docs' page "A real model" and VALIDATION.md quote them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter

import gspo_real
import smollm2
import torch
from tensordict import TensorDict, lazy_stack
from torchrl.data.llm import History
from torchrl.modules.llm import TransformersWrapper
from torchrl.modules.llm.policies import ChatHistory


def chats(tokenizer, count: int) -> list[list[dict[str, str]]]:
    """``count`` held-out problems as dialogs with the model's own system prompt."""
    system = gspo_real.system_prompt(tokenizer)
    held_out = gspo_real.problems().validation
    return [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": gspo_real.PROMPT.format(*p)},
        ]
        for p in held_out[:count]
    ]


@torch.no_grad()
def pad_mass(model, tokenizer, count: int, max_new_tokens: int) -> dict:
    """The pad token's probability at each sampled position, under the full
    distribution at temperature 1."""
    pad = tokenizer.pad_token_id
    masses = []
    for chat in chats(tokenizer, count):
        prompt = tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        sequence = model.generate(prompt, **gspo_real.generate_kwargs(tokenizer, max_new_tokens))
        logits = model(sequence).logits[0, prompt.shape[1] - 1 : -1].float()
        masses += logits.softmax(-1)[:, pad].tolist()
    return {
        "positions": len(masses),
        "mean": statistics.fmean(masses),
        "median": statistics.median(masses),
        "max": max(masses),
    }


def assistant_runs(tokens: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """The ids of each contiguous run of ``mask``, in order."""
    runs, previous = [], False
    for token, inside in zip(tokens.tolist(), mask.tolist(), strict=True):
        if inside and not previous:
            runs.append([])
        if inside:
            runs[-1].append(token)
        previous = inside
    return runs


def kind(sampled: list[int], masked: list[int], eos: int) -> str:
    """How the mask's run ``masked`` relates to the ``sampled`` response."""
    if masked == sampled:
        return "exact"
    if sampled[-1] == eos and masked == sampled[:-1]:
        return "eos_left_out"
    if masked[-1:] == [eos] and masked[:-1] == sampled:
        return "eos_appended"
    return "other_ids"


@torch.no_grad()
def rlhf_mask(model, tokenizer, dialogs: int, max_new_tokens: int, turns: int) -> dict:
    """Counts of each :func:`kind`, after each turn, over every response so far."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = {"tokenizer": tokenizer, "input_mode": "history", "pad_output": False}
    common["chat_template_name"] = "chatml_format"
    kwargs = gspo_real.generate_kwargs(tokenizer, max_new_tokens)
    generator = TransformersWrapper(model, generate=True, generate_kwargs=kwargs, **common)
    scorer = TransformersWrapper(model, generate=False, return_log_probs=True, **common)
    histories = History.from_chats(chats(tokenizer, dialogs)).unbind(0)
    sampled: list[list[list[int]]] = [[] for _ in range(dialogs)]
    report = {}
    for turn in range(1, turns + 1):
        out = generator(lazy_stack([TensorDict(history=ChatHistory(prompt=h)) for h in histories]))
        for row, response in enumerate(out.get(("tokens", "response"), as_list=True)):
            sampled[row].append(response.tolist())
        histories = out["history"].full.unbind(0)
        scored = scorer(lazy_stack([TensorDict(history=ChatHistory(full=h)) for h in histories]))
        tokens = scored.get(("tokens", "full"), as_list=True)
        masks = scored.get(("masks", "all_assistant_mask"), as_list=True)
        counts = {"ended": Counter(), "cut": Counter()}
        for row in range(dialogs):
            runs = assistant_runs(tokens[row], masks[row].bool())
            if len(runs) != len(sampled[row]):
                counts["cut"]["runs_mismatch"] += 1
                continue
            for response, run in zip(sampled[row], runs, strict=True):
                ending = "ended" if response[-1] == eos else "cut"
                counts[ending][kind(response, run, eos)] += 1
        report[f"turns={turn}"] = {ending: dict(c) for ending, c in counts.items()}
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("measure", choices=["pad-mass", "rlhf-mask"])
    parser.add_argument("--prompts", type=int, default=32, help="pad-mass: held-out prompts")
    parser.add_argument("--dialogs", type=int, default=16, help="rlhf-mask: dialogs")
    parser.add_argument("--turns", type=int, default=2, help="rlhf-mask: assistant turns")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model, tokenizer = smollm2.load()
    gspo_real.configure_pad(model, tokenizer)
    torch.manual_seed(args.seed)
    if args.measure == "pad-mass":
        result = pad_mass(model, tokenizer, args.prompts, args.max_new_tokens)
    else:
        result = rlhf_mask(model, tokenizer, args.dialogs, args.max_new_tokens, args.turns)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
