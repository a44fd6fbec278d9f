# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Test helpers: a bigram actor with real parameters, ragged batches and the oracle."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from tensordict.nn import TensorDictModuleBase
from torchrl.modules.distributions import LLMMaskedCategorical
from torchrl.objectives.llm import GRPOLoss

# True when the torchrl under test carries the first patch of the upstream series
# (upstream/, run by scripts/test_upstream.sh): GRPOLoss then counts its clip fraction
# over a mask, reads ragged advantages left-padded and returns a 0-dim prompt_mean.
UPSTREAM_FIXES = "mask" in inspect.signature(GRPOLoss._compute_policy_objective).parameters
VOCAB = 11
PAD = 0
MASK_KEYS = {
    "sft": ("masks", "response"),
    "rlhf": ("masks", "assistant"),
    "generic": ("masks", "attention"),
}


class BigramActor(TensorDictModuleBase):
    """A bigram language model: the logits of position t are ``table[token[t - 1]]``.

    It exposes the masked-distribution hooks ``GRPOLoss`` calls for each masking
    strategy, each reading its own (left-padded) boolean mask from the input.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float64,
        seed: int = 0,
        tokens_key=("tokens", "full"),
        mask_keys: dict | None = None,
    ) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=gen, dtype=dtype))
        self.tokens_key = tokens_key
        self.mask_keys = dict(MASK_KEYS if mask_keys is None else mask_keys)
        self.in_keys = [tokens_key, *self.mask_keys.values()]
        self.out_keys = []

    def logits(self, tensordict: TensorDictBase) -> torch.Tensor:
        tokens = tensordict.get(
            self.tokens_key, as_padded_tensor=True, padding_side="left", padding_value=PAD
        )
        previous = torch.cat([torch.full_like(tokens[..., :1], PAD), tokens[..., :-1]], -1)
        return self.table[previous]

    def _dist(self, tensordict: TensorDictBase, strategy: str) -> LLMMaskedCategorical:
        mask = tensordict.get(
            self.mask_keys[strategy],
            as_padded_tensor=True,
            padding_side="left",
            padding_value=False,
        )
        return LLMMaskedCategorical(logits=self.logits(tensordict), mask=mask)

    def _get_sft_dist(self, tensordict, **kwargs):
        return self._dist(tensordict, "sft")

    def _get_rlhf_dist(self, tensordict, **kwargs):
        return self._dist(tensordict, "rlhf")

    def _get_generic_dist(self, tensordict, **kwargs):
        return self._dist(tensordict, "generic")

    def get_dist(self, tensordict, **kwargs):
        return self._dist(tensordict, "generic")

    def forward(self, tensordict):
        return tensordict

    def token_log_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Independent reference: log-softmax of the bigram logits, gathered."""
        previous = torch.cat([torch.full_like(tokens[..., :1], PAD), tokens[..., :-1]], -1)
        log_probs = torch.log_softmax(self.table[previous], dim=-1)
        return log_probs.gather(-1, tokens.clamp_min(0).unsqueeze(-1)).squeeze(-1)


def fields_of(output) -> dict[str, torch.Tensor]:
    """Every field the output class declares that is set on ``output``."""
    names = (f.name for f in dataclasses.fields(type(output)))
    return {name: value for name in names if (value := getattr(output, name)) is not None}


def build_loss(loss_cls, actor, **kwargs):
    """``loss_cls(actor, **kwargs)``, asserting exactly the warnings its arguments raise.

    A clip range above 0.01 ("practically never clips") and ``aggregation="token_mean"``
    ("weights each sequence by its length") warn; oracle tests use both on purpose.
    """
    eps = kwargs.get("clip_epsilon", 0.0)
    expected = []
    if max(eps if isinstance(eps, (tuple, list)) else (eps,)) > 0.01:
        expected.append("practically never clips")
    if kwargs.get("aggregation") == "token_mean":
        expected.append("weights each sequence by its length")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_fn = loss_cls(actor, **kwargs)
    messages = [str(w.message) for w in caught]
    assert len(messages) == len(expected), messages
    assert all(any(words in m for m in messages) for words in expected), messages
    return loss_fn


# Ragged rows: (prompt length, response length). Response lengths include 0 and 1.
DEFAULT_SHAPES = ((3, 5), (2, 1), (4, 0), (1, 7), (2, 3), (5, 4))


