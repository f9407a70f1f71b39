"""Qwen2 / Qwen2.5 family: like Llama plus a bias on q/k/v (not on o_proj), tied or untied embeddings.

The QKV bias is fused per query group exactly like the QKV weight rows (``add_qkv_bias``).
Sliding-window attention (``use_sliding_window=True``) is rejected: the Megatron side runs full
causal attention, so outputs would differ beyond the window.
"""

from __future__ import annotations

from megamarl.models.spec import DecoderArch, rope_from_hf

MODEL_TYPES = ("qwen2",)


def arch_from_hf(hf_config) -> DecoderArch:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("qwen2: use_sliding_window=True unsupported (Megatron side uses full causal attention)")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"qwen2: hidden_act='{hf_config.hidden_act}' unsupported; allowed: ['silu']")
    theta, scaling = rope_from_hf(hf_config)
    num_heads = hf_config.num_attention_heads
    return DecoderArch(
        family="qwen2",
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=hf_config.hidden_size // num_heads,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta,
        rope_scaling_factor=scaling,
        qkv_bias=True,
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )
