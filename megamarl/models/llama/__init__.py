"""Llama family (SmolLM2, Llama-2/3): GQA, no biases, tied or untied embeddings, llama3 rope scaling.

HF ``LlamaConfig`` -> ``DecoderArch``. ``attention_bias`` (q/k/v *and* o bias in HF) and ``mlp_bias``
are rejected: megatron-core's ``add_qkv_bias`` has no output-projection bias, and no checkpoint we
target uses them.
"""

from __future__ import annotations

from megamarl.models.spec import DecoderArch, rope_from_hf

MODEL_TYPES = ("llama",)


def arch_from_hf(hf_config) -> DecoderArch:
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ValueError("llama: attention_bias/mlp_bias=True unsupported (megatron has no o_proj/MLP bias here)")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"llama: hidden_act='{hf_config.hidden_act}' unsupported; allowed: ['silu']")
    theta, scaling = rope_from_hf(hf_config)
    num_heads = hf_config.num_attention_heads
    return DecoderArch(
        family="llama",
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
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )
