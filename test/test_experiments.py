# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The many-seed runner (``examples/seeds.py``), the warm start and the R3 example."""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import math
import random
import statistics
import subprocess
import sys

import pytest
import torch
from llm_testing import example

seeds = example("seeds")


def _t4(p):
    """Student's t quantile with 4 degrees of freedom, in closed form."""
    alpha = 4 * p * (1 - p)
    q = math.cos(math.acos(math.sqrt(alpha)) / 3) / math.sqrt(alpha)
    return math.copysign(2 * math.sqrt(q - 1), p - 0.5)


@pytest.mark.parametrize("p", [0.975, 0.9])
def test_t_quantile_matches_closed_forms(p):
    """df 1 (Cauchy), 2 and 4 have closed forms; a large df tends to the normal."""
    assert seeds.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-7)
    two = (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    assert seeds.t_quantile(p, 2) == pytest.approx(two, rel=1e-7)
    assert seeds.t_quantile(p, 4) == pytest.approx(_t4(p), rel=1e-7)
    normal = statistics.NormalDist().inv_cdf(p)
    assert seeds.t_quantile(p, 100_000) == pytest.approx(normal, rel=1e-4)


@pytest.mark.parametrize("t", [-3.0, -0.4, 0.0, 0.7, 2.5, 12.0])
def test_t_cdf_matches_closed_forms(t):
    """df 1 (Cauchy) and df 2 have closed forms."""
    assert seeds.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-9)
    assert seeds.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-9)


def test_t_test_p_is_twice_the_tail_of_the_t_statistic():
    """Three values (df 2): p = 2 (1 - F(|mean| / (sd / sqrt 3))), F written out."""
    values = [0.5, 0.5, 2.0]
    t = statistics.fmean(values) / (statistics.stdev(values) / math.sqrt(3))
    expected = 2 * (1 - (0.5 + t / (2 * math.sqrt(2 + t * t))))
    assert seeds.t_test_p(values) == pytest.approx(expected, abs=1e-9)
    assert seeds.t_test_p([1.0]) is None
    assert seeds.t_test_p([0.0, 0.0]) == 1.0 and seeds.t_test_p([2.0, 2.0]) == 0.0


def test_sign_test_counts_and_exact_binomial_p():
    """7 positive, 1 zero, 1 negative: 8 trials, P(X <= 1) = (1 + 8) / 2^8, doubled."""
    result = seeds.sign_test([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.0, -0.1])
    assert (result["positive"], result["zero"], result["negative"]) == (7, 1, 1)
    assert result["p"] == pytest.approx(2 * 9 / 256)
    assert seeds.sign_test([1.0, -1.0])["p"] == 1.0  # capped at 1
    assert seeds.sign_test([0.0])["p"] == 1.0  # no non-zero value


def test_holm_adjusts_step_down_and_keeps_the_order():
    """Sorted 0.01, 0.03, 0.04 over 3: 3 x 0.01, 2 x 0.03, then max(0.06, 1 x 0.04)."""
    adjusted = seeds.holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert adjusted == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
    assert seeds.holm({"a": 0.6, "b": 0.9}) == pytest.approx({"a": 1.0, "b": 1.0})


def _record(config, seed, **summary):
    return {"config": config, "seed": seed, "summary": summary, "curve": [0.0]}


def test_aggregate_gives_intervals_and_paired_differences():
    """Against the t-intervals written out (df 2 and 4, closed forms): per
    configuration, and of the paired differences by seed; seeds on one side only are
    left out of the pair."""
    experiment = seeds.Experiment("test", {"a": None, "b": None}, ("m",), (("a", "b"),))
    a, b = [1.0, 2.0, 4.0], [0.5, 1.5, 2.0, 7.0, 8.0]
    records = [_record("a", s, m=v) for s, v in enumerate(a)]
    records += [_record("b", s, m=v) for s, v in enumerate(b)]
    result = seeds.aggregate(experiment, records)
    t2 = (2 * 0.975 - 1) / math.sqrt(2 * 0.975 * 0.025)
    for name, values, t in (("a", a, t2), ("b", b, _t4(0.975))):
        stats, mean = result["configs"][name]["m"], statistics.fmean(values)
        half = t * statistics.stdev(values) / math.sqrt(len(values))
        assert stats["n"] == len(values) and stats["mean"] == pytest.approx(mean)
        assert (stats["low"], stats["high"]) == pytest.approx((mean - half, mean + half))
    pair = result["pairs"]["a - b"]["m"]
    diffs = [0.5, 0.5, 2.0]  # seeds 0, 1, 2
    half = t2 * statistics.stdev(diffs) / math.sqrt(3)
    assert pair["n"] == 3 and pair["mean"] == pytest.approx(1.0)
    assert (pair["low"], pair["high"]) == pytest.approx((1.0 - half, 1.0 + half))
    assert pair["distinguishable"] is (1.0 - half > 0)
    assert pair["ratio_of_means"] == pytest.approx((7 / 3) / (4 / 3))  # on seeds 0 .. 2


