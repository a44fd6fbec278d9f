# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Overhead of GSPOLoss and GSPOTokenLoss over TorchRL's GRPOLoss: time and peak memory.

GSPO's extra work is one masked reduction per sequence, O(B·T), next to the actor's
O(B·T·V) log-softmax. This script times forward + backward of
:class:`~torchrl.objectives.llm.GRPOLoss`, :class:`~torchrl_gspo.GSPOLoss` and
:class:`~torchrl_gspo.GSPOTokenLoss` on the same batch, in the same process, interleaved
(each round runs the three once, the rounds going through every order of the three, after
warm-up rounds), and reports medians and the ratio to ``GRPOLoss``. Peak memory of one step
is measured for each loss in a fresh process.

The three losses are built with the same keyword arguments: ``clip_epsilon=(3e-4, 4e-4)``,
``aggregation="prompt_mean"``, ``entropy_bonus=False``, ``masking_strategy="sft"``. The batch
holds one advantage per sequence (``[B, 1, 1]``), so GSPOLoss and GSPOTokenLoss compute the
same loss and gradient: every run checks it, with finite losses and gradients.

Modes:

- ``full``: the actor maps token ids to logits over ``V`` tokens through a small embedding
  and a linear head (its parameters) and returns TorchRL's ``LLMMaskedCategorical``, whose
  ``log_prob`` pays for the log-softmax over ``V``. Where the ``[B, T, V]`` logits would
  exceed ``--logit-budget`` elements, ``V`` is scaled down (printed, never silently).
- ``head``: the actor's parameter *is* the ``[B, T]`` table of current log-probs: no
  log-softmax, only the losses' own work, GSPO's reduction included.
- ``compiled``: ``head`` with each loss wrapped in ``torch.compile``, compiled afresh for each
  size (the first call, compilation included, is reported separately).

Batches are ragged: each row has its own prompt and response lengths, left-padded into a
dense ``[B, T]`` batch with a ragged response mask; every other row holds NaN old log-probs
on its prompt, as vLLM writes them. ``--lazy`` adds lazily stacked batches of ragged rows
(with their ``("tokens", "response")``), as TorchRL's LLM collectors hand them out.

Times: wall-clock (``time.perf_counter``), process CPU time (``time.process_time``) and its
user-mode part (``ru_utime``) of each step. On a shared machine the CPU times are the steadier.
In ``full`` mode the table compares user-mode time: a step allocates gigabytes of fresh logits,
and the kernel's page-fault work, the same for the three losses, dominates the noise of the
system time (the user/system split is sampled at timer ticks: fine for steps of seconds, too
coarse for the millisecond steps of the other modes, which compare user + system time). Run
with ``--threads`` no larger than the number of idle cores: an OpenMP team with a descheduled
thread stalls. With more than one thread, CPU times add up all threads. On a shared CPU,
``THP_MEM_ALLOC_ENABLE=1`` (transparent huge pages for torch's large allocations) makes
``full`` mode several times cheaper in page faults.

The goal check also gives an estimate that is robust to noise: GSPO's extra work does not
depend on the actor, so its overhead measured in ``head`` mode (many cheap rounds) at a size,
divided by the ``full``-mode GRPOLoss step at that size, is the expected full-mode overhead.

Memory: on CPU, the resident set size's peak growth over one step (``VmHWM`` after a reset
through ``/proc/self/clear_refs``, else ``ru_maxrss``), after a warm-up step, in a fresh
process per loss, with glibc asked to return freed blocks to the system (``mallopt``) so that
the peak follows live tensors rather than the allocator's cache. On CUDA, the growth of
``torch.cuda.max_memory_allocated``.

Usage::

    python benchmarks/bench_loss.py --quick       # tiny sizes, seconds; non-zero exit on error
    python benchmarks/bench_loss.py --threads 1   # the full benchmark
    python benchmarks/bench_loss.py --help

No time or memory figure is asserted: they are reported.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import tensordict
import torch
import torchrl
from tensordict import TensorDict, TensorDictBase, lazy_stack
from tensordict.nn import TensorDictModuleBase
from torch import nn
from torchrl.modules.distributions import LLMMaskedCategorical
from torchrl.objectives.llm import GRPOLoss

import torchrl_gspo
from torchrl_gspo import GSPOLoss, GSPOTokenLoss

Mode = Literal["full", "head", "compiled"]
Layout = Literal["dense", "lazy"]
Clock = Literal["wall", "cpu", "user"]

LOSSES: dict[str, type[GRPOLoss]] = {
    "GRPOLoss": GRPOLoss,
    "GSPOLoss": GSPOLoss,
    "GSPOTokenLoss": GSPOTokenLoss,
}
BASELINE = "GRPOLoss"
SHORT_NAMES = {"GRPOLoss": "GRPO", "GSPOLoss": "GSPO", "GSPOTokenLoss": "GSPO-tok"}
LOSS_KWARGS: dict[str, Any] = {
    "clip_epsilon": (3e-4, 4e-4),
    "aggregation": "prompt_mean",
    "entropy_bonus": False,
    "masking_strategy": "sft",
}
TOKENS_KEY = ("tokens", "full")
RESPONSE_KEY = ("tokens", "response")
MASK_KEY = ("masks", "response")
OLD_LOG_PROB_KEY = ("log_probs", "full")
ADVANTAGE_KEY = "advantage"
# Scale of the perturbation between the current and the old log-probs.
OLD_LOG_PROB_NOISE = 1e-3
# Token ids of the head-only mode (they are read, never scored).
HEAD_VOCAB = 32_000
# Memory growths below this (MiB) are not compared (page and allocator granularity).
MEMORY_FLOOR_MB = 0.1
# The goal reported against: full mode, dense batches with B*T >= GOAL_MIN_TOKENS.
GOAL_TIME_RATIO = 1.02
GOAL_MEMORY_RATIO = 1.01
GOAL_MIN_TOKENS = 16 * 1024

