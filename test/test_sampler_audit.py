# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""SamplerAudit: each statistic against its formula, its false alarms, and the cause named."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from llm_testing import tiny_qwen, training_wrapper, word_tokenizer
from tensordict import TensorDict, lazy_stack

from torchrl_gspo import RecomputeOldLogProbs, SamplerAudit


def sample(logits: torch.Tensor, kind: str, value: float, gen: torch.Generator) -> torch.Tensor:
    """Tokens drawn by a sampler: "full", "top_k", "top_p" (renormalized) or "temperature"."""
    probs = logits.softmax(-1)
    if kind == "temperature":
        probs = (logits / value).softmax(-1)
    elif kind != "full":
        ordered = probs.sort(-1, descending=True)
        if kind == "top_k":
            keep = torch.arange(logits.shape[-1]) < value
        else:
            keep = ordered.values.cumsum(-1) - ordered.values < value
        kept = torch.where(keep, ordered.values, 0.0)
        probs = torch.zeros_like(probs).scatter(
            -1, ordered.indices, kept / kept.sum(-1, keepdim=True)
        )
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def test_each_statistic_is_its_formula():
    """Hand-set logits over 4 tokens, 3 positions, written out: S_t(k) the mass of the
    k likeliest, R_t(q) the mass of the tokens whose preceding mass is below q, and
    the temperature ratios pi_tau(y) / pi(y)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 1.0], [1.0, 1.5, 0.5, 0.0]])
    tokens = torch.tensor([1, 1, 2])  # ranks 2, 1, 3
    audit = SamplerAudit(ranks=(1, 2, 3), masses=(0.5, 0.9), temperatures=(0.5, 2.0))
    audit.update(logits, tokens)
    p = logits.double().softmax(-1)
    log_top, log_nucleus, log_ratio = [0.0] * 3, [0.0] * 2, [0.0] * 2
    for t in range(3):
        ordered = sorted(p[t].tolist(), reverse=True)
        for i, k in enumerate((1, 2, 3)):
            log_top[i] += math.log(sum(ordered[:k]))
        for i, q in enumerate((0.5, 0.9)):
            log_nucleus[i] += math.log(
                sum(v for j, v in enumerate(ordered) if sum(ordered[:j]) < q)
            )
        for i, tau in enumerate((0.5, 2.0)):
            scaled = (logits[t].double() / tau).softmax(-1)
            log_ratio[i] += math.log(scaled[tokens[t]] / p[t, tokens[t]])
    stats = audit.statistics()
    assert stats["max_rank"] == 3 and stats["positions"] == 3
    # a rank-3 token refutes k = 1 and 2; the largest mass before a sampled token
    assert stats["rank_log_evidence"][:2].tolist() == [-math.inf, -math.inf]
    assert stats["rank_log_evidence"][2].item() == pytest.approx(-log_top[2], rel=1e-12)
    before = max(sum(sorted(p[t].tolist(), reverse=True)[: r - 1]) for t, r in enumerate((2, 1, 3)))
    assert stats["max_mass_before"] == pytest.approx(before, rel=1e-12)
    alive = [q > before for q in (0.5, 0.9)]
    for i, a in enumerate(alive):
        want = -log_nucleus[i] if a else -math.inf
        assert stats["mass_log_evidence"][i].item() == pytest.approx(want, rel=1e-12)
    mixture = math.log(sum(math.exp(v) for v in log_ratio) / 2)
    assert stats["temperature_log_evidence"].item() == pytest.approx(mixture, rel=1e-12)
    assert stats["log_threshold"] == pytest.approx(math.log(6 / 1e-6))


def test_calls_accumulate_as_one_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 30, generator=gen) * 2
    tokens = sample(logits, "full", 1.0, gen)
    whole, parts = SamplerAudit(), SamplerAudit()
    whole.update(logits, tokens)
    parts.update(logits[:17], tokens[:17])
    parts.update(logits[17:], tokens[17:])
    for key, value in whole.statistics().items():
        torch.testing.assert_close(torch.as_tensor(parts.statistics()[key]), torch.as_tensor(value))


def test_banned_ids_leave_every_distribution():
    """A banned id's mass is removed before every statistic: the audit of logits with
    the pad is the audit of the logits without it."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 10, generator=gen)
    tokens = sample(logits[:, 1:], "full", 1.0, gen) + 1  # never id 0
    banned = SamplerAudit(ranks=(1, 3), banned_ids=[0])
    banned.update(logits, tokens)
    without = SamplerAudit(ranks=(1, 3))
    without.update(logits[:, 1:], tokens - 1)
    for key, value in without.statistics().items():
        torch.testing.assert_close(
            torch.as_tensor(banned.statistics()[key]), torch.as_tensor(value)
        )


def test_false_alarms_under_full_sampling_stay_below_alpha():
    """2,000 simulated runs of 3 batches each, sampled from the scored distribution,
    checked after every batch at alpha = 0.05: Ville's inequality bounds the share of
    runs ever flagged by 0.05; the count must lie below the upper end of the binomial
    interval at 0.05 (100 + 3 standard deviations = 129)."""
    gen = torch.Generator().manual_seed(2)
    flagged = 0
    for _ in range(2000):
        audit = SamplerAudit(alpha=0.05, ranks=(1, 2, 5, 10), masses=(0.5, 0.9))
        for _ in range(3):
            logits = torch.randn(8, 12, generator=gen) * 2
            audit.update(logits, sample(logits, "full", 1.0, gen))
            if audit.finding() is not None:
                flagged += 1
                break
    assert flagged <= 100 + 3 * math.sqrt(2000 * 0.05 * 0.95)


