"""Qwen3 (dense) family: per-head RMSNorm on queries and keys (``q_norm``/``k_norm``, applied before
rope, as megatron-core's ``qk_layernorm``), an explicit ``head_dim`` that may differ from
hidden/heads, no QKV bias by default.
"""

from __future__ import annotations

from megamarl.models.spec import DecoderArch, rope_from_hf

MODEL_TYPES = ("qwen3",)


def arch_from_hf(hf_config) -> DecoderArch:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("qwen3: use_sliding_window=True unsupported (Megatron side uses full causal attention)")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"qwen3: hidden_act='{hf_config.hidden_act}' unsupported; allowed: ['silu']")
    theta, scaling = rope_from_hf(hf_config)
    num_heads = hf_config.num_attention_heads
    return DecoderArch(
        family="qwen3",
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta,
        rope_scaling_factor=scaling,
        qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=True,
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )
