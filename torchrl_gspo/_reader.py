# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The inputs of one loss call, read once, dense or lazily stacked.

Missing keys, wrong shapes and constants that require grad raise here, each error
naming the key, the shape and the fix (the rules: the documentation's "Inputs"
page). Nothing here writes on a tensordict.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from tensordict.utils import NestedKey

from torchrl_gspo._arguments import Options
from torchrl_gspo._checks import FULL_KEY, PROMPT_KEY, RESPONSE_KEY, context_mismatch, enforce


class Batch(NamedTuple):
    """The tensors of one call, dense and left-aligned with the tokens.

    Attributes:
        old: ``[B, T]`` old log-probabilities, the ratio's denominator: the
            ``old_log_prob`` key when present, else ``sample_log_prob``.
        rollout: ``[B, T]`` rollout log-probabilities (``sample_log_prob``) when the
            old ones were recomputed, else ``None``.
        advantage: ``[B, 1, 1]`` (one per sequence) or ``[B, T, 1]`` (per token,
            0 where ``has_value`` is False); a floating dtype.
        has_value: where the advantage is finite, ``[B]`` or ``[B, T]``.
        scale: ``[B]`` sequence scale of the global normalization, or ``None``.
        ref: ``[B, T]`` reference log-probabilities when ``kl_to_ref_coeff`` is set.
        response_lengths: ``[B]`` lengths of the sampled responses when the
            response-mask check applies, else ``None``.
        inputs: ``[B, T]`` the objective's per-token inputs, one per key of
            ``Options.token_inputs``, left-padded with 0.
    """

    old: torch.Tensor
    rollout: torch.Tensor | None
    advantage: torch.Tensor
    has_value: torch.Tensor
    scale: torch.Tensor | None
    ref: torch.Tensor | None
    response_lengths: torch.Tensor | None
    inputs: tuple[torch.Tensor, ...] = ()


def _rows(tensordict: TensorDictBase) -> list[TensorDictBase] | None:
    """The rows of a batch lazily stacked along dim 0, else None."""
    if isinstance(tensordict, LazyStackedTensorDict) and tensordict.stack_dim == 0:
        return tensordict.tensordicts
    return None


def _read_rows(rows: list[TensorDictBase], key: NestedKey, owner: str) -> list[torch.Tensor] | None:
    """One tensor per row, or None when no row holds ``key``; some rows only raise."""
    return _complete([_get(row, key) for row in rows], key, owner)


def _complete(values: list, key: NestedKey, owner: str) -> list[torch.Tensor] | None:
    """The rows' values at ``key``, or None when no row holds it; some rows only raise."""
    missing = [i for i, value in enumerate(values) if value is None]
    if not missing:
        return values
    if len(missing) < len(values):
        raise ValueError(
            f"{owner}: the lazily stacked batch holds {key!r} on some rows only: rows {missing} of "
            f"{len(values)} lack it, so the loss can use it on none. Write it on every row "
            "(e.g. set_sequence_scale and RecomputeOldLogProbs write every row of what "
            "they are given) or on none."
        )
    return None


def _read(tensordict: TensorDictBase, rows, key: NestedKey, options: Options):
    """A dense tensor, a list of row tensors (lazy stack), or None when absent."""
    if rows is None:
        return _get(tensordict, key)
    return _read_rows(rows, key, options.owner)


def _get(tensordict: TensorDictBase, key: NestedKey) -> torch.Tensor | None:
    """``tensordict[key]``, or None when absent (in eager mode, ``get``'s default).

    Under ``torch.compile`` a graph traced without the key must be guarded on its
    absence, so that a batch that holds it, with as many keys, recompiles instead of
    reusing a graph that ignores it. Neither ``get``'s default nor a failing ``in``
    test of a nested key is guarded (both go through a caught ``KeyError``); the list
    of the keys is, key by key.
    """
    if not torch.compiler.is_compiling():
        return tensordict.get(key, None)
    key = key[0] if isinstance(key, tuple) and len(key) == 1 else key
    return tensordict.get(key) if key in list(tensordict.keys(include_nested=True)) else None


