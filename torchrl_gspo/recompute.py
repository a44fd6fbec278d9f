# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The trainer's old log-probabilities, recomputed next to the inference engine's."""

from __future__ import annotations

from typing import Literal

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from tensordict.utils import NestedKey, unravel_key
from torchrl.envs import Transform
from torchrl.modules.llm import LLMWrapperBase

from torchrl_gspo import _arguments
from torchrl_gspo.sampler_audit import SamplerAudit

__all__ = ["RecomputeOldLogProbs"]

# What the training wrapper must be: it scores the sampled tokens, one value each.
_WRAPPER_SETTINGS = (
    ("input_mode", "tokens"),
    ("generate", False),
    ("return_log_probs", True),
    ("pad_output", False),
)


class RecomputeOldLogProbs(Transform):
    r"""Writes the trainer's old log-probabilities, leaving the rollout ones untouched.

    GSPO's ratio :math:`s_i = \pi_\theta(y_i) / \pi_\text{old}(y_i)` assumes that
    :math:`\pi_\text{old}` is the trainer's own likelihood. An inference engine
    (vLLM in TorchRL's GRPO recipe) samples the responses and reports its own
    log-probabilities :math:`\log\pi_\text{roll}` at ``("log_probs", "full")``;
    they differ from the trainer's by engine numerics, by more than GSPO's clip
    range. This transform runs a no-grad forward of the *training* wrapper on the
    sampled tokens and writes its log-probabilities at ``out_key`` (by default
    ``"old_log_probs"``, so that :class:`~torchrl_gspo.GSPOLoss` finds them at
    its ``old_log_prob`` key, ``("old_log_probs", "full")``). The rollout
    log-probabilities stay where the collector wrote them; the loss then uses the
    recomputed ones in the ratio and the rollout ones for the rollout correction
    and its mismatch diagnostics (Zheng et al., 2025,
    `arXiv:2507.18071 <https://arxiv.org/abs/2507.18071>`_, discuss when the
    engine's likelihoods can serve directly).

    It must run once per rollout, before the first optimizer update on it: as the
    collector's ``postproc``, or as a replay-buffer transform, which runs it when
    a batch is written. A batch that already holds ``out_key`` is returned as it
    is, so a sample-time pass over such a buffer changes nothing. Do not add it as
    a sample-only transform (``append_transform(..., invert=False)`` on a buffer
    that did not write the key): later minibatches would be scored with updated
    weights.

    The written values are checked: in a lazily stacked batch each row must hold
    one log-probability per token, finite on every token of the sampled response
    (``("tokens", "response")``, when present), else a :class:`ValueError`
    names the rows.

    Args:
        policy (LLMWrapperBase): the training wrapper, e.g.
            ``TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens",
            generate=False, return_log_probs=True, pad_output=False)``, in eval
            mode. A wrapper with other values of these settings raises.

    Keyword Args:
        out_key (NestedKey, optional): where the wrapper's log-prob output (with
            its ``"full"`` entry) is written. Defaults to ``"old_log_probs"``.
        tokens_key (NestedKey, optional): the sampled sequences, prompt and
            response. Defaults to ``("tokens", "full")``.
        response_key (NestedKey, optional): the sampled responses, used by the
            check. Defaults to ``("tokens", "response")``.
        sampler_audit (SamplerAudit, optional): a
            :class:`~torchrl_gspo.SamplerAudit` that reads each batch's scored
            logits at the sampled response tokens (from a second no-grad forward,
            the wrapper's ``_get_sft_dist``, which GRPOLoss calls too) and tests
            that they were sampled from that distribution. Defaults to ``None``.
        sampler_check (str, optional): what a finding of the audit does:
            ``"warn"`` (once per run), ``"raise"`` (all ranks) or ``"ignore"``.
            Defaults to ``"warn"``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from torchrl_gspo import GSPOLoss, RecomputeOldLogProbs
        >>> _ = torch.manual_seed(0)
        >>> vocab = {f"t{i}": i for i in range(32)}
        >>> tokenizer = PreTrainedTokenizerFast(
        ...     tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t2")),
        ...     pad_token="t0", eos_token="t1")
        >>> config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        >>> policy = TransformersWrapper(Qwen2ForCausalLM(config).eval(), tokenizer=tokenizer,
        ...     input_mode="tokens", generate=False, return_log_probs=True, pad_output=False)
        >>> pairs = [([5, 6, 7], [8, 9, 1]), ([5, 6], [10, 11, 12, 13, 1])]
        >>> data = lazy_stack([
        ...     TensorDict(tokens=TensorDict(prompt=torch.tensor(p), response=torch.tensor(r),
        ...                                  full=torch.tensor(p + r)),
        ...                advantage=torch.tensor([[a]]))
        ...     for (p, r), a in zip(pairs, (1.0, -1.0))])
        >>> # rollout log-probs as an inference engine reports them: NaN on the prompt,
        >>> # 1e-3 above the trainer's on each response token
        >>> with torch.no_grad():
        ...     trainer = policy(data.copy()).get(("log_probs", "full"), as_list=True)
        >>> for row, (p, _), lp in zip(data.unbind(0), pairs, trainer):
        ...     row["log_probs"] = TensorDict(full=torch.cat([
        ...         torch.full((len(p),), float("nan")), lp[len(p):] + 1e-3]))
        >>> data = RecomputeOldLogProbs(policy)(data)
        >>> out = GSPOLoss(policy)(data)
        >>> float(out.sequence_log_ratio_max_abs)  # on-policy w.r.t. the recomputed old
        0.0
        >>> round(float(out.rollout_log_ratio_mean_abs), 6)  # the engine's mismatch
        0.001
    """

    def __init__(
        self,
        policy: LLMWrapperBase,
        *,
        out_key: NestedKey = "old_log_probs",
        tokens_key: NestedKey = ("tokens", "full"),
        response_key: NestedKey = ("tokens", "response"),
        sampler_audit: SamplerAudit | None = None,
        sampler_check: Literal["warn", "raise", "ignore"] = "warn",
    ) -> None:
        _arguments.choice("sampler_check", sampler_check, ("warn", "raise", "ignore"))
        if sampler_audit is not None and not isinstance(sampler_audit, SamplerAudit):
            raise TypeError(
                f"sampler_audit must be a torchrl_gspo.SamplerAudit, got {type(sampler_audit)}."
            )
        for name, expected in _WRAPPER_SETTINGS:
            value = getattr(policy, name, expected)
            if value != expected:
                raise ValueError(
                    f"RecomputeOldLogProbs needs the training wrapper ({name}={expected!r}), "
                    f"got {name}={value!r}. Use TransformersWrapper(model, "
                    "tokenizer=tokenizer, input_mode='tokens', generate=False, "
                    "return_log_probs=True, pad_output=False): it scores the sampled "
                    "tokens, one log-probability each."
                )
        super().__init__()
        self.policy = policy
        self.out_key = unravel_key(out_key)
        self.tokens_key = unravel_key(tokens_key)
        self.response_key = unravel_key(response_key)
        self.sampler_audit, self.sampler_check = sampler_audit, sampler_check

    def __call__(self, *args, **kwargs) -> TensorDictBase:
        # The whole call without gradients, its hooks included: a Routing Replay that a
        # pre-hook begins (RoutingReplay.replay_for, engine routes) then begins without
        # them too, as the forward runs.
        with torch.no_grad():
            return super().__call__(*args, **kwargs)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Writes the old log-probabilities into ``tensordict`` (unless present).

        Args:
            tensordict (TensorDictBase): the collected batch, with the sampled tokens.

        Returns:
            TensorDictBase: the same tensordict, holding ``out_key``.
        """
        return self._recompute(tensordict)

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self._recompute(tensordict)

    def _recompute(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self.out_key in tensordict.keys(include_nested=True):
            return tensordict
        with torch.no_grad():
            log_probs = self.policy(tensordict.copy()).get("log_probs")
        self._check(tensordict, log_probs.get("full", as_list=True))
        if self.sampler_audit is not None and self.sampler_check != "ignore":
            self._audit(tensordict)
        tensordict.set(self.out_key, log_probs)
        return tensordict

    def _audit(self, tensordict: TensorDictBase) -> None:
        """The scored logits at the sampled response tokens, into the audit."""
        dist = self.policy._get_sft_dist(tensordict.copy())
        tokens = tensordict.get(
            self.tokens_key, as_padded_tensor=True, padding_side="left", padding_value=0
        )
        mask = dist.mask
        self.sampler_audit.update(dist.logits[mask], tokens[mask])
        self.sampler_audit.check(self.sampler_check)

    def _check(self, tensordict: TensorDictBase, rows: list[torch.Tensor]) -> None:
        if not isinstance(tensordict, LazyStackedTensorDict):
            return
        tokens = tensordict.get(self.tokens_key, as_list=True)
        wrong = [
            i for i, (t, lp) in enumerate(zip(tokens, rows, strict=True)) if t.shape != lp.shape
        ]
        if self.response_key in tensordict.keys(include_nested=True) and not wrong:
            responses = tensordict.get(self.response_key, as_list=True)
            wrong = [
                i
                for i, (r, lp) in enumerate(zip(responses, rows, strict=True))
                if r.numel() and not lp[-r.numel() :].isfinite().all()
            ]
        if wrong:
            raise ValueError(
                f"RecomputeOldLogProbs: the training wrapper's log-probabilities do not "
                f"cover the sampled tokens at {self.tokens_key!r} in batch row(s) {wrong} "
                "(one finite value per response token expected). Check that the batch "
                "holds the sampled tokens and that the wrapper scores them unpadded "
                "(input_mode='tokens', pad_output=False)."
            )