def test_distinguishable_is_whether_the_interval_excludes_zero():
    experiment = seeds.Experiment("test", {"a": None, "b": None}, ("m",), (("a", "b"),))
    t2 = (2 * 0.975 - 1) / math.sqrt(2 * 0.975 * 0.025)

    def pair(a, b):
        records = [_record("a", s, m=v) for s, v in enumerate(a)]
        records += [_record("b", s, m=v) for s, v in enumerate(b)]
        return seeds.aggregate(experiment, records)["pairs"]["a - b"]["m"]

    diffs = [1.0, 1.0, 0.9]  # low = mean - t2 sd / sqrt(3) > 0
    assert statistics.fmean(diffs) - t2 * statistics.stdev(diffs) / math.sqrt(3) > 0
    assert pair([1.0, 2.0, 3.0], [0.0, 1.0, 2.1])["distinguishable"] is True
    below = pair([0.0, 1.0, 2.1], [1.0, 2.0, 3.0])  # the same, negative
    assert below["distinguishable"] is True and below["high"] < 0
    same = pair([1.0, 2.0, 3.0], [2.0, 1.0, 3.0])  # differences 1, -1, 0: contains 0
    assert same["mean"] == 0.0 and same["distinguishable"] is False
    assert pair([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])["ratio_of_means"] is None  # over 0


def test_primary_family_is_holm_adjusted_with_missing_pairs_at_one():
    """A registered family of three pairs, one not run: its p counts 1. The two run
    pairs' p-values are the t-test's (checked against t_test_p); Holm over
    {p1, p2, 1} is then 3 min, max(3 min, 2 max), 1."""
    configs = {"a": None, "b": None, "c": None}  # "d" is registered but not run yet
    pairs = (("a", "b"), ("c", "b"), ("d", "a"))
    experiment = seeds.Experiment("test", configs, ("m",), pairs, primary="m")
    values = {"a": [1.0, 2.0, 3.0, 4.5], "b": [0.0, 0.5, 1.0, 2.0], "c": [0.1, 0.7, 0.9, 2.4]}
    records = [_record(c, s, m=v) for c, vs in values.items() for s, v in enumerate(vs)]
    result = seeds.aggregate(experiment, records)["family"]
    p_ab = seeds.t_test_p([x - y for x, y in zip(values["a"], values["b"], strict=True)])
    p_cb = seeds.t_test_p([x - y for x, y in zip(values["c"], values["b"], strict=True)])
    assert result["metric"] == "m" and result["p"] == pytest.approx(
        {"a - b": p_ab, "c - b": p_cb, "d - a": None}
    )
    low, high = sorted((p_ab, p_cb))
    expected = {"a - b": 3 * p_ab, "c - b": 3 * p_cb, "d - a": 1.0}
    expected["a - b" if p_ab == high else "c - b"] = max(3 * low, 2 * high)
    assert result["holm"] == pytest.approx({k: min(1.0, v) for k, v in expected.items()})
    table = seeds.table(experiment, seeds.aggregate(experiment, records))
    assert "Holm-adjusted" in table and "| d - a | - | 1 |" in table