def _pad(values, value: float, side: str = "left") -> torch.Tensor:
    """Row tensors padded into one (on ``side``); a dense tensor as it is."""
    if isinstance(values, torch.Tensor):
        return values
    return torch.nn.utils.rnn.pad_sequence(
        values, batch_first=True, padding_value=value, padding_side=side
    )


def read_batch(tensordict: TensorDictBase, options: Options) -> Batch:
    """Reads every input of a loss from ``tensordict`` once, dense or lazily stacked.

    Args:
        tensordict (TensorDictBase): the batch; never modified.
        options (Options): the loss' keys and options.

    Returns:
        Batch: the inputs. Missing keys, wrong shapes and constants that require
        grad raise; the value rules that need the current policy are checked when
        the batch is scored (:func:`torchrl_gspo.scores.score`).
    """
    if tensordict.batch_dims != 1:
        raise ValueError(
            f"{options.owner}: the batch has shape {tuple(tensordict.batch_size)}; the "
            "loss expects one batch dimension, [B, T]. Flatten the batch first, e.g. "
            "tensordict.reshape(-1)."
        )
    rows = _rows(tensordict)
    tokens, advantage, sample = _required(tensordict, rows, options)
    responses = None  # each row's, read once for both checks
    if rows is not None and options.response_mask_check != "ignore":
        responses = [_get(row, RESPONSE_KEY) for row in rows]
        fulls = tokens if options.keys.action == FULL_KEY else [_get(r, FULL_KEY) for r in rows]
        prompts = [_get(row, PROMPT_KEY) for row in rows]
        _, error = context_mismatch(prompts, responses, fulls, options)
        enforce(error, options.response_mask_check)
    size = tensordict.batch_size[0]
    if size == 0:
        raise ValueError(
            f"{options.owner}: the batch is empty (batch size 0), so there is no sequence "
            "to optimize: skip the optimization step. (Rows with no response token are "
            "fine: they contribute 0 to the loss.)"
        )
    lengths = _token_lengths(tokens, rows is not None, options)
    _check_log_probs(options.keys.sample_log_prob, sample, tokens, lengths, options)
    old = _read_old(tensordict, rows, tokens, lengths, options)
    width = tokens.shape[-1] if lengths is None else max(lengths)
    advantage, has_value = _read_advantage(advantage, size, width, options)
    sample = _pad(sample, 0.0)
    return Batch(
        old=sample if old is None else old,
        rollout=None if old is None else sample,
        advantage=advantage,
        has_value=has_value,
        scale=_read_scale(
            _read(tensordict, rows, options.keys.sequence_scale, options), size, options
        ),
        ref=_read_ref(tensordict, rows, options),
        response_lengths=_response_lengths(responses, options, sample.device),
        inputs=tuple(
            _token_input(tensordict, rows, key, tokens, lengths, options)
            for key in options.token_inputs
        ),
    )


def _read_old(tensordict: TensorDictBase, rows, tokens, lengths, options: Options):
    """``[B, T]`` the recomputed old log-probabilities, padded, or None when absent."""
    keys = options.keys
    old = None
    if keys.old_log_prob != keys.sample_log_prob:
        old = _read(tensordict, rows, keys.old_log_prob, options)
    if old is not None:
        _check_log_probs(keys.old_log_prob, old, tokens, lengths, options)
        return _pad(old, 0.0)
    if options.rollout_correction is not None:
        raise KeyError(
            f"{options.owner}: rollout_correction={options.rollout_correction!r} needs the "
            f"trainer's recomputed old log-probabilities at {keys.old_log_prob!r}, "
            "which are missing. Write them before the batch is stored, e.g. with "
            "RecomputeOldLogProbs(policy) as the collector's postproc, or point the "
            "loss at their key with loss.set_keys(old_log_prob=...)."
        )
    return None


