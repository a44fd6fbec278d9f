# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Worker processes of the data-parallel tests: gloo on 127.0.0.1, one CPU thread each.

Each worker reads the global batch written by the test, takes its rank's rows, runs
every scenario and saves what it measured; the test compares with single-process
references on the union batch.
"""

from __future__ import annotations

import datetime
import functools
import gc
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from gspo_testing import BigramActor, build_loss, lazy_batch
from llm_testing import tiny_qwen, training_wrapper, word_tokenizer
from tensordict import lazy_stack
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from torchrl_gspo import (
    GlobalBatchStepper,
    GSPOLoss,
    SamplerAudit,
    SequenceStatistics,
    SubsequenceLoss,
    all_reduce_diagnostics,
    set_sequence_scale,
)


class Lookup(torch.nn.Module):
    """The bigram table as a module, so that DDP sees its forward."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table.detach().clone())

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        return self.table[previous]


class DDPBigramActor(BigramActor):
    """The test suite's bigram actor, its logits computed through a DDP-wrapped table."""

    def __init__(self, dtype: torch.dtype, seed: int) -> None:
        super().__init__(dtype=dtype, seed=seed)
        self.net = DistributedDataParallel(Lookup(self.table))

    def logits(self, tensordict):
        tokens = tensordict.get(
            self.tokens_key, as_padded_tensor=True, padding_side="left", padding_value=0
        )
        previous = torch.cat([torch.full_like(tokens[..., :1], 0), tokens[..., :-1]], -1)
        return self.net(previous)