@pytest.mark.parametrize(
    "kind, value", [("top_k", 50), ("top_k", 20), ("top_p", 0.9), ("temperature", 0.7)]
)
def test_each_sampler_is_named(kind, value):
    """On random logits over 2,000 tokens, 3 batches of 300 positions: the strict
    default level rejects full sampling and names the sampler and its parameter."""
    gen = torch.Generator().manual_seed(3)
    audit = SamplerAudit()
    for _ in range(3):
        logits = torch.randn(300, 2000, generator=gen) * 2.5
        audit.update(logits, sample(logits, kind, value, gen))
    finding = audit.finding()
    assert finding is not None and (finding.cause, finding.estimate) == (kind, value)
    assert "top_k=0, top_p=1.0, temperature=1.0" in finding.message


def test_full_sampling_is_not_flagged_at_the_default_level():
    gen = torch.Generator().manual_seed(4)
    audit = SamplerAudit()
    for _ in range(3):
        logits = torch.randn(300, 2000, generator=gen) * 2.5
        audit.update(logits, sample(logits, "full", 1.0, gen))
    assert audit.finding() is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"alpha": 0.0}, "alpha"),
        ({"ranks": (0, 5)}, "ranks"),
        ({"masses": (1.0,)}, "masses"),
        ({"temperatures": (1.0,)}, "temperatures"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplerAudit(**kwargs)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"logits \[N, V\] and tokens \[N\]"):
        SamplerAudit().update(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long))


PAD = 0  # word_tokenizer's pad, banned in generation and left out of the audit


def sampled_batch(model, kind: str, value: float, rows: int = 8, length: int = 12, seed: int = 5):
    """Responses drawn token by token from the model's logits by ``kind``, the pad (id
    0) banned as the README bans it, as a lazily stacked batch of TorchRL's tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        ids = torch.tensor([3 + i % 4, 5, 7])
        prompt = ids.clone()
        with torch.no_grad():
            for _ in range(length):
                logits = model(ids.unsqueeze(0)).logits[0, -1:]
                logits[:, PAD] = -math.inf
                ids = torch.cat([ids, sample(logits, kind, value, gen)])
        tokens = TensorDict(prompt=prompt, response=ids[len(prompt) :], full=ids)
        out.append(TensorDict(tokens=tokens, advantage=torch.tensor([[1.0]])))
    return lazy_stack(out)


def audit_warnings(caught) -> list[str]:
    """The audit's warnings among those caught (TorchRL's scorer warns of its own)."""
    return [str(w.message) for w in caught if "sampled tokens were not drawn" in str(w.message)]


@pytest.fixture(scope="module")
def tiny():
    tokenizer = word_tokenizer(64)
    model = tiny_qwen(tokenizer, seed=0)
    return model, training_wrapper(model, tokenizer)


def test_recompute_warns_once_naming_top_k(tiny):
    """Through RecomputeOldLogProbs on a tiny Qwen2: responses sampled with top_k=3 of
    64 tokens are flagged, top-k named, and the audit saw every response token."""
    model, policy = tiny
    audit = SamplerAudit(ranks=(1, 2, 3, 5, 10), banned_ids=[PAD])
    recompute = RecomputeOldLogProbs(policy, sampler_audit=audit)
    with pytest.warns(UserWarning, match=r"explains them best: top_k=3\b"):
        recompute(sampled_batch(model, "top_k", 3))
    assert audit.positions == 8 * 12
    with warnings.catch_warnings(record=True) as caught:  # once per run
        warnings.simplefilter("always")
        recompute(sampled_batch(model, "top_k", 3, seed=6))
    assert not audit_warnings(caught) and audit.finding().cause == "top_k"


def test_recompute_sampling_the_scored_distribution_is_not_flagged(tiny):
    model, policy = tiny
    audit = SamplerAudit(ranks=(1, 2, 3, 5, 10), banned_ids=[PAD])
    recompute = RecomputeOldLogProbs(policy, sampler_audit=audit, sampler_check="raise")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (7, 8, 9):
            recompute(sampled_batch(model, "full", 1.0, seed=seed))
    assert not audit_warnings(caught) and audit.finding() is None and audit.positions == 3 * 8 * 12


def test_recompute_raises_when_asked(tiny):
    model, policy = tiny
    recompute = RecomputeOldLogProbs(
        policy, sampler_audit=SamplerAudit(ranks=(1, 2, 3), banned_ids=[PAD]), sampler_check="raise"
    )
    with pytest.raises(RuntimeError, match="top_k=2"):
        recompute(sampled_batch(model, "top_k", 2))


def test_recompute_refuses_bad_audit_arguments(tiny):
    _, policy = tiny
    with pytest.raises(ValueError, match="sampler_check"):
        RecomputeOldLogProbs(policy, sampler_audit=SamplerAudit(), sampler_check="loud")
    with pytest.raises(TypeError, match="SamplerAudit"):
        RecomputeOldLogProbs(policy, sampler_audit=object())


def test_raise_agrees_across_ranks(tmp_path):
    """Two gloo processes on 127.0.0.1: only rank 0's tokens were truncated, and both
    ranks raise, rank 1 naming the other rank, so neither waits for the other."""
    import socket
    import time

    import torch.multiprocessing as mp
    from distributed_workers import audit_worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.start_processes(
        audit_worker, args=(2, port, str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 120
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the audit workers did not finish in 120 s")
    errors = [torch.load(tmp_path / f"audit{r}.pt")["error"] for r in range(2)]
    assert "top_k=3" in errors[0]
    assert "another rank's sampler audit failed" in errors[1]
