# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The oracle tests on CUDA, and a bfloat16-autocast training step (scripts/gpu_check.sh).

Deselected by default (marker ``cuda``); run with ``pytest -m cuda`` on a machine with a
GPU. Each loss runs on the GPU and is compared with the oracle computed on the CPU.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from gspo_testing import (
    BigramActor,
    build_loss,
    dense_batch,
    lazy_batch,
    make_rows,
    oracle_gspo_loss,
    padded,
)
from llm_testing import tiny_qwen, training_wrapper, word_tokenizer
from tensordict import TensorDict, lazy_stack

from torchrl_gspo import GSPOLoss, GSPOTokenLoss, RecomputeOldLogProbs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = "cuda"
PAPER_EPS = (3e-4, 4e-4)


def oracle(actor, rows, eps):
    """Eq. 5 on the CPU, from the actor's parameters."""
    cpu = BigramActor(dtype=actor.table.dtype)
    with torch.no_grad():
        cpu.table.copy_(actor.table.cpu())
    tokens = padded(rows, "tokens", 0)
    current = cpu.token_log_probs(tokens)
    old = padded(rows, "old", 0.0)
    mask = padded(rows, "response", False) & old.isfinite()
    advantage = torch.stack([r["advantage"].reshape(()) for r in rows])
    loss = oracle_gspo_loss(current, old, mask, advantage, *eps)
    return loss, torch.autograd.grad(loss, cpu.table)[0]


@pytest.mark.parametrize("loss_cls", [GSPOLoss, GSPOTokenLoss])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("noise,eps", [(1e-3, PAPER_EPS), (0.3, (0.05, 0.08))])
def test_loss_and_gradient_match_the_cpu_oracle(loss_cls, dtype, tol, kind, noise, eps):
    actor = BigramActor(dtype=dtype)
    rows = make_rows(actor=actor, dtype=dtype, noise=noise, seed=1)
    batch = (lazy_batch(rows) if kind == "lazy" else dense_batch(rows)).to(DEVICE)
    actor = actor.to(DEVICE)
    out = build_loss(loss_cls, actor, clip_epsilon=eps, entropy_bonus=False)(batch)
    assert out.loss_objective.device.type == "cuda"
    grad = torch.autograd.grad(out.loss_objective, actor.table)[0]
    expected, expected_grad = oracle(actor, rows, eps)
    torch.testing.assert_close(out.loss_objective.cpu(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(grad.cpu(), expected_grad, rtol=tol, atol=tol)


def test_compiled_loss_matches_eager_on_cuda():
    actor = BigramActor().to(DEVICE)
    rows = make_rows(actor=BigramActor(), noise=1e-3, seed=2)
    batch = dense_batch(rows).to(DEVICE)
    loss_fn = GSPOLoss(actor, entropy_bonus=False)
    eager = loss_fn(batch)
    compiled = torch.compile(loss_fn)(batch)
    for name in ("loss_objective", "clip_fraction", "ESS", "sequence_log_ratio"):
        torch.testing.assert_close(getattr(compiled, name), getattr(eager, name))


def test_clip_buffers_keep_float64_on_cuda():
    loss_fn = GSPOLoss(BigramActor()).to(DEVICE)
    assert loss_fn.clip_epsilon_low.dtype == torch.float64
    assert loss_fn.clip_epsilon_low.device.type == "cuda"
    assert float(loss_fn.clip_epsilon_low) == 3e-4


def test_bfloat16_autocast_training_step():
    """A tiny Qwen2 under bfloat16 autocast: old log-probs, loss, backward, Adam step."""
    tokenizer = word_tokenizer()
    model = tiny_qwen(tokenizer, seed=0).to(DEVICE)
    policy = training_wrapper(model, tokenizer)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i, (p, r) in enumerate([(4, 6), (2, 9), (5, 3), (3, 7)]):
        full = torch.randint(3, len(tokenizer), (p + r,), generator=gen)
        tokens = TensorDict(prompt=full[:p], response=full[p:], full=full)
        rows.append(TensorDict(tokens=tokens, advantage=torch.tensor([[(-1.0) ** i]])))
    data = lazy_stack(rows).to(DEVICE)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = GSPOLoss(policy)
    with torch.autocast("cuda", dtype=torch.bfloat16), warnings.catch_warnings():
        # whether the wrapper's log-probs are bfloat16 under autocast is its log-softmax's
        # business; the warning itself is tested on the CPU (test_robustness.py)
        warnings.filterwarnings("ignore", "GSPOLoss received torch.bfloat16")
        RecomputeOldLogProbs(policy, out_key="log_probs")(data)
        out = loss_fn(data)
    assert out.loss_objective.dtype in (torch.float32, torch.float64)
    assert out.loss_objective.isfinite() and 0 <= out.clip_fraction <= 1
    # on-policy up to the bfloat16 noise of two forwards of the same weights
    assert out.sequence_log_ratio_max_abs < 0.05
    out.loss_objective.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.isfinite().all() for g in grads)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert not math.isnan(float(out.ESS))
