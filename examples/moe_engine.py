# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Rollout Routing Replay (R3) against Routing Replay (R2): a bfloat16 engine, a tiny MoE.

The TorchRL pipeline of ``gspo_toy.py`` on the tiny Qwen3-MoE of ``moe_routing.py``
(4 layers, 8 experts, top-2), sampled by a **bfloat16 copy** of the float32 trainer,
as in ``engine_mismatch.py``. The copy stands in for an inference engine that returns
its routes (vLLM's ``routed_experts``): :func:`~torchrl_gspo.record_generation`
captures them during ``generate`` and writes them on each row, and the engine's
log-probs come from a scoring pass on the copy that replays them (TorchRL's generating
wrapper reports 0 for the first response token).

Six runs of GSPOLoss, the grid of the old policy and the replay:

- old policy ``engine`` (the engine's log-probs) or ``recomputed`` (the trainer's,
  recomputed in the collector's postproc);
- replay ``none``; ``r2``: the trainer's recompute records its own routes
  (:class:`~torchrl_gspo.RecordRoutes`) and the loss replays them; ``r3``: the
  trainer's recompute and the loss replay the engine's routes.

Every batch records, before any update, on the same rows and whatever the run: the
engine mismatch ``|log rho_i| = |mean_t (log pi_trainer - log pi_engine)|`` over each
response, with the trainer routing on its own (``none``) and replaying the engine's
routes (``r3``; R2 changes neither: it replays the trainer's own routes); the fraction
of (token, layer) top-2 sets, and of activated experts, that differ between engine
and trainer, on the positions whose forward scores a response token; then the run's
GSPO clip fraction on the first minibatch and on the later, off-policy ones.

Usage::

    python examples/moe_engine.py                       # the six runs, one seed
    python examples/moe_engine.py --steps 5 --runs engine-none,engine-r3
    python examples/seeds.py r3                         # the measurement: 5 seeds

Outputs in ``--out`` (default ``outputs/moe_engine``): ``metrics_<run>.jsonl`` and
``summary.json``.
"""

from __future__ import annotations

import argparse

import engine_mismatch
import gspo_toy
import moe_routing
import torch
from tensordict import TensorDictBase
from tqdm import tqdm

from torchrl_gspo import RecordRoutes, RoutingReplay, record_generation, routing_volatility

RUNS = tuple(
    f"{old}-{replay}" for old in ("engine", "recomputed") for replay in ("none", "r2", "r3")
)
TOKENS = ("tokens", "full")
ENGINE_ROUTES = ("routing", "experts")  # the generation's, written by record_generation
TRAINER_ROUTES = ("trainer_routing", "experts")  # R2: the trainer recompute's own


def mismatch(policy, replay: RoutingReplay, data: TensorDictBase) -> dict:
    """The engine-trainer mismatch of a collected batch, before any update."""
    fulls = data.get(TOKENS, as_list=True)
    responses = data.get(("tokens", "response"), as_list=True)
    width = max(f.numel() for f in fulls)
    # the positions whose forward scores a response token: the last prompt token's
    # and the response's but the last (the ChatML template's positions left out)
    scored = torch.zeros(len(fulls), width, dtype=torch.bool)
    for i, response in enumerate(responses):
        scored[i, width - response.numel() - 1 : width - 1] = True
    engine_routes = replay.from_rows(data.get(ENGINE_ROUTES, as_list=True))
    with torch.no_grad(), replay.capture() as own:
        plain = policy(data.copy()).get(("log_probs", "full"), as_list=True)
    with torch.no_grad(), replay.replay(engine_routes):
        forced = policy(data.copy()).get(("log_probs", "full"), as_list=True)
    engine = data.get(("log_probs", "full"), as_list=True)
    none = engine_mismatch.response_log_ratios(plain, engine, responses)
    r3 = engine_mismatch.response_log_ratios(forced, engine, responses)
    return {
        "log_rho_abs_none": sum(map(abs, none)) / len(none),
        "log_rho_abs_r3": sum(map(abs, r3)) / len(r3),
        "set_mismatch": float(routing_volatility(engine_routes, own, scored)[-1]),
        "expert_mismatch": float(
            routing_volatility(engine_routes, own, scored, count="experts")[-1]
        ),
    }


def build(run: str, args: argparse.Namespace):
    """The pipeline of ``run``, and its postproc that also measures the mismatch."""
    old, mode = run.split("-")
    trainer_key = "old_log_probs" if old == "recomputed" else "trainer_log_probs"
    pipeline = gspo_toy.build_pipeline(
        "gspo",
        args,
        engine_dtype=torch.bfloat16,
        trainer_key=trainer_key,
        model_fn=moe_routing.build_moe_model,
    )
    engine_scorer, trainer_scorer = pipeline.collector.postproc.transforms
    engine_replay, trainer_replay = RoutingReplay(pipeline.engine), RoutingReplay(pipeline.model)
    record_generation(engine_replay, pipeline.generator)  # R3's routes: the sampling pass
    engine_replay.replay_for(engine_scorer, tokens_key=TOKENS)  # the engine's log-probs
    if mode == "r3":
        trainer_replay.replay_for(trainer_scorer, tokens_key=TOKENS)
        trainer_replay.replay_for(pipeline.loss_fn, key=ENGINE_ROUTES)
    elif mode == "r2":
        trainer_scorer = RecordRoutes(trainer_replay, trainer_scorer, key=TRAINER_ROUTES)
        trainer_replay.replay_for(pipeline.loss_fn, key=TRAINER_ROUTES)
    return pipeline, engine_scorer, trainer_scorer, trainer_replay


class EngineMetrics(gspo_toy.StepMetrics):
    """The example's per-batch record, plus the batch's engine-trainer mismatch."""

    fields: dict

    def extra_fields(self, minibatches: list[dict]) -> dict:
        return self.fields


def train(run: str, args: argparse.Namespace) -> list[dict]:
    pipeline, engine_scorer, trainer_scorer, replay = build(run, args)
    policy = pipeline.loss_fn.actor_network
    with (
        (args.out / f"metrics_{run}.jsonl").open("w") as file,
        tqdm(total=args.steps, desc=run, disable=args.no_progress) as bar,
    ):
        metrics = EngineMetrics("gspo", file, bar)

        def postproc(data: TensorDictBase) -> TensorDictBase:
            data = trainer_scorer(engine_scorer(data))
            metrics.fields = mismatch(policy, replay, data)
            return data

        pipeline.collector.postproc = postproc
        pipeline.loss_fn.register_forward_hook(metrics.on_loss)
        pipeline.trainer.register_op("post_steps_log", metrics.on_step_end)
        pipeline.trainer.train()
    return metrics.records


def summarize(runs: dict[str, list[dict]]) -> dict:
    keys = (
        "clip_fraction_first",
        "clip_fraction_off_policy",
        "log_rho_abs_none",
        "log_rho_abs_r3",
        "set_mismatch",
        "expert_mismatch",
    )
    return {
        name: {
            "steps": len(records),
            "reward_first_10pct": gspo_toy.window_mean(records, "reward", True),
            "reward_last_10pct": gspo_toy.window_mean(records, "reward", False),
            "reward_mean": gspo_toy._mean([r["reward"] for r in records]),
            **{f"{key}_mean": gspo_toy._mean([r[key] for r in records]) for key in keys},
            "seconds": records[-1]["elapsed_s"],
        }
        for name, records in runs.items()
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    return gspo_toy.parse_runs(parser, RUNS, argv, steps=20, out="outputs/moe_engine", lr=1e-5)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {name: train(name, args) for name in args.runs.split(",")}
    return gspo_toy.write_summary(args.out, summarize(runs))


if __name__ == "__main__":
    main()