def _bigram(spec: dict, rank: int, dtype: torch.dtype) -> dict:
    rows = [
        {k: v.to(dtype) if v.is_floating_point() else v for k, v in row.items()}
        for row in spec["rows"][spec["split"][rank] : spec["split"][rank + 1]]
    ]
    results = {}
    for option in ("global", "local"):
        actor = DDPBigramActor(dtype=dtype, seed=spec["seed"])
        batch = lazy_batch(rows)
        if option == "global":
            set_sequence_scale([batch])
        out = build_loss(GSPOLoss, actor, clip_epsilon=spec["eps"])(batch)
        out.loss_objective.backward()
        results[option] = actor.net.module.table.grad.clone()
        if option == "global":
            names = out.statistics.fields()  # every statistic and diagnostic
            glob = all_reduce_diagnostics(out)
            results["diagnostics"] = {k: getattr(glob, k) for k in names}
            results["local_diagnostics"] = {k: getattr(out, k) for k in names}
    # a subsequence objective's segment statistics, reduced over the ranks
    actor = DDPBigramActor(dtype=dtype, seed=spec["seed"])
    out = build_loss(SubsequenceLoss, actor, clip_epsilon=spec["eps"], segments=2)(lazy_batch(rows))
    results["segment_diagnostics"] = all_reduce_diagnostics(out).statistics.fields()
    # gradient accumulation over this rank's micro-batches (unequal sizes), under DDP
    actor = DDPBigramActor(dtype=dtype, seed=spec["seed"])
    cuts = spec["micro"][rank]
    micro = [lazy_batch(rows[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    set_sequence_scale(micro)
    loss_fn = build_loss(GSPOLoss, actor, clip_epsilon=spec["eps"])
    for batch in micro:
        loss_fn(batch).loss_objective.backward()
    results["accumulated"] = actor.net.module.table.grad.clone()
    # diagnostics: split into micro-batches -> combine -> all_reduce
    with torch.no_grad():
        parts = [SequenceStatistics.from_output(loss_fn(batch)) for batch in micro]
    combined = functools.reduce(SequenceStatistics.combine, parts).all_reduce()
    results["combined"] = combined.fields()
    # GlobalBatchStepper (TorchRL's stepper protocol): one SGD step of lr 1, gradients
    # reduced at each micro-batch, then once per step (model=...: no_sync)
    for option in ("stepper", "stepper_no_sync"):
        update, metrics, reductions = _stepper_step(spec, rows, dtype, option == "stepper_no_sync")
        results[f"{option}_update"], results[f"{option}_reductions"] = update, reductions
        results[f"{option}_grad_norm"] = metrics["grad_norm"]
        results[f"{option}_loss_share"] = metrics["loss_objective"]
    return results


def _stepper_step(spec, rows, dtype, defer: bool, poison: bool = False):
    """One GlobalBatchStepper step (K = 3, SGD lr 1) of a DDP bigram actor whose
    gradient reductions are counted; ``poison`` makes this rank's loss infinite."""
    actor = DDPBigramActor(dtype=dtype, seed=spec["seed"])
    calls = {"n": 0}

    def counting(state, bucket):
        state["n"] += 1
        return allreduce_hook(None, bucket)

    actor.net.register_comm_hook(calls, counting)
    table = actor.net.module.table
    before = table.detach().clone()
    model = actor.net if defer else None
    optimizer = torch.optim.SGD([table], lr=1.0)
    stepper = GlobalBatchStepper(
        optimizer, gradient_accumulation_steps=3, clip_norm=None, model=model
    )
    loss_fn = build_loss(GSPOLoss, actor, clip_epsilon=spec["eps"], entropy_bonus=False)

    class Trainer:
        @staticmethod
        def compute_loss(batch):
            out = loss_fn(batch)
            return out.set("loss_objective", out.loss_objective * math.inf) if poison else out

    metrics = stepper.step(Trainer(), lazy_batch(rows))
    return (before - table.detach()).clone(), metrics, calls["n"]


def _failures(spec: dict, rank: int, world: int) -> dict:
    """What every rank sees when one rank's input is wrong: the same error, no hang."""
    rows = spec["rows"][spec["split"][rank] : spec["split"][rank + 1]]
    results = {}
    # rank 0 holds 3 rows: 4 micro-batches leave one of its micro-batches empty
    actor = DDPBigramActor(dtype=torch.float64, seed=spec["seed"])
    stepper = GlobalBatchStepper(
        torch.optim.SGD([actor.net.module.table], lr=1.0), gradient_accumulation_steps=4
    )
    results["empty_micro_batch"] = _error(lambda: stepper.step(None, lazy_batch(rows)))
    # a process group without this rank (every rank builds it; rank 0 is its member)
    group = dist.new_group([0])
    batch = lazy_batch(rows)
    results["scale_outside_group"] = _error(lambda: set_sequence_scale(batch, group=group))
    out = build_loss(GSPOLoss, actor, clip_epsilon=spec["eps"])(lazy_batch(rows))
    results["diagnostics_outside_group"] = _error(lambda: all_reduce_diagnostics(out, group=group))
    # an infinite loss on the last rank only: every rank skips the step
    update, metrics, _ = _stepper_step(spec, rows, torch.float64, False, rank == world - 1)
    results["poisoned_update"], results["poisoned_skipped"] = update, metrics["skipped"]
    return results


def _error(call) -> str | None:
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


def _qwen(spec: dict, rank: int, wrap: str, tie: bool = True) -> dict:
    """Gradients of GSPO's loss over the rank's rows of a tiny Qwen2, wrapped for data
    parallelism: "fsdp" (fully_shard), "ddp" (the whole model, the recipe) or
    "ddp_backbone" (DDP on model.model only, the recipe of 0.2)."""
    tokenizer = word_tokenizer()
    model = tiny_qwen(tokenizer, seed=spec["qwen_seed"], tie=tie).double()
    scored = model
    if wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    elif wrap == "ddp":
        scored = DistributedDataParallel(model)
    else:
        model.model = DistributedDataParallel(model.model)
    policy = training_wrapper(scored, tokenizer)
    rows = spec["qwen_rows"][spec["split"][rank] : spec["split"][rank + 1]]
    batch = lazy_stack([row.clone() for row in rows], 0)
    set_sequence_scale([batch])
    out = build_loss(GSPOLoss, policy, clip_epsilon=spec["eps"], entropy_bonus=False)(batch)
    out.loss_objective.backward()
    return _full_grads(model)


def _full_grads(model) -> dict:
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[name.replace("model.module.", "model.")] = grad.detach().clone()
    return grads


def _qwen_fsdp_stepper(spec: dict, rank: int) -> dict:
    """GlobalBatchStepper(model=fsdp_model): gradient sync deferred to the last of two
    micro-batches; the SGD (lr 1) update is minus the gradient."""
    from torch.distributed.fsdp import fully_shard

    tokenizer = word_tokenizer()
    model = tiny_qwen(tokenizer, seed=spec["qwen_seed"], tie=False).double()
    fully_shard(model)
    before = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    policy = training_wrapper(model, tokenizer)
    loss_fn = build_loss(GSPOLoss, policy, clip_epsilon=spec["eps"], entropy_bonus=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    stepper = GlobalBatchStepper(
        optimizer, gradient_accumulation_steps=2, clip_norm=None, model=model
    )

    class Trainer:
        compute_loss = staticmethod(loss_fn)

    rows = spec["qwen_rows"][spec["split"][rank] : spec["split"][rank + 1]]
    stepper.step(Trainer(), lazy_stack([row.clone() for row in rows], 0))
    return {n: before[n] - p.full_tensor().detach() for n, p in model.named_parameters()}


def _join(rank: int, world: int, port: int) -> None:
    """This process as ``rank`` of a gloo group on 127.0.0.1, one CPU thread."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )


def worker(rank: int, world: int, port: int, directory: str) -> None:
    _join(rank, world, port)
    try:
        path = Path(directory)
        spec = torch.load(path / "spec.pt", weights_only=False)
        results = {
            "bigram64": _bigram(spec, rank, torch.float64),
            "bigram32": _bigram(spec, rank, torch.float32),
            "failures": _failures(spec, rank, world),
        }
        if spec.get("qwen_rows") is not None:
            results["qwen_ddp"] = _qwen(spec, rank, "ddp_backbone")
            results["qwen_fsdp"] = _qwen(spec, rank, "fsdp")
            results["qwen_untied_ddp"] = _qwen(spec, rank, "ddp", tie=False)
            results["qwen_untied_backbone"] = _qwen(spec, rank, "ddp_backbone", tie=False)
            results["qwen_untied_fsdp_stepper"] = _qwen_fsdp_stepper(spec, rank)
        torch.save(results, path / f"rank{rank}.pt")
    finally:
        gc.collect()  # DDP wrappers left in reference cycles go while the group lives
        dist.destroy_process_group()


def audit_worker(rank: int, world: int, port: int, directory: str) -> None:
    """Rank 0 audits tokens sampled with top-k 3, the others full sampling; every rank
    calls ``check("raise")`` and saves the error it got (or ``None``)."""
    _join(rank, world, port)
    try:
        gen = torch.Generator().manual_seed(rank)
        logits = torch.randn(200, 50, generator=gen)
        probs = logits.softmax(-1)
        if rank == 0:
            top = probs.topk(3, -1)
            probs = torch.zeros_like(probs).scatter(-1, top.indices, top.values)
        tokens = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        audit = SamplerAudit(ranks=(1, 3, 10))
        audit.update(logits, tokens)
        error = None
        try:
            audit.check("raise")
        except RuntimeError as caught:
            error = str(caught)
        dist.barrier()  # every rank got here: none is left waiting
        torch.save({"error": error}, Path(directory) / f"audit{rank}.pt")
    finally:
        dist.destroy_process_group()
