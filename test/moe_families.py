# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Tiny random-init Hugging Face Mixture-of-Experts models, one per router family."""

from __future__ import annotations

import torch
import transformers

_COMMON = {
    "vocab_size": 32,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_experts_per_tok": 2,
    "intermediate_size": 32,
}
_DEEPSEEK = {
    "num_key_value_heads": 2,
    "moe_intermediate_size": 16,
    "n_shared_experts": 1,
    "first_k_dense_replace": 0,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
}

# family: (model class, config class, config arguments on top of _COMMON)
SUPPORTED = {
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4},
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {"moe_intermediate_size": 16, "num_experts": 4},
    ),
    "qwen3_next": (
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        {
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "num_experts": 4,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 2,
            "layer_types": ["linear_attention", "full_attention"],
        },
    ),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", {"num_experts": 4, "eos_token_id": None}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4}),
    "gpt_oss": (
        "GptOssForCausalLM",
        "GptOssConfig",
        {
            "num_local_experts": 4,
            "head_dim": 16,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        {
            **_DEEPSEEK,
            "n_routed_experts": 8,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
        },
    ),
}

REFUSED = {
    "GraniteMoeTopKRouter": ("GraniteMoeForCausalLM", "GraniteMoeConfig", {"num_local_experts": 4}),
    "MiniMaxTopKRouter": (
        "MiniMaxForCausalLM",
        "MiniMaxConfig",
        {
            "num_local_experts": 4,
            "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention"],
        },
    ),
    "Lfm2MoeTopKRouter": (
        "Lfm2MoeForCausalLM",
        "Lfm2MoeConfig",
        {
            "num_experts": 4,
            "moe_intermediate_size": 16,
            "num_dense_layers": 0,
            "layer_types": ["conv", "full_attention"],
        },
    ),
    "PhimoeTopKRouter": ("PhimoeForCausalLM", "PhimoeConfig", {"num_local_experts": 4}),
    "Glm4MoeTopkRouter": (
        "Glm4MoeForCausalLM",
        "Glm4MoeConfig",
        {
            "n_routed_experts": 4,
            "moe_intermediate_size": 16,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 0,
        },
    ),
    "Dots1TopkRouter": (
        "Dots1ForCausalLM",
        "Dots1Config",
        {
            "n_routed_experts": 4,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 0,
        },
    ),
    "DeepseekV2TopkRouter": (
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        {**_DEEPSEEK, "n_routed_experts": 4, "n_group": 1, "topk_group": 1},
    ),
    "Ernie4_5_MoeTopKRouter": (
        "Ernie4_5_MoeForCausalLM",
        "Ernie4_5_MoeConfig",
        {
            "moe_num_experts": 4,
            "moe_intermediate_size": 16,
            "moe_k": 2,
            "moe_layer_start_index": 0,
        },
    ),
    "HunYuanMoEV1Gate": (
        "HunYuanMoEV1ForCausalLM",
        "HunYuanMoEV1Config",
        {"num_experts": 4, "moe_topk": 2, "head_dim": 16},
    ),
    "Llama4Router": (
        "Llama4ForCausalLM",
        "Llama4TextConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 32,
            "head_dim": 16,
            "interleave_moe_layer_step": 1,
        },
    ),
    "Qwen3VLMoeTextTopKRouter": (
        "Qwen3VLMoeTextModel",
        "Qwen3VLMoeTextConfig",
        {"num_experts": 4, "moe_intermediate_size": 16, "head_dim": 16},
    ),
    "Qwen3OmniMoeThinkerTextTopKRouter": (
        "Qwen3OmniMoeThinkerTextModel",
        "Qwen3OmniMoeTextConfig",
        {"num_experts": 4, "moe_intermediate_size": 16, "head_dim": 16},
    ),
    "JetMoeTopKGating": (
        "JetMoeForCausalLM",
        "JetMoeConfig",
        {"num_key_value_heads": 2, "kv_channels": 16, "num_local_experts": 4},
    ),
}


def build(spec: tuple[str, str, dict], seed: int = 0) -> torch.nn.Module:
    """A random-init float32 model in eval mode; DeepSeek's selection bias made non-zero."""
    model_class, config_class, arguments = spec
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**_COMMON, **arguments})
    model = getattr(transformers, model_class)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):  # zeros at init: group-limited top-k made real
            with torch.no_grad():
                bias.copy_(0.05 * torch.randn(bias.shape, generator=gen))
    return model


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router of each MoE block, found independently of the library (by name)."""
    return [
        child
        for block in model.modules()
        if hasattr(block, "experts")
        for name, child in block.named_children()
        if name in ("gate", "router")
    ]