def test_real_curves_plot_accuracy_clip_and_the_paired_difference(tmp_path, monkeypatch):
    """Records with held-out and clip curves get the four panels; the paired panel's
    curve is the difference by seed of the two configurations' held-out accuracies."""
    experiment = seeds.Experiment("test", {"a": None, "b": None}, ("m",), (("a", "b"),))
    records = [
        {
            **_record(config, seed),
            "curve": [0.0, 0.5],
            "heldout_curve": [[-1, 0.5], [1, 0.5 + offset + seed / 10]],
            "clip_curve": [0.1, 0.2],
        }
        for config, offset in (("a", 0.2), ("b", 0.0))
        for seed in (0, 1)
    ]
    bands = []
    monkeypatch.setattr(seeds, "_band", lambda ax, x, curves, label: bands.append((label, curves)))
    seeds.plot(experiment, records, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert [label for label, _ in bands] == [
        "a",
        "b",
        "a",
        "a",
        "b",
        "b",
        "a - b",
    ]  # reward; per config held-out, clip; pair
    for difference in bands[-1][1]:  # seeds 0 and 1: a - b is 0 before, 0.2 after
        assert difference == pytest.approx([0.0, 0.2])


def test_sweep_rule_picks_the_best_mean_and_the_smaller_rate_on_a_tie():
    """Means over two seeds: a 0.25 / 0.3 / 0.2 (1e-6 wins), b tied at the third
    decimal (0.4 and 0.4004) goes to the smaller rate, at its grid's edge."""
    configs = {"a-lr1e-7": None, "a-lr1e-6": None, "a-lr3e-6": None}
    configs.update({"b-lr3e-7": None, "b-lr1e-5": None})
    experiment = seeds.Experiment("test", configs, ("m",), pick="m")
    values = {
        "a-lr1e-7": (0.2, 0.3),
        "a-lr1e-6": (0.3, 0.3),
        "a-lr3e-6": (0.1, 0.3),
        "b-lr3e-7": (0.4, 0.4),
        "b-lr1e-5": (0.4, 0.4008),
    }
    records = [_record(c, s, m=v) for c, vs in values.items() for s, v in enumerate(vs)]
    picked = seeds.aggregate(experiment, records)["picked"]
    assert picked["a"] == {"lr": 1e-6, "mean": 0.3, "at_edge": False}
    assert picked["b"] == {"lr": 3e-7, "mean": 0.4, "at_edge": True}


def test_the_final_runs_use_the_rates_the_rule_picks_from_the_committed_sweep():
    """real-smaller-final runs each loss at the rate that the registered rule picks
    from the committed records of real-smaller-sweep, its edge extension included:
    every rate of the grid on its two seeds, and the pick inside the extended grid
    or at the extension (no second extension)."""
    sweep = seeds.EXPERIMENTS["real-smaller-sweep"]
    final = seeds.EXPERIMENTS["real-smaller-final"]
    path = seeds.EXAMPLES / "figures" / "seeds" / "real-smaller-sweep" / "results.jsonl"
    records = seeds.load(path, sweep)
    picks = set(seeds.FINAL_RATES)  # the losses whose sweep is complete
    assert {(r["config"], r["seed"]) for r in records if r["config"].split("-lr")[0] in picks} == {
        (name, seed) for name in sweep.configs for seed in (0, 1) if name.split("-lr")[0] in picks
    }
    picked = seeds.aggregate(sweep, records)["picked"]
    for loss, lr in seeds.FINAL_RATES.items():
        assert picked[loss]["lr"] == float(lr)
        config = final.configs[loss]
        assert config.args[config.args.index("--lr") + 1] == lr
        assert config.args[config.args.index("--eval-set") + 1] == "test"
    assert list(final.seed_range()) == list(range(100, 108))
    assert final.primary == "heldout_accuracy_gain" and final.pairs == seeds.FINAL_PAIRS


def test_paper_regime_takes_the_rate_nearest_each_paper_clip_fraction():
    """Clip fractions 0.05 / 0.2 / 0.5 (GSPO target 0.15: 0.2 is nearest) and 0 / 0.001
    / 0.02 (GRPO target 0.0013: 0.001); the gains' paired difference by seed."""
    configs = dict.fromkeys(["gspo-lr1e-7", "gspo-lr3e-7", "gspo-lr1e-6"])
    configs.update(dict.fromkeys(["grpo-lr3e-7", "grpo-lr1e-6", "grpo-lr1e-5"]))
    clips = {"gspo-lr1e-7": 0.05, "gspo-lr3e-7": 0.2, "gspo-lr1e-6": 0.5}
    clips.update({"grpo-lr3e-7": 0.0, "grpo-lr1e-6": 0.001, "grpo-lr1e-5": 0.02})
    gains = {"gspo-lr3e-7": (0.1, 0.3), "grpo-lr1e-6": (0.2, 0.1)}
    metrics = ("clip_fraction_mean", "heldout_accuracy_gain")
    paper = (("gspo", 0.15), ("grpo", 0.0013))
    experiment = seeds.Experiment("test", configs, metrics, paper_clip=paper)
    records = [
        _record(c, s, clip_fraction_mean=clip, heldout_accuracy_gain=gains.get(c, (0, 0))[s])
        for c, clip in clips.items()
        for s in (0, 1)
    ]
    regime = seeds.aggregate(experiment, records)["paper_regime"]
    assert {k: v["config"] for k, v in regime["nearest"].items()} == {
        "gspo": "gspo-lr3e-7",
        "grpo": "grpo-lr1e-6",
    }
    assert regime["pair"] == "gspo-lr3e-7 - grpo-lr1e-6"
    assert regime["difference"]["n"] == 2
    assert regime["difference"]["mean"] == pytest.approx(statistics.fmean([-0.1, 0.2]))


def test_seed_range_starts_at_the_first_seed():
    experiment = seeds.Experiment("test", {}, (), seeds=8, first_seed=100)
    assert experiment.seed_range() == range(100, 108)
    assert experiment.seed_range(2) == range(100, 102)
    assert seeds.Experiment("test", {}, ()).seed_range() == range(8)


def test_kept_log_is_the_run_s_metrics_compressed_and_reproducible(tmp_path):
    config = seeds.Config("gspo_real", "gspo")
    run_dir = tmp_path / "runs" / "gspo-lr1e-7" / "seed3"
    run_dir.mkdir(parents=True)
    text = '{"step": 0, "reward": 0.5}\n{"step": 1, "reward": 0.25}\n'
    (run_dir / "metrics_gspo.jsonl").write_text(text)
    path = seeds.keep_log("gspo-lr1e-7", config, 3, tmp_path)
    assert path == tmp_path / "logs" / "gspo-lr1e-7-seed3.jsonl.gz"
    assert gzip.decompress(path.read_bytes()).decode() == text
    first = path.read_bytes()
    assert seeds.keep_log("gspo-lr1e-7", config, 3, tmp_path).read_bytes() == first  # no mtime


def test_records_of_another_definition_are_left_out(tmp_path):
    """Resuming never mixes definitions: a record whose arguments differ from the
    configuration's current ones is neither skipped nor aggregated."""
    experiment = seeds.EXPERIMENTS["smoke"]
    config = experiment.configs["gspo"]
    current = {**_record("gspo", 0, m=1.0), "args": [config.script, *config.args]}
    stale = {**_record("gspo", 1, m=5.0), "args": [config.script, "--steps", "99"]}
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(current) + "\n" + json.dumps(stale) + "\n")
    assert seeds.load(path, experiment) == [current]


