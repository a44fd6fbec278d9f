# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Group Sequence Policy Optimization (GSPO) losses for TorchRL's LLM stack."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torch import distributions as d
from torchrl.modules.llm import LLMWrapperBase
from torchrl.objectives.llm.grpo import GRPOLoss, LLMLossOutput

from torchrl_gspo import _arguments
from torchrl_gspo._reader import Batch, read_batch, read_lag
from torchrl_gspo.diagnostics import SequenceDiagnosticsOutput, SequenceStatistics
from torchrl_gspo.rollout import RolloutCorrection, rollout_terms
from torchrl_gspo.scores import Scores, dropped_tokens, loss_weight, off_policy_keep, score

if TYPE_CHECKING:
    from torchrl.envs.llm.transforms import PolicyVersion

__all__ = ["GSPOLoss", "GSPOLossOutput", "GSPOTokenLoss", "GSPOTokenLossOutput"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_CLIP_BUFFERS = ("clip_epsilon_low", "clip_epsilon_high")
_BASE_FIELDS = frozenset(f.name for f in fields(LLMLossOutput))


class GSPOLossOutput(SequenceDiagnosticsOutput):
    pass


# Building a tensorclass replaces the class docstring with the generated signature;
# set it afterwards so that help() and the API docs show it.
GSPOLossOutput.__doc__ = """GSPO loss output: the loss terms, which a trainer sums, and diagnostics.

The ``loss_*`` terms are 0-dim unless ``aggregation`` or ``reduction`` is ``"none"``;
the diagnostics are detached 0-dim tensors (``None`` where they do not apply) whose
names never start with ``loss_``, so trainers that sum the ``loss_*`` entries leave
them out. Their definitions and healthy values: :doc:`/diagnostics`.

Attributes:
    loss_objective (torch.Tensor): the clipped objective, negated (Eq. 5 with
        ``aggregation="prompt_mean"``).
    loss_entropy, entropy, loss_kl_to_ref, kl_to_ref, loss_kl_to_inference,
        kl_to_inference, kl_approx (torch.Tensor): GRPOLoss' entropy bonus, KL
        terms and KL estimate.
    clip_fraction, clip_fraction_low, clip_fraction_high, sequence_clip_fraction,
        ESS, sequence_log_ratio, sequence_log_ratio_max_abs (torch.Tensor): the
        sequence-level diagnostics.
    rollout_log_ratio_mean_abs, rollout_log_ratio_max_abs,
        rollout_outside_clip_fraction, rollout_kl, rollout_correction_fraction,
        rollout_correction_weight (torch.Tensor): the engine mismatch and the
        rollout correction, set when the old log-probabilities were recomputed.
    policy_lag_mean, policy_lag_max (torch.Tensor): the policy lag, set with the
        loss' ``policy_version`` argument.
    objective_diagnostic, off_policy_masked_fraction (torch.Tensor): a variant's own
        diagnostic (:doc:`/objectives`) and the share of tokens off-policy sequence
        masking dropped, when they apply.
    segment_clip_fraction, whole_clip_fraction, segments_per_sequence,
        kl_to_old (torch.Tensor): the segments' diagnostics of
        :class:`~torchrl_gspo.SubsequenceLoss`.
    stat_* (torch.Tensor): the :class:`~torchrl_gspo.SequenceStatistics` the
        diagnostics are computed from (``out.statistics``).

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
    r"""GSPO loss: GRPO's clipped objective on a length-normalized sequence ratio.

    Group Sequence Policy Optimization (Zheng et al., Qwen, 2025,
    `arXiv:2507.18071 <https://arxiv.org/abs/2507.18071>`_) replaces GRPO's
    per-token importance ratio by one ratio per response :math:`y_i`, the
    geometric mean of its token ratios (Eq. 7):

    .. math::

        s_i(\theta) = \exp\Big(\frac{1}{|y_i|} \sum_{t=1}^{|y_i|}
            \log \frac{\pi_\theta(y_{i,t} \mid x, y_{i,<t})}
                      {\pi_{\theta_\text{old}}(y_{i,t} \mid x, y_{i,<t})}\Big),

    and maximizes (Eq. 5)

    .. math::

        J(\theta) = \mathbb{E}\Big[\frac{1}{G} \sum_{i=1}^{G}
            \min\big(s_i \hat A_i,\ \text{clip}(s_i, 1 - \epsilon_\text{low},
            1 + \epsilon_\text{high}) \hat A_i\big)\Big],

    whose unclipped gradient weights every token of a response equally (Eq. 10).
    :math:`|y_i|` counts the valid tokens, clamped to at least 1; the masked-mean
    form of the ratio follows Hugging Face TRL's
    ``importance_sampling_level="sequence"`` (Apache-2.0). The clipped surrogate
    (evaluated once per sequence), the masking strategies, the entropy bonus and
    the KL terms are :class:`~torchrl.objectives.llm.GRPOLoss`' own. Inputs and
    the three log-probability roles: :doc:`/inputs`; numerical care:
    :doc:`/math`; diagnostics: :doc:`/diagnostics`; variants override
    ``_objective`` (:doc:`/design`).

    Args:
        actor_network (LLMWrapperBase): the policy, e.g. a
            :class:`~torchrl.modules.llm.TransformersWrapper` with
            ``generate=False`` and ``return_log_probs=True``.

    Keyword Args:
        clip_epsilon (float | tuple[float, float], optional): clip range of the
            sequence ratio, symmetric or ``(eps_low, eps_high)``; above 0.01 it
            warns (clipping would practically never bind). Defaults to the paper's
            ``(3e-4, 4e-4)`` (§5.1).
        aggregation (Literal["prompt_mean", "token_mean", "none"], optional):
            ``"prompt_mean"`` (mean over each sequence, then over sequences) is the
            paper's objective and returns a 0-dim loss; ``"token_mean"`` weights
            each sequence by its length and warns; ``"none"`` returns per-token
            terms. ``None`` means the default. Defaults to ``"prompt_mean"``.
        max_log_ratio (float | None, optional): upper clamp of the sequence
            log-ratio before exponentiation (the clamped sequence has no
            gradient), ``None`` to disable; not negative. Defaults to ``10.0``.
        masking_strategy (Literal["sft", "rlhf", "generic"], optional): the
            response (``"sft"``), the assistant turns (``"rlhf"``) or every token
            after the first (``"generic"``). Defaults to ``"sft"``.
        response_mask_check (Literal["raise", "warn", "ignore"], optional): what a
            ``"sft"`` mask that differs from ``("tokens", "response")``, or a
            ``("tokens", "full")`` that is not the prompt followed by the response,
            does (:doc:`/inputs`). Defaults to ``"raise"``.
        rollout_correction (Literal["truncate", "mask", "masked_is"] | None, optional):
            the weight of the rollout-to-old ratio :math:`\rho`: truncated, 0/1
            rejection, or :math:`\rho` inside a band
            (:class:`~torchrl_gspo.RolloutCorrection`); needs the ``old_log_prob``
            key. Defaults to ``None``.
        rollout_correction_form (Literal["geometric", "sequence", "token"], optional):
            :math:`\rho` per sequence as the geometric mean (GSPO's own form) or the
            product of the token ratios (TRL's and verl's ``sequence`` level), or per
            token (their ``token`` level). Defaults to ``"geometric"``.
        rollout_correction_threshold (float | tuple[float, float] | None, optional):
            the band ``(C_low, C_high)`` with ``C_low <= 1 <= C_high`` (a ``None``
            end is no bound, as TRL's ``clip_min`` and ``clip_max``), or a cap
            ``C >= 1`` meaning ``(0, C)`` (not for ``"mask"``). ``None`` takes the
            defaults of :class:`~torchrl_gspo.RolloutCorrection`: ``(0.999, 1.001)``
            for the geometric form (verl's length-normalized band; a cap ``1.001``
            for ``"truncate"``), and for the product and token forms TRL's
            ``vllm_importance_sampling_clip_max=3.0`` with no lower bound
            (``"mask"``: ``(1/3, 3.0)``).
        policy_version (Callable[[], int] | PolicyVersion | None, optional): the
            trainer's current policy version, as a function or TorchRL's
            ``PolicyVersion`` (its ``version``); with it the loss
            reads the version that sampled each row (the ``policy_version`` key)
            and reports the policy lag (:doc:`/diagnostics`). Defaults to ``None``.
        off_policy_mask_threshold (float | None, optional): :math:`\delta` of
            off-policy sequence masking (DeepSeek-V3.2,
            `arXiv:2512.02556 <https://arxiv.org/abs/2512.02556>`_, Eq. 9): a token
            with a negative advantage is dropped when its response's mean
            :math:`\frac{1}{|y_i|}\sum_t (\log\pi_\text{roll} - \log\pi_\theta)`
            exceeds :math:`\delta \ge 0` (:doc:`/objectives`). ``None`` disables
            it. Defaults to ``None``.
        **kwargs: every other keyword argument of
            :class:`~torchrl.objectives.llm.GRPOLoss` (``entropy_bonus``,
            ``entropy_coeff``, ``kl_to_ref_coeff``, ``kl_to_inference_coeff``,
            ``kl_mask_threshold``, ...), unchanged.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from torchrl_gspo import GSPOLoss
        >>> _ = torch.manual_seed(0)
        >>> words = models.WordLevel({f"t{i}": i for i in range(32)}, unk_token="t2")
        >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words),
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
    # "sequence": advantages constant over each sequence, read as [B, 1, 1]; "token":
    # as the batch holds them. A clip range above wide_clip_epsilon warns.
    advantage_level: ClassVar[Literal["sequence", "token"]] = "sequence"
    wide_clip_epsilon: ClassVar[float] = 0.01
    # the aggregation of the objective's paper: another one warns if it is token_mean
    objective_aggregation: ClassVar[str] = "prompt_mean"

    def __init__(
        self,
        actor_network: LLMWrapperBase | None = None,
        *,
        clip_epsilon: float | tuple[float, float] = (3e-4, 4e-4),
        aggregation: Literal["prompt_mean", "token_mean", "none"] | None = "prompt_mean",
        max_log_ratio: float | None = 10.0,
        masking_strategy: Literal["sft", "rlhf", "generic"] = "sft",
        response_mask_check: Literal["raise", "warn", "ignore"] = "raise",
        rollout_correction: Literal["truncate", "mask", "masked_is"] | None = None,
        rollout_correction_form: Literal["geometric", "sequence", "token"] = "geometric",
        rollout_correction_threshold: float | tuple[float, float] | None = None,
        policy_version: Callable[[], int] | PolicyVersion | None = None,
        off_policy_mask_threshold: float | None = None,
        **kwargs,
    ) -> None:
        eps_low, eps_high = _arguments.clip_epsilon(clip_epsilon)
        correction = RolloutCorrection.from_arguments(
            rollout_correction, rollout_correction_form, rollout_correction_threshold
        )
        max_log_ratio = _arguments.max_log_ratio(max_log_ratio)
        _arguments.choice("masking_strategy", masking_strategy, ("sft", "rlhf", "generic"))
        _arguments.choice("response_mask_check", response_mask_check, ("raise", "warn", "ignore"))
        aggregation = "prompt_mean" if aggregation is None else aggregation
        _arguments.choice("aggregation", aggregation, ("prompt_mean", "token_mean", "none"))
        eps = (eps_low, eps_high)
        _arguments.warn_off_paper(self, clip_epsilon, eps, self.wide_clip_epsilon, aggregation)
        # set before GRPOLoss' constructor, which builds the in_keys (_set_in_keys)
        self.max_log_ratio = max_log_ratio
        self.response_mask_check = response_mask_check
        self._correction, self._correction_form = correction, rollout_correction_form
        self.policy_version = _arguments.version_source(policy_version)
        self.off_policy_mask_threshold = _arguments.off_policy_threshold(off_policy_mask_threshold)
        # Warn-once flag: it only silences a repeated warning, never changes a result.
        self._warned_half_precision = False
        super().__init__(
            actor_network,
            clip_epsilon=eps,
            aggregation=aggregation,
            masking_strategy=masking_strategy,
            **kwargs,
        )
        # float64, exact (GRPOLoss' float32 3e-4 is off by ~1e-11); still buffers
        for buffer, value in zip(_CLIP_BUFFERS, (eps_low, eps_high), strict=True):
            device = getattr(self, buffer).device
            setattr(self, buffer, torch.tensor(value, dtype=torch.float64, device=device))

    @dataclass
    class _AcceptedKeys(GRPOLoss._AcceptedKeys):
        r"""Tensordict keys: GRPOLoss' own, and (:doc:`/inputs`):

        Attributes:
            old_log_prob (NestedKey): the trainer's recomputed old log-probabilities.
                Defaults to ``("old_log_probs", "full")``.
            sequence_scale (NestedKey): :math:`c_i` per row (:doc:`/scaling`).
                Defaults to ``"sequence_scale"``.
            policy_version (NestedKey): the policy version that sampled each row,
                read with the ``policy_version`` argument. Defaults to
                ``"policy_version"`` (TorchRL's ``PolicyVersion``).
        """

        old_log_prob: NestedKey = ("old_log_probs", "full")
        sequence_scale: NestedKey = "sequence_scale"
        policy_version: NestedKey = "policy_version"

    @property
    def rollout_correction(self) -> Literal["truncate", "mask", "masked_is"] | None:
        """The rollout correction, fixed at construction (:class:`RolloutCorrection`)."""
        return None if self._correction is None else self._correction.mode

    @property
    def rollout_correction_form(self) -> Literal["geometric", "sequence", "token"]:
        """The form of the rollout correction's ratio, fixed at construction."""
        return self._correction_form

    def _set_in_keys(self):
        super()._set_in_keys()
        keys = [self.tensor_keys.old_log_prob]
        if self.policy_version is not None:
            keys.append(self.tensor_keys.policy_version)
        self._in_keys.extend(key for key in keys if key not in self._in_keys)

    def _apply(self, fn, recurse: bool = True):
        # the float64 clip buffers become float32 on a device without float64 (MPS)
        try:
            fn(torch.zeros((), dtype=torch.float64))
        except (TypeError, RuntimeError):
            for name in _CLIP_BUFFERS:
                self._buffers[name] = self._buffers[name].float()
        if recurse:
            return super()._apply(fn)
        # LossModule._apply lacks torch's `recurse` argument (used by to_empty).
        self._erase_cache()
        return torch.nn.Module._apply(self, fn, recurse=False)

    @property
    def out_keys(self):
        if getattr(self, "_out_keys", None) is None:  # GRPOLoss' defaults, then ours
            keys = list(super().out_keys)
            names = (f.name for f in fields(self.output_type))
            self._out_keys = keys + [n for n in names if n not in keys and n not in _BASE_FIELDS]
        return self._out_keys

    @out_keys.setter
    def out_keys(self, values):
        self._out_keys = values

    def forward(self, tensordict: TensorDictBase) -> GSPOLossOutput:
        """Computes the loss and its sequence-level diagnostics in one pass.

        Args:
            tensordict (TensorDictBase): the batch (:doc:`/inputs`); not modified.

        Returns:
            GSPOLossOutput: the loss terms and diagnostics.
        """
        options = self._options()
        batch = read_batch(tensordict, options)
        # the trainer's version changes every update: read eagerly (one graph break)
        lag = None if self.policy_version is None else read_lag(tensordict, options)
        # the actor may write on what it gets (TorchRL's "rlhf" path does): a shallow copy
        current, dist, _ = self._get_cur_log_prob(tensordict.copy())
        dtype = self._accumulation_dtype(current.dtype, batch.old.dtype)
        scores = score(batch, current, dist.mask, options, dtype)  # masked and checked
        rollout = None
        if batch.rollout is not None:
            rollout = rollout_terms(scores.old, scores.rollout, scores.mask, self._correction)
        keep = None
        if self.off_policy_mask_threshold is not None:
            keep = off_policy_keep(scores, self.off_policy_mask_threshold)
        weight = loss_weight(batch.scale, rollout, keep)
        terms = self._objective(scores)  # the variant hook
        parts = terms if isinstance(terms, tuple) else (terms,)
        terms, diagnostic, segments = (*parts, None, None)[:3]
        stats = SequenceStatistics.of(
            scores.log_ratio.detach(),
            scores.lengths,
            self._clip_bounds,
            rollout,
            lag,
            objective=None if diagnostic is None else diagnostic.detach().sum(-1),
            masked=None if keep is None else dropped_tokens(scores, keep),
            segments=segments,
        )
        aggregation_mask = self._kl_filter(scores)
        out = {
            "loss_objective": self._reduce_terms(terms, aggregation_mask, weight, tensordict),
            "kl_approx": -scores.token_log_ratio.detach().mean(),
            **stats.fields(),
            **self._regularizers(batch, current, dist, aggregation_mask, weight, tensordict),
        }
        return self.output_type.from_tensordict(TensorDict(out, batch_size=[]))

    def _objective(self, scores: Scores) -> torch.Tensor | tuple:
        """The loss terms of the objective: the hook a variant overrides (:doc:`/design`).

        Args:
            scores (Scores): the batch scored by the current policy.

        Returns:
            torch.Tensor | tuple: the loss terms per sequence, ``[B, 1, 1]``, or per
            token, ``[B, T, 1]``; or the terms and the objective's own diagnostic,
            ``[B, T]`` per-token values, 0 off the mask (or ``None``), computed in
            the same pass; or those two and the
            :class:`~torchrl_gspo.SegmentTerms` of an objective with one ratio per
            segment. Here GRPOLoss' clipped surrogate on :math:`\\log s_i`, without
            a diagnostic.
        """
        log_ratio = scores.log_ratio  # -inf (a token of probability 0): the lowest float
        log_ratio = log_ratio.clamp(torch.finfo(log_ratio.dtype).min, self.max_log_ratio)
        loss, _ = self._compute_policy_objective(log_ratio.reshape(-1, 1, 1), scores.advantage)
        return loss

    def _token_inputs(self) -> tuple[NestedKey, ...]:
        """The keys of the per-token inputs the objective reads (:attr:`Scores.inputs`)."""
        return ()

    def _options(self) -> _arguments.Options:
        """The options that reading, scoring and checking a batch read, at this call."""
        return _arguments.Options(
            owner=type(self).__name__,
            keys=self.tensor_keys,
            masking_strategy=self.masking_strategy,
            response_mask_check=self.response_mask_check,
            rollout_correction=self.rollout_correction,
            aggregation=self.aggregation,
            reduction=self.reduction,
            kl_to_ref_coeff=self.kl_to_ref_coeff,
            ref_padding=(self.ref_log_prob_padding_value, self.ref_log_prob_padding_side),
            policy_version=self.policy_version,
            advantage_level=self.advantage_level,
            tokenizer=getattr(self.actor_network, "tokenizer", None),
            input_mode=getattr(self.actor_network, "input_mode", None),
            token_inputs=self._token_inputs(),
        )

    def _accumulation_dtype(self, current: torch.dtype, old: torch.dtype) -> torch.dtype:
        """The log-probs' promoted dtype, at least float32; half precision warns once."""
        half = next((t for t in (current, old) if t in _HALF_DTYPES), None)
        warn = half is not None and not self._warned_half_precision
        if warn and not torch.compiler.is_compiling():
            low, high = self.clip_epsilon_low.item(), self.clip_epsilon_high.item()
            _arguments.warn(
                f"{type(self).__name__} received {half} log-probabilities. Their "
                f"rounding error is of the order of GSPO's clip range ({low:g}, {high:g}); "
                "the sequence reduction accumulates in float32, but prefer float32 "
                "log-probabilities (e.g. compute the log-softmax in float32)."
            )
            self._warned_half_precision = True
        return torch.promote_types(torch.promote_types(current, old), torch.float32)

    def _kl_filter(self, scores: Scores) -> torch.Tensor:
        """GRPOLoss' KL-Mask: the loss mask without tokens far from the old policy."""
        threshold = self.kl_mask_threshold
        if threshold is None or threshold <= 0:
            return scores.mask
        drift = 0.5 * scores.token_log_ratio.detach() ** 2
        return scores.mask & (drift <= threshold)

    def _reduce_terms(
        self,
        value: torch.Tensor,
        mask: torch.Tensor,
        weight: torch.Tensor | None,
        tensordict: TensorDictBase,
    ) -> torch.Tensor:
        """Weights the terms, per sequence ``[B, 1, 1]`` or per token ``[B, T, 1]``, and
        reduces them to the loss. Per-token terms are masked, then averaged as
        GRPOLoss' ``prompt_mean`` averages them (each sequence's mean over its valid
        tokens, then the mean over sequences), or go to its ``_aggregate_loss_value``
        for the other aggregations.

        ``weight`` is ``[B]`` (per sequence) or ``[B, T]`` (per token), or ``None``.
        """
        if weight is not None:
            value = value * weight.to(value.dtype).reshape(weight.shape[0], -1, 1)
        reduce = self.aggregation == "prompt_mean" and self.reduction != "none"
        if reduce and value.shape[-2] == 1:
            # the mean over a sequence's valid tokens of its constant term is the term
            # itself; a sequence without valid tokens counts 0
            return torch.where(mask.any(-1), value.reshape(-1), 0.0).mean()
        # masked positions may hold inf (an overflowing ratio): never NaN in the product
        value = torch.where(mask.unsqueeze(-1), value, 0.0)
        if reduce:  # GRPOLoss' prompt_mean, without its second product by the mask
            count = mask.sum(-1, keepdim=True).clamp_min(1).to(value.dtype)
            return (value.sum(-2) / count).mean(0).squeeze(-1)
        return self._aggregate_loss_value(value, mask, tensordict=tensordict)

    def _regularizers(
        self,
        batch: Batch,
        current: torch.Tensor,
        dist: d.Distribution,
        mask: torch.Tensor,
        weight: torch.Tensor | None,
        tensordict: TensorDictBase,
    ) -> dict[str, torch.Tensor]:
        """GRPOLoss' entropy bonus and KL terms, with GRPOLoss' own helpers."""
        out = {}
        if self.entropy_bonus:
            entropy = self._get_entropy(dist, adv_shape=batch.advantage.shape[:-1])
            out["entropy"] = entropy.detach().mean()
            out["loss_entropy"] = self._reduce_terms(
                -self.entropy_coeff * entropy, mask, weight, tensordict
            )
        terms = []
        if self.kl_to_ref_coeff is not None and self.kl_to_ref_coeff > 0:
            terms.append(("ref", batch.ref, self.kl_to_ref_coeff))
        if self.kl_to_inference_coeff is not None:
            rollout = batch.old if batch.rollout is None else batch.rollout
            terms.append(("inference", rollout, self.kl_to_inference_coeff))
        if terms:
            # _kl_to_ref reads the current log-probs from this throwaway tensordict
            holder = TensorDict({"_cur_log_prob": current}, batch_size=current.shape[:1])
            for name, reference, coeff in terms:
                loss, value = self._kl_to_ref(
                    holder, ref_log_prob=reference, coeff=coeff, mask=mask, dist=dist
                )
                if batch.scale is not None:  # a batch mean, counted once per sequence
                    loss = loss * batch.scale.sum().to(loss.dtype)
                out[f"loss_kl_to_{name}"], out[f"kl_to_{name}"] = loss, value.detach()
        return out


class GSPOTokenLossOutput(GSPOLossOutput):
    pass


GSPOTokenLossOutput.__doc__ = """GSPO-token loss output: the same fields as :class:`GSPOLossOutput`.

Examples:
    >>> from torchrl_gspo import GSPOLossOutput, GSPOTokenLossOutput
    >>> issubclass(GSPOTokenLossOutput, GSPOLossOutput)
    True
"""


class GSPOTokenLoss(GSPOLoss):
    r"""GSPO-token: GSPO's sequence ratio with one advantage per token (paper §4.3).

    For per-token advantages :math:`\hat A_{i,t}` (multi-turn, tool use, process
    rewards), GSPO-token (Zheng et al., 2025,
    `arXiv:2507.18071 <https://arxiv.org/abs/2507.18071>`_, Eqs. 13-17) gives every
    valid token the importance weight

    .. math::

        s_{i,t}(\theta) = \text{sg}[s_i(\theta)]
            \frac{\pi_\theta(y_{i,t} \mid x, y_{i,<t})}
                 {\text{sg}[\pi_\theta(y_{i,t} \mid x, y_{i,<t})]},

    where :math:`\text{sg}` stops the gradient and :math:`s_i` is
    :class:`GSPOLoss`' sequence ratio. Its value is exactly :math:`s_i`, and the
    objective

    .. math::

        J(\theta) = \mathbb{E}\Big[\frac{1}{G} \sum_{i=1}^{G} \frac{1}{|y_i|}
            \sum_{t=1}^{|y_i|} \min\big(s_{i,t} \hat A_{i,t},\ \text{clip}(s_{i,t},
            1 - \epsilon_\text{low}, 1 + \epsilon_\text{high}) \hat A_{i,t}\big)\Big]

    has the unclipped gradient of Eq. 17. With :math:`\hat A_{i,t} = \hat A_i` it
    equals :class:`GSPOLoss` in value, clipping and gradient (tested). Per-token
    advantages are read left-aligned with the tokens (:doc:`/inputs`); defaults,
    keyword arguments and diagnostics are :class:`GSPOLoss`' own.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from torchrl_gspo import GSPOTokenLoss
        >>> _ = torch.manual_seed(0)
        >>> words = models.WordLevel({f"t{i}": i for i in range(32)}, unk_token="t2")
        >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words),
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
    advantage_level: ClassVar[Literal["sequence", "token"]] = "token"

    def _objective(self, scores: Scores) -> torch.Tensor:
        r"""GRPOLoss' clipped surrogate per token on :math:`\log s_{i,t}`, ``[B, T, 1]``.

        :math:`s_{i,t}` has the value :math:`s_i` on every token of a response, so the
        ratio and its clipped value are computed once per response, ``[B, 1, 1]``; the
        token's own ratio carries the gradient, :math:`\nabla s_{i,t} = s_i \nabla
        \log \pi_\theta(y_{i,t})`. The pessimistic minimum is taken per token (the
        advantage may change sign along a response), the unclipped term on ties,
        where the two agree in value and gradient.
        """
        log_ratio = scores.log_ratio.detach()
        log_ratio = log_ratio.clamp(min=torch.finfo(log_ratio.dtype).min, max=self.max_log_ratio)
        ratio = log_ratio.exp().reshape(-1, 1)
        clipped = log_ratio.clamp(*self._clip_bounds).exp().reshape(-1, 1, 1) * scores.advantage
        # 0 off the mask (scores are); a token of probability 0 gives its sequence ratio
        # 0 and no gradient, as in GSPOLoss: its -inf - (-inf) = NaN becomes 0
        token = (scores.current - scores.current.detach()).nan_to_num(0.0)
        if self.max_log_ratio is not None:  # no gradient where GSPOLoss clamps either
            token = token * (log_ratio < self.max_log_ratio).reshape(-1, 1)
        # the value s_i (1 + 0) is s_i exactly, an overflowing s_i included
        unclipped = (ratio * (token + 1)).unsqueeze(-1) * scores.advantage
        return -torch.where(clipped < unclipped, clipped, unclipped)