def make_rows(
    shapes=DEFAULT_SHAPES,
    *,
    seed: int = 0,
    noise: float = 1e-3,
    actor: BigramActor | None = None,
    dtype: torch.dtype = torch.float64,
    advantages=None,
    holes: bool = True,
    nan_prompt: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """Per-row tensors of a ragged batch (un-padded, one dict per row).

    Old log-probs are the actor's own log-probs minus a random perturbation of scale
    ``noise`` (so that ratios differ from 1); rows alternate between NaN and 0 for the
    prompt positions of the old log-probs (vLLM writes NaN there). ``holes`` removes
    a token from the middle of the longer responses (as tool output would).
    """
    gen = torch.Generator().manual_seed(seed)
    if advantages is None:
        advantages = torch.randn(len(shapes), generator=gen, dtype=dtype)
    rows = []
    for i, (p, r) in enumerate(shapes):
        tokens = torch.randint(1, VOCAB, (p + r,), generator=gen)
        response = torch.zeros(p + r, dtype=torch.bool)
        response[p:] = True
        if holes and r >= 4:
            response[p + r // 2] = False
        assistant = response.clone()
        if r >= 2:
            assistant[-1] = False  # a different, still valid, mask for "rlhf"
        attention = torch.ones(p + r, dtype=torch.bool)
        if actor is not None:
            with torch.no_grad():
                current = actor.token_log_probs(tokens.unsqueeze(0)).squeeze(0).to(dtype)
        else:
            current = -torch.rand(p + r, generator=gen, dtype=dtype)
        old = current - noise * torch.randn(p + r, generator=gen, dtype=dtype)
        if nan_prompt and i % 2 == 0:
            old[:p] = float("nan")
        rows.append(
            {
                "tokens": tokens,
                "response": response,
                "assistant": assistant,
                "attention": attention,
                "old": old,
                "advantage": advantages[i].reshape(1, 1).to(dtype),
            }
        )
    return rows


def _row_td(row: dict, advantage_per_token: bool) -> TensorDict:
    n = row["tokens"].shape[0]
    advantage = row["advantage"].expand(n, 1).clone() if advantage_per_token else row["advantage"]
    return TensorDict(
        {
            ("tokens", "full"): row["tokens"],
            ("masks", "response"): row["response"],
            ("masks", "assistant"): row["assistant"],
            ("masks", "attention"): row["attention"],
            ("log_probs", "full"): row["old"],
            "advantage": advantage,
        },
        batch_size=[],
    )


def lazy_batch(rows, advantage_per_token: bool = False) -> TensorDictBase:
    """Lazily stacked ragged rows, as TorchRL's LLM collectors hand them out."""
    return lazy_stack([_row_td(row, advantage_per_token) for row in rows], 0)


def left_pad(tensors, value, width: int | None = None) -> torch.Tensor:
    width = max(t.shape[0] for t in tensors) if width is None else width
    out = []
    for t in tensors:
        pad = torch.full((width - t.shape[0], *t.shape[1:]), value, dtype=t.dtype)
        out.append(torch.cat([pad, t]))
    return torch.stack(out)


def dense_batch(rows, width: int | None = None, advantage_per_token: bool = False) -> TensorDict:
    """The same rows, left-padded into one dense TensorDict of width ``width``."""
    batch = len(rows)
    tokens = left_pad([r["tokens"] for r in rows], PAD, width)
    width = tokens.shape[-1]
    if advantage_per_token:
        advantage = torch.cat([r["advantage"].expand(1, width, 1) for r in rows])
    else:
        advantage = torch.stack([r["advantage"] for r in rows])
    return TensorDict(
        {
            ("tokens", "full"): tokens,
            ("masks", "response"): left_pad([r["response"] for r in rows], False, width),
            ("masks", "assistant"): left_pad([r["assistant"] for r in rows], False, width),
            ("masks", "attention"): left_pad([r["attention"] for r in rows], False, width),
            ("log_probs", "full"): left_pad([r["old"] for r in rows], 0.0, width),
            "advantage": advantage,
        },
        batch_size=[batch],
    )


def ragged_batch(rows, layout: str, per_token: bool, seed: int) -> TensorDictBase:
    """The rows, ``"dense"`` or ``"lazy"``; with ``per_token``, each row's advantage is
    replaced by random per-token values (in place), left-padded by hand in the dense
    layout so that nothing is padded on read."""
    if per_token:
        gen = torch.Generator().manual_seed(seed)
        for row in rows:
            n = row["tokens"].shape[0]
            row["advantage"] = torch.randn(n, 1, generator=gen, dtype=torch.float64)
    if layout == "lazy":  # each row holds its own advantage, [1, 1] or [n, 1]
        return lazy_batch(rows)
    if not per_token:
        return dense_batch(rows)
    data = dense_batch([{**row, "advantage": torch.zeros(1, 1)} for row in rows])
    data["advantage"] = left_pad([row["advantage"] for row in rows], 0.0)
    return data


def padded(rows, name: str, value) -> torch.Tensor:
    return left_pad([r[name] for r in rows], value)


def oracle_gspo_loss(
    current: torch.Tensor,
    old: torch.Tensor,
    mask: torch.Tensor,
    advantage: torch.Tensor,
    eps_low: float,
    eps_high: float,
    aggregation_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """GSPO loss written out, after TRL's ``importance_sampling_level="sequence"``.

    ``current``/``old``: ``[B, T]`` token log-probs, ``mask``: ``[B, T]`` bool,
    ``advantage``: ``[B]``. Per sequence: masked mean of the log-ratios (count clamped
    to 1), exp, PPO min with the clipped ratio; then the mean over sequences, where a
    sequence with no valid token contributes 0. ``aggregation_mask`` (default:
    ``mask``) only decides which sequences are empty for the aggregation.
    """
    log_ratio = torch.where(mask, current - old, torch.zeros_like(current))
    seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
    ratio = torch.exp(seq_log_ratio)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantage
    per_sequence = -torch.minimum(unclipped, clipped)
    keep = (mask if aggregation_mask is None else aggregation_mask).any(-1)
    return torch.where(keep, per_sequence, torch.zeros_like(per_sequence)).mean()


def oracle_sequence_log_ratio(current, old, mask) -> torch.Tensor:
    log_ratio = torch.where(mask, current - old, torch.zeros_like(current))
    return log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)


class _FixedDist:
    """The two members of a distribution that GRPOLoss reads without an entropy bonus."""

    def __init__(self, log_prob: torch.Tensor, mask: torch.Tensor) -> None:
        self._log_prob = log_prob
        self.mask = mask

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return self._log_prob


class LogProbActor(TensorDictModuleBase):
    """An actor whose current log-probs ``[B, T]`` are themselves the parameter."""

    def __init__(self, log_probs: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__()
        self.log_probs = torch.nn.Parameter(log_probs.clone())
        self.register_buffer("mask", mask.clone())
        self.in_keys = [("tokens", "full")]
        self.out_keys = []

    def get_dist(self, tensordict, **kwargs):
        return _FixedDist(self.log_probs, self.mask)

    def forward(self, tensordict):
        return tensordict
