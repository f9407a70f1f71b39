"""Qwen3 (dense) family: per-head RMSNorm on queries and keys (``q_norm``/``k_norm``, applied before
rope, as megatron-core's ``qk_layernorm``), an explicit ``head_dim`` that may differ from
hidden/heads, no QKV bias by default.
"""

from __future__ import annotations

from megamarl.models.spec import DecoderArch, decoder_arch

MODEL_TYPES = ("qwen3",)


def arch_from_hf(hf_config) -> DecoderArch:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(
            "qwen3: use_sliding_window=True unsupported (Megatron side uses full causal attention)"
        )
    return decoder_arch(
        hf_config, "qwen3", qk_norm=True, qkv_bias=bool(getattr(hf_config, "attention_bias", False))
    )
