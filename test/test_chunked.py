# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""chunked_log_probs against the whole logits: values, entropies and gradients."""

from __future__ import annotations

import pytest
import torch
from llm_testing import tiny_qwen, word_tokenizer

from torchrl_gspo.chunked import chunked_log_probs


def reference(hidden, weight, targets, bias=None):
    """The whole ``[N, V]`` logits' log-softmax at the targets, and their entropy."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    log_probs = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    return log_probs, torch.distributions.Categorical(logits=logits).entropy()


def problem(n: int, vocab: int = 40, width: int = 6, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, width, generator=gen, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, width, generator=gen, dtype=dtype) / 2).requires_grad_()
    bias = torch.randn(vocab, generator=gen, dtype=dtype).requires_grad_()
    return hidden, weight, bias, torch.randint(vocab, (n,), generator=gen)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 50])  # a boundary inside, larger than N
def test_gradcheck_in_float64(chunk_size):
    """Finite differences (autograd's gradcheck) of both outputs with respect to the
    hidden states, the weight and the bias, through the backward's recomputation."""
    hidden, weight, bias, targets = problem(7)

    def both(h, w, b):
        return chunked_log_probs(h, w, targets, bias=b, chunk_size=chunk_size)

    assert torch.autograd.gradcheck(both, (hidden, weight, bias))
    lp, ent = both(hidden, weight, bias)
    rlp, rent = reference(hidden.double(), weight, targets, bias)
    torch.testing.assert_close(lp, rlp.double(), rtol=0, atol=1e-6)  # reference: float32


def test_the_entropy_gradient_is_the_formula():
    """dH/dz = -p (z - E_p[z]), written out: with the identity as the head's weight the
    hidden state is the logits, so its gradient is dH/dz itself."""
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(4, 9, generator=gen).requires_grad_()
    _, entropy = chunked_log_probs(z, torch.eye(9), torch.zeros(4, dtype=torch.long), chunk_size=3)
    (grad,) = torch.autograd.grad(entropy.sum(), z)
    p = z.detach().softmax(-1)
    expected = -p * (z.detach() - (p * z.detach()).sum(-1, keepdim=True))
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk_size", [2, 5, 64])
def test_float32_matches_the_whole_logits(chunk_size):
    hidden, weight, bias, targets = problem(11, vocab=300, width=16, dtype=torch.float32)
    lp, ent = chunked_log_probs(hidden, weight, targets, bias=bias, chunk_size=chunk_size)
    rlp, rent = reference(hidden, weight, targets, bias)
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, rent, rtol=1e-5, atol=1e-5)
    scale = torch.linspace(-1, 1, 11)
    got = torch.autograd.grad((lp * scale + ent).sum(), (hidden, weight, bias))
    want = torch.autograd.grad((rlp * scale + rent).sum(), (hidden, weight, bias))
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_bfloat16_logits_are_the_heads_reduced_in_float32():
    """bfloat16 hidden states and head: the logits are the head's bfloat16 product, as
    the model computes them, so the log-probs equal the whole bfloat16 logits' float32
    log-softmax up to float32 summation order (1e-5 on log-sum-exps of order 10)."""
    hidden, weight, _, targets = problem(9, vocab=500, width=32, dtype=torch.bfloat16)
    lp, ent = chunked_log_probs(hidden, weight, targets, chunk_size=4)
    assert lp.dtype == ent.dtype == torch.float32
    rlp, rent = reference(hidden, weight, targets)
    torch.testing.assert_close(lp, rlp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, rent, rtol=0, atol=1e-5)
    lp.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_tied_embeddings_get_both_gradients():
    """A tiny Qwen2 whose LM head is its input embedding: the body's hidden states and
    the chunked head give every parameter the gradient that the whole logits give
    (float64 throughout)."""
    tokenizer = word_tokenizer()
    model = tiny_qwen(tokenizer, seed=3, tie=True).double()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tokens = torch.tensor([[3, 5, 7, 2, 9, 4, 6, 8]])
    targets = tokens[0, 1:]
    hidden = model.model(tokens).last_hidden_state[0, :-1]
    lp, _ = chunked_log_probs(hidden, model.lm_head.weight, targets, chunk_size=3)
    got = torch.autograd.grad(lp.sum(), list(model.parameters()))
    logits = model(tokens).logits[0, :-1]
    want_lp = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    want = torch.autograd.grad(want_lp.sum(), list(model.parameters()))
    torch.testing.assert_close(lp, want_lp, rtol=1e-12, atol=1e-12)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_the_graph_saves_no_logits():
    """What autograd keeps for the backward: the inputs and one log-sum-exp per row,
    nothing of N x V (here N x V = 64 x 1000, far above the weight's 1000 x 8)."""
    hidden, weight, _, targets = problem(64, vocab=1000, width=8, dtype=torch.float32)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        lp, ent = chunked_log_probs(hidden, weight, targets, chunk_size=16)
    (lp + ent).sum().backward()
    assert saved and max(saved) == weight.numel() < 64 * 1000


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long)), "hidden"),
        ((torch.zeros(2, 4), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long)), "weight"),
        ((torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long)), "targets"),
        ((torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2)), "long"),
    ],
)
def test_bad_shapes_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        chunked_log_probs(*args)


@pytest.mark.parametrize("chunk_size", [0, 2.0, True])
def test_bad_chunk_sizes_are_refused(chunk_size):
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_log_probs(
            torch.zeros(2, 4),
            torch.zeros(5, 4),
            torch.zeros(2, dtype=torch.long),
            chunk_size=chunk_size,
        )
