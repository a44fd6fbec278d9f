# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Cost of GSPOLoss and GSPOTokenLoss against TorchRL's GRPOLoss on the same batch.

Each case times one forward + backward of the three losses, built with the same keyword
arguments (clip range (3e-4, 4e-4), ``prompt_mean``, no entropy bonus, ``"sft"``
masking), on the same ragged batch: rows of different prompt and response lengths,
NaN prompt log-probs on every other row (as vLLM writes them), one advantage per row.

Modes:

- ``full``: the actor maps tokens to logits over ``--vocab`` tokens (an embedding and a
  linear head, its parameters) and returns TorchRL's ``LLMMaskedCategorical``: a step
  pays for the log-softmax over the vocabulary, as with a real model's head.
- ``head``: the actor's parameter *is* the ``[B, T]`` table of current log-probs: only
  the losses' own work is timed.
- ``compiled``: ``head`` with each loss wrapped in ``torch.compile`` (compiled afresh for
  each case; the first call, compilation included, is reported apart).

Layouts: ``dense`` (left-padded ``[B, T]`` tensors) and ``lazy`` (lazily stacked ragged
rows, as TorchRL's LLM collectors hand them out).

Timing uses ``torch.utils.benchmark`` (``Timer.blocked_autorange``; CUDA is synchronised
by it). The three losses are timed one after the other in each of ``--rounds`` rounds;
a loss' ratio is the median over rounds of its time over GRPOLoss' in the same round,
with the spread (min-max over rounds) in parentheses. Peak memory of one step (after a
warm-up step) is measured for each loss in a fresh process: on CPU the growth of the
resident set's peak (``VmHWM``) in ``full`` mode (a ``head`` step allocates a few MB,
which the allocator's reuse of freed pages blurs), on CUDA the growth of
``torch.cuda.max_memory_allocated`` in ``full`` and ``head`` modes (dense layout).

Usage::

    python benchmarks/bench_loss.py --quick               # seconds, for CI
    python benchmarks/bench_loss.py --threads 1           # the full table (minutes)
    python benchmarks/bench_loss.py --device cuda         # on a GPU: CUDA time and memory

It prints ``torch.utils.benchmark.Compare``'s table and a markdown table of ratios, and
writes both with a JSON copy to ``--out``. No figure is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from tensordict.nn import TensorDictModuleBase
from torch.utils import benchmark
from torchrl.modules.distributions import LLMMaskedCategorical
from torchrl.objectives.llm import GRPOLoss

from torchrl_gspo import GSPOLoss, GSPOTokenLoss

LOSSES = {"GRPOLoss": GRPOLoss, "GSPOLoss": GSPOLoss, "GSPOTokenLoss": GSPOTokenLoss}
KWARGS = {"clip_epsilon": (3e-4, 4e-4), "aggregation": "prompt_mean", "entropy_bonus": False}
TOKENS, MASK = ("tokens", "full"), ("masks", "response")
PLANS = {  # mode -> (sizes, layouts)
    "full": {"full": (["8x256", "16x1024"], ["dense", "lazy"])},
    "quick": {"full": (["2x32"], ["dense", "lazy"]), "head": (["4x64"], ["dense", "lazy"])},
}
PLANS["full"]["head"] = (["16x256", "16x1024", "16x4096", "16x8192"], ["dense"])
PLANS["full"]["head-lazy"] = (["16x1024"], ["lazy"])
PLANS["full"]["compiled"] = (["16x1024", "16x8192"], ["dense"])


@dataclass(frozen=True)
class Case:
    mode: str  # full, head or compiled
    batch: int
    seq_len: int
    layout: str  # dense or lazy
    vocab: int
    device: str


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
            row = {TOKENS: tokens[i, t - n :], MASK: mask[i, t - n :]}
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


def time_case(case: Case, rounds: int, min_run_time: float, threads: int) -> dict:
    data, current, mask = make_case_data(case)
    fns = {name: make_loss(case, name, current, mask) for name in LOSSES}
    first_call, losses = {}, {}
    for name, fn in fns.items():  # warm-up; compilation happens here in compiled mode
        first_call[name] = (
            benchmark.Timer("step(fn, data)", globals={"step": step, "fn": fn, "data": data})
            .timeit(1)
            .median
        )
        losses[name] = step(fn, data)
    if not torch.allclose(losses["GSPOLoss"], losses["GSPOTokenLoss"], rtol=1e-5, atol=1e-6):
        raise RuntimeError(f"{case}: GSPOLoss and GSPOTokenLoss disagree: {losses}")
    measurements = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            timer = benchmark.Timer(
                "step(fn, data)",
                globals={"step": step, "fn": fn, "data": data},
                label=f"forward + backward, {case.mode}, {case.layout}",
                sub_label=f"{case.batch}x{case.seq_len}",
                description=name,
                num_threads=threads,
            )
            measurements[name].append(timer.blocked_autorange(min_run_time=min_run_time))
    ratios = {
        name: [m.median / g.median for m, g in zip(ms, measurements["GRPOLoss"], strict=True)]
        for name, ms in measurements.items()
    }
    return {
        "measurements": measurements,
        "ms": {n: 1e3 * statistics.median(m.median for m in ms) for n, ms in measurements.items()},
        "ratio": {n: (statistics.median(r), min(r), max(r)) for n, r in ratios.items()},
        "first_call_s": first_call,
        "valid_tokens": int(mask.sum()),
    }


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
    step(loss_fn, data)  # warm-up: allocator caches, lazy initialisations
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
    peak = int(
        next(
            line.split()[1] for line in status.read_text().splitlines() if line.startswith("VmHWM")
        )
    )
    print((peak - rss["VmRSS"]) / 1024)


def markdown(rows: list[tuple[Case, dict]], device: str) -> str:
    clock = "CUDA time" if device.startswith("cuda") else "CPU wall time"
    lines = [
        "| size BxT | mode | layout | GRPO ms | GSPO ms | GSPO-tok ms | GSPO/GRPO | "
        "GSPO-tok/GRPO | memory GSPO/GRPO | memory GSPO-tok/GRPO |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, res in rows:
        ms, ratio, mem = res["ms"], res["ratio"], res.get("memory_mb", {})
        cells = [f"{case.batch}x{case.seq_len}", case.mode, case.layout]
        cells += [f"{ms[name]:.2f}" for name in LOSSES]
        for name in ("GSPOLoss", "GSPOTokenLoss"):
            med, low, high = ratio[name]
            cells.append(f"{med:.3f} ({low:.2f}-{high:.2f})")
        for name in ("GSPOLoss", "GSPOTokenLoss"):
            base = mem.get("GRPOLoss", 0.0)
            cells.append(f"{mem[name] / base:.3f}" if base >= 1.0 else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        f"\nms: median {clock} of one forward + backward; ratios: median over rounds of "
        "the per-round ratio to GRPOLoss (min-max over rounds); memory: peak growth of one "
        "step, fresh process per loss (ratios shown when GRPOLoss' peak is at least 1 MB)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds (for CI)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary of full mode")
    parser.add_argument("--rounds", type=int, help="timed rounds per case (default 5; quick 2)")
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks"))
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_probe:
        return _memory_probe(args.memory_probe)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (2 if args.quick else 5)
    min_run_time = 0.05 if args.quick else 0.5
    vocab = 256 if args.quick else args.vocab
    plan = PLANS["quick" if args.quick else "full"]
    rows = []
    for mode, (sizes, layouts) in plan.items():
        mode = mode.removesuffix("-lazy")
        for size in sizes:
            for layout in layouts:
                b, t = map(int, size.split("x"))
                case = Case(mode, b, t, layout, vocab if mode == "full" else 0, args.device)
                result = time_case(case, rounds, min_run_time, args.threads)
                cuda_head = mode == "head" and args.device.startswith("cuda") and not args.quick
                if layout == "dense" and (mode == "full" or cuda_head):
                    result["memory_mb"] = {n: peak_memory_mb(case, n) for n in LOSSES}
                rows.append((case, result))
                print(f"{case}: {result['ms']}", flush=True)
    compare = benchmark.Compare(
        [m for _, res in rows for ms in res["measurements"].values() for m in ms[-1:]]
    )
    compare.trim_significant_figures()
    table = markdown(rows, args.device)
    print(compare, table, sep="\n\n")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_loss_quick" if args.quick else f"bench_loss_{args.device}"
    (args.out / f"{stem}.md").write_text(f"{compare}\n\n{table}\n")
    summary = [
        {"case": asdict(case), **{k: v for k, v in res.items() if k != "measurements"}}
        for case, res in rows
    ]
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