def _token_input(tensordict: TensorDictBase, rows, key, tokens, lengths, options: Options):
    """``[B, T]`` an integer per-token input of the objective, left-padded with 0."""
    values = tokens if key == options.keys.action else _read(tensordict, rows, key, options)
    name = options.owner
    if values is None:
        raise KeyError(
            f"{name} reads a per-token input at {key!r}, which is missing: write one "
            f"value per token of {options.keys.action!r} there, or point the loss at its "
            f"key with loss.set_keys(...)."
        )
    shapes = [v.shape for v in values] if lengths is not None else [values.shape]
    expected = [(n,) for n in lengths] if lengths is not None else [tokens.shape]
    wrong = [i for i, (a, b) in enumerate(zip(shapes, expected, strict=True)) if a != b]
    if wrong:
        where = f"batch row(s) {wrong}: shapes " if lengths is not None else "shape "
        raise ValueError(
            f"{name}: the per-token input at {key!r} has {where}"
            f"{[tuple(shapes[i]) for i in wrong]} but the log-probabilities have "
            f"{[tuple(expected[i]) for i in wrong]} (the tokens at {options.keys.action!r}). "
            "Store one value per token of each row, laid out as the tokens are."
        )
    dtype = (values if lengths is None else values[0]).dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(
            f"{name}: the per-token input at {key!r} has dtype {dtype}; it must hold "
            "integers (e.g. segment ids as torch.long): convert it with .long()."
        )
    return _pad(values, 0)


# The inputs every call needs: (key name, GRPOLoss' exception type and the start of its
# message, what the loss reads there); a missing one raises as GRPOLoss does
_REQUIRED = (
    ("action", ValueError, "Action key {key} not in tensordict.", "the sampled tokens"),
    (
        "advantage",
        ValueError,
        "Advantage key {key} not in tensordict.",
        "one advantage per sequence (e.g. from MCAdvantage)",
    ),
    (
        "sample_log_prob",
        KeyError,
        "Couldn't find the log-prob {key} in the input data.",
        "the old (sampling) log-probabilities, one per token,",
    ),
)


def _required(tensordict: TensorDictBase, rows, options: Options) -> tuple:
    """Tokens, advantage and log-probs; a missing one raises GRPOLoss' exception type."""
    values = []
    for name, error, start, what in _REQUIRED:
        key = getattr(options.keys, name)
        value = _read(tensordict, rows, key, options)
        if value is None:
            raise error(
                f"{start.format(key=key)} {options.owner} reads {what} there; write "
                f"them, or point the loss at their key with loss.set_keys({name}=...)."
            )
        values.append(value)
    return tuple(values)


def _token_lengths(tokens, lazy: bool, options: Options) -> list[int] | None:
    """Each row's token count (lazy stacks; None for dense batches), or an error."""
    shape = [row.shape for row in tokens] if lazy else tokens.shape
    if not lazy and tokens.ndim == 2:
        return None
    if lazy and all(len(row) == 1 for row in shape):
        return [row[0] for row in shape]
    raise ValueError(
        f"{options.owner}: the tokens at {options.keys.action!r} have shape "
        f"{tuple(shape)}; the loss expects one batch dimension, [B, T]. Flatten the "
        "batch first, e.g. tensordict.reshape(-1)."
    )


def _check_log_probs(key: NestedKey, log_prob, tokens, lengths, options: Options) -> None:
    """Log-probabilities are constants with one value per token of each row."""
    name, action = options.owner, options.keys.action
    if lengths is None:
        requires_grad = log_prob.requires_grad
        if log_prob.shape != tokens.shape:
            raise ValueError(
                f"{name}: the log-probabilities at {key!r} have shape "
                f"{tuple(log_prob.shape)} but the tokens at {action!r} have shape "
                f"{tuple(tokens.shape)} (both read left-padded). Store one "
                "log-probability per token, of shape [B, T], e.g. from a no-grad "
                "forward of the training wrapper (return_log_probs=True)."
            )
    else:
        requires_grad = any(row.requires_grad for row in log_prob)
        pairs = enumerate(zip(log_prob, lengths, strict=True))
        wrong = [i for i, (row, n) in pairs if row.shape != (n,)]
        if wrong:
            raise ValueError(
                f"{name}: the log-probabilities at {key!r} do not have one value per "
                f"token in batch row(s) {wrong}: shapes "
                f"{[tuple(log_prob[i].shape) for i in wrong]} vs token lengths "
                f"{[lengths[i] for i in wrong]} at {action!r}. A shorter row would be "
                "padded with a finite value that silently enters the options. Known cause: "
                "log-probabilities from a wrapper with pad_output=True, padded to the "
                "longest row. Store one log-probability per token of each row, e.g. "
                "from a no-grad forward of TransformersWrapper(input_mode='tokens', "
                "generate=False, return_log_probs=True, pad_output=False)."
            )
    if requires_grad:
        raise RuntimeError(
            f"{name}: the log-probabilities at {key!r} require grad. They must be "
            "constants: compute them under torch.no_grad() or store them with .detach()."
        )


