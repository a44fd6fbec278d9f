# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Routing Replay for Mixture-of-Experts models: record the experts, force them later."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Literal

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from tensordict.utils import NestedKey, unravel_key
from torch import nn
from torch.utils.hooks import RemovableHandle
from torchrl.envs import Transform

from torchrl_gspo.moe import _routers

__all__ = ["RecordRoutes", "RoutingReplay", "routing_volatility"]


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward (a checkpoint's recomputation)."""
    return torch._C._current_graph_task_id() != -1


def _in_non_reentrant_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are those of a non-reentrant checkpoint."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and hooks[0].__module__ == "torch.utils.checkpoint"


def _compact(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert indices ``0 .. num_experts - 1``."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2**15 else torch.int32


def _check_row_agrees(index: int, shape: torch.Size, first: torch.Size) -> None:
    """Raises unless the routes of row ``index`` have row 0's layers and top-k.

    Args:
        index (int): the row's index in the batch.
        shape (torch.Size): its routes' shape, ``[n, layers, k]``.
        first (torch.Size): the shape of row 0's routes.
    """
    if shape[1:] == first[1:]:
        return
    if len(shape) != 3 or len(first) != 3:
        wrong = f"row {index} has routes of shape {tuple(shape)} where row 0 has {tuple(first)}"
    elif shape[1] != first[1]:
        wrong = (
            f"row {index} has {shape[1]} MoE layers where row 0 has {first[1]} (layer "
            f"{min(shape[1], first[1])} is missing from one of them)"
        )
    else:
        wrong = f"row {index}, layer 0 has top-k {shape[2]} where row 0 has {first[2]}"
    raise ValueError(
        f"RoutingReplay.from_rows: {wrong}. Each row's routes are [n, layers, top_k] with "
        "the same layers and top-k: record all rows with the same model and router top-k "
        "(num_experts_per_tok), e.g. with one RecordRoutes or record_generation."
    )


class RoutingReplay:
    r"""Records the experts a Mixture-of-Experts model selects, and forces them later.

    GRPO's token ratios :math:`\pi_\theta(y_t) / \pi_\text{old}(y_t)` are computed by
    two forwards of a model whose router may send the same token to other experts
    once the weights have changed: in the 48-layer Qwen3-30B-A3B about 10% of the
    activated experts of a rollout change after one update (Zheng et al., 2025,
    `arXiv:2507.18071 <https://arxiv.org/abs/2507.18071>`_, §5.3). *Routing Replay*
    caches the experts selected when the old log-probabilities are computed and
    replays them when the current ones are: each token then goes through the same
    experts, weighted by the current router's weights of those experts (so the router
    still receives gradients). The GSPO paper reports that GRPO needed it to converge
    on MoE models and GSPO did not; R3 (arXiv:2510.11370) replays the inference
    engine's routing instead.

    It hooks the routers of a Hugging Face MoE model, found by structure and replayed
    with their own family's weight formula: Qwen2-MoE, Qwen3-MoE, Qwen3-Next, OLMoE,
    Mixtral, GPT-OSS and DeepSeek-V3 (:doc:`/moe`); a model with another router is
    refused with an error that names its class. With unchanged weights a replayed
    forward is bit-identical to the plain one. The routes of one forward are a list
    with one ``[B, T, k]`` tensor of expert indices per MoE layer, in the layout of
    that forward's padded batch, in the router's order, stored in the smallest
    integer dtype; any integer dtype is accepted back. :meth:`to_rows` and
    :meth:`from_rows` move them to and from per-row tensors (left-padded batches, as
    TorchRL's wrappers build them), so that they can travel with the data:
    :class:`RecordRoutes` writes them on the batch, and :meth:`replay_for` replays
    them in a loss module's forward.

    The hooks change nothing outside :meth:`capture` and :meth:`replay` (which do not
    nest) and stay until :meth:`remove`, or the end of a ``with`` block. Gradient
    checkpointing of a replayed MoE layer is refused: its backward would recompute the
    forward after the replayed routes are gone.

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
        >>> tokens = torch.randint(0, 32, (2, 5))
        >>> with RoutingReplay(model) as replay:  # the hooks go with the block
        ...     with torch.no_grad(), replay.capture() as routes:
        ...         logits = model(tokens).logits
        ...     with torch.no_grad(), replay.replay(routes):
        ...         replayed = model(tokens).logits
        >>> len(routes), tuple(routes[0].shape), routes[0].dtype  # 2 layers, [B, T, k]
        (2, (2, 5, 2), torch.uint8)
        >>> torch.equal(replayed, logits)  # same weights: the same experts
        True
    """

    def __init__(self, model: nn.Module) -> None:
        found = _routers.find(model)
        self.model = model
        self.routers = [router for _, router, _ in found]
        self._shapes: dict[int, torch.Size] = {}
        self._recorded: list[torch.Tensor | None] | None = None
        self._appending = False  # whether the running capture appends (a generation)
        self._forced: list[torch.Tensor] | None = None
        self._grad_at_replay = False  # whether the running replay began with gradients on
        self._handles: list[RemovableHandle] = []
        for index, (block, router, formula) in enumerate(found):
            self._handles.append(
                block.register_forward_pre_hook(self._shape_hook(index), with_kwargs=True)
            )
            self._handles.append(router.register_forward_hook(self._hook(index, formula)))

    @property
    def num_layers(self) -> int:
        """The number of MoE layers (routers) of the model."""
        return len(self.routers)

    def remove(self) -> None:
        """Removes the hooks from the model (those of :meth:`replay_for` too); the replay
        then hooks no router and refuses to record or replay."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.routers = []

    def hold(self, handles: list[RemovableHandle]) -> Callable[[], None]:
        """Makes :meth:`remove` take ``handles`` off too: the hooks of a helper that
        serves this replay, such as :func:`~torchrl_gspo.record_generation`.

        Args:
            handles (list of RemovableHandle): hooks registered for this replay.

        Returns:
            Callable[[], None]: removes ``handles`` alone, leaving the replay hooked.
        """
        self._handles.extend(handles)

        def remove() -> None:
            for handle in handles:
                handle.remove()

        return remove

    def __enter__(self) -> RoutingReplay:
        """Returns the hooked replay; the hooks are removed at the end of the block."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Removes the hooks (:meth:`remove`)."""
        self.remove()

    def _require_hooks(self, caller: str) -> None:
        if not self.routers:
            raise RuntimeError(
                f"RoutingReplay.{caller}: the hooks were removed (remove(), or the end of "
                "the with block), so nothing would be recorded or replayed. Build a new "
                "RoutingReplay(model)."
            )

    def _shape_hook(self, index: int) -> Callable:
        def hook(module, args, kwargs):
            # The router may see [B * T, H]; the MoE block that calls it sees [B, T, H].
            hidden = args[0] if args else kwargs["hidden_states"]
            self._shapes[index] = hidden.shape[:-1]

        return hook

    def _hook(self, index: int, formula: Callable) -> Callable:
        def hook(module, args, output):
            if _in_backward():  # a checkpoint recomputing a forward that was not replayed
                return output
            if self._forced is not None:
                self._refuse_checkpointing()
                forced = self._layer_routes(index, output[2])
                output = (output[0], formula(module, output[0], forced), forced)
            if self._recorded is not None:
                shape = self._shapes[index]
                dtype = _compact(module.num_experts)
                routes = output[2].detach().reshape(*shape, -1).to(dtype)
                earlier = self._recorded[index]
                if self._appending and earlier is not None:  # a decode step: its positions
                    routes = torch.cat([earlier, routes], dim=1)
                self._recorded[index] = routes
            return output

        return hook

    def _refuse_checkpointing(self) -> None:
        """Raises when a replayed router runs under gradient checkpointing.

        A checkpoint recomputes its forward in the backward pass, after the replayed
        routes are released. Non-reentrant checkpointing runs the forward under its
        saved-tensor hooks; the reentrant one runs it with gradients off.
        """
        if _in_non_reentrant_checkpoint() or (self._grad_at_replay and not torch.is_grad_enabled()):
            raise RuntimeError(
                "RoutingReplay: a replayed MoE layer ran under gradient checkpointing (or "
                "with gradients disabled inside a replay begun with them enabled). The "
                "backward pass would recompute it after the replayed routes are released, "
                "so it would route afresh and the gradient would be wrong. Do not "
                "checkpoint the MoE layers of a replayed forward (transformers: "
                "model.activation_checkpointing_disable(), formerly "
                "gradient_checkpointing_disable()); to replay without gradients, begin "
                "the replay under torch.no_grad()."
            )

    def _layer_routes(self, index: int, indices: torch.Tensor) -> torch.Tensor:
        """The forced routes of layer ``index``, as the router's indices, or an error."""
        forced, shape = self._forced[index], self._shapes[index]
        if forced.shape[:-1] != shape or forced.shape[-1] != indices.shape[-1]:
            raise ValueError(
                f"RoutingReplay: layer {index} routes a batch laid out as {tuple(shape)} "
                f"with top-{indices.shape[-1]}; the replayed routes are "
                f"{tuple(forced.shape)}. Replay on a batch laid out (padded) as the "
                "recorded one: RoutingReplay.from_rows lays per-row routes out for it."
            )
        return forced.reshape(-1, forced.shape[-1]).to(indices.device, torch.long)

    def _check(self, routes: list[torch.Tensor]) -> list[torch.Tensor]:
        """Routes of every layer, integer, in range and without a repeated expert.

        The values of all layers are checked in one device synchronization.
        """
        if len(routes) != self.num_layers:
            raise ValueError(
                f"RoutingReplay: {len(routes)} layers of routes for a model with "
                f"{self.num_layers} MoE layers."
            )
        for index, route in enumerate(routes):
            if route.dtype.is_floating_point or route.dtype.is_complex or route.dtype == torch.bool:
                raise ValueError(
                    f"RoutingReplay: the routes of layer {index} must be integer expert "
                    f"indices; got {route.dtype}."
                )
        flags = []  # per layer: out of range, an expert twice
        for route, router in zip(routes, self.routers, strict=True):
            flat = route.reshape(-1, route.shape[-1]).long()
            ordered = flat.sort(-1).values
            repeated = (ordered[:, 1:] == ordered[:, :-1]).any()
            out_of_range = ((flat < 0) | (flat >= router.num_experts)).any()
            flags.append(torch.stack([out_of_range, repeated]))
        flags = torch.stack(flags).tolist()
        for index, ((out_of_range, repeated), route) in enumerate(zip(flags, routes, strict=True)):
            if out_of_range:
                experts = self.routers[index].num_experts
                raise ValueError(
                    f"RoutingReplay: the routes of layer {index} must be expert indices in "
                    f"[0, {experts}); got values from {route.min().item()} to "
                    f"{route.max().item()}."
                )
            if repeated:
                raise ValueError(
                    f"RoutingReplay: a route of layer {index} names an expert twice; a top-k "
                    "route holds k distinct experts."
                )
        return list(routes)

    @contextlib.contextmanager
    def capture(self, generation: bool = False) -> Iterator[list[torch.Tensor]]:
        """Records the routes of the forwards run inside.

        Args:
            generation (bool, optional): ``False`` keeps the last forward's routes per
                layer; ``True`` appends each forward's positions to the earlier ones,
                as a ``generate`` with a KV cache runs them: the prompt's prefill, then
                one position per decode step. A generation of :math:`n` tokens then
                yields the routes of positions :math:`0 .. n - 2` (the last sampled
                token is never fed), an engine's layout (:func:`~torchrl_gspo.routes_from_engine`).
                Defaults to ``False``.

        Yields:
            list[torch.Tensor]: filled on exit, one ``[B, T, k]`` tensor per layer.
        """
        self._require_hooks("capture")
        if self._recorded is not None:
            raise RuntimeError("RoutingReplay.capture does not nest: one capture at a time.")
        routes: list[torch.Tensor] = []
        self._recorded = [None] * self.num_layers
        self._appending = generation
        try:
            yield routes
        finally:
            recorded, self._recorded, self._appending = self._recorded, None, False
        if any(r is None for r in recorded):
            raise RuntimeError(
                "RoutingReplay.capture: no forward of the model ran inside (a scorer that "
                "skipped the batch, e.g. RecomputeOldLogProbs on a batch that already "
                "holds its output key, runs none)."
            )
        routes.extend(recorded)

    @contextlib.contextmanager
    def replay(self, routes: list[torch.Tensor]) -> Iterator[None]:
        """Forces ``routes`` (one ``[B, T, k]`` tensor per layer) in the forwards inside."""
        self._start(routes, "replay")
        try:
            yield
        finally:
            self._forced = None

    def _start(self, routes: list[torch.Tensor], caller: str) -> None:
        """Checks and forces ``routes``, or raises (hooks removed, nesting, checkpointing)."""
        self._require_hooks(caller)
        if self._forced is not None:
            raise RuntimeError(
                f"RoutingReplay.{caller}: a replay is already running; replays do not nest."
            )
        if torch.is_grad_enabled() and any(
            getattr(m, "gradient_checkpointing", False) and m.training for m in self.model.modules()
        ):
            raise RuntimeError(
                f"RoutingReplay.{caller}: the model uses gradient checkpointing, whose "
                "backward recomputes the forward after the replayed routes are released. "
                "Disable it (model.activation_checkpointing_disable(), formerly "
                "gradient_checkpointing_disable())."
            )
        self._forced = self._check(routes)
        self._grad_at_replay = torch.is_grad_enabled()

    def to_rows(self, routes: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
        """Per-row routes ``[n_i, layers, k]`` of a left-padded batch of row lengths ``n_i``."""
        stacked = torch.stack(routes, dim=-2)  # [B, T, layers, k]
        if stacked.shape[0] != len(lengths) or stacked.shape[1] < max(lengths):
            raise ValueError(
                f"RoutingReplay: routes laid out as {tuple(stacked.shape[:2])} for {len(lengths)} "
                f"rows of up to {max(lengths)} tokens. The model must see one padded row per "
                "sequence: packed input (TransformersWrapper(pad_model_input=False)) routes "
                "the rows as one; keep the default pad_model_input=True."
            )
        return [row[stacked.shape[1] - n :] for row, n in zip(stacked, lengths, strict=True)]

    def from_rows(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Routes per layer ``[B, T, k]`` of the left-padded batch of ``rows``.

        Every row must have row 0's layers and top-k (a check of shapes: no device
        synchronization); its padding takes experts ``0 .. k - 1``.
        """
        for index, row in enumerate(rows[1:], start=1):
            _check_row_agrees(index, row.shape, rows[0].shape)
        width = max(r.shape[0] for r in rows)
        # padding positions get experts 0..k-1 (distinct, as top-k's are)
        fill = torch.arange(rows[0].shape[-1], device=rows[0].device, dtype=rows[0].dtype)
        fill = fill.expand(*rows[0].shape[1:])
        padded = torch.stack(
            [torch.cat([fill.expand(width - r.shape[0], *r.shape[1:]), r]) for r in rows]
        )
        return list(padded.unbind(-2))

    def replay_for(
        self,
        loss_module: nn.Module,
        key: NestedKey = ("routing", "experts"),
        tokens_key: NestedKey | None = None,
    ) -> Callable[[], None]:
        """Replays, in each call of ``loss_module``, the routes its batch holds at ``key``.

        Each row's routes must cover its tokens (``tokens_key``, by default the loss'
        ``action`` key), one route per token; when the batch also holds the tokens the
        routes were recorded for (``key``'s sibling ``"tokens"``, as
        :class:`RecordRoutes` writes them), they must be the row's tokens.

        Returns:
            Callable[[], None]: removes the replay from ``loss_module`` (so does
            :meth:`remove`).
        """
        key = unravel_key(key)
        recorded_key = (*key[:-1], "tokens")
        if tokens_key is None:
            tokens_key = getattr(loss_module, "tensor_keys", None)
            tokens_key = tokens_key.action if tokens_key is not None else ("tokens", "full")

        running = []  # holds True while a call of this loss replays

        def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
            batch = args[0] if args else kwargs["tensordict"]
            rows = self._rows(batch, key, tokens_key, recorded_key)
            self._start(self.from_rows(rows), "replay_for")
            running.append(True)

        def after(module: nn.Module, args: tuple, output: object) -> None:
            if running:  # not when `before` raised: another replay may be running
                running.pop()
                self._forced = None

        self._require_hooks("replay_for")
        handles = [
            loss_module.register_forward_pre_hook(before, with_kwargs=True),
            loss_module.register_forward_hook(after, always_call=True),
        ]
        return self.hold(handles)

    @staticmethod
    def _rows(
        batch: TensorDictBase, key: NestedKey, tokens_key: NestedKey, recorded_key: NestedKey
    ) -> list[torch.Tensor]:
        """Each row's routes, checked against the row's tokens."""
        if key not in batch.keys(True):
            raise KeyError(
                f"RoutingReplay.replay_for: the batch holds no routes at {key!r} (on every "
                "row). RecordRoutes writes them where the old log-probabilities are computed."
            )

        def rows_of(entry: NestedKey) -> list[torch.Tensor]:
            if isinstance(batch, LazyStackedTensorDict):
                return batch.get(entry, as_list=True)
            return list(batch.get(entry).unbind(0))

        routes, tokens = rows_of(key), rows_of(tokens_key)
        pairs = zip(routes, tokens, strict=True)
        wrong = [i for i, (r, t) in enumerate(pairs) if len(r) != len(t)]
        if not wrong and recorded_key in batch.keys(True):
            recorded = rows_of(recorded_key)
            pairs = zip(recorded, tokens, strict=True)
            wrong = [i for i, (r, t) in enumerate(pairs) if not torch.equal(r.to(t.dtype), t)]
        if wrong:
            raise ValueError(
                f"RoutingReplay.replay_for: the routes at {key!r} of batch row(s) {wrong} were "
                f"not recorded for the row's tokens at {tokens_key!r} (another length, or "
                "other tokens): they would route every token of the row through another "
                "token's experts. Keep each row's routes with its row."
            )
        return routes


class RecordRoutes(Transform):
    """Runs a scorer (e.g. :class:`~torchrl_gspo.RecomputeOldLogProbs`) and records its routes.

    The routes of the scorer's forward are written per row at ``key`` (``[n_i, layers,
    k]`` expert indices, for the ``n_i`` tokens of row ``i``), and the tokens they were
    recorded for next to them (``key``'s sibling ``"tokens"``), where
    :meth:`RoutingReplay.replay_for` finds and checks them. Place it where the old
    log-probabilities are computed: the collector's ``postproc`` or the replay
    buffer's write. The batch must be lazily stacked (one row per sequence), and the
    scorer must run the model on it.

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
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from tokenizers import Tokenizer, models
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
        >>> from torchrl_gspo import GSPOLoss, RecomputeOldLogProbs, RecordRoutes, RoutingReplay
        >>> _ = torch.manual_seed(0)
        >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        ...     {f"t{i}": i for i in range(32)}, unk_token="t2")), pad_token="t0", eos_token="t1")
        >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=32, hidden_size=16,
        ...     intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_experts=4,
        ...     num_experts_per_tok=2)).eval()
        >>> policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens",
        ...     generate=False, return_log_probs=True, pad_output=False)
        >>> pairs = [([5, 6, 7], [8, 9, 1]), ([5, 6], [10, 11, 12, 13, 1])]
        >>> data = lazy_stack([
        ...     TensorDict(tokens=TensorDict(prompt=torch.tensor(p), response=torch.tensor(r),
        ...                                  full=torch.tensor(p + r)),
        ...                advantage=torch.tensor([[a]]))
        ...     for (p, r), a in zip(pairs, (1.0, -1.0))])
        >>> replay = RoutingReplay(model)
        >>> data = RecordRoutes(replay, RecomputeOldLogProbs(policy, out_key="log_probs"))(data)
        >>> [tuple(r.shape) for r in data.get(("routing", "experts"), as_list=True)]
        [(6, 2, 2), (7, 2, 2)]
        >>> loss = GSPOLoss(policy)
        >>> stop = replay.replay_for(loss)  # each call of `loss` replays its rows' routes
        >>> float(loss(data).sequence_log_ratio_max_abs) < 1e-6  # same weights: on-policy
        True
        >>> stop()
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
        if not isinstance(tensordict, LazyStackedTensorDict):
            raise TypeError(
                "RecordRoutes needs a lazily stacked batch, one row per sequence (what "
                "LLMCollector hands out, or data.to_lazystack(0)): a dense TensorDict's "
                f"rows cannot hold routes of their own; got {type(tensordict).__name__}."
            )
        out_key = getattr(self.scorer, "out_key", None)
        if out_key is not None and out_key in tensordict.keys(True):
            raise ValueError(
                f"RecordRoutes: the batch already holds {out_key!r}, so the scorer would "
                "skip it and run no forward to record. Record the routes where the old "
                "log-probabilities are first computed (the collector's postproc)."
            )
        with self.replay.capture() as routes:
            tensordict = self.scorer(tensordict)
        tokens = tensordict.get(self.tokens_key, as_list=True)
        rows = self.replay.to_rows(routes, [t.shape[-1] for t in tokens])
        recorded_key = (*self.key[:-1], "tokens")
        for td, route, row_tokens in zip(tensordict.tensordicts, rows, tokens, strict=True):
            td.set(self.key, route)
            td.set(recorded_key, row_tokens)
        return tensordict

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.forward(tensordict)


