"""Qwen3-MoE family: Qwen3's attention (q/k RMSNorm, explicit ``head_dim``) with routed experts in the
sparse layers (``models.moe``): softmax router, top-k, ``norm_topk_prob`` renormalisation, no shared
expert; ``mlp_only_layers`` / ``decoder_sparse_step`` layers are dense MLPs of ``intermediate_size``.
"""

from __future__ import annotations

from megamarl.models.moe import qwen_moe_arch
from megamarl.models.spec import DecoderArch, decoder_arch

MODEL_TYPES = ("qwen3_moe",)


def arch_from_hf(hf_config) -> DecoderArch:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(
            "qwen3_moe: use_sliding_window=True unsupported (Megatron side uses full causal attention)"
        )
    return decoder_arch(
        hf_config,
        "qwen3_moe",
        qk_norm=True,
        qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        moe=qwen_moe_arch(hf_config, shared_expert=False),
    )