def _stacked_advantage(rows: list[torch.Tensor]) -> torch.Tensor | None:
    """Lazily stacked advantage rows as one tensor, left-padded with NaN; None if
    their shapes cannot be advantages."""
    if all(row.shape == (1, 1) and row.is_floating_point() for row in rows):
        return torch.stack(rows)
    if all(row.ndim >= 1 for row in rows):
        # Integer rows are cast before the NaN padding, which they cannot hold.
        dtype = torch.get_default_dtype()
        return _pad([r if r.is_floating_point() else r.to(dtype) for r in rows], math.nan)
    return None


def _read_advantage(advantage, size: int, width: int, options: Options) -> tuple:
    """The advantage ``[B, 1, 1]`` or ``[B, T, 1]``, left-aligned, and where it has a value."""
    name, key = options.owner, options.keys.advantage
    rows = advantage if isinstance(advantage, list) else None
    if rows is not None:
        advantage = _stacked_advantage(rows)
    if advantage is not None and advantage.requires_grad:
        raise RuntimeError(
            f"{name}: the advantage at {key!r} requires grad, so the loss would "
            "backpropagate into it. Advantages must be constants: compute them under "
            "torch.no_grad() or store them with .detach()."
        )
    if advantage is None or not (
        advantage.ndim == 3
        and advantage.shape[0] == size
        and advantage.shape[-1] == 1
        and advantage.shape[-2] <= width
    ):
        shape = advantage.shape if advantage is not None else [r.shape for r in rows]
        raise ValueError(
            f"{name}: advantage at {key!r} has shape {tuple(shape)}, expected "
            f"{(size, 1, 1)} (one value per sequence) or {(size, width, 1)} (one "
            f"value per token, aligned with {options.keys.action!r}; shorter rows "
            "are read as covering the last tokens). A [B] or [B, 1] advantage needs "
            "trailing singleton dimensions: advantage.reshape(-1, 1, 1)."
        )
    if not advantage.is_floating_point():
        advantage = advantage.to(torch.get_default_dtype())
    if advantage.shape[-2] == 1:
        return advantage, advantage.isfinite().reshape(size)
    if advantage.shape[-2] < width:  # rows shorter than the tokens end with them
        pad = advantage.new_full((size, width - advantage.shape[-2], 1), math.nan)
        advantage = torch.cat([pad, advantage], dim=-2)
    has_value = advantage.isfinite()
    return torch.where(has_value, advantage, 0.0), has_value.squeeze(-1)


def _read_scale(scale, size: int, options: Options) -> torch.Tensor | None:
    """The per-sequence scale of the global normalization, ``[B]``, or None."""
    if scale is None:
        return None
    name, key = options.owner, options.keys.sequence_scale
    if options.aggregation != "prompt_mean" or options.reduction == "none":
        raise ValueError(
            f"{name}: the batch holds a sequence scale at {key!r} (global "
            "normalization), which replaces the per-sequence mean of "
            f"aggregation='prompt_mean'; got aggregation={options.aggregation!r}, "
            f"reduction={options.reduction!r}. Use aggregation='prompt_mean'."
        )
    if isinstance(scale, list):
        scale = torch.stack([value.reshape(-1) for value in scale])
    if scale.numel() != size or scale.requires_grad:
        raise ValueError(
            f"{name}: the sequence scale at {key!r} has shape {tuple(scale.shape)}; "
            f"expected one constant value per row ({size} values), as "
            "set_sequence_scale writes it."
        )
    scale = scale.reshape(size)
    # its values (finite, >= 0) are checked with the scored values: one synchronization
    return scale if scale.is_floating_point() else scale.to(torch.get_default_dtype())


