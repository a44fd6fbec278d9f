# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The experts an inference engine routed each token to, as per-row routes."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from tensordict.utils import NestedKey, unravel_key
from torch import nn

from torchrl_gspo.moe.routing import RoutingReplay

__all__ = ["decode_sglang_routes", "record_generation", "routes_from_engine"]


def decode_sglang_routes(encoded: str | bytes, num_layers: int, top_k: int) -> torch.Tensor:
    """SGLang's ``meta_info["routed_experts"]`` as ``[rows, num_layers, top_k]``.

    SGLang (``--enable-return-routed-experts``) returns the routes as the base64
    encoding of a flattened int32 buffer over all decoder layers.

    Args:
        encoded (str | bytes): the base64 string.
        num_layers (int): the model's decoder layers (``num_hidden_layers``).
        top_k (int): experts per token (``num_experts_per_tok``).

    Returns:
        torch.Tensor: int32 routes, one row per routed position.

    Examples:
        >>> import base64
        >>> import numpy as np
        >>> from torchrl_gspo import decode_sglang_routes
        >>> raw = np.arange(12, dtype=np.int32)  # 3 positions, 2 layers, top-2
        >>> decode_sglang_routes(base64.b64encode(raw.tobytes()), 2, 2).shape
        torch.Size([3, 2, 2])
    """
    raw = base64.b64decode(encoded)
    if len(raw) % (4 * num_layers * top_k):
        raise ValueError(
            f"decode_sglang_routes: {len(raw) / 4:g} int32 values do not split into rows of "
            f"{num_layers} layers x top-{top_k}; pass the model's num_hidden_layers and "
            "num_experts_per_tok."
        )
    if not raw:  # a one-token sequence: no routed position
        return torch.empty(0, num_layers, top_k, dtype=torch.int32)
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(-1, num_layers, top_k)


