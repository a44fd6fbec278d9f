# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The subsequence objective's clip band on the real model, measured.

One run of ``examples/gspo_real.py``'s pipeline on SmolLM2-135M-Instruct trains
with ``SubsequenceLoss(segments=1)`` (GSPO exactly) on the calibrated task with
working (``--task smaller-steps``: "compare them step by step, one short sentence
per step"). On every minibatch it trains on, a forward hook scores the same batch,
without gradient, with ``SubsequenceLoss`` at each segmentation of ``--segments``
(K equal segments, or ``delimiters``: a segment ends after . , ; : ! ? or a newline),
each with its default band (GSPO's at the response's full length, scaled by
``(|y| / L)^(1/2)``). It prints, per segmentation, the per-token clip fraction over
all minibatches and over the off-policy ones (all but each batch's first), the share
of clipped segments and of whole-clipped responses, and the median number of segments
per response; and writes them to ``--out/segment_band.json``. ``--band-scales c ...``
scores each segmentation also with the band ``c * (3e-4, 4e-4)`` (named ``x c``): one
run, a band's width chosen by measurement.

Usage::

    python examples/segment_band.py --steps 8 --lr 3e-7 --out examples/figures/segment_band
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gspo_real  # noqa: E402
import gspo_toy  # noqa: E402

from torchrl_gspo import SubsequenceLoss  # noqa: E402
from torchrl_gspo.segments import delimiter_token_ids  # noqa: E402

FIELDS = ("clip_fraction", "segment_clip_fraction", "whole_clip_fraction")


def segment_counts(responses: list[torch.Tensor], segments, delimiters: set[int]) -> list[int]:
    """Each response's number of segments (its valid tokens are its sampled ones)."""
    if segments != "delimiters":
        return [min(segments, len(r)) for r in responses]
    counts = []
    for response in responses:
        ends = sum(int(t) in delimiters for t in response)
        counts.append(ends + int(len(response) > 0 and int(response[-1]) not in delimiters))
    return counts


class Probe:
    """A forward hook on the training loss: each segmentation's diagnostics on its batch."""

    def __init__(self, losses: dict[str, SubsequenceLoss], minibatches: int, ids) -> None:
        self.losses, self.minibatches, self.delimiters = losses, minibatches, set(ids)
        self.calls = 0
        self.rows = {name: [] for name in losses}
        self.counts = {name: [] for name in losses}

    def __call__(self, module, args, output) -> None:
        data = args[0]
        responses = data.get(("tokens", "response"), as_list=True)
        off_policy = self.calls % self.minibatches != 0
        self.calls += 1
        with torch.no_grad():
            for name, loss_fn in self.losses.items():
                out = loss_fn(data)
                record = {f: float(getattr(out, f)) for f in FIELDS}
                self.rows[name].append({"off_policy": off_policy, **record})
                self.counts[name] += segment_counts(responses, loss_fn.segments, self.delimiters)

    def table(self) -> dict:
        result = {}
        for name, rows in self.rows.items():
            off = [r for r in rows if r["off_policy"]]
            result[name] = {
                **{f: statistics.fmean(r[f] for r in rows) for f in FIELDS},
                "clip_fraction_off_policy": statistics.fmean(r["clip_fraction"] for r in off),
                "median_segments": statistics.median(self.counts[name]),
                "minibatches": len(rows),
            }
        return result


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--segments", nargs="+", default=["1", "2", "4", "delimiters"])
    parser.add_argument(
        "--band-scales",
        nargs="+",
        type=float,
        default=[1.0],
        help="c: each segmentation is also scored with the band c * (3e-4, 4e-4)",
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/segment_band"))
    args = parser.parse_args(argv)
    real = [
        "--task", "smaller-steps", "--loss", "sspo", "--segments", "1",
        "--steps", str(args.steps), "--lr", str(args.lr), "--seed", str(args.seed),
        "--max-new-tokens", str(args.max_new_tokens), "--out", str(args.out), "--no-progress",
    ]  # fmt: skip
    return args, real


def main(argv: list[str] | None = None) -> dict:
    args, real = parse_args(argv)
    start = time.perf_counter()
    config = gspo_real.parse_args(real)
    task = gspo_real.real_task(config)
    setup = gspo_real.engine_setup(config)
    setup["loss_kwargs"] = {**setup["loss_kwargs"], "segments": 1}  # GSPO, exactly
    pipeline = gspo_toy.build_pipeline("sspo", config, task=task, **setup)
    policy = pipeline.loss_fn.actor_network
    ids = delimiter_token_ids(task.tokenizer)
    losses = {
        (f"K={s}" if s.isdigit() else s) + ("" if c == 1 else f" x{c:g}"): SubsequenceLoss(
            policy,
            segments=int(s) if s.isdigit() else s,
            delimiter_ids=None if s.isdigit() else ids,
            clip_epsilon=(3e-4 * c, 4e-4 * c),
            entropy_bonus=False,
        )
        for c in args.band_scales
        for s in args.segments
    }
    probe = Probe(losses, config.minibatches, ids)
    handle = pipeline.loss_fn.register_forward_hook(probe)
    try:
        pipeline.trainer.train()
    finally:
        handle.remove()
    result = {
        "command": "python examples/segment_band.py " + " ".join(argv or sys.argv[1:]),
        "lr": args.lr,
        "steps": args.steps,
        "max_new_tokens": args.max_new_tokens,
        "seconds": time.perf_counter() - start,
        "segmentations": probe.table(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "segment_band.json").write_text(json.dumps(result, indent=2) + "\n")
    print("| segments | clip fraction (all / off-policy) | clipped segments | whole-clipped "
          "responses | median segments |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, row in result["segmentations"].items():
        print(
            f"| {name} | {row['clip_fraction']:.3f} / {row['clip_fraction_off_policy']:.3f} | "
            f"{row['segment_clip_fraction']:.3f} | {row['whole_clip_fraction']:.3f} | "
            f"{row['median_segments']:g} |"
        )
    return result


if __name__ == "__main__":
    main()
