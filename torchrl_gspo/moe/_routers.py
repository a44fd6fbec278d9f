# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The Mixture-of-Experts routers Routing Replay supports, and their weight formulas.

A router is found by structure: a child with a ``top_k`` of a module that holds an
``experts`` child (the MoE block). Every supported router returns ``(logits, weights,
indices)`` and its block uses the weights as given; replaying forced ``indices`` means
recomputing their weights from the current logits with the family's own formula, so
that with unchanged weights the replayed forward is bit-identical to the plain one.
The formulas follow the routers of Hugging Face transformers (5.16 to 5.25).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def _softmax_gather(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE, Qwen3-MoE, Qwen3-Next, OLMoE: softmax over all experts, renormalized
    over the top-k when ``norm_topk_prob``, in the logits' dtype."""
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def _softmax_renormalized(
    router: nn.Module, logits: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """Mixtral: softmax over all experts in float32, always renormalized, kept float32."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, idx)
    return weights / weights.sum(dim=-1, keepdim=True)


def _softmax_of_selected(
    router: nn.Module, logits: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """GPT-OSS: softmax over the selected experts' (biased) logits only."""
    return torch.softmax(logits.gather(-1, idx), dim=1, dtype=logits.dtype)


def _sigmoid_scaled(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3: sigmoid scores (the selection's correction bias left out),
    renormalized when ``norm_topk_prob``, times ``routed_scaling_factor``."""
    weights = logits.sigmoid().gather(1, idx)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


_PREFIX = "transformers.models."
FORMULAS: dict[str, Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    _PREFIX + "qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter": _softmax_gather,
    _PREFIX + "qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter": _softmax_gather,
    _PREFIX + "qwen3_next.modeling_qwen3_next.Qwen3NextTopKRouter": _softmax_gather,
    _PREFIX + "olmoe.modeling_olmoe.OlmoeTopKRouter": _softmax_gather,
    _PREFIX + "mixtral.modeling_mixtral.MixtralTopKRouter": _softmax_renormalized,
    _PREFIX + "gpt_oss.modeling_gpt_oss.GptOssTopKRouter": _softmax_of_selected,
    _PREFIX + "deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter": _sigmoid_scaled,
}
FAMILIES = "Qwen2-MoE, Qwen3-MoE, Qwen3-Next, OLMoE, Mixtral, GPT-OSS and DeepSeek-V3"


def _name(module: nn.Module) -> str:
    """The module's class, with the module that defines it (the registry's key)."""
    return f"{type(module).__module__}.{type(module).__qualname__}"


def find(model: nn.Module) -> list[tuple[nn.Module, nn.Module, Callable]]:
    """``(MoE block, router, weight formula)`` for every MoE layer of ``model``.

    Raises:
        ValueError: when the model has no router, or a router of another family (its
            class is named).
    """
    pairs = [
        (block, child)
        for block in model.modules()
        if isinstance(getattr(block, "experts", None), nn.Module)
        for name, child in block.named_children()
        if name != "experts" and hasattr(child, "top_k")
    ]
    if not pairs:
        holders = sorted(
            {_name(m) for m in model.modules() if isinstance(getattr(m, "top_k", None), int)}
        )
        raise ValueError(
            "RoutingReplay found no Mixture-of-Experts router in the model (a child with a "
            f"`top_k` of a module that holds `experts`); modules with a `top_k`: {holders}. "
            "The supported families are in the documentation's Mixture-of-Experts page."
        )
    unknown = sorted({_name(router) for _, router in pairs if _name(router) not in FORMULAS})
    if unknown:
        raise ValueError(
            f"RoutingReplay replays the routers of {FAMILIES}, each with its own weight "
            f"formula; this model's {unknown} route another way, and a replay with the "
            "wrong formula would make every ratio off-policy. The supported families and "
            "how to add one are in the documentation's Mixture-of-Experts page."
        )
    return [(block, router, FORMULAS[_name(router)]) for block, router in pairs]
