# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Cost of GSPOLoss, GSPOTokenLoss and SubsequenceLoss against TorchRL's GRPOLoss.

Each case times one forward + backward of the four losses, built with the same keyword
arguments (clip range (3e-4, 4e-4), ``prompt_mean``, no entropy bonus, ``"sft"``
masking; SubsequenceLoss with its default 4 equal segments), on the same ragged
batch: rows of different prompt and response lengths, NaN prompt log-probs on every
other row (as vLLM writes them), one advantage per row.

Modes:

- ``head``: the actor's parameter *is* the ``[B, T]`` table of current log-probs: only
  the losses' own work is timed.
- ``compiled``: ``head`` with each loss wrapped in ``torch.compile``; the number of
  graphs and graph breaks of each loss' forward is reported.
- ``full``: the actor maps tokens to logits over ``--vocab`` tokens (an embedding and a
  linear head) and returns TorchRL's ``LLMMaskedCategorical``: a step also pays for the
  log-softmax over the vocabulary, as with a real model. Peak memory is measured here.

Layouts: ``dense`` (left-padded ``[B, T]`` tensors) and ``lazy`` (lazily stacked ragged
rows, as TorchRL's LLM collectors hand them out).

Protocol, chosen so that the machine's drift cannot pass a goal: the cases run in
``--processes`` fresh processes, one after the other, each with ``--threads`` torch
threads. Within a process the losses are timed in interleaved repeats (GRPO, GSPO,
GSPO-token, subsequence, then GSPO, GSPO-token, subsequence, GRPO, ...: the order
rotates), each repeat a block of calls lasting about ``--block-ms``; a loss' time is its
fastest block (per call). A ratio is a loss' time over GRPO's (or, for the subsequence
objective's goals, GSPO's) *in the same process*; each goal is checked against the
worst process.
The fixed overhead is GSPO's time minus GRPO's per call, in microseconds, at 16x1024
(the goal's size) and at 4x64 (where per-token work vanishes).

Usage::

    python benchmarks/bench_loss.py                  # the table and the goals (~10 min)
    python benchmarks/bench_loss.py --quick          # seconds: a smoke run for CI
    python benchmarks/bench_loss.py --device cuda    # on a GPU: CUDA time and memory

It prints markdown tables and writes them with a JSON copy to ``--out``; it exits with
status 1 when a goal is missed (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from tensordict.nn import TensorDictModuleBase
from torchrl.modules.distributions import LLMMaskedCategorical
from torchrl.objectives.llm import GRPOLoss

from torchrl_gspo import GSPOLoss, GSPOTokenLoss, SubsequenceLoss

LOSSES = {
    "GRPOLoss": GRPOLoss,
    "GSPOLoss": GSPOLoss,
    "GSPOTokenLoss": GSPOTokenLoss,
    "SubsequenceLoss": SubsequenceLoss,
}
KWARGS = {"clip_epsilon": (3e-4, 4e-4), "aggregation": "prompt_mean", "entropy_bonus": False}
TOKENS, MASK = ("tokens", "full"), ("masks", "response")
# mode -> sizes, layouts, repeats
PLANS = {
    "full": {
        "head": (["4x64", "16x256", "16x1024", "16x4096", "16x8192"], ["dense"], 15),
        "head-lazy": (["16x1024", "16x4096"], ["lazy"], 15),
        "compiled": (["16x1024", "16x4096"], ["dense"], 15),
        "full": (["16x1024"], ["dense", "lazy"], 5),
    },
    "quick": {
        "head": (["4x64"], ["dense", "lazy"], 3),
        "full": (["2x32"], ["dense", "lazy"], 2),
    },
}
# (mode, size, layout, loss, baseline, bound): the worst process' ratio of the loss'
# time to the baseline's must not exceed the bound
GOALS = (
    [
        ("head", size, layout, "GSPOLoss", "GRPOLoss", bound)
        for size in ("16x1024", "16x4096")
        for layout, bound in (("dense", 1.10), ("lazy", 1.20))
    ]
    + [
        ("compiled", size, "dense", loss, "GRPOLoss", bound)
        for size in ("16x1024", "16x4096")
        for loss, bound in (("GSPOLoss", 1.10), ("GSPOTokenLoss", 1.20))
    ]
    + [
        ("head", "16x1024", layout, "GSPOTokenLoss", "GRPOLoss", 1.10)
        for layout in ("dense", "lazy")
    ]
    + [
        (mode, "16x1024", layout, "SubsequenceLoss", "GSPOLoss", 1.10)
        for mode, layout in (("head", "dense"), ("head", "lazy"), ("compiled", "dense"))
    ]
)


@dataclass(frozen=True)
class Case:
    mode: str  # head, compiled or full
    batch: int
    seq_len: int
    layout: str  # dense or lazy
    vocab: int
    device: str

    @property
    def key(self) -> str:
        return f"{self.mode} {self.batch}x{self.seq_len} {self.layout}"


class HeadActor(TensorDictModuleBase):
    """Current log-probs ``[B, T]`` as the parameter; what GRPOLoss reads of a distribution."""

    def __init__(self, log_probs: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__()
        self.log_probs = torch.nn.Parameter(log_probs.clone())
        self.register_buffer("mask", mask)
        self.in_keys, self.out_keys = [TOKENS], []

    def get_dist(self, tensordict, **kwargs):
        return _Dist(self.log_probs, self.mask)


class _Dist:
    def __init__(self, log_probs: torch.Tensor, mask: torch.Tensor) -> None:
        self._log_probs, self.mask = log_probs, mask

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return self._log_probs


class LogitsActor(TensorDictModuleBase):
    """A tiny causal LM over ``vocab`` tokens: ``logits[t] = embedding[token[t - 1]] @ head``."""

    def __init__(self, vocab: int, device: str, hidden: int = 16) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embedding = torch.nn.Parameter(torch.randn(vocab, hidden, generator=gen).to(device))
        self.head = torch.nn.Parameter((torch.randn(hidden, vocab, generator=gen) / 4).to(device))
        self.in_keys, self.out_keys = [TOKENS, MASK], []

    def get_dist(self, tensordict, **kwargs):
        tokens = tensordict.get(TOKENS, as_padded_tensor=True, padding_side="left", padding_value=0)
        mask = tensordict.get(MASK, as_padded_tensor=True, padding_side="left", padding_value=False)
        previous = torch.cat([torch.zeros_like(tokens[:, :1]), tokens[:, :-1]], -1)
        return LLMMaskedCategorical(logits=self.embedding[previous] @ self.head, mask=mask)


def make_case_data(case: Case) -> tuple[TensorDictBase, torch.Tensor, torch.Tensor]:
    """The batch (dense or lazy), and the left-padded current log-probs and mask."""
    gen = torch.Generator().manual_seed(0)
    b, t = case.batch, case.seq_len
    lengths = torch.randint(t // 2, t + 1, (b,), generator=gen)
    lengths[0] = t
    prompts = torch.randint(1, max(t // 8, 2), (b,), generator=gen)
    tokens = torch.randint(1, max(case.vocab, 2), (b, t), generator=gen)
    mask = torch.zeros(b, t, dtype=torch.bool)
    current = -torch.rand(b, t, generator=gen)
    old = current - 1e-3 * torch.randn(b, t, generator=gen)
    for i in range(b):
        start = t - int(lengths[i])
        mask[i, start + int(prompts[i]) :] = True
        if i % 2:
            old[i, start : start + int(prompts[i])] = float("nan")
    advantage = torch.randn(b, 1, 1, generator=gen)
    if case.layout == "dense":
        data = TensorDict(
            {TOKENS: tokens, MASK: mask, ("log_probs", "full"): old, "advantage": advantage},
            batch_size=[b],
        )
    else:
        rows = []
        for i in range(b):
            n, p = int(lengths[i]), int(prompts[i])
            # the prompt, the response and the sequence, as TorchRL's collectors hand
            # them out: the losses check by id that the sequence is the other two
            row = {TOKENS: tokens[i, t - n :], MASK: mask[i, t - n :]}
            row.update({("tokens", "prompt"): tokens[i, t - n : t - n + p]})
            row.update({("tokens", "response"): tokens[i, t - n + p :], "advantage": advantage[i]})
            rows.append(TensorDict({**row, ("log_probs", "full"): old[i, t - n :]}))
        data = lazy_stack(rows, 0)
    return data.to(case.device), current.to(case.device), mask.to(case.device)


def make_loss(case: Case, name: str, current: torch.Tensor, mask: torch.Tensor):
    if case.mode == "full":
        actor = LogitsActor(case.vocab, case.device)
    else:
        actor = HeadActor(current, mask)
    loss_fn = LOSSES[name](actor, **KWARGS)
    return torch.compile(loss_fn) if case.mode == "compiled" else loss_fn


def step(loss_fn, data: TensorDictBase) -> torch.Tensor:
    loss = loss_fn(data).loss_objective
    loss.backward()
    return loss.detach()


def _block(fn, data, number: int, cuda: bool) -> float:
    """Seconds per call of ``number`` calls."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(number):
        step(fn, data)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / number


def graphs(case: Case, data, current, mask) -> dict[str, list[int]]:
    """Compiled graphs and graph breaks of each loss' forward."""
    out = {}
    for name, cls in LOSSES.items():
        explained = torch._dynamo.explain(cls(HeadActor(current, mask), **KWARGS))(data)
        out[name] = [explained.graph_count, explained.graph_break_count]
    torch._dynamo.reset()
    return out


def time_case(case: Case, repeats: int, block_s: float) -> dict:
    """The fastest block of each loss over interleaved repeats, in seconds per call."""
    data, current, mask = make_case_data(case)
    fns = {name: make_loss(case, name, current, mask) for name in LOSSES}
    cuda = case.device.startswith("cuda")
    losses = {}
    for name, fn in fns.items():  # warm-up; compilation happens here in compiled mode
        for _ in range(3):
            losses[name] = step(fn, data)
    if not torch.allclose(losses["GSPOLoss"], losses["GSPOTokenLoss"], rtol=1e-5, atol=1e-6):
        raise RuntimeError(f"{case}: GSPOLoss and GSPOTokenLoss disagree: {losses}")
    number = max(1, round(block_s / _block(fns["GRPOLoss"], data, 1, cuda)))
    best = dict.fromkeys(fns, float("inf"))
    names = list(fns)
    for repeat in range(repeats):  # interleaved, the order rotated at every repeat
        turn = repeat % len(names)
        for name in names[turn:] + names[:turn]:
            best[name] = min(best[name], _block(fns[name], data, number, cuda))
    result = {"seconds": best, "calls_per_block": number, "valid_tokens": int(mask.sum())}
    if case.layout == "lazy" and case.mode == "head":
        result["checks_seconds"] = checks_cost(case, data, current, mask, repeats, number)
    if case.mode == "compiled":
        result["graphs"] = graphs(case, data, current, mask)
    return result


def checks_cost(case: Case, data, current, mask, repeats: int, number: int) -> float:
    """GSPOLoss' time per call minus its time with ``response_mask_check="ignore"``:
    what the per-row checks cost (the context by id, and the response's length),
    timed in interleaved repeats, each loss' fastest block."""
    fns = [make_loss(case, "GSPOLoss", current, mask)]
    fns.append(GSPOLoss(HeadActor(current, mask), response_mask_check="ignore", **KWARGS))
    cuda = case.device.startswith("cuda")
    best = [float("inf")] * 2
    for repeat in range(repeats):
        for k in (repeat % 2, 1 - repeat % 2):
            best[k] = min(best[k], _block(fns[k], data, number, cuda))
    return best[0] - best[1]


def peak_memory_mb(case: Case, name: str) -> float:
    """Peak memory growth of one step of ``name``, in a fresh process."""
    probe = [sys.executable, __file__, "--memory-probe", json.dumps([asdict(case), name])]
    result = subprocess.run(probe, capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def _memory_probe(spec: str) -> None:
    fields, name = json.loads(spec)
    case = Case(**fields)
    data, current, mask = make_case_data(case)
    loss_fn = make_loss(case, name, current, mask)
    step(loss_fn, data)  # warm-up: allocator caches, lazy initializations
    if case.device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(loss_fn, data)
        torch.cuda.synchronize()
        print((torch.cuda.max_memory_allocated() - before) / 2**20)
        return
    status = Path("/proc/self/status")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    rss = {
        line.split(":")[0]: int(line.split()[1])
        for line in status.read_text().splitlines()
        if line.startswith(("VmHWM", "VmRSS"))
    }
    step(loss_fn, data)
    peak = next(line for line in status.read_text().splitlines() if line.startswith("VmHWM"))
    print((int(peak.split()[1]) - rss["VmRSS"]) / 1024)


def plan_cases(quick: bool, device: str, vocab: int) -> list[tuple[Case, int]]:
    cases = []
    for mode, (sizes, layouts, repeats) in PLANS["quick" if quick else "full"].items():
        mode = mode.removesuffix("-lazy")
        for size in sizes:
            for layout in layouts:
                b, t = map(int, size.split("x"))
                cases.append(
                    (Case(mode, b, t, layout, vocab if mode == "full" else 0, device), repeats)
                )
    return cases


def _worker(spec: str) -> None:
    """One fresh process: every case, printed as one JSON line."""
    args = json.loads(spec)
    torch.set_num_threads(args["threads"])
    out = []
    for fields, repeats in args["cases"]:
        case = Case(**fields)
        out.append({"case": fields, **time_case(case, repeats, args["block_s"])})
        print(f"  {case.key}: done", file=sys.stderr, flush=True)
    print(json.dumps(out))


def run_processes(cases, processes: int, threads: int, block_s: float) -> list[list[dict]]:
    spec = {"cases": [[asdict(c), r] for c, r in cases], "threads": threads, "block_s": block_s}
    runs = []
    for index in range(processes):
        print(f"process {index + 1}/{processes}", file=sys.stderr, flush=True)
        command = [sys.executable, __file__, "--worker", json.dumps(spec)]
        result = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    return runs


def summarize(runs: list[list[dict]]) -> dict[str, dict]:
    """Per case: each process' per-call times, ratios to GRPOLoss, and graph counts."""
    summary = {}
    for results in zip(*runs, strict=True):
        case = Case(**results[0]["case"])
        ms = {n: [1e3 * r["seconds"][n] for r in results] for n in LOSSES}
        ratios = {n: [a / g for a, g in zip(ms[n], ms["GRPOLoss"], strict=True)] for n in LOSSES}
        summary[case.key] = {"case": asdict(case), "ms": ms, "ratio": ratios}
        if "checks_seconds" in results[0]:
            summary[case.key]["checks_us"] = [1e6 * r["checks_seconds"] for r in results]
        if "graphs" in results[0]:
            summary[case.key]["graphs"] = results[0]["graphs"]
    return summary


def tables(summary: dict, goals: list, device: str) -> str:
    clock = "CUDA" if device.startswith("cuda") else "CPU"
    lines = [
        "| case | GRPO ms | GSPO ms | GSPO-tok ms | Subseq ms | GSPO/GRPO worst (median) | "
        "GSPO-tok/GRPO worst (median) | Subseq/GRPO worst (median) | "
        "graphs, breaks (GRPO / GSPO / GSPO-tok / Subseq) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, res in summary.items():
        ms, ratio = res["ms"], res["ratio"]
        cells = [key] + [f"{statistics.median(ms[n]):.3f}" for n in LOSSES]
        cells += [
            f"{max(ratio[n]):.3f} ({statistics.median(ratio[n]):.3f})" for n in list(LOSSES)[1:]
        ]
        graph = res.get("graphs")
        cells.append(" / ".join(f"{g[0]}, {g[1]}" for g in graph.values()) if graph else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        f"\nms: median over processes of the fastest block's {clock} time per forward + "
        "backward; ratios: per process, to GRPOLoss in the same process; worst = highest."
    )
    if goals:
        lines += ["", "| goal | worst ratio | met |", "|---|---|---|"]
        for mode, size, layout, loss, baseline, bound, worst in goals:
            met = "yes" if worst <= bound else "**no**"
            goal = f"{loss} / {baseline} {mode} {layout} {size} <= {bound:.2f}"
            lines.append(f"| {goal} | {worst:.3f} | {met} |")
    return "\n".join(lines)


def report(summary: dict, goals: list, device: str) -> tuple[str, dict]:
    """The tables, the fixed overhead per call (us) and the peak memory, as text."""
    text = tables(summary, goals, device)
    overhead = {}
    for size in ("16x1024", "4x64"):
        if f"head {size} dense" in summary:
            ms = summary[f"head {size} dense"]["ms"]
            pairs = zip(ms["GSPOLoss"], ms["GRPOLoss"], strict=True)
            overhead[size] = [1e3 * (gspo - grpo) for gspo, grpo in pairs]
            text += f"\n\nGSPOLoss minus GRPOLoss per call, head dense {size}, per process: "
            text += ", ".join(f"{v:+.0f} us" for v in overhead[size])
    for key, res in summary.items():
        if "checks_us" in res:
            share = [
                c / (1e3 * g) for c, g in zip(res["checks_us"], res["ms"]["GSPOLoss"], strict=True)
            ]
            text += f"\n\nThe per-row checks' cost (context by id, response length), {key}, "
            text += "per process: " + ", ".join(
                f"{c:+.0f} us ({100 * f:.1f}% of GSPOLoss)"
                for c, f in zip(res["checks_us"], share, strict=True)
            )
    for key, res in summary.items():
        if "memory_mb" in res:
            text += f"\n\nPeak memory growth of one step, {key} (MB): "
            text += ", ".join(f"{n} {v:.1f}" for n, v in res["memory_mb"].items())
    return text, overhead


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds (for CI)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--processes", type=int, help="fresh processes (default 3; quick 1)")
    parser.add_argument("--block-ms", type=float, default=30.0, help="duration of one block")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary of full mode")
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker) or 0
    if args.memory_probe:
        return _memory_probe(args.memory_probe) or 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    processes = args.processes or (1 if args.quick else 3)
    vocab = 256 if args.quick else args.vocab
    cases = plan_cases(args.quick, args.device, vocab)
    summary = summarize(run_processes(cases, processes, args.threads, args.block_ms / 1e3))
    for case, _ in cases:
        if case.mode == "full" and case.layout == "dense":
            summary[case.key]["memory_mb"] = {n: peak_memory_mb(case, n) for n in LOSSES}
    goals = []
    for mode, size, layout, loss, baseline, bound in [] if args.quick else GOALS:
        ms = summary[f"{mode} {size} {layout}"]["ms"]
        worst = max(a / b for a, b in zip(ms[loss], ms[baseline], strict=True))
        goals.append((mode, size, layout, loss, baseline, bound, worst))
    text, overhead = report(summary, goals, args.device)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_loss_quick" if args.quick else f"bench_loss_{args.device}"
    (args.out / f"{stem}.md").write_text(text + "\n")
    record = {
        "processes": processes,
        "threads": args.threads,
        "summary": summary,
        "goals": goals,
        "fixed_overhead_us": overhead,
    }
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    return int(any(worst > bound for *_, bound, worst in goals))


if __name__ == "__main__":
    sys.exit(main())