def test_the_machine_record_reads_a_capability_with_a_space(monkeypatch):
    """torch names some instruction sets with a space ("NO AVX", "Z VECTOR"): the
    record keeps the whole name, and the thread count, from the probe's one line."""
    real_run = seeds.subprocess.run

    def run(args, **kwargs):
        if args[0] == sys.executable:  # the torch probe; git runs for real
            return subprocess.CompletedProcess(args, 0, stdout="1 NO AVX\n", stderr="")
        return real_run(args, **kwargs)

    monkeypatch.setattr(seeds.subprocess, "run", run)
    machine = seeds.environment()
    assert machine["cpu_capability"] == "NO AVX" and machine["threads"] == 1


def test_the_runner_records_the_machine_and_resumes(tmp_path, capsys):
    """The smoke experiment (what CI runs): 2 seeds x 2 configurations; each record
    holds the versions, the CPU and 1 thread; a rerun runs only what is missing."""
    result = seeds.main(["smoke", "--out", str(tmp_path)])
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert sorted((r["config"], r["seed"]) for r in records) == [
        ("grpo", 0),
        ("grpo", 1),
        ("gspo", 0),
        ("gspo", 1),
    ]
    for record in records:
        assert record["threads"] == 1 and record["cpu"] and "commit" in record
        assert record["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        assert record["versions"]["torch"] == importlib.metadata.version("torch")
        assert len(record["curve"]) == 3
        assert record["args"][0] == "gspo_toy" and "--seed" in record["command"]
        gain = record["summary"]["reward_last_10pct"] - record["summary"]["reward_first_10pct"]
        assert record["summary"]["reward_gain"] == pytest.approx(gain)
    assert result["seeds"] == [0, 1] and "gspo - grpo" in result["pairs"]
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert json.loads((tmp_path / "aggregate.json").read_text())["experiment"] == "smoke"
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:3]) + "\n")  # one lost
    capsys.readouterr()
    seeds.main(["smoke", "--out", str(tmp_path)])
    assert "3 runs on record, 1 to run" in capsys.readouterr().out
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 4


