# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""GSPO's objective over the global batch, on real processes and real collectives.

Two and three processes (gloo, 127.0.0.1), each with a different number of ragged
rows, empty responses included, with the actor in DistributedDataParallel (and, for
the tiny Qwen2, FSDP2's ``fully_shard``). Every gradient is compared with the
single-process gradient of Eq. 5 on the union batch.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from gspo_testing import BigramActor, build_loss, lazy_batch, make_rows
from llm_testing import EXAMPLES, tiny_qwen, training_wrapper, word_tokenizer
from tensordict import TensorDict, lazy_stack

from torchrl_gspo import GSPOLoss, RecomputeOldLogProbs, SubsequenceLoss

pytestmark = pytest.mark.distributed

EPS = (0.02, 0.02)  # sequences clipped on both sides and inside the range
# 12 ragged rows, three of them without a response token
SHAPES = [
    (3, 5),
    (2, 1),
    (4, 0),
    (1, 7),
    (2, 3),
    (5, 4),
    (2, 0),
    (3, 2),
    (1, 6),
    (4, 3),
    (2, 0),
    (3, 4),
]
SPLITS = {2: [0, 3, 12], 3: [0, 3, 7, 12]}
# micro-batch boundaries of each rank's rows (unequal sizes)
MICRO = {2: [[0, 1, 2, 3], [0, 2, 5, 9]], 3: [[0, 1, 2, 3], [0, 1, 3, 4], [0, 2, 3, 5]]}
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _qwen_rows(seed: int):
    """Ragged token rows for the tiny Qwen2, with perturbed recomputed old log-probs."""
    tokenizer = word_tokenizer()
    model = tiny_qwen(tokenizer, seed=seed).double()
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, (p, r) in enumerate(SHAPES):
        full = torch.randint(3, len(tokenizer), (p + max(r, 1),), generator=gen)
        tokens = TensorDict(prompt=full[:p], response=full[p:], full=full)
        rows.append(
            TensorDict(tokens=tokens, advantage=torch.tensor([[(-1.0) ** i * (1 + i / 10)]]))
        )
    data = lazy_stack(rows, 0)
    RecomputeOldLogProbs(training_wrapper(model, tokenizer), out_key="log_probs")(data)
    out = []
    for row in data.unbind(0):
        row = row.clone()
        old = row.get(("log_probs", "full")).double()
        row.set(
            ("log_probs", "full"),
            old + 0.02 * torch.randn(old.shape, generator=gen, dtype=old.dtype),
        )
        out.append(row)
    return out, model, tokenizer


def _run(world: int, tmp_path: Path, qwen: bool) -> list[dict]:
    rows = make_rows(SHAPES, actor=BigramActor(seed=3), noise=0.03, seed=5, dtype=torch.float64)
    spec = {"rows": rows, "split": SPLITS[world], "micro": MICRO[world], "seed": 3, "eps": EPS}
    if qwen:
        spec["qwen_rows"], _, _ = _qwen_rows(seed=7)
        spec["qwen_seed"] = 7
    torch.save(spec, tmp_path / "spec.pt")
    from distributed_workers import worker

    context = mp.start_processes(
        worker,
        args=(world, _free_port(), str(tmp_path)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 150
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} workers did not finish in 150 s")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)], spec


def _union_grad(rows, dtype, loss_cls=GSPOLoss, **kwargs):
    actor = BigramActor(dtype=dtype, seed=3)
    rows = [{k: v.to(dtype) if v.is_floating_point() else v for k, v in r.items()} for r in rows]
    out = build_loss(loss_cls, actor, clip_epsilon=EPS, **kwargs)(lazy_batch(rows))
    return torch.autograd.grad(out.loss_objective, actor.table)[0], out


def _check_bigram(results, spec, world):
    rows, split = spec["rows"], spec["split"]
    for dtype, name in ((torch.float64, "bigram64"), (torch.float32, "bigram32")):
        tol = TOL[dtype]
        expected, union_out = _union_grad(rows, dtype)
        _, segment_out = _union_grad(rows, dtype, SubsequenceLoss, segments=2)
        segment_fields = segment_out.statistics.fields()
        if dtype == torch.float64:  # (the float32 actor is another table: all clipped)
            assert 0 < segment_fields["segment_clip_fraction"] < 1
        # option off: DDP averages the ranks' per-rank means, (1/R) sum_r grad(mean_r)
        local = [_union_grad(rows[split[r] : split[r + 1]], dtype)[0] for r in range(world)]
        documented = sum(local) / world
        for rank, result in enumerate(results):
            r = result[name]
            torch.testing.assert_close(r["global"], expected, rtol=tol, atol=tol)
            torch.testing.assert_close(r["accumulated"], expected, rtol=tol, atol=tol)
            for option in ("stepper", "stepper_no_sync"):
                torch.testing.assert_close(r[f"{option}_update"], expected, rtol=tol, atol=tol)
            # one gradient reduction per micro-batch (3), or one per step with no_sync
            assert (r["stepper_reductions"], r["stepper_no_sync_reductions"]) == (3, 1)
            torch.testing.assert_close(r["local"], documented, rtol=tol, atol=tol)
            assert (r["local"] - expected).abs().max() > 100 * tol  # the difference is real
            assert set(r["diagnostics"]) == set(r["combined"]) == set(union_out.statistics.fields())
            for key, value in r["diagnostics"].items():  # every statistic and diagnostic
                union = getattr(union_out, key).detach()
                torch.testing.assert_close(value, union, rtol=tol, atol=tol)
                torch.testing.assert_close(r["combined"][key], union, rtol=tol, atol=tol)
            # the segment statistics of SubsequenceLoss: those of the union batch
            assert set(r["segment_diagnostics"]) == set(segment_fields)
            for key, value in r["segment_diagnostics"].items():
                torch.testing.assert_close(value, segment_fields[key], rtol=tol, atol=tol)
            # each rank logs its share of the loss; their sum over R is the global loss
            shares = sum(result[name]["stepper_loss_share"] for result in results) / world
            torch.testing.assert_close(
                shares, union_out.loss_objective.detach(), rtol=tol, atol=tol
            )
            if rank == 0:  # rank 0's own diagnostics differ from the global ones
                assert any(
                    not torch.equal(r["local_diagnostics"][k], r["diagnostics"][k])
                    for k in r["diagnostics"]
                )


def _check_failures(results, world):
    """One rank's bad input: every rank raises the same error (none waits); a rank
    outside a group is refused; an infinite loss on one rank skips the step on all."""
    for rank, result in enumerate(results):
        r = result["failures"]
        assert r["empty_micro_batch"].startswith(
            "set_sequence_scale: 1 micro-batch(es) of the step hold no row"
        ), rank
        for key in ("scale_outside_group", "diagnostics_outside_group"):
            assert (r[key] is None) == (rank == 0), (key, rank)
            if rank:
                assert f"global rank {rank}) is not in the process group" in r[key]
        assert r["poisoned_skipped"] == 1.0 and not r["poisoned_update"].any(), rank
    assert world == len(results)


def _groups(split, micro_batches: int = 1) -> list[tuple[int, int]]:
    """The row ranges forwarded together: each rank's rows, cut as the stepper cuts them."""
    groups = []
    for a, b in zip(split[:-1], split[1:], strict=True):
        for part in torch.arange(a, b).tensor_split(micro_batches):
            groups.append((int(part[0]), int(part[-1]) + 1))
    return groups


def _qwen_reference(rows, tie: bool, groups) -> dict:
    """The gradient of Eq. 5 on the union batch, (1/N) sum_i loss_i. The transformer's
    padded forward depends on the padding width at about 1e-9 (float64 kernels on other
    shapes), so the rows are forwarded in the groups the workers forward together, on
    one thread."""
    tokenizer = word_tokenizer()
    model = tiny_qwen(tokenizer, seed=7, tie=tie).double()
    policy = training_wrapper(model, tokenizer)
    loss_fn = build_loss(GSPOLoss, policy, clip_epsilon=EPS, entropy_bonus=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loss = sum(
            loss_fn(lazy_stack(rows[a:b], 0)).loss_objective * (b - a) / len(rows)
            for a, b in groups
        )
    finally:
        torch.set_num_threads(threads)
    names, params = zip(*model.named_parameters(), strict=True)
    return dict(zip(names, torch.autograd.grad(loss, params), strict=True))


def _assert_grads(got, expected, kind):
    assert set(got) == set(expected), kind
    for name, grad in expected.items():
        difference = float((got[name] - grad).abs().max())
        torch.testing.assert_close(
            got[name], grad, rtol=1e-12, atol=1e-12, msg=f"{kind} {name}: {difference:.2e}"
        )


def test_two_processes_ddp_and_fsdp(tmp_path):
    results, spec = _run(2, tmp_path, qwen=True)
    _check_bigram(results, spec, 2)
    _check_failures(results, 2)
    rows, _, _ = _qwen_rows(seed=7)
    tied = _qwen_reference(rows, True, _groups(SPLITS[2]))
    untied = _qwen_reference(rows, False, _groups(SPLITS[2]))
    stepped = _qwen_reference(rows, False, _groups(SPLITS[2], micro_batches=2))
    for result in results:
        _assert_grads(result["qwen_ddp"], tied, "qwen_ddp")
        _assert_grads(result["qwen_fsdp"], tied, "qwen_fsdp")
        # an untied head: DDP on the whole model (the recipe) is exact ...
        _assert_grads(result["qwen_untied_ddp"], untied, "qwen_untied_ddp")
        # ... and so is the stepper's FSDP2 step with its gradient sync deferred
        _assert_grads(result["qwen_untied_fsdp_stepper"], stepped, "qwen_untied_fsdp_stepper")
    # ... DDP on the backbone only leaves each rank its own lm_head gradient: drift
    heads = [result["qwen_untied_backbone"]["lm_head.weight"] for result in results]
    assert not torch.allclose(heads[0], heads[1])
    assert not torch.allclose(heads[0], untied["lm_head.weight"])


def test_three_processes_ddp(tmp_path):
    results, spec = _run(3, tmp_path, qwen=False)
    _check_bigram(results, spec, 3)
    _check_failures(results, 3)


def test_example_trains_under_torchrun(tmp_path):
    """``torchrun --nproc-per-node 2 examples/gspo_toy.py``: DDP with GlobalBatchStepper."""
    import os
    import subprocess

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(EXAMPLES / "gspo_toy.py"),
        "--loss",
        "gspo",
        "--steps",
        "2",
        "--out",
        str(tmp_path),
        "--no-progress",
        "--untie-head",  # an output head of its own: DDP must wrap the whole model
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [
        [json.loads(line) for line in (tmp_path / f"metrics_gspo_rank{r}.jsonl").open()]
        for r in range(2)
    ]
    assert [len(records) for records in ranks] == [2, 2]
    # each rank sampled its own prompts: its own batches and rewards
    assert ranks[0][0]["reward"] != ranks[1][0]["reward"]
    summary = json.loads((tmp_path / "summary.json").read_text())["gspo"]
    assert summary["steps"] == 2
    assert summary["rank_divergence"] == 0.0  # the ranks end with the same weights
