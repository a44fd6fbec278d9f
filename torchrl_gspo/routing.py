# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Routing Replay for Mixture-of-Experts models: record the experts, force them later."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from tensordict.utils import NestedKey, unravel_key
from torch import nn
from torchrl.envs import Transform

__all__ = ["RecordRoutes", "RoutingReplay", "routing_volatility"]


def _is_router(module: nn.Module) -> bool:
    """A top-k router: ``forward(hidden) -> (logits, scores, indices)``, with ``top_k``."""
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k")


class RoutingReplay:
    r"""Records the experts a Mixture-of-Experts model selects, and forces them later.

    GRPO's token ratios :math:`\pi_\theta(y_t) / \pi_\text{old}(y_t)` are computed by
    two forwards of a model whose router may send the same token to other experts
    once the weights have changed: in the 48-layer Qwen3-30B-A3B about 10% of the
    experts of a rollout change after one update (Zheng et al., 2025,
    `arXiv:2507.18071 <https://arxiv.org/abs/2507.18071>`_, §5.3). *Routing Replay*
    caches the experts selected when the old log-probabilities are computed and
    replays them when the current ones are: each token then goes through the same
    experts, weighted by the current router's probabilities of those experts (so the
    router still receives gradients). The GSPO paper reports that GRPO needed it to
    converge on MoE models and GSPO did not; R3 (arXiv:2510.11370) replays the
    inference engine's routing instead.

    It wraps the top-k routers of a Hugging Face MoE model (modules whose class name
    ends with ``TopKRouter``, returning ``(logits, scores, indices)``, as in
    Qwen3-MoE) with forward hooks; it changes nothing outside :meth:`capture` and
    :meth:`replay`. The routes of one forward are a list with one ``[B, T, k]``
    tensor of expert indices per MoE layer, in the layout of that forward's padded
    batch. :meth:`to_rows` and :meth:`from_rows` move them to and from per-row
    tensors (left-padded batches, as TorchRL's wrappers build them), so that they can
    travel with the data: :class:`RecordRoutes` writes them on the batch, and
    :meth:`replay_for` replays them in a loss module's forward.

    It serves GRPO and GSPO alike: a TorchRL user on an MoE model needs it whatever
    the loss.

    Args:
        model (nn.Module): the MoE model (e.g. ``Qwen3MoeForCausalLM``).

    Examples:
        >>> import torch
        >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        >>> from torchrl_gspo import RoutingReplay
        >>> _ = torch.manual_seed(0)
        >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=32, hidden_size=16,
        ...     intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_experts=4,
        ...     num_experts_per_tok=2)).eval()
        >>> replay = RoutingReplay(model)
        >>> tokens = torch.randint(0, 32, (2, 5))
        >>> with torch.no_grad(), replay.capture() as routes:
        ...     logits = model(tokens).logits
        >>> len(routes), tuple(routes[0].shape)  # 2 MoE layers, [B, T, top-k]
        (2, (2, 5, 2))
        >>> with torch.no_grad(), replay.replay(routes):
        ...     replayed = model(tokens).logits
        >>> torch.equal(replayed, logits)  # same weights: the same experts
        True
    """

    def __init__(self, model: nn.Module) -> None:
        # each router and the MoE block that calls it (and knows the [B, T] layout)
        pairs = [(m, c) for m in model.modules() for c in m.children() if _is_router(c)]
        self.routers = [router for _, router in pairs]
        if not self.routers:
            raise ValueError(
                "RoutingReplay found no top-k router in the model (a module whose class "
                "name ends with 'TopKRouter', returning (logits, scores, indices))."
            )
        self._shapes: dict[int, torch.Size] = {}
        self._recorded: list[torch.Tensor] | None = None
        self._forced: list[torch.Tensor] | None = None
        for index, (block, router) in enumerate(pairs):
            block.register_forward_pre_hook(self._pre_hook(index))
            router.register_forward_hook(self._hook(index))

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def _pre_hook(self, index: int) -> Callable:
        def hook(module, args):
            # The router sees [B * T, H]; the MoE block that calls it sees [B, T, H].
            self._shapes[index] = args[0].shape[:-1]

        return hook

    def _hook(self, index: int) -> Callable:
        def hook(module, args, output):
            logits, scores, indices = output
            if self._forced is not None:
                forced = self._forced[index].reshape(-1, indices.shape[-1]).to(indices.device)
                if forced.shape != indices.shape:
                    raise ValueError(
                        f"RoutingReplay: layer {index} routes {tuple(indices.shape[:-1])} "
                        f"tokens, the replayed routes hold {tuple(forced.shape[:-1])}. Replay "
                        "on a batch laid out (padded) as the recorded one."
                    )
                probs = torch.softmax(logits, dim=-1, dtype=torch.float)
                scores = probs.gather(-1, forced)
                if getattr(module, "norm_topk_prob", False):
                    scores = scores / scores.sum(-1, keepdim=True)
                output = (logits, scores.to(logits.dtype), forced)
            if self._recorded is not None:
                shape = self._shapes.get(index, output[2].shape[:-1])
                if len(shape) == 1:  # already flat: one row
                    shape = torch.Size([1, shape[0]])
                self._recorded[index] = output[2].detach().reshape(*shape[-2:], -1)
            return output

        return hook

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Records the routes of the forwards run inside (the last one per layer).

        Yields:
            list[torch.Tensor]: filled on exit, one ``[B, T, k]`` tensor per layer.
        """
        routes: list[torch.Tensor] = []
        self._recorded = [None] * self.num_layers
        try:
            yield routes
        finally:
            recorded, self._recorded = self._recorded, None
        if any(r is None for r in recorded):
            raise RuntimeError("RoutingReplay.capture: no forward of the model ran inside.")
        routes.extend(recorded)

    @contextlib.contextmanager
    def replay(self, routes: list[torch.Tensor]) -> Iterator[None]:
        """Forces ``routes`` (one ``[B, T, k]`` tensor per layer) in the forwards inside."""
        if len(routes) != self.num_layers:
            raise ValueError(
                f"RoutingReplay.replay: {len(routes)} layers of routes for a model with "
                f"{self.num_layers} MoE layers."
            )
        self._forced = list(routes)
        try:
            yield
        finally:
            self._forced = None

    def to_rows(self, routes: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
        """Per-row routes ``[n_i, layers, k]`` of a left-padded batch of row lengths ``n_i``."""
        stacked = torch.stack(routes, dim=-2)  # [B, T, layers, k]
        return [row[stacked.shape[1] - n :] for row, n in zip(stacked, lengths, strict=True)]

    def from_rows(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Routes per layer ``[B, T, k]`` of the left-padded batch of ``rows``."""
        width = max(r.shape[0] for r in rows)
        # padding positions get experts 0..k-1 (distinct, as top-k's are)
        fill = torch.arange(rows[0].shape[-1], device=rows[0].device).expand(*rows[0].shape[1:])
        padded = torch.stack(
            [torch.cat([fill.expand(width - r.shape[0], *r.shape[1:]), r]) for r in rows]
        )
        return list(padded.unbind(-2))

    def replay_for(self, loss_module: nn.Module, key: NestedKey = ("routing", "experts")):
        """Replays, in each call of ``loss_module``, the routes its batch holds at ``key``.

        Returns:
            list: the hook handles; ``handle.remove()`` on each to stop.
        """
        key = unravel_key(key)

        def before(module, args):
            rows = (
                args[0].get(key, as_list=True)
                if isinstance(args[0], LazyStackedTensorDict)
                else list(args[0].get(key).unbind(0))
            )
            self._forced = self.from_rows(rows)

        def after(module, args, output):
            self._forced = None

        return [
            loss_module.register_forward_pre_hook(before),
            loss_module.register_forward_hook(after, always_call=True),
        ]


