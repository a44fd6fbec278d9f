# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPO and GRPO on a tiny Mixture-of-Experts model: routing volatility and Routing Replay.

The toy task and TorchRL pipeline of ``gspo_toy.py`` (``ChatEnv`` -> ``LLMCollector`` ->
``ReplayBuffer`` with ``MCAdvantage`` -> ``GRPOTrainer``, 4 minibatches per batch) on a
randomly initialized Qwen3-MoE (``Qwen3MoeConfig``: 4 layers, 8 experts, top-2), built in
code. The collector's postproc computes the old log-probs and records, per token and
layer, the experts they were computed with (:class:`~torchrl_gspo.RecordRoutes`).

First, on one collected batch: the fraction of (token, layer) top-2 expert sets that one
Adam step changes, and the fraction of activated experts it changes (the GSPO paper's
count, at most the first), per layer and overall, and the spread of GRPO's token log-ratios and
GSPO's sequence log-ratios after that step, with and without Routing Replay
(:class:`~torchrl_gspo.RoutingReplay`).

Then four runs with the same seed and budget: GRPO, GRPO with Routing Replay, GSPO and
GSPO with Routing Replay. Each batch records the reward, the clip fractions of the
minibatches (valid tokens), the spread of the sequence log-ratios after the batch's
updates (with the run's replay setting), and the routing volatility of the batch, both
counts (recorded routes against those of the updated model).

Usage::

    python examples/moe_routing.py                  # the measurement and the 4 runs
    python examples/moe_routing.py --steps 20 --runs gspo,grpo-replay

Outputs in ``--out`` (default ``outputs/moe_routing``): ``one_update.json``,
``metrics_<run>.jsonl``, ``summary.json`` and ``moe_routing.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import gspo_toy
import torch
from tensordict import TensorDictBase
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

from torchrl_gspo import RecordRoutes, RoutingReplay, routing_volatility

RUNS = ("grpo", "grpo-replay", "gspo", "gspo-replay")


def build_moe_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3MoeForCausalLM:
    """A randomly initialized 4-layer Qwen3-MoE, 8 experts, top-2; ``seed`` also seeds sampling."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    return Qwen3MoeForCausalLM(config).eval()


def build(run: str, args: argparse.Namespace):
    """The example's pipeline on the MoE model; routes recorded, replayed if asked."""
    holder: dict = {}

    def model_fn(tokenizer, seed):
        model = build_moe_model(tokenizer, seed)
        holder["replay"] = RoutingReplay(model)
        return model

    def postproc_fn(postproc):
        record = RecordRoutes(holder["replay"], postproc)

        def remember(data: TensorDictBase) -> TensorDictBase:
            holder["batch"] = record(data)
            return holder["batch"]

        return remember

    pipeline = gspo_toy.build_pipeline(
        run.removesuffix("-replay"), args, model_fn=model_fn, postproc_fn=postproc_fn
    )
    if run.endswith("-replay"):
        holder["replay"].replay_for(pipeline.loss_fn)
    return pipeline, holder


def batch_layout(data: TensorDictBase) -> tuple[list[int], torch.Tensor]:
    """Row lengths, and the left-padded mask of the response tokens."""
    fulls = data.get(("tokens", "full"), as_list=True)
    responses = data.get(("tokens", "response"), as_list=True)
    lengths = [f.numel() for f in fulls]
    mask = torch.zeros(len(fulls), max(lengths), dtype=torch.bool)
    for i, r in enumerate(responses):
        if r.numel():
            mask[i, -r.numel() :] = True
    return lengths, mask


def measure(policy, replay: RoutingReplay, data: TensorDictBase, replayed: bool) -> dict:
    """Routing volatility of ``data`` and the spread of its log-ratios against its old ones."""
    lengths, mask = batch_layout(data)
    recorded = replay.from_rows(data.get(("routing", "experts"), as_list=True))
    with torch.no_grad(), replay.capture() as now:
        plain = policy(data.copy()).get(("log_probs", "full"), as_list=True)
    if replayed:
        with torch.no_grad(), replay.replay(recorded):
            current = policy(data.copy()).get(("log_probs", "full"), as_list=True)
    else:
        current = plain
    old = data.get(("log_probs", "full"), as_list=True)
    responses = [int(m.sum()) for m in mask]
    tokens = [(c - o)[len(c) - n :] for c, o, n in zip(current, old, responses, strict=True)]
    token_ratios = torch.cat(tokens)
    sequence = torch.stack([t.mean() for t in tokens if t.numel()])
    sets = routing_volatility(recorded, now, mask, count="sets")
    experts = routing_volatility(recorded, now, mask, count="experts")
    return {
        "set_volatility_per_layer": sets[:-1].tolist(),
        "set_volatility": float(sets[-1]),
        "expert_volatility_per_layer": experts[:-1].tolist(),
        "expert_volatility": float(experts[-1]),
        "token_log_ratio_std": float(token_ratios.std()),
        "sequence_log_ratio_std": float(sequence.std()),
    }


def one_update(args: argparse.Namespace) -> dict:
    """One collected batch, one Adam step (GRPO loss on the whole batch), measured."""
    pipeline, holder = build("grpo", args)
    next(iter(pipeline.collector))
    pipeline.collector.shutdown()
    data = pipeline.buffer[:]  # with MCAdvantage's advantages and the recorded routes
    policy = pipeline.loss_fn.actor_network
    optimizer = torch.optim.Adam(pipeline.model.parameters(), lr=args.lr)
    pipeline.loss_fn(data).loss_objective.backward()
    optimizer.step()
    return {
        "without_replay": measure(policy, holder["replay"], data, replayed=False),
        "with_replay": measure(policy, holder["replay"], data, replayed=True),
    }


class MoEMetrics(gspo_toy.StepMetrics):
    """The example's per-batch record, plus the batch's volatility and log-ratio spread."""

    def __init__(self, *args, pipeline, holder, replayed: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pipeline, self.holder, self.replayed = pipeline, holder, replayed

    def extra_fields(self, minibatches: list[dict]) -> dict:
        policy = self.pipeline.loss_fn.actor_network
        return measure(policy, self.holder["replay"], self.holder["batch"], self.replayed)


def train(run: str, args: argparse.Namespace) -> list[dict]:
    pipeline, holder = build(run, args)
    with (
        (args.out / f"metrics_{run}.jsonl").open("w") as file,
        tqdm(total=args.steps, desc=run, disable=args.no_progress) as bar,
    ):
        loss_name = run.removesuffix("-replay")
        metrics = MoEMetrics(
            loss_name, file, bar, pipeline=pipeline, holder=holder, replayed=run.endswith("-replay")
        )
        pipeline.loss_fn.register_forward_hook(metrics.on_loss)
        pipeline.trainer.register_op("post_steps_log", metrics.on_step_end)
        pipeline.trainer.train()
    return metrics.records


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for name, records in runs.items():
        out[name] = {
            "steps": len(records),
            "reward_first_10pct": gspo_toy.window_mean(records, "reward", True),
            "reward_last_10pct": gspo_toy.window_mean(records, "reward", False),
            "clip_fraction_off_policy_mean": gspo_toy._mean(
                [r["clip_fraction_off_policy"] for r in records]
            ),
            "set_volatility_mean": gspo_toy._mean([r["set_volatility"] for r in records]),
            "expert_volatility_mean": gspo_toy._mean([r["expert_volatility"] for r in records]),
            "sequence_log_ratio_std_mean": gspo_toy._mean(
                [r["sequence_log_ratio_std"] for r in records]
            ),
            "token_log_ratio_std_mean": gspo_toy._mean([r["token_log_ratio_std"] for r in records]),
            "seconds": records[-1]["elapsed_s"],
        }
    return out


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (
        ("reward", "mean reward"),
        ("clip_fraction_off_policy", "clip fraction, off-policy minibatches"),
        ("sequence_log_ratio_std", "std of sequence log-ratios after the updates"),
        ("expert_volatility", "activated experts changed (the paper's count)"),
    )
    fig, axes = plt.subplots(1, len(keys), figsize=(17, 3.8))
    for name, records in runs.items():
        steps = [r["step"] for r in records]
        for ax, (key, _) in zip(axes, keys, strict=True):
            ax.plot(steps, [r[key] for r in records], label=name, linewidth=1.2)
    for ax, (_, title) in zip(axes, keys, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "Tiny Qwen3-MoE (4 layers, 8 experts, top-2): GRPO and GSPO, with and "
        "without Routing Replay"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    return gspo_toy.parse_runs(parser, RUNS, argv, steps=60, out="outputs/moe_routing")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = one_update(copy.copy(args))
    (args.out / "one_update.json").write_text(json.dumps(report, indent=2) + "\n")
    runs = {name: train(name, args) for name in args.runs.split(",")}
    plot(runs, args.out / "moe_routing.png")
    return gspo_toy.write_summary(args.out, {"one_update": report, **summarize(runs)})


if __name__ == "__main__":
    main()