def test_each_real_configuration_reads_the_run_its_script_writes():
    """The runner reads ``summary.json[config.run]`` and ``metrics_<run>.jsonl``: the
    names ``gspo_real.py`` gives the outputs of those arguments (with an engine, the
    loss and the engine)."""
    gspo_real = example("gspo_real")
    configs = [
        config
        for experiment in seeds.EXPERIMENTS.values()
        for config in experiment.configs.values()
        if config.script == "gspo_real"
    ]
    assert any("--engine" in config.args for config in configs)
    for config in configs:
        assert config.run == gspo_real.run_name(gspo_real.parse_args(list(config.args)))


def test_demonstrations_use_the_prompts_the_pipeline_renders():
    """The warm start's prompts are, token for token, what TorchRL's ChatEnv and
    generation wrapper feed the model; the responses end with the end of turn."""
    gspo_toy = example("gspo_toy")
    args = gspo_toy.parse_args(["--prompts", "2", "--group-size", "2", "--minibatches", "1"])
    pipeline = gspo_toy.build_pipeline("gspo", args)
    next(iter(pipeline.collector))
    pipeline.collector.shutdown()
    data = pipeline.buffer[:]
    tokenizer = gspo_toy.build_tokenizer()
    letter = 6  # the query's position: "<|im_start|>", "u", "s", "e", "r", "\n", letter
    rendered = {int(p[letter]): p for p in data.get(("tokens", "prompt"), as_list=True)}
    tokens, mask = gspo_toy.demonstrations(tokenizer, random.Random(0), 16, args)
    compared = 0
    for row, response in zip(tokens, mask, strict=True):
        prompt = row[~response & (row != tokenizer.pad_token_id)]
        if int(prompt[letter]) in rendered:
            assert torch.equal(prompt, rendered[int(prompt[letter])])
            compared += 1
        answer = row[response]
        assert answer[-1] == tokenizer.eos_token_id and 2 <= answer.numel() <= 8
    assert compared > 0


def test_r3_example_runs_each_cell(tmp_path):
    """Two steps of each of the six cells. Recomputed old log-probs make the first
    minibatch on-policy whatever the replay (R2 and R3 replay the recompute's routes);
    the mismatch figures are what they count."""
    moe_engine = example("moe_engine")
    summary = moe_engine.main(["--steps", "2", "--out", str(tmp_path), "--no-progress"])
    assert set(summary) == set(moe_engine.RUNS)
    for run in moe_engine.RUNS:
        records = [json.loads(line) for line in (tmp_path / f"metrics_{run}.jsonl").open()]
        assert len(records) == 2
        for r in records:
            assert r["log_rho_abs_none"] > 0 and r["log_rho_abs_r3"] > 0  # bfloat16 engine
            # of k = 2 experts, a differing set differs by one or two
            assert r["expert_mismatch"] <= r["set_mismatch"] <= 2 * r["expert_mismatch"]
        if run.startswith("recomputed"):
            assert all(r["clip_fraction_first"] == 0.0 for r in records)


@pytest.mark.parametrize(
    "argv", [["--warm-start", "-1"], ["--demo-accuracy", "1.5"], ["--max-new-tokens", "1"]]
)
def test_bad_warm_start_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        example("gspo_toy").parse_args(argv)
    assert "--warm-start" in capsys.readouterr().err