DEFAULTS: dict[str, dict[str, Any]] = {
    "full": {
        "modes": "full,head,compiled",
        "sizes": "8x256,16x1024,16x8192,64x8192",
        "head_sizes": "8x256,16x256,16x1024,16x4096,16x8192,64x8192",
        "compile_sizes": "16x256,16x1024,16x8192,64x8192",
        "lazy": "16x1024",
        "lazy_modes": "head",
        "vocab": 32_000,
        "warmup": 1,
        "head_warmup": 3,
        "repeats": 6,
        "head_repeats": 30,
        "memory_modes": "full,head",
    },
    "quick": {
        "modes": "full,head",
        "sizes": "2x32,4x64",
        "head_sizes": "2x32,4x64",
        "compile_sizes": "4x64",
        "lazy": "4x64",
        "lazy_modes": "full,head",
        "vocab": 512,
        "warmup": 1,
        "head_warmup": 1,
        "repeats": 2,
        "head_repeats": 2,
        "memory_modes": "full",
    },
}


@dataclass(frozen=True)
class Case:
    """One benchmarked configuration.

    Attributes:
        mode (str): ``"full"``, ``"head"`` or ``"compiled"``.
        batch (int): number of sequences B.
        seq_len (int): padded width T.
        vocab (int): vocabulary size V of the actor in ``full`` mode, 0 otherwise.
        layout (str): ``"dense"`` (left-padded tensors) or ``"lazy"`` (lazily stacked rows).
    """

    mode: Mode
    batch: int
    seq_len: int
    vocab: int = 0
    layout: Layout = "dense"

    @property
    def size(self) -> str:
        return f"{self.batch}x{self.seq_len}"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


@dataclass
class Batch:
    """A batch, the actor that scores it and the parameters that receive gradients."""

    data: TensorDictBase
    actor: TensorDictModuleBase
    valid_tokens: int
    params: list[nn.Parameter] = field(default_factory=list)


@dataclass
class CaseResult:
    """Measurements of one :class:`Case`: per-round times (ms) of each loss, and memory."""

    case: Case
    valid_tokens: int
    wall_ms: dict[str, list[float]]
    cpu_ms: dict[str, list[float]]
    user_ms: dict[str, list[float]]
    first_call_ms: dict[str, float]
    memory_mb: dict[str, float] = field(default_factory=dict)
    memory_method: str = ""

    def times(self, clock: Clock) -> dict[str, list[float]]:
        return {"wall": self.wall_ms, "cpu": self.cpu_ms, "user": self.user_ms}[clock]

    def median_ms(self, name: str, clock: Clock = "wall") -> float:
        return statistics.median(self.times(clock)[name])

    @property
    def cpu_clock(self) -> Clock:
        """The CPU clock compared: user-mode time in full mode, user + system otherwise.

        A full-mode step allocates gigabytes of fresh logits, and the kernel's page-fault
        work (the same for the three losses) dominates the noise of its system time. The
        user/system split is sampled at timer ticks, too coarse for millisecond steps.
        """
        return "user" if self.case.mode == "full" else "cpu"

    def paired_ratios(self, name: str, clock: Clock = "wall") -> list[float]:
        """``time(name) / time(GRPOLoss)`` within each round (rounds timed at 0 left out)."""
        times = self.times(clock)
        return [t / b for t, b in zip(times[name], times[BASELINE], strict=True) if b > 0]

    def ratio(self, name: str, clock: Clock = "wall") -> float:
        """Median over rounds of the per-round ratio to ``GRPOLoss``."""
        paired = self.paired_ratios(name, clock)
        return statistics.median(paired) if paired else math.nan

    def ratio_iqr(self, name: str, clock: Clock = "wall") -> tuple[float, float]:
        paired = self.paired_ratios(name, clock)
        if len(paired) < 2:
            value = paired[0] if paired else math.nan
            return value, value
        quartiles = statistics.quantiles(paired, n=4, method="inclusive")
        return quartiles[0], quartiles[2]

    def delta_ms(self, name: str, clock: Clock = "cpu") -> float:
        """Median over rounds of ``time(name) - time(GRPOLoss)`` within each round."""
        times = self.times(clock)
        return statistics.median(t - b for t, b in zip(times[name], times[BASELINE], strict=True))

    def memory_ratio(self, name: str) -> float | None:
        base, value = self.memory_mb.get(BASELINE), self.memory_mb.get(name)
        if base is None or value is None or base < MEMORY_FLOOR_MB:
            return None
        return value / base

    def to_json(self) -> dict[str, Any]:
        names = list(self.wall_ms)
        out: dict[str, Any] = {"case": asdict(self.case), "valid_tokens": self.valid_tokens}
        for clock in ("wall", "cpu", "user"):
            out[f"{clock}_ms"] = self.times(clock)
            out[f"{clock}_median_ms"] = {n: self.median_ms(n, clock) for n in names}
            out[f"{clock}_ratio_of_medians"] = {
                n: self.median_ms(n, clock) / self.median_ms(BASELINE, clock) for n in names
            }
            out[f"{clock}_paired_ratio_median"] = {n: self.ratio(n, clock) for n in names}
            out[f"{clock}_paired_ratio_iqr"] = {n: self.ratio_iqr(n, clock) for n in names}
            out[f"{clock}_paired_delta_ms"] = {n: self.delta_ms(n, clock) for n in names}
        out["first_call_ms"] = self.first_call_ms
        out["memory_mb"] = self.memory_mb
        out["memory_ratio"] = {n: self.memory_ratio(n) for n in self.memory_mb}
        out["memory_method"] = self.memory_method
        return out