def routing_volatility(
    before: list[torch.Tensor],
    after: list[torch.Tensor],
    mask: torch.Tensor,
    *,
    count: Literal["sets", "experts"] = "sets",
) -> torch.Tensor:
    """How much of a routing changed: the top-k sets, or the activated experts.

    With ``count="sets"``, the fraction of (token, layer) top-k expert sets that
    differ; with ``count="experts"``, the fraction of activated experts that are no
    longer activated for their token (the GSPO paper's "about 10% of the experts"
    counts these). With top-k routing the first can be up to k times the second.

    Args:
        before (list[torch.Tensor]): routes per layer, ``[B, T, k]``.
        after (list[torch.Tensor]): the same tokens' routes after an update.
        mask (torch.Tensor): ``[B, T]``, the tokens to count.

    Keyword Args:
        count (Literal["sets", "experts"], optional): what to count. Defaults to
            ``"sets"``.

    Returns:
        torch.Tensor: ``[layers + 1]``: the fraction per layer, then overall.

    Examples:
        >>> import torch
        >>> from torchrl_gspo import routing_volatility
        >>> before = [torch.tensor([[[0, 1], [2, 3]]])]
        >>> after = [torch.tensor([[[1, 0], [2, 4]]])]  # same set, then one new expert
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> routing_volatility(before, after, mask)  # one set of two changed
        tensor([0.5000, 0.5000], dtype=torch.float64)
        >>> routing_volatility(before, after, mask, count="experts")  # one expert of four
        tensor([0.2500, 0.2500], dtype=torch.float64)
    """
    if count not in ("sets", "experts"):
        raise ValueError(f"count must be 'sets' or 'experts', got {count!r}.")
    per_layer = []
    for b, a in zip(before, after, strict=True):
        # [B, T, k]: expert j of the token's old route is absent from its new one
        gone = (b.long().unsqueeze(-1) != a.long().unsqueeze(-2)).all(-1)
        changed = gone.any(-1).double() if count == "sets" else gone.double().mean(-1)
        per_layer.append((changed * mask).sum() / mask.sum().clamp_min(1))
    per_layer = torch.stack(per_layer)
    return torch.cat([per_layer, per_layer.mean().unsqueeze(0)])
