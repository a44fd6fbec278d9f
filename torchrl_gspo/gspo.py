# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Group Sequence Policy Optimization (GSPO) losses for TorchRL's LLM stack."""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from torch import distributions as d
from torchrl.modules.llm import LLMWrapperBase
from torchrl.objectives.llm.grpo import GRPOLoss, LLMLossOutput

__all__ = ["GSPOLoss", "GSPOLossOutput", "GSPOTokenLoss", "GSPOTokenLossOutput"]

# Private key, set on the loss' own shallow copy of the input: True where the
# (left-aligned) advantage holds a value, False where it is padding or NaN.
_ADVANTAGE_HAS_VALUE = "_gspo_advantage_has_value"
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_AGGREGATIONS = ("prompt_mean", "token_mean", "none")
_RESPONSE_KEY = ("tokens", "response")
# Clip ranges above this are GRPO-scale: sequence-level clipping barely ever binds.
_LARGE_EPSILON = 0.01
_RESPONSE_MASK_CHECKS = ("raise", "warn", "ignore")


class GSPOLossOutput(LLMLossOutput):
    clip_fraction_low: torch.Tensor | None = None
    clip_fraction_high: torch.Tensor | None = None
    sequence_clip_fraction: torch.Tensor | None = None
    sequence_log_ratio: torch.Tensor | None = None
    sequence_log_ratio_max_abs: torch.Tensor | None = None


# Building a tensorclass replaces the class docstring with the generated signature;
# set it afterwards so that help() and the API docs show it.
GSPOLossOutput.__doc__ = """GSPO loss output.

The fields inherited from :class:`~torchrl.objectives.llm.LLMLossOutput` keep
their names, but ``clip_fraction`` and ``ESS`` are computed at the sequence
level (see :class:`GSPOLoss`). All diagnostics are detached 0-dim tensors; none
of their names starts with ``loss_``, so trainers that sum the ``loss_*``
entries do not pick them up.

Attributes:
    clip_fraction_low (torch.Tensor): fraction of valid response tokens whose
        sequence ratio lies below ``1 - eps_low``.
    clip_fraction_high (torch.Tensor): fraction of valid response tokens whose
        sequence ratio lies above ``1 + eps_high``.
        ``clip_fraction == clip_fraction_low + clip_fraction_high``.
    sequence_clip_fraction (torch.Tensor): fraction of non-empty sequences whose
        ratio lies outside ``[1 - eps_low, 1 + eps_high]`` (every sequence
        weighted equally).
    sequence_log_ratio (torch.Tensor): mean of the sequence log-ratios
        :math:`\\log s_i` over non-empty sequences (0 on-policy).
    sequence_log_ratio_max_abs (torch.Tensor): largest :math:`|\\log s_i|` over
        non-empty sequences.

Examples:
    >>> import torch
    >>> from torchrl_gspo import GSPOLossOutput
    >>> out = GSPOLossOutput(loss_objective=torch.tensor(-0.3), clip_fraction=torch.tensor(0.2),
    ...     kl_approx=torch.tensor(0.0), ESS=torch.tensor(0.98), batch_size=[])
    >>> total = sum(v for k, v in out.items() if k.startswith("loss_"))  # what trainers do
    >>> float(total)
    -0.30000001192092896
"""