def routes_from_engine(
    routes: Any,
    num_tokens: int,
    moe_layers: Sequence[int],
    *,
    start: int = 0,
    earlier: torch.Tensor | None = None,
) -> torch.Tensor:
    """An engine's routes of one sequence as per-row routes ``[n, layers, k]``.

    vLLM (``CompletionOutput.routed_experts``) and SGLang (after
    :func:`decode_sglang_routes`) return one route per position ``start .. n - 2`` of
    a sequence of ``n`` tokens (prompt and response), over all decoder layers: the
    last token was never fed to the model, and dense layers hold placeholders (0 in
    vLLM 0.34 and SGLang 0.5.23, -1 in other builds). Row ``j`` is the route of token
    ``start + j``, whose forward gives the log-probability of token ``start + j + 1``.
    This keeps the MoE layers (so a dense layer's placeholder never reaches the route
    check, whereas a -1 inside an MoE layer, a missing route, is refused when
    replayed), takes the rows before ``start`` from ``earlier`` (the routes of the
    previous turn, in this
    format), and gives the last token experts ``0 .. k - 1``: its forward only
    predicts a token after the sequence, so it changes no log-probability of the
    sequence. The result is the format :class:`~torchrl_gspo.RecordRoutes` writes,
    which :meth:`~torchrl_gspo.RoutingReplay.replay_for` replays (:doc:`/moe`).

    Args:
        routes (numpy.ndarray | torch.Tensor): ``[n - 1 - start, num_layers, k]``
            integer expert indices (vLLM: a numpy uint8 or uint16 array, SGLang: int32);
            a float, complex or bool dtype is refused, not truncated.
        num_tokens (int): ``n``, the sequence's tokens.
        moe_layers (Sequence[int]): the decoder-layer indices of the MoE layers, in
            order (:attr:`RoutingReplay.num_layers` of them).

    Keyword Args:
        start (int, optional): the first routed position (vLLM's
            ``routed_experts_prompt_start``, SGLang's ``routed_experts_start_len``).
            Defaults to 0.
        earlier (torch.Tensor, optional): ``[> start, layers, k]`` the routes of the
            earlier turn, one row per token, whose last row (that turn's last token,
            filled) is never taken: an engine reports ``start <= len(earlier) - 1``.
            Required when ``start > 0``.

    Returns:
        torch.Tensor: int64 ``[n, len(moe_layers), k]``.

    Examples:
        >>> import numpy as np
        >>> from torchrl_gspo import routes_from_engine
        >>> engine = np.zeros((4, 3, 2), dtype=np.uint8)  # 5 tokens, 3 layers, top-2
        >>> engine[:, 1] = [[2, 3]] * 4  # layer 1 is the MoE layer
        >>> routes_from_engine(engine, 5, [1])[:, 0].tolist()  # the last token: 0, 1
        [[2, 3], [2, 3], [2, 3], [2, 3], [0, 1]]
    """
    routes = torch.as_tensor(routes)
    _refuse_non_integer(routes, start)  # before the conversion truncates them
    routes = routes.to(torch.int64)
    expected = num_tokens - 1 - start
    layers = list(moe_layers)
    top = max(layers, default=-1)
    if routes.ndim != 3 or routes.shape[0] != expected or top >= routes.shape[1]:
        raise ValueError(
            f"routes_from_engine: the engine's routes have shape {tuple(routes.shape)}; "
            f"expected [{expected}, >{top}, top_k]: one row per "
            f"position {start} .. {num_tokens - 2} of the {num_tokens} tokens (none for "
            "the last), over all decoder layers. Pass the sequence's token count and the "
            "start offset the engine used."
        )
    routes = routes[:, layers]
    last = torch.arange(routes.shape[-1]).expand(1, len(layers), -1)
    if start == 0:
        return torch.cat([routes, last])
    if earlier is None or earlier.shape[0] < start or earlier.shape[1:] != routes.shape[1:]:
        raise ValueError(
            f"routes_from_engine: start={start} needs the routes of the first {start} "
            f"tokens as earlier=[> {start}, {len(layers)}, {routes.shape[-1]}] (the "
            "previous turn's routes, in this format)."
        )
    _refuse_filler_start(start, earlier.shape[0])
    return torch.cat([earlier[:start].to(routes.dtype), routes, last])


def _refuse_non_integer(routes: torch.Tensor, start: int) -> None:
    """Raises when the engine's routes are not integer expert ids.

    The dtype check syncs nothing; only the error, to name the first row holding a
    fraction, reads the values (one device synchronization, before raising).

    Args:
        routes (torch.Tensor): the engine's routes, ``[n - 1 - start, layers, k]``.
        start (int): the first routed position (row ``j`` is token ``start + j``).
    """
    dtype = routes.dtype
    if not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
        return
    where = ""
    if dtype.is_floating_point and routes.ndim == 3:
        fractions = (routes != routes.trunc()).nonzero()
        if len(fractions):
            row, layer, slot = fractions[0].tolist()
            where = (
                f" (row {row}, the route of token {start + row}, holds "
                f"{routes[row, layer, slot].item():g} at layer {layer})"
            )
    raise ValueError(
        f"routes_from_engine: the engine's routes are {dtype}, not integer expert "
        f"ids{where}; converting them would truncate each value to an expert (2.7 -> "
        "2). Pass the integer expert ids as the engine returns them (vLLM: a numpy "
        "uint8 or uint16 array, SGLang: int32 from decode_sglang_routes), not a float "
        "copy."
    )


def _refuse_filler_start(start: int, earlier_rows: int) -> None:
    """Raises when ``start`` would take the earlier turn's last-token filler as a route.

    Args:
        start (int): the first routed position, ``> 0``.
        earlier_rows (int): the rows of ``earlier``, one per token of the earlier turn.
    """
    if start < earlier_rows:
        return
    last = earlier_rows - 1
    raise ValueError(
        f"routes_from_engine: start={start} but earlier holds {earlier_rows} rows: its "
        f"row {last} is the filler of the earlier turn's last token (experts 0 .. k - 1, "
        f"never routed), which would be replayed as the route of token {last}. An "
        f"engine routes that token again in the next turn, so it reports start <= {last}: "
        "pass the start the engine returned, and earlier as the earlier turn's full "
        "routes (one row per token, in this format)."
    )


