"""Qwen2-MoE family (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (QKV bias) with routed experts plus
one always-on shared expert per sparse layer whose output is scaled by ``sigmoid(shared_expert_gate(x))``
(megatron-core's ``moe_shared_expert_gate``); ``norm_topk_prob`` is usually off (top-k of the softmax
over all experts: ``moe_router_pre_softmax``).
"""

from __future__ import annotations

from megamarl.models.moe import qwen_moe_arch
from megamarl.models.spec import DecoderArch, decoder_arch

MODEL_TYPES = ("qwen2_moe",)


def arch_from_hf(hf_config) -> DecoderArch:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(
            "qwen2_moe: use_sliding_window=True unsupported (Megatron side uses full causal attention)"
        )
    if not getattr(hf_config, "shared_expert_intermediate_size", 0):
        raise ValueError("qwen2_moe: shared_expert_intermediate_size must be > 0 (the shared expert)")
    return decoder_arch(
        hf_config,
        "qwen2_moe",
        qkv_bias=bool(getattr(hf_config, "qkv_bias", True)),
        head_dim=hf_config.hidden_size // hf_config.num_attention_heads,
        moe=qwen_moe_arch(hf_config, shared_expert=True),
    )