@torch.compiler.disable
def read_lag(tensordict: TensorDictBase, options: Options) -> torch.Tensor:
    """``[B]`` each row's policy lag: the trainer's version (``options.policy_version()``)
    minus the version that sampled the row.

    Outside ``torch.compile``'s graph: the trainer's version is a Python int that
    changes every update, which a compiled graph would take as a constant.
    """
    name, key = options.owner, options.keys.policy_version
    rows, size = _rows(tensordict), tensordict.batch_size[0]
    version = _read(tensordict, rows, key, options)
    if version is None:
        raise KeyError(
            f"{name}: policy_version is set, so the loss reports the policy lag, but the "
            f"batch has no {key!r}. Collect with LLMCollector(track_policy_version=True) "
            "(TorchRL's PolicyVersion writes it), point the loss at the key with "
            "loss.set_keys(policy_version=...), or leave policy_version unset."
        )
    values = version if isinstance(version, list) else [version]
    if not all(isinstance(v, torch.Tensor) and not v.is_floating_point() for v in values):
        raise TypeError(
            f"{name}: the policy versions at {key!r} are not integers "
            "(PolicyVersion(version_type='uuid') writes UUID strings); the lag needs "
            "integer versions: PolicyVersion(version_type='int'), TorchRL's default."
        )
    version = _one_per_row(version, size)
    if version is None:
        raise ValueError(
            f"{name}: the policy versions at {key!r} do not hold one integer per row "
            f"({size} rows), as PolicyVersion writes them; pass one version per row."
        )
    current = options.policy_version()
    if isinstance(current, bool) or not isinstance(current, int):
        raise TypeError(
            f"{name}: policy_version returned {current!r}; it must return the trainer's "
            "current version as an int."
        )
    return current - version


def _one_per_row(version, size: int) -> torch.Tensor | None:
    """``[B]`` from one value per row (repeated over a row's entries), else None."""
    if isinstance(version, list):
        if any(value.numel() == 0 for value in version):
            return None
        first = torch.stack([value.reshape(-1)[0] for value in version])
        counts = torch.tensor([value.numel() for value in version])
        flat = torch.cat([value.reshape(-1) for value in version])
        same = flat == first.repeat_interleave(counts)
    elif version.ndim and version.shape[0] == size and version.numel():
        flat = version.reshape(size, -1)
        first, same = flat[:, 0], flat == flat[:, :1]
    else:
        return None
    return first if bool(same.all()) else None


def _read_ref(tensordict: TensorDictBase, rows, options: Options) -> torch.Tensor | None:
    """The reference log-probabilities, read as GRPOLoss reads them, when needed."""
    if not (options.kl_to_ref_coeff is not None and options.kl_to_ref_coeff > 0):
        return None
    key = options.keys.ref_log_probs
    ref = _read(tensordict, rows, key, options)
    if ref is None:
        raise KeyError(
            f"Couldn't find the ref log-prob {key} in the input data "
            f"({tensordict.keys(True)=}). {options.owner} reads the reference "
            "policy's log-probabilities there for kl_to_ref_coeff; write them, or point "
            "the loss at their key with loss.set_keys(ref_log_probs=...)."
        )
    ref = _pad(ref, *options.ref_padding)
    return ref.squeeze(-1) if ref.ndim == 3 else ref


def _response_lengths(responses, options: Options, device: torch.device) -> torch.Tensor | None:
    """The sampled responses' lengths, where the "sft" response-mask check applies."""
    if responses is None or options.masking_strategy != "sft":
        return None
    responses = _complete(responses, RESPONSE_KEY, options.owner)
    if responses is None:
        return None
    return torch.tensor([r.shape[-1] for r in responses], device=device)
