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
import os
from pathlib import Path

import torch
import torch.distributed as dist
from gspo_testing import BigramActor, build_loss, lazy_batch
from llm_testing import tiny_qwen, training_wrapper, word_tokenizer
from tensordict import lazy_stack
from torch.nn.parallel import DistributedDataParallel

from torchrl_gspo import (
    GlobalBatchStepper,
    GSPOLoss,
    SequenceStatistics,
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
    # GlobalBatchStepper (TorchRL's stepper protocol): one SGD step of lr 1
    actor = DDPBigramActor(dtype=dtype, seed=spec["seed"])
    table = actor.net.module.table
    before = table.detach().clone()
    stepper = GlobalBatchStepper(
        torch.optim.SGD([table], lr=1.0), gradient_accumulation_steps=3, clip_norm=None
    )
    loss_fn = build_loss(GSPOLoss, actor, clip_epsilon=spec["eps"], entropy_bonus=False)

    class Trainer:
        compute_loss = staticmethod(loss_fn)

    metrics = stepper.step(Trainer(), lazy_batch(rows))
    results["stepper_update"] = (before - table.detach()).clone()
    results["stepper_grad_norm"] = metrics["grad_norm"]
    return results


def _qwen(spec: dict, rank: int, fsdp: bool) -> dict:
    tokenizer = word_tokenizer()
    model = tiny_qwen(tokenizer, seed=spec["qwen_seed"]).double()
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    else:
        model.model = DistributedDataParallel(model.model)
    policy = training_wrapper(model, tokenizer)
    rows = spec["qwen_rows"][spec["split"][rank] : spec["split"][rank + 1]]
    batch = lazy_stack([row.clone() for row in rows], 0)
    set_sequence_scale([batch])
    out = build_loss(GSPOLoss, policy, clip_epsilon=spec["eps"], entropy_bonus=False)(batch)
    out.loss_objective.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[name.replace("model.module.", "model.")] = grad.detach().clone()
    return grads


def worker(rank: int, world: int, port: int, directory: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        path = Path(directory)
        spec = torch.load(path / "spec.pt", weights_only=False)
        results = {
            "bigram64": _bigram(spec, rank, torch.float64),
            "bigram32": _bigram(spec, rank, torch.float32),
        }
        if spec.get("qwen_rows") is not None:
            results["qwen_ddp"] = _qwen(spec, rank, fsdp=False)
            results["qwen_fsdp"] = _qwen(spec, rank, fsdp=True)
        torch.save(results, path / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
