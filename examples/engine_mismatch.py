# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPO with an inference engine whose log-probs differ from the trainer's, on a CPU.

The toy task and TorchRL pipeline of ``gspo_toy.py`` (``ChatEnv`` -> ``LLMCollector``
-> ``ReplayBuffer`` with ``MCAdvantage`` -> ``GRPOTrainer``, 4 minibatches per batch),
with the responses sampled by a **bfloat16 copy** of the trained float32 model: the
precision gap of real inference engines (vLLM samples from bfloat16 weights). The copy
takes the trainer's weights after every batch's updates (a state-dict copy), and its own
log-probabilities (bfloat16 logits, log-softmax in float32) are the rollout log-probs
at ``("log_probs", "full")``. The generation wrapper reports 0 for the first response
token, so the copy scores the sampled tokens in a no-grad forward instead
(:class:`~torchrl_gspo.RecomputeOldLogProbs` on the copy); the trainer's own
log-probs are recomputed the same way on the float32 model.

Four runs, the same seed and budget:

- ``grpo``: GRPOLoss, the rollout log-probs as the old policy;
- ``gspo-rollout``: GSPOLoss, the rollout log-probs as the old policy: the GSPO paper's
  claim that sequence likelihoods let one use the engine's likelihoods directly;
- ``gspo-recomputed``: GSPOLoss with the trainer's recomputed old log-probs
  (``("old_log_probs", "full")``), no correction;
- ``gspo-corrected``: the same with the sequence-level rollout correction
  (``--correction``, default geometric mask with its default band).

Every run records, per batch, the engine mismatch of each sequence,
``|log rho_i| = |mean_t (log pi_trainer - log pi_engine)|`` over its response tokens,
against GSPO's clip band, the clip fraction of the first (nominally on-policy)
minibatch, the reward, and the correction's masked/truncated fraction.

Usage::

    python examples/engine_mismatch.py                    # the four runs, ~1.5 min each
    python examples/engine_mismatch.py --steps 20 --runs gspo-rollout,gspo-recomputed

Outputs in ``--out`` (default ``outputs/engine_mismatch``): ``metrics_<run>.jsonl``,
``summary.json`` and ``engine_mismatch.png``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import gspo_toy
import torch
from tensordict import TensorDictBase
from tqdm import tqdm

RUNS = {
    # name: (loss, where the trainer's recomputed log-probs go)
    "grpo": ("grpo", "trainer_log_probs"),
    "gspo-rollout": ("gspo", "trainer_log_probs"),
    "gspo-recomputed": ("gspo", "old_log_probs"),
    "gspo-corrected": ("gspo", "old_log_probs"),
}
CORRECTIONS = (
    "mask-geometric",
    "truncate-geometric",
    "mask-sequence",
    "truncate-sequence",
    "masked_is-sequence",
)
CLIP = (3e-4, 4e-4)  # GSPO's clip range: log-ratios outside (log(1-3e-4), log(1+4e-4)) clip


def correction_kwargs(correction: str) -> dict:
    """``GSPOLoss``' arguments for a ``--correction`` choice, ``"<mode>-<form>"``."""
    mode, form = correction.split("-")
    return {"rollout_correction": mode, "rollout_correction_form": form}


def response_log_ratios(current: list, engine: list, responses: list) -> list[float]:
    """log rho_i per non-empty response: the mean over its tokens of current - engine."""
    return [
        (c[-len(r) :].double() - e[-len(r) :].double()).mean().item()
        for c, e, r in zip(current, engine, responses, strict=True)
        if len(r)
    ]


def engine_log_ratios(data: TensorDictBase, trainer_key: str) -> list[float]:
    """log rho_i per sequence: the mean over its response tokens of trainer - engine."""
    return response_log_ratios(
        data.get((trainer_key, "full"), as_list=True),
        data.get(("log_probs", "full"), as_list=True),
        data.get(("tokens", "response"), as_list=True),
    )


def outside_band(log_rhos: list[float]) -> float:
    low, high = math.log1p(-CLIP[0]), math.log1p(CLIP[1])
    return sum(not low <= x <= high for x in log_rhos) / max(len(log_rhos), 1)


