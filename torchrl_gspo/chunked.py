# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Log-probabilities and entropies of sampled tokens without the whole ``[N, V]`` logits."""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["chunked_log_probs"]


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A chunk's logits in the model's dtype (as its LM head computes them), then in
    float32 at least."""
    logits = F.linear(hidden, weight, bias)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


class _ChunkedLogProbs(torch.autograd.Function):
    """Per chunk of rows: the logits, their log-sum-exp, the sampled token's log-prob and
    the entropy; the backward computes each chunk's logits again."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        log_probs = hidden.new_empty(hidden.shape[0], dtype=dtype)
        entropy, lse = torch.empty_like(log_probs), torch.empty_like(log_probs)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            z = _logits(hidden[rows], weight, bias)
            lse[rows] = z.logsumexp(-1)
            log_probs[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - lse[rows]
            p = (z - lse[rows, None]).exp()
            entropy[rows] = lse[rows] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_size = chunk_size
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        dtype = lse.dtype  # float32 at least: a copy of the weight for half precision only
        grad_weight = torch.zeros_like(weight, dtype=dtype) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=dtype) if need_bias else None
        weight32 = weight.to(dtype) if need_hidden else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            z = _logits(hidden[rows], weight, bias)
            p = (z - lse[rows, None]).exp()
            # d log p_y / dz = onehot(y) - p;  d H / dz = -p (z - E_p[z])
            mean = (p * z).sum(-1, keepdim=True)
            grad_z = p * (-grad_log_probs[rows, None] - grad_entropy[rows, None] * (z - mean))
            grad_z.scatter_add_(-1, targets[rows, None], grad_log_probs[rows, None])
            if need_hidden:
                grad_hidden[rows] = (grad_z @ weight32).to(hidden.dtype)
            if need_weight:
                grad_weight.addmm_(grad_z.T, hidden[rows].to(dtype))
            if need_bias:
                grad_bias += grad_z.sum(0)
        cast = (
            None if g is None else g.to(t.dtype)
            for g, t in ((grad_weight, weight), (grad_bias, bias))
        )
        return grad_hidden, *cast, None, None


def chunked_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The log-probability of each target token and the entropy, one chunk of rows at a time.

    With :math:`z = h W^\top + b` the logits of a row (the model's LM head),

    .. math::

        \log \pi(y) = z_y - \log \sum_v e^{z_v}, \qquad
        H = \log \sum_v e^{z_v} - \sum_v \pi_v z_v,

    computed for ``chunk_size`` rows at a time, so that no more than one chunk's
    ``[chunk_size, V]`` logits exist at once, in the forward or the backward (a custom
    autograd function computes each chunk's logits again there, from its hidden
    states). The logits are computed in the model's dtype, as its LM head would, and
    reduced in float32 (float64 inputs stay float64); the outputs are in that dtype.
    The gradient reaches ``hidden``, ``weight`` and ``bias`` (for tied input and
    output embeddings, ``weight`` is the embedding's parameter and autograd adds both
    uses):

    .. math::

        \frac{\partial \log \pi(y)}{\partial z} = e_y - \pi, \qquad
        \frac{\partial H}{\partial z} = -\pi \odot (z - \mathbb{E}_\pi[z]).

    The same chunked log-probability is TRL's ``trl/kernels/chunked_logprob.py`` and
    Liger-Kernel's fused linear losses; this one is written for TorchRL's scorers.

    Args:
        hidden (torch.Tensor): ``[N, H]`` the hidden states of the rows to score (the
            positions before each target token).
        weight (torch.Tensor): ``[V, H]`` the LM head's weight.
        targets (torch.Tensor): ``[N]`` the token ids whose log-probabilities are
            returned.

    Keyword Args:
        bias (torch.Tensor, optional): ``[V]`` the LM head's bias. Defaults to ``None``.
        chunk_size (int, optional): rows per chunk. Defaults to ``1024``.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``[N]`` the log-probabilities and ``[N]``
        the entropies, float32 (float64 for float64 inputs).

    Examples:
        >>> import torch
        >>> from torchrl_gspo.chunked import chunked_log_probs
        >>> _ = torch.manual_seed(0)
        >>> hidden, weight = torch.randn(5, 8, requires_grad=True), torch.randn(32, 8)
        >>> targets = torch.tensor([3, 1, 4, 1, 5])
        >>> log_probs, entropy = chunked_log_probs(hidden, weight, targets, chunk_size=2)
        >>> full = torch.log_softmax(hidden @ weight.T, -1)  # what it never builds
        >>> torch.allclose(log_probs, full.gather(-1, targets[:, None]).squeeze(-1))
        True
        >>> log_probs.sum().backward()
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"chunked_log_probs expects hidden [N, H] and weight [V, H], got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}: flatten the positions first, "
            "e.g. hidden.reshape(-1, hidden.shape[-1])."
        )
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.long:
        raise ValueError(
            f"chunked_log_probs expects targets [N] = [{hidden.shape[0]}] of dtype long, got "
            f"{tuple(targets.shape)} of {targets.dtype}."
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}.")
    return _ChunkedLogProbs.apply(hidden, weight, bias, targets, chunk_size)
