# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The inputs of one loss call: read once, checked against the input rules.

The rules are written out once, in the documentation's "Inputs" page; the error
messages here name the key, the shape and the fix. Nothing here writes on a
tensordict.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from tensordict.utils import NestedKey

from torchrl_gspo import _arguments

if TYPE_CHECKING:
    from torchrl_gspo.gspo import GSPOLoss

RESPONSE_KEY = ("tokens", "response")
PROMPT_KEY, FULL_KEY = ("tokens", "prompt"), ("tokens", "full")


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
        scale: ``[B]`` sequence scale of the global normalisation, or ``None``.
        ref: ``[B, T]`` reference log-probabilities when ``kl_to_ref_coeff`` is set.
        response_lengths: ``[B]`` lengths of the sampled responses when the
            response-mask check applies, else ``None``.
        lag: ``[B]`` each row's policy lag, the trainer's version minus the one
            that sampled the row, when the loss reports it; else ``None``.
    """

    old: torch.Tensor
    rollout: torch.Tensor | None
    advantage: torch.Tensor
    has_value: torch.Tensor
    scale: torch.Tensor | None
    ref: torch.Tensor | None
    response_lengths: torch.Tensor | None
    lag: torch.Tensor | None


def _rows(tensordict: TensorDictBase) -> list[TensorDictBase] | None:
    """The rows of a batch lazily stacked along dim 0, else None."""
    if isinstance(tensordict, LazyStackedTensorDict) and tensordict.stack_dim == 0:
        return tensordict.tensordicts
    return None


def _read_rows(rows: list[TensorDictBase], key: NestedKey, owner: str) -> list[torch.Tensor] | None:
    """One tensor per row, or None when no row holds ``key``; some rows only raise."""
    values = [_get(row, key) for row in rows]
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


def _read(tensordict: TensorDictBase, rows, key: NestedKey, loss: GSPOLoss):
    """A dense tensor, a list of row tensors (lazy stack), or None when absent."""
    if rows is None:
        return _get(tensordict, key)
    return _read_rows(rows, key, type(loss).__name__)


def _get(tensordict: TensorDictBase, key: NestedKey) -> torch.Tensor | None:
    """``tensordict[key]``, or None when absent.

    Tested by membership, not ``get(key, None)``: under ``torch.compile`` a graph traced
    without the key is guarded by ``in`` (not by ``get``'s default), so a batch that
    holds it, with as many keys, recompiles instead of reusing a graph that ignores it.
    """
    return tensordict.get(key) if key in tensordict.keys(include_nested=True) else None


def _pad(values, value: float, side: str = "left") -> torch.Tensor:
    """Row tensors padded into one (on ``side``); a dense tensor as it is."""
    if isinstance(values, torch.Tensor):
        return values
    return torch.nn.utils.rnn.pad_sequence(
        values, batch_first=True, padding_value=value, padding_side=side
    )


def read_batch(tensordict: TensorDictBase, loss: GSPOLoss) -> Batch:
    """Reads every input of ``loss`` from ``tensordict`` once, dense or lazily stacked.

    Args:
        tensordict (TensorDictBase): the batch; never modified.
        loss (GSPOLoss): the loss, for its keys and options.

    Returns:
        Batch: the inputs. Missing keys, wrong shapes and constants that require
        grad raise; the value rules that need the current policy are
        :func:`check_scored`'s.
    """
    name, keys = type(loss).__name__, loss.tensor_keys
    if tensordict.batch_dims != 1:
        raise ValueError(
            f"{name}: the batch has shape {tuple(tensordict.batch_size)}; the loss "
            "expects one batch dimension, [B, T]. Flatten the batch first, e.g. "
            "tensordict.reshape(-1)."
        )
    rows = _rows(tensordict)
    tokens, advantage, sample = _required(tensordict, rows, loss)
    if rows is not None and loss.response_mask_check != "ignore":
        _, error = stripped_context(rows, name, getattr(loss.actor_network, "tokenizer", None))
        if error is not None and loss.response_mask_check == "raise":
            raise error
        if error is not None:
            _arguments.warn(str(error))
    size = tensordict.batch_size[0]
    if size == 0:
        raise ValueError(
            f"{name}: the batch is empty (batch size 0), so there is no sequence to "
            "optimise: skip the optimisation step. (Rows with no response token are "
            "fine: they contribute 0 to the loss.)"
        )
    lengths = _token_lengths(tokens, rows is not None, loss)
    _check_log_probs(keys.sample_log_prob, sample, tokens, lengths, loss)
    old = None
    if keys.old_log_prob != keys.sample_log_prob:
        old = _read(tensordict, rows, keys.old_log_prob, loss)
    if old is not None:
        _check_log_probs(keys.old_log_prob, old, tokens, lengths, loss)
    elif loss.rollout_correction is not None:
        raise KeyError(
            f"{name}: rollout_correction={loss.rollout_correction!r} needs the "
            f"trainer's recomputed old log-probabilities at {keys.old_log_prob!r}, "
            "which are missing. Write them before the batch is stored, e.g. with "
            "RecomputeOldLogProbs(policy) as the collector's postproc, or point the "
            "loss at their key with loss.set_keys(old_log_prob=...)."
        )
    width = tokens.shape[-1] if lengths is None else max(lengths)
    advantage, has_value = _read_advantage(advantage, size, width, loss)
    sample = _pad(sample, 0.0)
    return Batch(
        old=sample if old is None else _pad(old, 0.0),
        rollout=None if old is None else sample,
        advantage=advantage,
        has_value=has_value,
        scale=_read_scale(_read(tensordict, rows, keys.sequence_scale, loss), size, loss),
        ref=_read_ref(tensordict, rows, loss),
        response_lengths=_response_lengths(rows, loss, sample.device),
        lag=None if loss.policy_version is None else _read_lag(tensordict, rows, size, loss),
    )


def _required(tensordict: TensorDictBase, rows, loss: GSPOLoss) -> tuple:
    """Tokens, advantage and log-probs; a missing one raises GRPOLoss' exception type."""
    name, keys = type(loss).__name__, loss.tensor_keys
    tokens = _read(tensordict, rows, keys.action, loss)
    if tokens is None:
        raise ValueError(
            f"Action key {keys.action} not in tensordict. {name} reads the sampled "
            "tokens there; write them, or point the loss at their key with "
            "loss.set_keys(action=...)."
        )
    advantage = _read(tensordict, rows, keys.advantage, loss)
    if advantage is None:
        raise ValueError(
            f"Advantage key {keys.advantage} not in tensordict. {name} reads one "
            "advantage per sequence there (e.g. from MCAdvantage); write it, or point "
            "the loss at its key with loss.set_keys(advantage=...)."
        )
    sample = _read(tensordict, rows, keys.sample_log_prob, loss)
    if sample is None:
        raise KeyError(
            f"Couldn't find the log-prob {keys.sample_log_prob} in the input data. "
            f"{name} reads the old (sampling) log-probabilities there, one per token; "
            "write them, or point the loss at their key with "
            "loss.set_keys(sample_log_prob=...)."
        )
    return tokens, advantage, sample


def _token_lengths(tokens, lazy: bool, loss: GSPOLoss) -> list[int] | None:
    """Each row's token count (lazy stacks; None for dense batches), or an error."""
    shape = [row.shape for row in tokens] if lazy else tokens.shape
    if not lazy and tokens.ndim == 2:
        return None
    if lazy and all(len(row) == 1 for row in shape):
        return [row[0] for row in shape]
    raise ValueError(
        f"{type(loss).__name__}: the tokens at {loss.tensor_keys.action!r} have shape "
        f"{tuple(shape)}; the loss expects one batch dimension, [B, T]. Flatten the "
        "batch first, e.g. tensordict.reshape(-1)."
    )


def _check_log_probs(key: NestedKey, log_prob, tokens, lengths, loss: GSPOLoss) -> None:
    """Log-probabilities are constants with one value per token of each row."""
    name, action = type(loss).__name__, loss.tensor_keys.action
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
                "padded with a finite value that silently enters the loss. Known cause: "
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


def _read_advantage(advantage, size: int, width: int, loss: GSPOLoss) -> tuple:
    """The advantage ``[B, 1, 1]`` or ``[B, T, 1]``, left-aligned, and where it has a value."""
    name, key = type(loss).__name__, loss.tensor_keys.advantage
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
            f"value per token, aligned with {loss.tensor_keys.action!r}; shorter rows "
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


def _read_scale(scale, size: int, loss: GSPOLoss) -> torch.Tensor | None:
    """The per-sequence scale of the global normalisation, ``[B]``, or None."""
    if scale is None:
        return None
    name, key = type(loss).__name__, loss.tensor_keys.sequence_scale
    if loss.aggregation != "prompt_mean" or loss.reduction == "none":
        raise ValueError(
            f"{name}: the batch holds a sequence scale at {key!r} (global "
            "normalisation), which replaces the per-sequence mean of "
            f"aggregation='prompt_mean'; got aggregation={loss.aggregation!r}, "
            f"reduction={loss.reduction!r}. Use aggregation='prompt_mean'."
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
    # its values (finite, >= 0) are checked with the scored values: one synchronisation
    return scale if scale.is_floating_point() else scale.to(torch.get_default_dtype())


@torch.compiler.disable
def _read_lag(tensordict: TensorDictBase, rows, size: int, loss: GSPOLoss) -> torch.Tensor:
    """``[B]`` the trainer's version (``loss.policy_version()``) minus each row's.

    Outside ``torch.compile``'s graph: the trainer's version is a Python int that
    changes every update, which a compiled graph would take as a constant.
    """
    name, key = type(loss).__name__, loss.tensor_keys.policy_version
    version = _read(tensordict, rows, key, loss)
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
    current = loss.policy_version()
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


def _read_ref(tensordict: TensorDictBase, rows, loss: GSPOLoss) -> torch.Tensor | None:
    """The reference log-probabilities, read as GRPOLoss reads them, when needed."""
    if not (loss.kl_to_ref_coeff is not None and loss.kl_to_ref_coeff > 0):
        return None
    key = loss.tensor_keys.ref_log_probs
    ref = _read(tensordict, rows, key, loss)
    if ref is None:
        raise KeyError(
            f"Couldn't find the ref log-prob {key} in the input data "
            f"({tensordict.keys(True)=}). {type(loss).__name__} reads the reference "
            "policy's log-probabilities there for kl_to_ref_coeff; write them, or point "
            "the loss at their key with loss.set_keys(ref_log_probs=...)."
        )
    ref = _pad(ref, loss.ref_log_prob_padding_value, loss.ref_log_prob_padding_side)
    return ref.squeeze(-1) if ref.ndim == 3 else ref


def stripped_context(
    rows: list[TensorDictBase], owner: str, tokenizer=None
) -> tuple[list[int], ValueError | None]:
    """Rows whose sequence is not their prompt followed by their response.

    TorchRL's ``Tokens`` hold ``full = prompt + response``. A row whose ``full`` is
    shorter lost tokens after sampling: TorchRL's wrappers strip pad ids, so a
    tokenizer whose pad token is its end of turn deletes every end of turn, the
    prompt's and the sampled one. The loss would then score another context than the
    one that was sampled.

    Args:
        rows (list[TensorDictBase]): the rows of a lazily stacked batch.
        owner (str): the name the error starts with.
        tokenizer: the actor's tokenizer, to name pad = eos in the error, or ``None``.

    Returns:
        tuple[list[int], ValueError | None]: the bad rows and the error naming them
        (``None`` when every row holds the three keys consistently or none of them).
    """
    keys = (PROMPT_KEY, RESPONSE_KEY, FULL_KEY)
    tokens = [[_get(row, key) for key in keys] for row in rows]
    lengths = [[t.shape[-1] for t in row] for row in tokens if all(t is not None for t in row)]
    if len(lengths) != len(rows):
        return [], None
    bad = [i for i, (prompt, response, full) in enumerate(lengths) if prompt + response != full]
    if not bad:
        return [], None
    pad = getattr(tokenizer, "pad_token_id", None)
    cause = "a pad token equal to the end-of-turn token"
    if pad is not None and pad == getattr(tokenizer, "eos_token_id", None):
        cause = f"this actor's tokenizer: its pad token is its end of turn (id {pad})"
    found = [lengths[i] for i in bad]
    return bad, ValueError(
        f"{owner}: the tokens at {FULL_KEY!r} are not the prompt at {PROMPT_KEY!r} "
        f"followed by the response at {RESPONSE_KEY!r} in batch row(s) {bad}: "
        f"{[full for _, _, full in found]} tokens vs "
        f"{[prompt + response for prompt, response, _ in found]} (prompt + response). "
        "Tokens were stripped after sampling, so the loss would score a context that "
        f"was not sampled. Known cause: {cause}; TorchRL strips pad ids from the "
        "sampled tokens, every end of turn included. Fix: give the tokenizer a pad "
        "token distinct from its end of turn (e.g. tokenizer.pad_token = "
        "'<|endoftext|>'), set it as the model's generation_config.pad_token_id, and "
        "ban it in generation (bad_words_ids). Pass response_mask_check='warn' or "
        "'ignore' to override."
    )


def _response_lengths(rows, loss: GSPOLoss, device: torch.device) -> torch.Tensor | None:
    """The sampled responses' lengths, where the "sft" response-mask check applies."""
    if rows is None or loss.masking_strategy != "sft" or loss.response_mask_check == "ignore":
        return None
    responses = _read_rows(rows, RESPONSE_KEY, type(loss).__name__)
    if responses is None:
        return None
    return torch.tensor([r.shape[-1] for r in responses], device=device)


class Scores(NamedTuple):
    """A batch scored by the current policy: what an objective reads.

    Every ``[B, T]`` tensor is 0 outside ``mask`` and has the accumulation dtype
    (``float32`` for half-precision log-probabilities).

    Attributes:
        current: ``[B, T]`` :math:`\\log\\pi_\\theta`, with gradient.
        old: ``[B, T]`` :math:`\\log\\pi_\\text{old}`.
        rollout: ``[B, T]`` :math:`\\log\\pi_\\text{roll}` (``old`` unless the old
            log-probabilities were recomputed).
        mask: ``[B, T]`` the loss mask.
        lengths: ``[B]`` :math:`|y_i|`, the valid tokens of each sequence.
        token_log_ratio: ``[B, T]`` ``current - old``, the token log-ratios.
        log_ratio: ``[B]`` :math:`\\log s_i`, the mean of ``token_log_ratio`` over each
            sequence's valid tokens.
        advantage: ``[B, 1, 1]`` (one per sequence) or ``[B, T, 1]`` (per token,
            :class:`GSPOTokenLoss`).
    """

    current: torch.Tensor
    old: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    token_log_ratio: torch.Tensor
    log_ratio: torch.Tensor
    advantage: torch.Tensor


def loss_mask(
    loss: GSPOLoss, batch: Batch, current: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid tokens with finite old (and rollout) log-probs, and the loss mask.

    Args:
        loss (GSPOLoss): the loss, for its keys and masking strategy.
        batch (Batch): the call's inputs.
        current (torch.Tensor): ``[B, T]`` the actor's log-probabilities.
        valid (torch.Tensor): ``[B, T]`` the actor's mask (``dist.mask``).
    """
    if current.shape != batch.old.shape:
        keys = loss.tensor_keys
        old_key = keys.sample_log_prob if batch.rollout is None else keys.old_log_prob
        raise ValueError(
            f"Shape mismatch detected in {type(loss).__name__}: current log-prob shape "
            f"{current.shape} != previous log-prob shape {batch.old.shape} (read at "
            f"{old_key!r}). The actor must score the tokens at "
            f"{keys.action!r}, one log-probability each; check that the masking strategy "
            f"(masking_strategy={loss.masking_strategy!r}) matches the data."
        )
    kept = valid & batch.old.isfinite()
    if batch.rollout is not None:
        kept = kept & batch.rollout.isfinite()
    if loss.masking_strategy == "generic":  # a row's first token has no context
        return kept, kept & (valid.cumsum(-1) != 1)
    return kept, kept


def score(
    batch: Batch,
    current: torch.Tensor,
    mask: torch.Tensor,
    dtype: torch.dtype,
    advantage_level: str,
) -> tuple[Scores, torch.Tensor | None]:
    """The batch scored by the current policy, in the accumulation ``dtype``.

    Args:
        batch (Batch): the call's inputs.
        current (torch.Tensor): ``[B, T]`` the actor's log-probabilities.
        mask (torch.Tensor): ``[B, T]`` the loss mask.
        dtype (torch.dtype): the accumulation dtype.
        advantage_level (str): ``"sequence"`` to read per-token advantages as one
            per sequence.

    Returns:
        The scores, and the rows whose per-token advantages vary (``None`` unless
        they were read as one per sequence).
    """
    current = torch.where(mask, current.to(dtype), 0.0)
    old = torch.where(mask, batch.old.to(dtype), 0.0)
    rollout = old
    if batch.rollout is not None:
        rollout = torch.where(mask, batch.rollout.to(dtype), 0.0)
    lengths = mask.sum(-1)
    token_log_ratio = current - old
    log_ratio = token_log_ratio.sum(-1) / lengths.clamp_min(1).to(dtype)
    advantage, varies = batch.advantage, None
    if advantage_level == "sequence" and advantage.shape[-2] > 1:
        advantage, varies = sequence_advantage(advantage, mask)
    scores = Scores(current, old, rollout, mask, lengths, token_log_ratio, log_ratio, advantage)
    return scores, varies


def loss_weight(batch: Batch, correction: torch.Tensor | None) -> torch.Tensor | None:
    """The weight of the loss terms: the rollout correction's times the global scale.

    Args:
        batch (Batch): the call's inputs, for the scale :math:`c_i`.
        correction (torch.Tensor | None): ``[B]`` per sequence or ``[B, T]`` per
            token (:attr:`RolloutTerms.loss_weight`), or ``None``.

    Returns:
        ``[B]`` or ``[B, T]``, ``None`` when neither applies. The scale is multiplied
        by :math:`B`: ``prompt_mean``'s mean over the rows then gives
        :math:`\\sum_i c_i \\ell_i`.
    """
    if batch.scale is None:
        return correction
    scale = batch.scale * batch.scale.shape[0]
    return scale if correction is None else times(correction, scale.to(correction.dtype))


def off_policy_keep(scores: Scores, threshold: float) -> torch.Tensor:
    """Off-policy sequence masking: which terms stay (DeepSeek-V3.2, Eq. 9).

    A term is dropped when its advantage is negative and its response's mean
    :math:`\\log\\pi_\\text{roll} - \\log\\pi_\\theta` (detached) exceeds ``threshold``.

    Returns:
        ``[B]`` for one advantage per sequence, ``[B, T]`` for per-token advantages.
    """
    drift = (scores.rollout - scores.current.detach()).sum(-1)
    far = drift / scores.lengths.clamp_min(1).to(drift.dtype) > threshold
    advantage = scores.advantage.squeeze(-1)  # [B, 1] or [B, T]
    keep = (advantage >= 0) | far.unsqueeze(-1).logical_not()
    return keep.squeeze(-1) if keep.shape[-1] == 1 else keep


def times(weight: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``weight`` times ``keep``, each per sequence ``[B]`` or per token ``[B, T]``."""
    if weight.ndim < keep.ndim:
        weight = weight.unsqueeze(-1)
    elif keep.ndim < weight.ndim:
        keep = keep.unsqueeze(-1)
    return weight * keep


def dropped_tokens(scores: Scores, keep: torch.Tensor) -> torch.Tensor:
    """``[B]`` the valid tokens whose terms ``keep`` drops."""
    if keep.ndim == 1:
        return torch.where(keep, 0, scores.lengths)
    return (scores.mask & ~keep).sum(-1)


def sequence_advantage(advantage: torch.Tensor, mask: torch.Tensor) -> tuple:
    """One advantage per sequence from per-token ones, and the rows where they vary.

    Args:
        advantage (torch.Tensor): ``[B, T, 1]`` per-token advantages.
        mask (torch.Tensor): ``[B, T]`` loss mask.

    Returns:
        ``([B, 1, 1]`` the value on each row's valid tokens (0 on empty rows),
        ``[B]`` whether it varies across them).
    """
    advantage = advantage.squeeze(-1)
    inf = torch.finfo(advantage.dtype).max
    high = torch.where(mask, advantage, -inf).amax(-1)
    low = torch.where(mask, advantage, inf).amin(-1)
    nonempty = mask.any(-1)
    value = torch.where(nonempty, high, 0.0).reshape(-1, 1, 1)
    return value, nonempty & (high != low)


def check_scored(
    loss: GSPOLoss,
    batch: Batch,
    *,
    valid: torch.Tensor,
    kept: torch.Tensor,
    mask: torch.Tensor,
    log_ratio: torch.Tensor,
    current: torch.Tensor,
    varies: torch.Tensor | None,
) -> None:
    """The rules on scored values, as one flag per row and one synchronisation.

    In eager mode a broken rule raises an error that names the key, the rows and
    the fix; under ``torch.compile`` the flags are checked in-graph with
    ``torch._assert_async``. A response-mask mismatch warns instead with
    ``response_mask_check="warn"``.

    Args:
        loss (GSPOLoss): the loss, for its keys and options.
        batch (Batch): the call's inputs.

    Keyword Args:
        valid (torch.Tensor): ``[B, T]`` the actor's mask (``dist.mask``).
        kept (torch.Tensor): ``[B, T]`` valid tokens with finite old (and rollout)
            log-probabilities.
        mask (torch.Tensor): ``[B, T]`` the loss mask.
        log_ratio (torch.Tensor): ``[B]`` the sequence log-ratios.
        current (torch.Tensor): ``[B, T]`` the actor's log-probabilities.
        varies (torch.Tensor | None): ``[B]`` rows whose per-token advantages vary,
            for a loss with one advantage per sequence; else ``None``.
    """
    lengths = mask.sum(-1)
    if loss.masking_strategy == "sft":  # the mask is then the kept valid tokens
        ok = valid.sum(-1) == lengths
    else:  # non-finite values are legitimate before a row's first kept token only
        ok = ~(valid & ~kept & (kept.cumsum(-1) > 0)).any(-1)
    ok = ok & (log_ratio < math.inf)  # False for NaN and +inf
    if batch.has_value.ndim == 1:  # one advantage per sequence: finite on every row
        ok = ok & batch.has_value
    else:
        ok = ok & ~(mask & ~batch.has_value).any(-1)
    if varies is not None:
        ok = ok & ~varies
    if batch.scale is not None:
        ok = ok & batch.scale.isfinite() & (batch.scale >= 0)
    response = None
    if batch.response_lengths is not None:
        response = lengths != batch.response_lengths
        if loss.response_mask_check == "raise":
            ok = ok & ~response
    if torch.compiler.is_compiling():
        # No data-dependent branch (a graph break) under torch.compile: check in-graph;
        # the eager path below gives the detailed message.
        torch._assert_async(
            ok.all(),
            f"{type(loss).__name__}: invalid input (non-finite old or rollout "
            "log-probabilities on response tokens, NaN current log-probabilities, "
            "advantages that are missing, not finite or varying within a sequence, or a "
            "sequence scale that is not finite and >= 0); run the loss eagerly for the "
            "details.",
        )
        return
    if not ok.all():
        _raise_bad_log_probs(loss, batch, valid, kept, mask, current)
        _raise_bad_advantage(loss, batch, mask, varies)
        _raise_bad_scale(loss, batch)
        _raise_response_mismatch(loss, lengths, batch.response_lengths, response)
        rows = (~ok).nonzero().squeeze(-1).tolist()
        raise ValueError(
            f"{type(loss).__name__}: the sequence log-ratio is not finite in batch row(s) "
            f"{rows} although every log-probability is: the current minus the old "
            "log-probabilities overflow. Check the old log-probabilities at "
            f"{loss.tensor_keys.sample_log_prob!r} (and {loss.tensor_keys.old_log_prob!r})."
        )
    if response is not None and loss.response_mask_check == "warn" and response.any():
        _raise_response_mismatch(loss, lengths, batch.response_lengths, response)


def _where(bad: torch.Tensor) -> str:
    rows = bad.any(-1).nonzero().squeeze(-1).tolist()
    return f"{int(bad.sum())} valid token(s), in batch row(s) {rows}"


def _raise_bad_log_probs(
    loss: GSPOLoss,
    batch: Batch,
    valid: torch.Tensor,
    kept: torch.Tensor,
    mask: torch.Tensor,
    current: torch.Tensor,
) -> None:
    """Raises the detailed error of a broken log-probability rule, if any."""
    name, keys, strategy = type(loss).__name__, loss.tensor_keys, loss.masking_strategy
    base = valid & batch.old.isfinite()
    bad_old, bad_rollout = valid & ~base, valid & ~kept & base
    if strategy != "sft":
        after_first = kept.cumsum(-1) > 0
        bad_old, bad_rollout = bad_old & after_first, bad_rollout & after_first
    decoupled = batch.rollout is not None
    for bad, key, role in (
        (bad_old, keys.old_log_prob if decoupled else keys.sample_log_prob, "old"),
        (bad_rollout, keys.sample_log_prob, "rollout"),
    ):
        if bad.any():
            raise ValueError(
                f"{name}: the {role} log-probabilities at {key!r} are NaN or infinite on "
                f"{_where(bad)} of the loss mask (masking_strategy={strategy!r}). "
                "Non-finite log-probabilities are accepted only on the prompt, where "
                "vLLM writes NaN: before the first finite value of a row, and outside "
                "the 'sft' mask. Store a finite log-probability for every response token."
            )
    bad_current = mask & (current.isnan() | (current == math.inf))
    if bad_current.any():
        raise ValueError(
            f"{name}: the actor returned NaN or +inf log-probabilities on "
            f"{_where(bad_current)}. Log-probabilities are at most 0; check the model's "
            "logits (e.g. for overflow in half precision)."
        )


def _raise_bad_advantage(
    loss: GSPOLoss, batch: Batch, mask: torch.Tensor, varies: torch.Tensor | None
) -> None:
    """Raises the detailed error of a broken advantage rule, if any."""
    name, key = type(loss).__name__, loss.tensor_keys.advantage
    if batch.has_value.ndim == 1:
        rows = (~batch.has_value).nonzero().squeeze(-1).tolist()
        if rows:
            raise ValueError(
                f"{name}: the advantage at {key!r} is NaN or infinite in batch row(s) "
                f"{rows}. Every sequence needs a finite advantage (GRPO-style group "
                "advantages are finite: check the reward and the group statistics)."
            )
        return
    uncovered = mask & ~batch.has_value
    if uncovered.any():
        raise ValueError(
            f"{name}: the advantage at {key!r} is NaN, infinite or padding at "
            f"{_where(uncovered)}. Every token of the loss mask needs a finite "
            "advantage; ragged rows are read left-padded, aligned with the end of the "
            "tokens."
        )
    if varies is not None and varies.any():
        raise ValueError(
            f"{name}: the advantage at {key!r} varies across the valid tokens of batch "
            f"row(s) {varies.nonzero().squeeze(-1).tolist()}. GSPO needs one "
            "advantage per sequence; for per-token advantages use GSPOTokenLoss "
            "(GSPO-token, paper section 4.3)."
        )


def _raise_bad_scale(loss: GSPOLoss, batch: Batch) -> None:
    scale = batch.scale
    if scale is not None and not (scale.isfinite() & (scale >= 0)).all():
        raise ValueError(
            f"{type(loss).__name__}: the sequence scale at "
            f"{loss.tensor_keys.sequence_scale!r} must be finite and >= 0, got "
            f"{scale.tolist()}."
        )


def _raise_response_mismatch(
    loss: GSPOLoss,
    lengths: torch.Tensor,
    expected: torch.Tensor | None,
    wrong: torch.Tensor | None,
) -> None:
    if wrong is None or not wrong.any():
        return
    rows = wrong.nonzero().squeeze(-1).tolist()
    message = (
        f"{type(loss).__name__}: the 'sft' loss mask does not match the sampled "
        f"responses at {RESPONSE_KEY!r} in batch row(s) {rows}: valid tokens "
        f"{lengths[wrong].tolist()} vs response lengths {expected[wrong].tolist()}. "
        "GSPO divides each sequence log-ratio by this count, so those ratios are "
        "wrong. Known cause: a training wrapper with pad_output=True on ragged rows. "
        "Working configuration: TransformersWrapper(input_mode='tokens', "
        "generate=False, return_log_probs=True, pad_output=False) on lazily stacked "
        "data. Pass response_mask_check='warn' or 'ignore' to override."
    )
    if loss.response_mask_check == "raise":
        raise ValueError(message)
    _arguments.warn(message)