class MismatchMetrics(gspo_toy.StepMetrics):
    """The example's per-batch record, plus the engine mismatch and the correction."""

    def __init__(self, *args, trainer_key: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trainer_key = trainer_key
        self.log_rhos: list[float] = []

    def on_collect(self, data: TensorDictBase) -> TensorDictBase:
        self.log_rhos = engine_log_ratios(data, self.trainer_key)
        return data

    def on_loss(self, module, args, out) -> None:
        super().on_loss(module, args, out)
        fraction = getattr(out, "rollout_correction_fraction", None)
        self._minibatches[-1]["correction_fraction"] = None if fraction is None else float(fraction)

    def extra_fields(self, minibatches: list[dict]) -> dict:
        return {
            "log_rho": self.log_rhos,
            "log_rho_mean_abs": sum(map(abs, self.log_rhos)) / max(len(self.log_rhos), 1),
            "outside_clip_band": outside_band(self.log_rhos),
            "correction_fraction": gspo_toy._mean(
                [mb["correction_fraction"] for mb in minibatches]
            ),
        }


def train(name: str, args: argparse.Namespace) -> list[dict]:
    loss_name, trainer_key = RUNS[name]
    loss_kwargs = correction_kwargs(args.correction) if name == "gspo-corrected" else {}
    pipeline = gspo_toy.build_pipeline(
        loss_name,
        args,
        engine_dtype=torch.bfloat16,
        trainer_key=trainer_key,
        loss_kwargs=loss_kwargs,
    )
    with (
        (args.out / f"metrics_{name}.jsonl").open("w") as file,
        tqdm(total=args.steps, desc=name, disable=args.no_progress) as bar,
    ):
        metrics = MismatchMetrics(loss_name, file, bar, trainer_key=trainer_key)
        postproc = pipeline.collector.postproc
        pipeline.collector.postproc = lambda data: metrics.on_collect(postproc(data))
        handle = pipeline.loss_fn.register_forward_hook(metrics.on_loss)
        pipeline.trainer.register_op("post_steps_log", metrics.on_step_end)
        try:
            pipeline.trainer.train()
        finally:
            handle.remove()
    return metrics.records


def summarize(runs: dict[str, list[dict]]) -> dict:
    summary = {}
    for name, records in runs.items():
        log_rhos = [x for r in records for x in r["log_rho"]]
        summary[name] = {
            "steps": len(records),
            "reward_first_10pct": gspo_toy.window_mean(records, "reward", True),
            "reward_last_10pct": gspo_toy.window_mean(records, "reward", False),
            "clip_fraction_first_minibatch_mean": gspo_toy._mean(
                [r["clip_fraction_first"] for r in records]
            ),
            "clip_fraction_off_policy_mean": gspo_toy._mean(
                [r["clip_fraction_off_policy"] for r in records]
            ),
            "log_rho_mean_abs": sum(map(abs, log_rhos)) / len(log_rhos),
            "log_rho_median_abs": sorted(map(abs, log_rhos))[len(log_rhos) // 2],
            "outside_clip_band": outside_band(log_rhos),
            "correction_fraction_mean": gspo_toy._mean([r["correction_fraction"] for r in records]),
            "seconds": records[-1]["elapsed_s"],
        }
    return summary


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for name, records in runs.items():
        steps = [r["step"] for r in records]
        axes[0].plot(steps, [r["reward"] for r in records], label=name, linewidth=1.2)
        axes[1].plot(steps, [r["clip_fraction_first"] for r in records], label=name, lw=1.2)
    log_rhos = [abs(x) for records in runs.values() for r in records for x in r["log_rho"]]
    if log_rhos:
        top = max(max(log_rhos), 2 * CLIP[1])
        bins = torch.logspace(-7, math.log10(top), 40).tolist()
        axes[2].hist([max(x, 1e-7) for x in log_rhos], bins=bins, color="0.5")
        axes[2].set_xscale("log")
        axes[2].axvline(math.log1p(CLIP[1]), color="C3", label="clip band: log(1 + 4e-4)")
        axes[2].axvline(-math.log1p(-CLIP[0]), color="C1", ls="--", label="-log(1 - 3e-4)")
        axes[2].legend(fontsize=8)
    corrected = runs.get("gspo-corrected")
    if corrected:
        axes[3].plot(
            [r["step"] for r in corrected], [r["correction_fraction"] for r in corrected], lw=1.2
        )
    titles = (
        "mean reward",
        "clip fraction, first minibatch (valid tokens)",
        "|log rho_i|: engine mismatch per sequence",
        "gspo-corrected: sequences masked/truncated",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in (axes[0], axes[1], axes[3]):
        ax.set_xlabel("step")
    axes[2].set_xlabel("|log rho_i| (all runs, all batches)")
    axes[0].legend(fontsize=8)
    fig.suptitle("bfloat16 engine, float32 trainer: tiny Qwen2, clip 3e-4/4e-4 (GRPO 0.2/0.27)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--correction",
        default="mask-geometric",
        choices=CORRECTIONS,
        help="rollout correction of the gspo-corrected run (default thresholds)",
    )
    return gspo_toy.parse_runs(parser, RUNS, argv, steps=70, out="outputs/engine_mismatch")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {name: train(name, args) for name in args.runs.split(",")}
    plot(runs, args.out / "engine_mismatch.png")
    return gspo_toy.write_summary(args.out, summarize(runs))


if __name__ == "__main__":
    main()