def record_generation(
    replay: RoutingReplay,
    generator: nn.Module,
    *,
    key: NestedKey = ("routing", "experts"),
    tokens_key: NestedKey = ("tokens", "full"),
) -> Callable[[], None]:
    """Records, in each call of ``generator``, the routes its generation ran, per row.

    The local stand-in for an engine's ``routed_experts`` (Rollout Routing Replay, R3,
    `arXiv:2510.11370 <https://arxiv.org/abs/2510.11370>`_; :doc:`/moe`): around each
    call of a generating TorchRL wrapper (e.g. ``TransformersWrapper(model,
    generate=True, pad_output=False)``) of the model that ``replay`` hooks, the routes
    are captured *during* ``generate``: the prefill of the left-padded prompts, then one
    position per decode step, with the KV cache (:meth:`RoutingReplay.capture` with
    ``generation=True``). Each row of the output then gets, at ``key``, the routes of
    its own ``n`` tokens (``[n, layers, k]``, the format of
    :class:`~torchrl_gspo.RecordRoutes`): the generation's routes of its positions, its
    padding cut off, and experts ``0 .. k - 1`` for its last token, which the generation
    never fed (as :func:`routes_from_engine`). Next to them, at ``key``'s sibling
    ``"tokens"``, go the tokens the model was fed there, checked against the row's
    tokens, so that :meth:`RoutingReplay.replay_for` can check every later use.

    Args:
        replay (RoutingReplay): hooks the generator's model.
        generator (nn.Module): the generating wrapper; its output must be lazily
            stacked (``pad_output=False``), one row per sequence.

    Keyword Args:
        key (NestedKey, optional): where the routes go. Defaults to
            ``("routing", "experts")``.
        tokens_key (NestedKey, optional): the rows' tokens, prompt and response; the
            responses are read at its sibling ``"response"``. Defaults to
            ``("tokens", "full")``.

    Returns:
        Callable[[], None]: removes the hooks from ``generator`` and its model (so
        does :meth:`RoutingReplay.remove`).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from tokenizers import Tokenizer, models
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
        >>> from torchrl_gspo import RoutingReplay, record_generation
        >>> _ = torch.manual_seed(0)
        >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        ...     {f"t{i}": i for i in range(32)}, unk_token="t2")), pad_token="t0", eos_token="t1")
        >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=32, hidden_size=16,
        ...     intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_experts=4,
        ...     num_experts_per_tok=2, pad_token_id=0, eos_token_id=1)).eval()
        >>> generator = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens",
        ...     generate=True, pad_output=False, generate_kwargs={"max_new_tokens": 4,
        ...     "do_sample": True, "bad_words_ids": [[0]]})  # a sampled pad would be dropped
        >>> replay = RoutingReplay(model)
        >>> stop = record_generation(replay, generator)
        >>> prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]  # left-padded inside
        >>> out = generator(lazy_stack([TensorDict(tokens=TensorDict(prompt=p)) for p in prompts]))
        >>> [r.shape[0] == t.numel() for r, t in zip(out.get(("routing", "experts"),
        ...     as_list=True), out.get(("tokens", "full"), as_list=True))]
        [True, True]
        >>> stop()
    """
    if any(getattr(generator, name, None) for name in ("pad_output", "num_samples", "batching")):
        raise ValueError(
            "record_generation: the generator pads its output, samples several responses "
            "per prompt or batches the calls of several callers (pad_output=True, "
            "num_samples or batching=True); each row must be one sequence of this call. "
            "Build it with pad_output=False, one response per prompt (repeat the prompts "
            "instead, as ChatEnv's repeats does) and without batching."
        )
    key, tokens_key = unravel_key(key), unravel_key(tokens_key)
    calls: list[tuple[contextlib.ExitStack, list[torch.Tensor], list[torch.Tensor]]] = []

    def fed(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if calls and calls[-1] is not None:  # inside a generation: this forward's tokens
            calls[-1][2].append(kwargs["input_ids"] if "input_ids" in kwargs else args[0])

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        stack = contextlib.ExitStack()
        calls.append(None)  # this call's entry, whether or not its capture starts
        routes = stack.enter_context(replay.capture(generation=True))
        calls[-1] = (stack, routes, [])

    def after(module: nn.Module, args: tuple, output: TensorDictBase | None) -> None:
        entry = calls.pop()
        if entry is None:  # `before` raised: this call captured nothing
            return
        stack, routes, inputs = entry
        if output is None:  # the generation raised: leave its error alone
            with contextlib.suppress(RuntimeError):
                stack.close()
            return
        stack.close()  # fills `routes`
        _write_rows(output, routes, inputs, key, tokens_key)

    handles = [
        replay.model.register_forward_pre_hook(fed, with_kwargs=True),
        generator.register_forward_pre_hook(before, with_kwargs=True),
        generator.register_forward_hook(after, always_call=True),
    ]
    return replay.hold(handles)  # RoutingReplay.remove() takes them off too


def _write_rows(
    output: TensorDictBase,
    routes: list[torch.Tensor],
    inputs: list[torch.Tensor],
    key: tuple[str, ...],
    tokens_key: tuple[str, ...],
) -> None:
    """Writes each row's routes ``[n, layers, k]`` and fed tokens on ``output``.

    ``inputs`` holds the tokens of each forward: the left-padded prompts ``[B, P]``,
    then ``[B, 1]`` per decode step. A row of ``p`` prompt and ``n - p`` response
    tokens sat at columns ``P - p .. P - p + n - 1`` of their concatenation.
    """
    if not isinstance(output, LazyStackedTensorDict) or output.ndim != 1:
        raise TypeError(
            "record_generation: the generator's output must be lazily stacked with one "
            "row per sequence (TransformersWrapper(pad_output=False), without "
            f"num_samples); got {type(output).__name__} of batch size "
            f"{tuple(output.batch_size)}."
        )
    stacked = torch.stack(routes, dim=-2)  # [B, P + steps, layers, k]
    prompt_width, fed = inputs[0].shape[1], torch.cat(inputs, dim=1)
    rows = output.get(tokens_key, as_list=True)
    responses = output.get((*tokens_key[:-1], "response"), as_list=True)
    last = torch.arange(stacked.shape[-1], dtype=stacked.dtype).expand(1, *stacked.shape[2:])
    wrong, written = [], []
    for i, (tokens, response) in enumerate(zip(rows, responses, strict=True)):
        n = tokens.numel()
        left = prompt_width - (n - response.numel())
        seen = fed[i, left : left + n - 1]
        if not torch.equal(seen.to(tokens.device), tokens[:-1]):
            wrong.append(i)
        written.append(torch.cat([stacked[i, left : left + n - 1], last.to(stacked.device)]))
    if wrong:
        raise ValueError(
            f"record_generation: the tokens at {tokens_key!r} of row(s) {wrong} are not "
            "the tokens the generation fed to the model at their positions. TorchRL's "
            "wrapper drops a sampled pad token from its row: ban the pad id in generation "
            "(generate_kwargs={'bad_words_ids': [[pad_token_id]]}), as TorchRL's recipes "
            "do. A generate that does not run the prompts in one prefill, then one "
            "position per step (use_cache=False, chunked prefill), cannot be recorded."
        )
    recorded_key = (*key[:-1], "tokens")
    for td, route, tokens in zip(output.tensordicts, written, rows, strict=True):
        td.set(key, route)
        td.set(recorded_key, tokens)