# ----------------------------------------------------------------------------- actors


class _PrecomputedLogProbs:
    """The two members of a distribution that ``GRPOLoss`` reads without an entropy bonus."""

    def __init__(self, log_prob: torch.Tensor, mask: torch.Tensor) -> None:
        self._log_prob = log_prob
        self.mask = mask

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return self._log_prob


def _response_mask(tensordict: TensorDictBase) -> torch.Tensor:
    return tensordict.get(MASK_KEY, as_padded_tensor=True, padding_side="left", padding_value=False)


class LogitsActor(TensorDictModuleBase):
    """A tiny causal LM over a real vocabulary: ``logits[t] = embed(token[t - 1]) @ head``.

    It returns TorchRL's :class:`~torchrl.modules.distributions.LLMMaskedCategorical`, whose
    ``log_prob`` runs a log-softmax over the ``vocab`` logits of every position (through
    ``cross_entropy``), as TorchRL's LLM wrappers do.

    Args:
        vocab (int): vocabulary size V.

    Keyword Args:
        hidden (int, optional): width of the embedding. Defaults to ``16``.
        seed (int, optional): seed of the parameters. Defaults to ``0``.
    """

    def __init__(self, vocab: int, *, hidden: int = 16, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.embedding = nn.Parameter(torch.randn(vocab, hidden, generator=gen))
        self.head = nn.Parameter(torch.randn(hidden, vocab, generator=gen) / math.sqrt(hidden))
        self.in_keys = [TOKENS_KEY, MASK_KEY]
        self.out_keys = []

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[*B, T, V]`` of the (left-padded, non-negative) tokens ``[*B, T]``."""
        previous = torch.cat([torch.zeros_like(tokens[..., :1]), tokens[..., :-1]], -1)
        return nn.functional.embedding(previous, self.embedding) @ self.head

    def _get_sft_dist(self, tensordict: TensorDictBase, **kwargs) -> LLMMaskedCategorical:
        tokens = tensordict.get(
            TOKENS_KEY, as_padded_tensor=True, padding_side="left", padding_value=0
        )
        return LLMMaskedCategorical(logits=self.logits(tokens), mask=_response_mask(tensordict))

    def get_dist(self, tensordict: TensorDictBase, **kwargs) -> LLMMaskedCategorical:
        return self._get_sft_dist(tensordict)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return tensordict

    @torch.no_grad()
    def token_log_probs(self, tokens: torch.Tensor, chunk_elements: int = 2**25) -> torch.Tensor:
        """Log-probs ``[B, T]`` of the tokens, a few rows at a time (bounded memory)."""
        rows = max(1, chunk_elements // (tokens.shape[-1] * self.vocab))
        out = []
        for chunk in tokens.split(rows):
            log_probs = self.logits(chunk).log_softmax(-1)
            out.append(log_probs.gather(-1, chunk.unsqueeze(-1)).squeeze(-1))
        return torch.cat(out)


class LogProbActor(TensorDictModuleBase):
    """An actor whose parameter is the ``[B, T]`` table of current log-probs.

    The loss then does only its own work: no actor, no log-softmax.

    Args:
        log_probs (torch.Tensor): the initial current log-probs ``[B, T]``, left-padded.
    """

    def __init__(self, log_probs: torch.Tensor) -> None:
        super().__init__()
        self.log_probs = nn.Parameter(log_probs.clone())
        self.in_keys = [TOKENS_KEY, MASK_KEY]
        self.out_keys = []

    def _get_sft_dist(self, tensordict: TensorDictBase, **kwargs) -> _PrecomputedLogProbs:
        return _PrecomputedLogProbs(self.log_probs, _response_mask(tensordict))

    def get_dist(self, tensordict: TensorDictBase, **kwargs) -> _PrecomputedLogProbs:
        return self._get_sft_dist(tensordict)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return tensordict


# ----------------------------------------------------------------------------- batches


def _row_shapes(batch: int, seq_len: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """(prompt, response) lengths: row 0 fills the width, the others half of it or more."""
    shapes = []
    for i in range(batch):
        total = seq_len
        if i:
            total = int(torch.randint(seq_len // 2, seq_len + 1, (), generator=gen))
        low, high = max(1, seq_len // 16), max(2, seq_len // 4)
        prompt = min(int(torch.randint(low, high + 1, (), generator=gen)), total - 1)
        shapes.append((prompt, total - prompt))
    return shapes


def build_batch(case: Case, *, device: torch.device, seed: int = 0, hidden: int = 16) -> Batch:
    """The ragged batch of ``case`` and its actor, deterministic in ``seed``.

    Old log-probs are the actor's current log-probs minus a perturbation of scale
    ``OLD_LOG_PROB_NOISE``, so that ratios are close to, but not exactly, 1.
    """
    gen = torch.Generator().manual_seed(seed)
    batch, width = case.batch, case.seq_len
    shapes = _row_shapes(batch, width, gen)
    vocab = case.vocab if case.mode == "full" else HEAD_VOCAB
    tokens = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.bool)
    prompt = torch.zeros(batch, width, dtype=torch.bool)
    for i, (p, r) in enumerate(shapes):
        start = width - p - r
        tokens[i, start:] = torch.randint(1, vocab, (p + r,), generator=gen)
        prompt[i, start : start + p] = True
        mask[i, start + p :] = True
    if case.mode == "full":
        actor: TensorDictModuleBase = LogitsActor(vocab, hidden=hidden, seed=seed)
        current = actor.token_log_probs(tokens)
    else:
        current = -2.0 * torch.rand(batch, width, generator=gen)
        actor = LogProbActor(current)
    old = current - OLD_LOG_PROB_NOISE * torch.randn(batch, width, generator=gen)
    old = torch.where(mask | prompt, old, 0.0)
    nan_rows = (torch.arange(batch) % 2 == 0).unsqueeze(-1)
    old = torch.where(prompt & nan_rows, torch.nan, old)
    advantage = torch.randn(batch, 1, 1, generator=gen)
    if case.layout == "dense":
        data: TensorDictBase = TensorDict(
            {TOKENS_KEY: tokens, MASK_KEY: mask, OLD_LOG_PROB_KEY: old, ADVANTAGE_KEY: advantage},
            batch_size=[batch],
        )
    else:
        rows = []
        for i, (p, r) in enumerate(shapes):
            keep = slice(width - p - r, width)
            row = {
                TOKENS_KEY: tokens[i, keep],
                RESPONSE_KEY: tokens[i, width - r :],
                MASK_KEY: mask[i, keep],
                OLD_LOG_PROB_KEY: old[i, keep],
                ADVANTAGE_KEY: advantage[i],
            }
            rows.append(TensorDict(row, batch_size=[]))
        data = lazy_stack(rows, 0)
    actor = actor.to(device)
    return Batch(
        data=data.to(device),
        actor=actor,
        valid_tokens=int(mask.sum()),
        params=list(actor.parameters()),
    )


# ----------------------------------------------------------------------------- timing


def make_losses(
    actor: TensorDictModuleBase, *, compiled: bool, names: Sequence[str] = tuple(LOSSES)
) -> dict[str, Callable[[TensorDictBase], Any]]:
    """The losses, built with the same keyword arguments, optionally ``torch.compile``-d."""
    losses: dict[str, Callable[[TensorDictBase], Any]] = {}
    for name in names:
        loss = LOSSES[name](actor, **LOSS_KWARGS)
        losses[name] = torch.compile(loss) if compiled else loss
    return losses


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(loss_fn: Callable[[TensorDictBase], Any], batch: Batch) -> torch.Tensor:
    """Forward and backward of one loss, gradients reset first; returns the loss value."""
    for param in batch.params:
        param.grad = None
    loss = loss_fn(batch.data).loss_objective.sum()
    loss.backward()
    return loss.detach()


def _check_outputs(
    values: dict[str, torch.Tensor], grads: dict[str, list[torch.Tensor]], case: Case
) -> None:
    """Finite losses and gradients; GSPOLoss == GSPOTokenLoss under sequence advantages."""
    for name, value in values.items():
        if not bool(torch.isfinite(value)):
            raise RuntimeError(f"{case}: {name} returned a non-finite loss {value}.")
        if not grads[name] or not all(bool(g.isfinite().all()) for g in grads[name]):
            raise RuntimeError(f"{case}: {name} produced missing or non-finite gradients.")
    if "GSPOLoss" in values and "GSPOTokenLoss" in values:
        same = torch.allclose(values["GSPOLoss"], values["GSPOTokenLoss"], rtol=1e-5, atol=1e-7)
        same = same and all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-8)
            for a, b in zip(grads["GSPOLoss"], grads["GSPOTokenLoss"], strict=True)
        )
        if not same:
            raise RuntimeError(
                f"{case}: GSPOLoss and GSPOTokenLoss differ under sequence advantages."
            )


def time_case(
    case: Case, *, device: torch.device, warmup: int, repeats: int, seed: int, hidden: int
) -> CaseResult:
    """Times forward + backward of every loss on the same batch, interleaved.

    Each round runs every loss once; the rounds go through all orders of the losses in turn.
    Garbage is collected between rounds, not within them.
    """
    batch = build_batch(case, device=device, seed=seed, hidden=hidden)
    if case.mode == "compiled":
        torch._dynamo.reset()
    losses = make_losses(batch.actor, compiled=case.mode == "compiled")
    names = list(losses)
    first_call_ms: dict[str, float] = {}
    values: dict[str, torch.Tensor] = {}
    grads: dict[str, list[torch.Tensor]] = {}
    for i in range(max(1, warmup)):
        for name in names:
            _sync(device)
            start = time.perf_counter()
            values[name] = run_step(losses[name], batch)
            _sync(device)
            if i == 0:
                first_call_ms[name] = 1e3 * (time.perf_counter() - start)
            grads[name] = [p.grad.clone() for p in batch.params if p.grad is not None]
    _check_outputs(values, grads, case)
    del grads
    # Every order in turn, so that each loss follows each other one equally often.
    orders = list(itertools.permutations(names))
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    user: dict[str, list[float]] = {name: [] for name in names}
    gc_enabled = gc.isenabled()
    try:
        for round_ in range(repeats):
            gc.collect()
            gc.disable()
            for name in orders[round_ % len(orders)]:
                for param in batch.params:
                    param.grad = None
                _sync(device)
                start_user = resource.getrusage(resource.RUSAGE_SELF).ru_utime
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                run_step(losses[name], batch)
                _sync(device)
                wall[name].append(1e3 * (time.perf_counter() - start_wall))
                cpu[name].append(1e3 * (time.process_time() - start_cpu))
                end_user = resource.getrusage(resource.RUSAGE_SELF).ru_utime
                user[name].append(1e3 * (end_user - start_user))
            if gc_enabled:
                gc.enable()
    finally:
        if gc_enabled:
            gc.enable()
    return CaseResult(
        case=case,
        valid_tokens=batch.valid_tokens,
        wall_ms=wall,
        cpu_ms=cpu,
        user_ms=user,
        first_call_ms=first_call_ms,
    )


# ----------------------------------------------------------------------------- memory


def _limit_malloc_caching() -> bool:
    """Asks glibc to return freed blocks to the system, so that RSS follows live tensors."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_mmap_threshold, 64 * 1024) == 1
    return libc.mallopt(m_trim_threshold, 128 * 1024) == 1 and ok


def _proc_status_kb(name: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def _measure_memory(spec: dict[str, Any]) -> dict[str, Any]:
    """Peak memory growth (bytes) of one step of one loss; runs in a fresh process."""
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    case = Case(**spec["case"])
    name = spec["loss"]
    malloc_limited = device.type == "cpu" and _limit_malloc_caching()
    batch = build_batch(case, device=device, seed=spec["seed"], hidden=spec["hidden"])
    loss_fn = make_losses(batch.actor, compiled=case.mode == "compiled", names=[name])[name]
    if case.mode == "full":
        # One-time initialisations, without paying for a full-size step.
        small = replace(case, batch=2, seq_len=min(case.seq_len, 64), layout="dense")
        warm = build_batch(small, device=device, seed=spec["seed"], hidden=spec["hidden"])
        run_step(make_losses(warm.actor, compiled=False, names=[name])[name], warm)
        del warm
    else:
        run_step(loss_fn, batch)
    for param in batch.params:
        param.grad = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run_step(loss_fn, batch)
        torch.cuda.synchronize(device)
        growth = torch.cuda.max_memory_allocated(device) - before
        method = "cuda max_memory_allocated"
    elif _reset_peak_rss() and _proc_status_kb("VmRSS") is not None:
        before = _proc_status_kb("VmRSS")
        run_step(loss_fn, batch)
        growth = 1024 * (_proc_status_kb("VmHWM") - before)
        method = "VmHWM - VmRSS"
    else:
        # ru_maxrss is in kB on Linux, bytes on macOS, and is never reset.
        scale = 1 if sys.platform == "darwin" else 1024
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run_step(loss_fn, batch)
        growth = scale * (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
        method = "ru_maxrss growth"
    if device.type == "cpu":
        method += ", freed blocks returned" if malloc_limited else ", default malloc"
    return {"growth_bytes": int(growth), "method": method}


def measure_memory(
    case: Case, *, device: torch.device, threads: int, seed: int, hidden: int
) -> tuple[dict[str, float], str]:
    """Peak memory growth (MiB) of one step of each loss, each in a fresh process."""
    memory: dict[str, float] = {}
    method = ""
    for name in LOSSES:
        spec = {
            "case": asdict(case),
            "loss": name,
            "device": str(device),
            "threads": threads,
            "seed": seed,
            "hidden": hidden,
        }
        command = [sys.executable, str(Path(__file__).resolve()), "--memory-child"]
        proc = subprocess.run(command + [json.dumps(spec)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"memory measurement of {name} on {case} failed with exit code "
                f"{proc.returncode}:\n{proc.stderr[-4000:]}"
            )
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        memory[name] = result["growth_bytes"] / 2**20
        method = result["method"]
    return memory, method


# ----------------------------------------------------------------------------- planning


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"8x256,16x1024"`` -> ``[(8, 256), (16, 1024)]``; ``"none"`` -> ``[]``."""
    if text.strip().lower() in ("", "none"):
        return []
    sizes = []
    for item in text.split(","):
        batch, seq_len = item.lower().strip().split("x")
        sizes.append((int(batch), int(seq_len)))
    return sizes


def parse_modes(text: str) -> list[str]:
    """``"full,head"`` -> ``["full", "head"]``; ``"none"`` -> ``[]``."""
    if text.strip().lower() in ("", "none"):
        return []
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for mode in modes:
        if mode not in ("full", "head", "compiled"):
            raise ValueError(f"unknown mode {mode!r}: choose among full, head, compiled")
    return modes


def plan_cases(args: argparse.Namespace) -> tuple[list[Case], list[str]]:
    """The cases to run, and one line for every case skipped or changed."""
    notes: list[str] = []
    cases: list[Case] = []
    sizes = {
        "full": parse_sizes(args.sizes),
        "head": parse_sizes(args.head_sizes),
        "compiled": parse_sizes(args.compile_sizes),
    }
    lazy = parse_sizes(args.lazy)
    lazy_modes = parse_modes(args.lazy_modes)
    for mode in parse_modes(args.modes):
        planned = [(b, t, "dense") for b, t in sizes[mode]]
        if mode == "compiled":
            skipped = [f"{b}x{t}" for b, t in sizes["head"] if (b, t) not in sizes[mode]]
            if skipped:
                notes.append(
                    f"compiled: not run at {', '.join(skipped)} (each loss is compiled afresh "
                    "for each size, seconds per compilation on a CPU)"
                )
        if mode in lazy_modes and mode != "compiled":
            planned += [(b, t, "lazy") for b, t in lazy]
        elif lazy:
            notes.append(f"{mode}: lazily stacked batches not run (see --lazy-modes)")
        for batch, seq_len, layout in planned:
            case = Case(mode=mode, batch=batch, seq_len=seq_len, layout=layout)
            if mode == "full":
                vocab = min(args.vocab, args.logit_budget // case.tokens)
                if vocab < args.min_vocab:
                    notes.append(
                        f"full {case.size} {layout}: skipped, V={args.vocab} needs "
                        f"{case.tokens * args.vocab:.3g} logits (budget {args.logit_budget:.3g}) "
                        f"and V={vocab} is under --min-vocab {args.min_vocab}"
                    )
                    continue
                if vocab < args.vocab:
                    notes.append(
                        f"full {case.size} {layout}: V={vocab} instead of {args.vocab}, so that "
                        f"B*T*V <= {args.logit_budget:.3g} elements "
                        f"({4 * args.logit_budget / 2**30:.1f} GiB of float32 logits)"
                    )
                case = replace(case, vocab=vocab)
            cases.append(case)
    return cases, notes


# ----------------------------------------------------------------------------- report


def machine_facts(device: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
        "tensordict": tensordict.__version__,
        "torchrl_gspo": torchrl_gspo.__version__,
        "device": str(device),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
    }
    for name in ("OMP_NUM_THREADS", "THP_MEM_ALLOC_ENABLE"):
        facts[name] = os.environ.get(name, "unset")
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    if hasattr(os, "getloadavg"):
        facts["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    return facts


def _fmt_ratio(value: float | None, iqr: tuple[float, float] | None = None) -> str:
    if value is None:
        return "n/a"
    if iqr is None:
        return f"{value:.3f}"
    return f"{value:.3f} ({iqr[0]:.2f}-{iqr[1]:.2f})"


def markdown_table(results: Sequence[CaseResult]) -> str:
    """One row per case: medians, ratios to GRPOLoss (wall and user CPU time), memory."""
    others = [n for n in LOSSES if n != BASELINE]
    header = ["size BxT", "mode", "V", "layout", "valid tok"]
    header += [f"{SHORT_NAMES[n]} ms" for n in LOSSES]
    header += [f"{SHORT_NAMES[n]}/GRPO {clock}" for clock in ("wall", "cpu") for n in others]
    header += [f"{SHORT_NAMES[n]} MB" for n in LOSSES]
    header += [f"{SHORT_NAMES[n]}/GRPO mem" for n in others]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for res in results:
        case = res.case
        row = [case.size, case.mode, str(case.vocab or "-"), case.layout, str(res.valid_tokens)]
        row += [f"{res.median_ms(n):.2f}" for n in LOSSES]
        for clock in ("wall", res.cpu_clock):
            row += [_fmt_ratio(res.ratio(n, clock), res.ratio_iqr(n, clock)) for n in others]
        row += [f"{res.memory_mb[n]:.1f}" if n in res.memory_mb else "-" for n in LOSSES]
        row += [_fmt_ratio(res.memory_ratio(n)) for n in others]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _head_match(results: Sequence[CaseResult], case: Case) -> CaseResult | None:
    for res in results:
        if (
            res.case.mode == "head"
            and res.case.layout == case.layout
            and (res.case.batch, res.case.seq_len) == (case.batch, case.seq_len)
        ):
            return res
    return None


def _verdict(value: float, goal: float) -> str:
    return f"{value:.4f} ({'met' if value <= goal else 'NOT met'})"


def _measured_verdict(rows: Sequence[CaseResult], name: str, clock: Clock) -> str:
    """Worst median ratio over ``rows``; 'not resolved' when the noise spans the goal.

    A row meets the goal when its median ratio is within it; it is not resolved when its
    median is above the goal but its lower quartile is within it.
    """
    worst = max(rows, key=lambda r: r.ratio(name, clock))
    low, high = worst.ratio_iqr(name, clock)
    value = worst.ratio(name, clock)
    if value <= GOAL_TIME_RATIO:
        status = "met"
    elif all(r.ratio_iqr(name, clock)[0] <= GOAL_TIME_RATIO for r in rows):
        status = "not resolved: the noise spans the goal"
    else:
        status = "NOT met"
    return f"{value:.4f} (IQR {low:.3f}-{high:.3f}, {worst.case.size}; {status})"


def summary_lines(results: Sequence[CaseResult]) -> list[str]:
    """Goal check (full mode), overhead estimated from head mode, scaling with T."""
    lines: list[str] = []
    goal_rows = [
        r
        for r in results
        if r.case.mode == "full" and r.case.layout == "dense" and r.case.tokens >= GOAL_MIN_TOKENS
    ]
    for name in ("GSPOLoss", "GSPOTokenLoss"):
        if not goal_rows:
            lines.append(f"goal ({name}): no full-mode dense size with B*T >= {GOAL_MIN_TOKENS}")
            continue
        parts = [
            f"{clock} {_measured_verdict(goal_rows, name, clock)}" for clock in ("wall", "user")
        ]
        expected = [
            1 + head.delta_ms(name, "cpu") / res.median_ms(BASELINE, "user")
            for res in goal_rows
            if (head := _head_match(results, res.case)) is not None
        ]
        if expected:
            parts.append(f"expected from head mode {_verdict(max(expected), GOAL_TIME_RATIO)}")
        mems = [m for m in (r.memory_ratio(name) for r in goal_rows) if m is not None]
        mem = _verdict(max(mems), GOAL_MEMORY_RATIO) if mems else "not measured"
        lines.append(
            f"goal {name}/GRPOLoss, full mode, dense, B*T >= 16x1024: time <= {GOAL_TIME_RATIO}, "
            f"worst median ratio: {', '.join(parts)}; memory <= {GOAL_MEMORY_RATIO}, worst: {mem}"
        )
    for res in results:
        head = _head_match(results, res.case) if res.case.mode == "full" else None
        if head is None:
            continue
        base = res.median_ms(BASELINE, "user")
        deltas = ", ".join(
            f"{n} {head.delta_ms(n, 'cpu'):+.2f} ms = {100 * head.delta_ms(n, 'cpu') / base:.3f}%"
            for n in LOSSES
            if n != BASELINE
        )
        lines.append(
            f"full {res.case.size} {res.case.layout} V={res.case.vocab}: overhead over "
            "GRPOLoss measured in head mode at the same size (CPU time), relative to the "
            f"full-mode GRPOLoss step ({base:.0f} ms user CPU): {deltas}"
        )
    for mode in ("full", "head", "compiled"):
        for batch in sorted({r.case.batch for r in results if r.case.mode == mode}):
            rows = sorted(
                (
                    r
                    for r in results
                    if r.case.mode == mode and r.case.batch == batch and r.case.layout == "dense"
                ),
                key=lambda r: r.case.seq_len,
            )
            if len(rows) < 2:
                continue
            if mode == "full":
                items = [
                    f"T={r.case.seq_len} V={r.case.vocab}: {r.ratio('GSPOLoss', 'user'):.3f}"
                    for r in rows
                ]
                what = "GSPOLoss/GRPOLoss user CPU time"
            else:
                items = [
                    f"T={r.case.seq_len}: {r.ratio('GSPOLoss', 'cpu'):.3f}, "
                    f"{1e6 * r.delta_ms('GSPOLoss', 'cpu') / r.case.tokens:.1f} ns"
                    for r in rows
                ]
                what = "GSPOLoss/GRPOLoss CPU time, (GSPOLoss - GRPOLoss) per padded token"
            lines.append(f"scaling with T, {mode}, B={batch}: {what}: {'; '.join(items)}")
    for res in results:
        if res.case.mode == "compiled":
            first = ", ".join(f"{n} {v / 1e3:.1f} s" for n, v in res.first_call_ms.items())
            lines.append(f"compiled {res.case.size}: first call, compilation included: {first}")
    return lines


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Time and peak memory of GSPOLoss and GSPOTokenLoss relative to GRPOLoss.",
    )
    full, quick = DEFAULTS["full"], DEFAULTS["quick"]

    def default(name: str) -> str:
        return f"default {full[name]}; --quick: {quick[name]}"

    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds (for CI)")
    parser.add_argument("--modes", help=f"comma list of full,head,compiled ({default('modes')})")
    parser.add_argument("--sizes", help=f"BxT list, full mode ({default('sizes')})")
    parser.add_argument("--head-sizes", help=f"BxT list, head mode ({default('head_sizes')})")
    parser.add_argument("--compile-sizes", help=f"BxT list, compiled ({default('compile_sizes')})")
    parser.add_argument("--lazy", help=f"BxT list run lazily stacked ({default('lazy')})")
    parser.add_argument("--lazy-modes", help=f"modes run lazily stacked ({default('lazy_modes')})")
    parser.add_argument("--vocab", type=int, help=f"full-mode V ({default('vocab')})")
    parser.add_argument(
        "--logit-budget",
        type=int,
        default=2**29,
        help="most B*T*V logits in full mode; V is scaled down above it (default 2**29)",
    )
    parser.add_argument("--min-vocab", type=int, default=256, help="skip full mode below this V")
    parser.add_argument("--hidden", type=int, default=16, help="full-mode embedding width")
    parser.add_argument(
        "--warmup", type=int, help=f"full-mode warm-up rounds ({default('warmup')})"
    )
    parser.add_argument("--head-warmup", type=int, help=f"head/compiled ({default('head_warmup')})")
    parser.add_argument(
        "--repeats", type=int, help=f"full-mode timed rounds ({default('repeats')})"
    )
    parser.add_argument(
        "--head-repeats", type=int, help=f"head/compiled timed rounds ({default('head_repeats')})"
    )
    parser.add_argument(
        "--memory-modes", help=f"modes whose memory is measured ({default('memory_modes')})"
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0, help="seed of batches and actors")
    parser.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parent.parent / "outputs" / "benchmarks"),
        help="folder for the JSON and markdown results (default: outputs/benchmarks)",
    )
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.memory_child is not None:
        print(json.dumps(_measure_memory(json.loads(args.memory_child))))
        return 0
    for name, value in DEFAULTS["quick" if args.quick else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cases, notes = plan_cases(args)
    memory_modes = set(parse_modes(args.memory_modes))
    # --quick measures memory at its largest dense size only.
    memory_sizes = parse_sizes(args.sizes)[-1:] if args.quick else None
    facts = machine_facts(device)
    settings = {
        "quick": args.quick,
        "loss_kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in LOSS_KWARGS.items()},
        "advantage": "one per sequence, [B, 1, 1]",
        "warmup_rounds": {"full": args.warmup, "head/compiled": args.head_warmup},
        "timed_rounds": {"full": args.repeats, "head/compiled": args.head_repeats},
        "memory_modes": sorted(memory_modes),
        "logit_budget": args.logit_budget,
        "hidden": args.hidden,
        "seed": args.seed,
    }
    print("# GSPOLoss / GSPOTokenLoss vs GRPOLoss: forward + backward of one step\n")
    for key, value in {**facts, **settings}.items():
        print(f"- {key}: {value}")
    for note in notes:
        print(f"- plan: {note}")
    print(flush=True)

    results: list[CaseResult] = []
    started = time.perf_counter()
    for case in cases:
        tic = time.perf_counter()
        full = case.mode == "full"
        res = time_case(
            case,
            device=device,
            warmup=args.warmup if full else args.head_warmup,
            repeats=args.repeats if full else args.head_repeats,
            seed=args.seed,
            hidden=args.hidden,
        )
        measure = case.mode in memory_modes
        if memory_sizes is not None:
            measure = measure and case.layout == "dense"
            measure = measure and [(case.batch, case.seq_len)] == memory_sizes
        if measure:
            res.memory_mb, res.memory_method = measure_memory(
                case,
                device=device,
                threads=torch.get_num_threads(),
                seed=args.seed,
                hidden=args.hidden,
            )
        results.append(res)
        medians = ", ".join(f"{SHORT_NAMES[n]} {res.median_ms(n):.2f}" for n in LOSSES)
        print(
            f"[{time.perf_counter() - started:6.1f} s] {case.mode} {case.size} {case.layout} "
            f"V={case.vocab or '-'}: median wall ms {medians} "
            f"({time.perf_counter() - tic:.1f} s)",
            flush=True,
        )

    if hasattr(os, "getloadavg"):
        facts["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    facts["runtime_s"] = round(time.perf_counter() - started, 1)
    methods = sorted({r.memory_method for r in results if r.memory_method})
    footnotes = [
        "ms: median wall-clock time of one forward + backward over the timed rounds.",
        "X/GRPO wall, cpu: median over rounds of time(X) / time(GRPOLoss) within the round "
        "(interquartile range in parentheses), wall-clock or CPU time of the process; cpu is "
        "the user-mode CPU time in full mode (it leaves out the kernel's page-fault work on "
        "the fresh logits, the same for all three losses) and user + system CPU time in the "
        "other modes.",
        "MB: peak memory growth (MiB) of one step, one fresh process per loss"
        + (f" ({'; '.join(methods)})" if methods else "")
        + "; '-': not measured.",
    ]
    table = markdown_table(results)
    summary = summary_lines(results)
    print()
    print(table)
    print()
    for line in footnotes + summary:
        print(f"- {line}")
    print(f"- runtime: {facts['runtime_s']} s; load average at the end: {facts.get('loadavg_end')}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "bench_loss_quick" if args.quick else "bench_loss"
    payload = {
        "machine": facts,
        "settings": settings,
        "notes": notes,
        "results": [r.to_json() for r in results],
        "summary": summary,
    }
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    report = [table, ""] + [f"- {line}" for line in footnotes + notes + summary]
    (out / f"{stem}.md").write_text("\n".join(report) + "\n")
    print(f"- results: {out / stem}.json, {out / stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