class RecordRoutes(Transform):
    """Runs a scorer (e.g. :class:`~torchrl_gspo.RecomputeOldLogProbs`) and records its routes.

    The routes of the scorer's forward are written per row at ``key`` (``[n_i, layers,
    k]`` expert indices, for the ``n_i`` tokens of row ``i``), where
    :meth:`RoutingReplay.replay_for` finds them. Place it where the old
    log-probabilities are computed: the collector's ``postproc`` or the replay
    buffer's write.

    Args:
        replay (RoutingReplay): wraps the model the scorer runs.
        scorer (Callable[[TensorDictBase], TensorDictBase]): the old log-prob
            computation, run once per batch.

    Keyword Args:
        key (NestedKey, optional): where the routes go. Defaults to
            ``("routing", "experts")``.
        tokens_key (NestedKey, optional): the sampled tokens (their row lengths).
            Defaults to ``("tokens", "full")``.

    Examples:
        >>> # postproc=RecordRoutes(RoutingReplay(model), RecomputeOldLogProbs(policy))
    """

    def __init__(
        self,
        replay: RoutingReplay,
        scorer: Callable[[TensorDictBase], TensorDictBase],
        *,
        key: NestedKey = ("routing", "experts"),
        tokens_key: NestedKey = ("tokens", "full"),
    ) -> None:
        super().__init__()
        self.replay, self.scorer = replay, scorer
        self.key, self.tokens_key = unravel_key(key), unravel_key(tokens_key)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Scores ``tensordict`` and writes its routes at ``key``.

        Args:
            tensordict (TensorDictBase): the collected batch, lazily stacked.

        Returns:
            TensorDictBase: ``tensordict`` with the scorer's outputs and the routes.
        """
        with self.replay.capture() as routes:
            tensordict = self.scorer(tensordict)
        lengths = [t.shape[-1] for t in tensordict.get(self.tokens_key, as_list=True)]
        rows = self.replay.to_rows(routes, lengths)
        for row, route in zip(tensordict.unbind(0), rows, strict=True):
            row.set(self.key, route)
        return tensordict

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.forward(tensordict)


def routing_volatility(
    before: list[torch.Tensor], after: list[torch.Tensor], mask: torch.Tensor
) -> torch.Tensor:
    """Fraction of (token, layer) top-k expert sets that differ between two routings.

    Args:
        before (list[torch.Tensor]): routes per layer, ``[B, T, k]``.
        after (list[torch.Tensor]): the same tokens' routes after an update.
        mask (torch.Tensor): ``[B, T]``, the tokens to count.

    Returns:
        torch.Tensor: ``[layers + 1]``: the fraction per layer, then overall.

    Examples:
        >>> import torch
        >>> from torchrl_gspo import routing_volatility
        >>> before = [torch.tensor([[[0, 1], [2, 3]]])]
        >>> after = [torch.tensor([[[1, 0], [2, 4]]])]  # same set, then a new expert
        >>> routing_volatility(before, after, torch.ones(1, 2, dtype=torch.bool))
        tensor([0.5000, 0.5000], dtype=torch.float64)
    """
    changed = torch.stack(  # [layers, B, T]
        [
            (b.sort(-1).values != a.sort(-1).values).any(-1)
            for b, a in zip(before, after, strict=True)
        ]
    )
    per_layer = (changed & mask).sum((-1, -2)).double() / mask.sum().clamp_min(1)
    return torch.cat([per_layer, per_layer.mean().unsqueeze(0)])
