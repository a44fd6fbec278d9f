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

from torchrl_gspo import GSPOLoss, RecomputeOldLogProbs

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


def _union_grad(rows, dtype, **kwargs):
    actor = BigramActor(dtype=dtype, seed=3)
    rows = [{k: v.to(dtype) if v.is_floating_point() else v for k, v in r.items()} for r in rows]
    out = build_loss(GSPOLoss, actor, clip_epsilon=EPS, **kwargs)(lazy_batch(rows))
    return torch.autograd.grad(out.loss_objective, actor.table)[0], out


def _check_bigram(results, spec, world):
    rows, split = spec["rows"], spec["split"]
    for dtype, name in ((torch.float64, "bigram64"), (torch.float32, "bigram32")):
        tol = TOL[dtype]
        expected, union_out = _union_grad(rows, dtype)
        # option off: DDP averages the ranks' per-rank means, (1/R) sum_r grad(mean_r)
        local = [_union_grad(rows[split[r] : split[r + 1]], dtype)[0] for r in range(world)]
        documented = sum(local) / world
        for rank, result in enumerate(results):
            r = result[name]
            torch.testing.assert_close(r["global"], expected, rtol=tol, atol=tol)
            torch.testing.assert_close(r["accumulated"], expected, rtol=tol, atol=tol)
            torch.testing.assert_close(r["stepper_update"], expected, rtol=tol, atol=tol)
            torch.testing.assert_close(r["local"], documented, rtol=tol, atol=tol)
            assert (r["local"] - expected).abs().max() > 100 * tol  # the difference is real
            assert set(r["diagnostics"]) == set(r["combined"]) == set(union_out.statistics.fields())
            for key, value in r["diagnostics"].items():  # every statistic and diagnostic
                union = getattr(union_out, key).detach()
                torch.testing.assert_close(value, union, rtol=tol, atol=tol)
                torch.testing.assert_close(r["combined"][key], union, rtol=tol, atol=tol)
            if rank == 0:  # rank 0's own diagnostics differ from the global ones
                assert any(
                    not torch.equal(r["local_diagnostics"][k], r["diagnostics"][k])
                    for k in r["diagnostics"]
                )


def test_two_processes_ddp_and_fsdp(tmp_path):
    results, spec = _run(2, tmp_path, qwen=True)
    _check_bigram(results, spec, 2)
    rows, model, tokenizer = _qwen_rows(seed=7)
    # Eq. 5 on the union batch, (1/N) sum_i loss_i. The transformer's padded forward
    # depends on the padding width at about 1e-9 (float64 kernels on other shapes),
    # so each rank's rows are forwarded together, as in the workers, on one thread.
    policy = training_wrapper(model, tokenizer)
    loss_fn = build_loss(GSPOLoss, policy, clip_epsilon=EPS, entropy_bonus=False)
    split, threads = SPLITS[2], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loss = sum(
            loss_fn(lazy_stack(rows[a:b], 0)).loss_objective * (b - a) / len(rows)
            for a, b in zip(split[:-1], split[1:], strict=True)
        )
    finally:
        torch.set_num_threads(threads)
    names, params = zip(*model.named_parameters(), strict=True)
    expected = dict(zip(names, torch.autograd.grad(loss, params), strict=True))
    for result in results:
        for kind in ("qwen_ddp", "qwen_fsdp"):
            assert set(result[kind]) == set(expected), kind
            for name, grad in expected.items():
                torch.testing.assert_close(result[kind][name], grad, rtol=1e-12, atol=1e-12)


def test_three_processes_ddp(tmp_path):
    results, spec = _run(3, tmp_path, qwen=False)
    _check_bigram(results, spec, 3)


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
    assert json.loads((tmp_path / "summary.json").read_text())["gspo"]["steps"] == 2