class GSPOLoss(GRPOLoss):
    r"""GSPO loss: GRPO's clipped objective on a length-normalised sequence ratio.

    Group Sequence Policy Optimization (Zheng et al., Qwen, 2025,
    `arXiv:2507.18071 <https://arxiv.org/abs/2507.18071>`_) replaces GRPO's
    per-token importance ratio by one ratio per response :math:`y_i`, the
    geometric mean of its token ratios (Eq. 7):

    .. math::

        s_i(\theta) = \exp\Big(\frac{1}{|y_i|} \sum_{t=1}^{|y_i|}
            \log \frac{\pi_\theta(y_{i,t} \mid x, y_{i,<t})}
                      {\pi_{\theta_\text{old}}(y_{i,t} \mid x, y_{i,<t})}\Big),

    and maximises (Eq. 5)

    .. math::

        J(\theta) = \mathbb{E}\Big[\frac{1}{G} \sum_{i=1}^{G}
            \min\big(s_i A_i,\ \text{clip}(s_i, 1 - \epsilon_\text{low},
            1 + \epsilon_\text{high}) A_i\big)\Big],

    whose unclipped gradient weights every token of a response equally:
    :math:`s_i A_i \frac{1}{|y_i|} \sum_t \nabla_\theta \log \pi_\theta(y_{i,t})`
    (Eq. 10). :math:`|y_i|` counts the valid (unmasked) tokens, clamped to at
    least 1; the masked-mean form of the ratio follows Hugging Face TRL's
    ``importance_sampling_level="sequence"`` (Apache-2.0).

    Only :meth:`_log_weight` differs from :class:`~torchrl.objectives.llm.GRPOLoss`:
    it reduces the masked token log-ratios to :math:`\log s_i` and broadcasts that
    value over the valid tokens of the sequence (0 on masked positions), so the
    clipped surrogate, the masking strategies, the entropy bonus and the KL terms
    are GRPO's own. With ``aggregation="prompt_mean"`` (per-sequence mean, then
    mean over sequences) this is exactly Eq. 5.

    Numerical care:

    - The sequence reduction accumulates in ``float32`` when log-probabilities are
      ``float16``/``bfloat16`` (``float64`` stays ``float64``), and the returned
      log-weight keeps that dtype; a warning is issued once per loss, because
      half-precision log-probabilities carry rounding noise of the order of the
      clip range (bfloat16's spacing near 1.0 is :math:`2^{-7}`).
    - Before exponentiation the sequence log-ratio is clamped from above at
      ``max_log_ratio`` so that a runaway sequence gives a finite loss and
      gradient (the clamped sequence then has no gradient, as in verl).
    - Old log-probabilities that are NaN (vLLM pads prompt positions with NaN)
      are excluded from the mask by :class:`~torchrl.objectives.llm.GRPOLoss`; an
      empty (all-padding) sequence contributes 0 to the loss.

    Advantages must be one value per sequence: ``[B, 1, 1]``, a dense
    ``[B, T, 1]`` aligned with the (left-padded) log-probabilities, or lazily
    stacked rows of different lengths as :class:`~torchrl.objectives.llm.MCAdvantage`
    writes them, which are read left-padded so that they line up with the tokens
    they belong to. Advantages that vary across the valid tokens of a sequence
    raise a :class:`ValueError`: use :class:`~torchrl_gspo.GSPOTokenLoss` for
    per-token advantages.

    Diagnostics (see :class:`GSPOLossOutput`): ``clip_fraction`` is the fraction of
    valid response tokens whose *sequence* ratio lies outside
    :math:`[1 - \epsilon_\text{low}, 1 + \epsilon_\text{high}]` (padding excluded),
    i.e. the length-weighted fraction of clipped sequences; ``ESS`` is the
    effective sample size of the sequence weights,
    :math:`(\sum_i s_i)^2 / (N \sum_i s_i^2)` over the :math:`N` non-empty
    sequences, 1.0 when all weights are equal. Expect GSPO to clip a far larger
    fraction of tokens than GRPO (the paper reports about two orders of
    magnitude) while training well. When ``kl_mask_threshold`` is set, the
    diagnostics describe the sequence ratios before that token filter.

    Args:
        actor_network (LLMWrapperBase): the policy, e.g. a
            :class:`~torchrl.modules.llm.TransformersWrapper` with
            ``generate=False`` and ``return_log_probs=True``.

    Keyword Args:
        clip_epsilon (float | tuple[float, float], optional): clip range of the
            sequence ratio, symmetric or ``(eps_low, eps_high)``. Defaults to the
            paper's ``(3e-4, 4e-4)`` (§5.1). A range above 0.01 (GRPO's 0.2, say)
            warns: it would make sequence-level clipping practically a no-op.
        aggregation (Literal["prompt_mean", "token_mean", "none"], optional): loss
            aggregation. ``"prompt_mean"`` (mean over the tokens of each sequence,
            then over sequences) is the paper's objective and returns a 0-dim
            ``loss_objective``. ``"token_mean"`` (global token mean) weights each
            sequence by its length, which is not GSPO's objective: it works but
            warns. ``"none"`` returns per-token losses. ``None`` means the
            default, as in :class:`~torchrl.objectives.llm.GRPOLoss`. Defaults to
            ``"prompt_mean"``.
        max_log_ratio (float | None, optional): upper clamp applied to the
            sequence log-ratio before exponentiation, ``None`` to disable.
            Defaults to ``10.0``.
        response_mask_check (Literal["raise", "warn", "ignore"], optional): with
            ``masking_strategy="sft"`` and a lazily stacked batch that carries the
            sampled responses at ``("tokens", "response")``, each row's number of
            valid tokens must equal its response length, since :math:`|y_i|`
            divides every sequence log-ratio. A mismatch (e.g. a training wrapper
            with ``pad_output=True`` on ragged rows, which counts prompt tokens of
            the shorter rows as response) raises, warns or is ignored. Multi-turn
            strategies (``"rlhf"``, ``"generic"``) are not checked. Defaults to
            ``"raise"``.
        **kwargs: every other keyword argument of
            :class:`~torchrl.objectives.llm.GRPOLoss` (``entropy_bonus``,
            ``entropy_coeff``, ``kl_to_ref_coeff``, ``kl_to_inference_coeff``,
            ``kl_mask_threshold``, ``masking_strategy``, ...), unchanged.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from torchrl_gspo import GSPOLoss
        >>> _ = torch.manual_seed(0)
        >>> # a tiny random-init causal LM and a word-level tokenizer, built in code
        >>> vocab = {f"t{i}": i for i in range(32)}
        >>> tokenizer = PreTrainedTokenizerFast(
        ...     tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t2")),
        ...     pad_token="t0", eos_token="t1")
        >>> config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        >>> policy = TransformersWrapper(Qwen2ForCausalLM(config).eval(), tokenizer=tokenizer,
        ...     input_mode="tokens", generate=False, return_log_probs=True, pad_output=False)
        >>> # two ragged (prompt, response) pairs, lazily stacked, one advantage each
        >>> pairs = [([5, 6, 7], [8, 9, 1]), ([5, 6], [10, 11, 12, 13, 1])]
        >>> data = lazy_stack([
        ...     TensorDict(tokens=TensorDict(prompt=torch.tensor(p), response=torch.tensor(r),
        ...                                  full=torch.tensor(p + r)),
        ...                advantage=torch.tensor([[a]]))
        ...     for (p, r), a in zip(pairs, (1.0, -1.0))])
        >>> with torch.no_grad():  # "old" log-probs: here the same weights (on-policy)
        ...     data = data.set("log_probs", policy(data.copy()).get("log_probs"))
        >>> loss_fn = GSPOLoss(policy)  # paper defaults: clip (3e-4, 4e-4), prompt_mean
        >>> out = loss_fn(data)
        >>> out.loss_objective.shape
        torch.Size([])
        >>> float(out.clip_fraction), float(out.ESS), float(out.sequence_log_ratio)
        (0.0, 1.0, 0.0)
        >>> out.loss_objective.backward()
    """

    output_type: type[LLMLossOutput] = GSPOLossOutput
    # Whether advantages must be constant over the valid tokens of a sequence.
    _sequence_advantage: bool = True

    def __init__(
        self,
        actor_network: LLMWrapperBase | None = None,
        *,
        clip_epsilon: float | tuple[float, float] = (3e-4, 4e-4),
        aggregation: Literal["prompt_mean", "token_mean", "none"] | None = "prompt_mean",
        max_log_ratio: float | None = 10.0,
        response_mask_check: Literal["raise", "warn", "ignore"] = "raise",
        **kwargs,
    ) -> None:
        if response_mask_check not in _RESPONSE_MASK_CHECKS:
            raise ValueError(
                f"response_mask_check must be one of {_RESPONSE_MASK_CHECKS}, "
                f"got {response_mask_check!r}."
            )
        aggregation = "prompt_mean" if aggregation is None else aggregation
        if aggregation not in _AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {_AGGREGATIONS}, got {aggregation!r}.")
        if aggregation == "token_mean":
            warnings.warn(
                f"{type(self).__name__} with aggregation='token_mean' averages over all "
                "tokens of the batch, which weights each sequence by its length: that is "
                "not GSPO's objective (Eq. 5, a mean over sequences). Use "
                "aggregation='prompt_mean' for the paper's objective.",
                UserWarning,
                stacklevel=2,
            )
        super().__init__(
            actor_network,
            clip_epsilon=clip_epsilon,
            aggregation=aggregation,
            **kwargs,
        )
        if max(self.clip_epsilon_low.item(), self.clip_epsilon_high.item()) > _LARGE_EPSILON:
            warnings.warn(
                f"{type(self).__name__} got clip_epsilon={clip_epsilon}: a token-level "
                "(GRPO/PPO-scale) range. Sequence ratios are geometric means and stay "
                "close to 1, so such a range practically never clips them; the paper "
                "uses (3e-4, 4e-4), the default.",
                UserWarning,
                stacklevel=2,
            )
        # GRPOLoss stores the clip range in float32, where 3e-4 is off by ~1e-11:
        # keep the user's values exactly (they stay schedulable buffers).
        if not isinstance(clip_epsilon, (tuple, list)):
            clip_epsilon = (clip_epsilon, clip_epsilon)
        for name, value in zip(
            ("clip_epsilon_low", "clip_epsilon_high"), clip_epsilon, strict=True
        ):
            device = getattr(self, name).device
            setattr(self, name, torch.tensor(float(value), dtype=torch.float64, device=device))
        self.max_log_ratio = max_log_ratio
        self.response_mask_check = response_mask_check
        self._warned_half_precision = False
        self._sequence_stats: dict[str, torch.Tensor] | None = None

    @property
    def out_keys(self):
        keys = list(super().out_keys)
        for key in (
            "clip_fraction_low",
            "clip_fraction_high",
            "sequence_clip_fraction",
            "sequence_log_ratio",
            "sequence_log_ratio_max_abs",
        ):
            if key not in keys:
                keys.append(key)
        return keys

    @out_keys.setter
    def out_keys(self, values):
        self._out_keys = values

    def forward(self, tensordict: TensorDictBase) -> GSPOLossOutput:
        """Computes the GSPO loss and its sequence-level diagnostics.

        Args:
            tensordict (TensorDictBase): the batch, as for
                :class:`~torchrl.objectives.llm.GRPOLoss`. It is not modified.

        Returns:
            GSPOLossOutput: the loss terms and diagnostics.
        """
        tensordict = self._with_aligned_advantage(tensordict)
        self._sequence_stats = None
        out = super().forward(tensordict)
        stats, self._sequence_stats = self._sequence_stats, None
        for name, value in stats.items():
            setattr(out, name, value)
        return out

    def _with_aligned_advantage(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Validates the inputs and returns a shallow copy with a dense advantage.

        Ragged advantages are read left-padded, like the log-probabilities, so that
        each value lines up with the token it belongs to; padding is recorded under
        a private key and replaced by 0.
        """
        keys = self.tensor_keys
        for name, key in (
            ("action", keys.action),
            ("sample_log_prob", keys.sample_log_prob),
            ("advantage", keys.advantage),
        ):
            if key not in tensordict.keys(include_nested=True):
                raise KeyError(
                    f"{type(self).__name__}: key {key!r} ({name}) is missing from the "
                    f"input tensordict. Write it there, or point the loss at the key "
                    f"that holds it with loss.set_keys({name}=...)."
                )
        action = tensordict.get(
            keys.action, as_padded_tensor=True, padding_side="left", padding_value=-100
        )
        if action.ndim != 2:
            raise ValueError(
                f"{type(self).__name__}: the tokens at {keys.action!r} have shape "
                f"{tuple(action.shape)}; the loss expects one batch dimension, [B, T]. "
                "Flatten the batch first, e.g. tensordict.reshape(-1)."
            )
        old_log_prob = tensordict.get(
            keys.sample_log_prob,
            as_padded_tensor=True,
            padding_side="left",
            padding_value=0.0,
        )
        if old_log_prob.requires_grad:
            raise ValueError(
                f"{type(self).__name__}: the old log-probabilities at "
                f"{keys.sample_log_prob!r} require grad. They must be constants: compute "
                "them under torch.no_grad() or store them with .detach()."
            )
        if old_log_prob.shape != action.shape:
            raise ValueError(
                f"{type(self).__name__}: old log-probabilities at {keys.sample_log_prob!r} "
                f"have shape {tuple(old_log_prob.shape)} but the tokens at {keys.action!r} "
                f"have shape {tuple(action.shape)} (both read left-padded). Store one "
                "log-probability per token, of shape [B, T], e.g. from a no-grad forward "
                "of the training wrapper (return_log_probs=True)."
            )
        advantage = tensordict.get(
            keys.advantage,
            as_padded_tensor=True,
            padding_side="left",
            padding_value=float("nan"),
        )
        batch_shape, seq_len = action.shape[:-1], action.shape[-1]
        if (
            advantage.ndim != action.ndim + 1
            or advantage.shape[-1] != 1
            or advantage.shape[:-2] != batch_shape
            or advantage.shape[-2] > seq_len
        ):
            raise ValueError(
                f"{type(self).__name__}: advantage at {keys.advantage!r} has shape "
                f"{tuple(advantage.shape)}, expected {(*batch_shape, 1, 1)} (one value "
                f"per sequence) or {(*batch_shape, seq_len, 1)} (one value per token, "
                f"aligned with {keys.action!r}; shorter rows are read as covering the "
                "last tokens). A [B] or [B, 1] advantage needs trailing singleton "
                "dimensions: advantage.reshape(-1, 1, 1)."
            )
        if 1 < advantage.shape[-2] < seq_len:
            # Rows shorter than the tokens (e.g. response-only) end with them.
            pad = advantage.new_full((*batch_shape, seq_len - advantage.shape[-2], 1), torch.nan)
            advantage = torch.cat([pad, advantage], dim=-2)
        if not advantage.is_floating_point():
            advantage = advantage.to(torch.get_default_dtype())
        has_value = ~advantage.isnan()
        tensordict = tensordict.copy()
        tensordict.set(keys.advantage, torch.where(has_value, advantage, 0.0))
        tensordict.set(_ADVANTAGE_HAS_VALUE, has_value.squeeze(-1))
        return tensordict

    def _check_advantage(self, tensordict: TensorDictBase, mask: torch.Tensor) -> None:
        advantage = tensordict.get(self.tensor_keys.advantage).squeeze(-1)
        uncovered = mask & ~tensordict.get(_ADVANTAGE_HAS_VALUE)
        missing = uncovered.any(-1)
        varying = torch.zeros_like(missing)
        if self._sequence_advantage and advantage.shape[-1] > 1:
            inf = torch.finfo(advantage.dtype).max
            high = torch.where(mask, advantage, -inf).amax(-1)
            low = torch.where(mask, advantage, inf).amin(-1)
            varying = mask.any(-1) & (high != low)
        if torch.compiler.is_compiling():
            # No data-dependent branch (a graph break) under torch.compile: check in-graph;
            # the eager path below gives the detailed message.
            torch._assert_async(
                ~(missing | varying).any(),
                f"{type(self).__name__}: an advantage is NaN, padding or varying within a "
                "sequence; run the loss eagerly for the details.",
            )
            return
        if not (missing | varying).any():
            return
        key = self.tensor_keys.advantage
        if missing.any():
            raise ValueError(
                f"{type(self).__name__}: the advantage at {key!r} is NaN or padding at "
                f"{int(uncovered.sum())} valid response "
                f"token(s), in batch row(s) {missing.nonzero().squeeze(-1).tolist()}. "
                "Per-token advantages must cover every token of the loss mask; ragged rows "
                "are read left-padded, aligned with the end of the tokens."
            )
        raise ValueError(
            f"{type(self).__name__}: the advantage at {key!r} varies across the valid "
            f"tokens of batch row(s) {varying.nonzero().squeeze(-1).tolist()}. GSPO needs "
            "one advantage per sequence; for per-token advantages use GSPOTokenLoss "
            "(GSPO-token, paper section 4.3)."
        )

    def _check_response_mask(self, tensordict: TensorDictBase, mask: torch.Tensor) -> None:
        if (
            self.response_mask_check == "ignore"
            or self.masking_strategy != "sft"
            or not isinstance(tensordict, LazyStackedTensorDict)
            or _RESPONSE_KEY not in tensordict.keys(include_nested=True)
            or torch.compiler.is_compiling()
        ):
            return
        responses = tensordict.get(_RESPONSE_KEY, as_list=True)
        lengths = torch.tensor([r.shape[-1] for r in responses], device=mask.device)
        counts = mask.sum(-1)
        wrong = counts != lengths
        if not wrong.any():
            return
        rows = wrong.nonzero().squeeze(-1).tolist()
        message = (
            f"{type(self).__name__}: the 'sft' loss mask does not match the sampled "
            f"responses at {_RESPONSE_KEY!r} in batch row(s) {rows}: valid tokens "
            f"{counts[wrong].tolist()} vs response lengths {lengths[wrong].tolist()}. "
            "GSPO divides each sequence log-ratio by this count, so those ratios are "
            "wrong. Known cause: a training wrapper with pad_output=True on ragged rows. "
            "Working configuration: TransformersWrapper(input_mode='tokens', "
            "generate=False, return_log_probs=True, pad_output=False) on lazily stacked "
            "data. Pass response_mask_check='warn' or 'ignore' to override."
        )
        if self.response_mask_check == "raise":
            raise ValueError(message)
        warnings.warn(message, UserWarning, stacklevel=4)

    def _sequence_log_ratio(
        self, token_log_ratio: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked mean of the token log-ratios over each sequence.

        Returns the sequence log-ratio (``[*B]``, float32 or float64) and the
        number of valid tokens per sequence (``[*B]``).
        """
        dtype = token_log_ratio.dtype
        if dtype in _HALF_DTYPES:
            if not self._warned_half_precision and not torch.compiler.is_compiling():
                warnings.warn(
                    f"{type(self).__name__} received {dtype} log-probabilities. Their "
                    "rounding error is of the order of GSPO's clip range "
                    f"({self.clip_epsilon_low.item():g}, {self.clip_epsilon_high.item():g}); the "
                    "sequence reduction accumulates in float32, but prefer float32 "
                    "log-probabilities (e.g. compute the log-softmax in float32).",
                    UserWarning,
                    stacklevel=4,
                )
                self._warned_half_precision = True
            dtype = torch.float32
        lengths = mask.sum(-1)
        token_log_ratio = torch.where(mask, token_log_ratio.to(dtype), 0.0)
        return token_log_ratio.sum(-1) / lengths.clamp_min(1).to(dtype), lengths

    def _sequence_diagnostics(
        self, log_ratio: torch.Tensor, lengths: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        log_ratio = log_ratio.detach()
        low, high = self._clip_bounds
        nonempty = lengths > 0
        tokens = lengths.to(log_ratio.dtype)
        below = (log_ratio < low) & nonempty
        above = (log_ratio > high) & nonempty
        n_tokens = tokens.sum().clamp_min(1)
        n_seq = nonempty.sum()
        n_seq_f = n_seq.clamp_min(1).to(log_ratio.dtype)
        weights = torch.where(nonempty, log_ratio, -torch.inf)
        ess = (2 * weights.logsumexp(-1) - (2 * weights).logsumexp(-1)).exp()
        masked = torch.where(nonempty, log_ratio, 0.0)
        return {
            "clip_fraction": (tokens * (below | above)).sum() / n_tokens,
            "clip_fraction_low": (tokens * below).sum() / n_tokens,
            "clip_fraction_high": (tokens * above).sum() / n_tokens,
            "sequence_clip_fraction": (below | above).sum() / n_seq_f,
            "ESS": torch.where(n_seq > 0, ess / n_seq_f, 0.0),
            "sequence_log_ratio": masked.sum() / n_seq_f,
            "sequence_log_ratio_max_abs": masked.abs().max(),
        }

    def _log_weight(
        self, tensordict: TensorDictBase, adv_shape: torch.Size
    ) -> tuple[torch.Tensor, d.Distribution, torch.Tensor, torch.Tensor]:
        token_log_weight, dist, kl_approx, mask = super()._log_weight(tensordict, adv_shape)
        self._check_advantage(tensordict, mask)
        self._check_response_mask(tensordict, mask)
        log_ratio, lengths = self._sequence_log_ratio(token_log_weight.squeeze(-1), mask)
        self._sequence_stats = self._sequence_diagnostics(log_ratio, lengths)
        if self.max_log_ratio is not None:
            log_ratio = log_ratio.clamp(max=self.max_log_ratio)
        log_weight = torch.where(mask, log_ratio.unsqueeze(-1), 0.0).unsqueeze(-1)
        return log_weight, dist, kl_approx, mask

    def _aggregate_loss_value(
        self,
        value: torch.Tensor,
        mask: torch.Tensor,
        tensordict: TensorDictBase | None = None,
    ) -> torch.Tensor:
        loss = super()._aggregate_loss_value(value, mask, tensordict=tensordict)
        if self.aggregation == "prompt_mean" and self.reduction != "none":
            # GRPOLoss returns shape (1,) here; GSPO's objective is a scalar.
            loss = loss.squeeze(-1)
        return loss


class GSPOTokenLossOutput(GSPOLossOutput):
    pass


GSPOTokenLossOutput.__doc__ = """GSPO-token loss output: the same fields as :class:`GSPOLossOutput`.

Examples:
    >>> import torch
    >>> from torchrl_gspo import GSPOLossOutput, GSPOTokenLossOutput
    >>> out = GSPOTokenLossOutput(loss_objective=torch.tensor(0.1), clip_fraction=torch.tensor(0.0),
    ...     kl_approx=torch.tensor(0.0), ESS=torch.tensor(1.0), batch_size=[])
    >>> isinstance(out, GSPOLossOutput), out.sequence_log_ratio is None
    (True, True)
"""


class GSPOTokenLoss(GSPOLoss):
    r"""GSPO-token: GSPO's sequence ratio with one advantage per token (paper §4.3).

    For per-token advantages :math:`A_{i,t}` (multi-turn, tool use, process
    rewards), GSPO-token (Zheng et al., 2025,
    `arXiv:2507.18071 <https://arxiv.org/abs/2507.18071>`_, Eqs. 13-17) gives every
    valid token the importance weight

    .. math::

        s_{i,t}(\theta) = \text{sg}[s_i(\theta)]
            \frac{\pi_\theta(y_{i,t} \mid x, y_{i,<t})}
                 {\text{sg}[\pi_\theta(y_{i,t} \mid x, y_{i,<t})]},

    where :math:`\text{sg}` stops the gradient and :math:`s_i` is
    :class:`GSPOLoss`' sequence ratio. Its value is exactly :math:`s_i`, so the
    clipping decision is made per sequence value and per token sign of
    :math:`A_{i,t}`, and the objective

    .. math::

        J(\theta) = \mathbb{E}\Big[\frac{1}{G} \sum_{i=1}^{G} \frac{1}{|y_i|}
            \sum_{t=1}^{|y_i|} \min\big(s_{i,t} A_{i,t},\ \text{clip}(s_{i,t},
            1 - \epsilon_\text{low}, 1 + \epsilon_\text{high}) A_{i,t}\big)\Big]

    has, where nothing is clipped, the gradient (Eq. 17)
    :math:`\frac{1}{G} \sum_i s_i \frac{1}{|y_i|} \sum_t A_{i,t} \nabla_\theta
    \log \pi_\theta(y_{i,t})`.

    Equivalence: when :math:`A_{i,t} = A_i` for every token, GSPO-token and
    :class:`GSPOLoss` are identical in loss value, clipping decision and gradient
    (this is tested). Choose :class:`GSPOLoss` for one reward per response: it
    also checks that the advantages are constant over each sequence. Choose
    ``GSPOTokenLoss`` when advantages differ across the tokens of a response.

    Per-token advantages are read like the log-probabilities: a dense
    ``[B, T, 1]`` tensor must be aligned with the left-padded tokens, and lazily
    stacked rows of different lengths are read left-padded, so that each row's
    last value meets its last token (rows may cover the whole sequence or only its
    response). A valid response token with no advantage value (padding or NaN)
    raises a :class:`ValueError`. ``[B, 1, 1]`` sequence advantages work too.

    Defaults, keyword arguments and diagnostics are :class:`GSPOLoss`' own.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from torchrl_gspo import GSPOTokenLoss
        >>> _ = torch.manual_seed(0)
        >>> vocab = {f"t{i}": i for i in range(32)}
        >>> tokenizer = PreTrainedTokenizerFast(
        ...     tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t2")),
        ...     pad_token="t0", eos_token="t1")
        >>> config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        >>> policy = TransformersWrapper(Qwen2ForCausalLM(config).eval(), tokenizer=tokenizer,
        ...     input_mode="tokens", generate=False, return_log_probs=True, pad_output=False)
        >>> # ragged rows; one advantage per response token (e.g. a process reward)
        >>> pairs = [([5, 6, 7], [8, 9, 1]), ([5, 6], [10, 11, 12, 13, 1])]
        >>> data = lazy_stack([
        ...     TensorDict(tokens=TensorDict(prompt=torch.tensor(p), response=torch.tensor(r),
        ...                                  full=torch.tensor(p + r)),
        ...                advantage=torch.linspace(-1.0, 1.0, len(r)).unsqueeze(-1))
        ...     for p, r in pairs])
        >>> with torch.no_grad():
        ...     data = data.set("log_probs", policy(data.copy()).get("log_probs"))
        >>> out = GSPOTokenLoss(policy)(data)
        >>> out.loss_objective.shape, float(out.ESS)
        (torch.Size([]), 1.0)
        >>> out.loss_objective.backward()
    """

    output_type: type[LLMLossOutput] = GSPOTokenLossOutput
    _sequence_advantage: bool = False

    def _log_weight(
        self, tensordict: TensorDictBase, adv_shape: torch.Size
    ) -> tuple[torch.Tensor, d.Distribution, torch.Tensor, torch.Tensor]:
        log_weight, dist, kl_approx, mask = super()._log_weight(tensordict, adv_shape)
        # GRPOLoss leaves the masked current log-probs here for its KL terms.
        token = tensordict.get("_cur_log_prob").to(log_weight.dtype).unsqueeze(-1)
        # No gradient on masked tokens, nor on sequences clamped at max_log_ratio
        # (where GSPOLoss has none either).
        keep = mask.unsqueeze(-1)
        if self.max_log_ratio is not None:
            keep = keep & (log_weight.detach() < self.max_log_ratio)
        token_grad = torch.where(keep, token - token.detach(), 0.0)
        return log_weight.detach() + token_grad, dist, kl_approx, mask
