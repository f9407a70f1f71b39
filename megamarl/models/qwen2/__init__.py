"""Qwen2 / Qwen2.5 family: like Llama plus a bias on q/k/v (not on o_proj), tied or untied embeddings.

The QKV bias is fused per query group exactly like the QKV weight rows (``add_qkv_bias``).
Sliding-window attention (``use_sliding_window=True``) is rejected: the Megatron side runs full
causal attention, so outputs would differ beyond the window.
"""

from __future__ import annotations

from megamarl.models.spec import DecoderArch, decoder_arch

MODEL_TYPES = ("qwen2",)


def arch_from_hf(hf_config) -> DecoderArch:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(
            "qwen2: use_sliding_window=True unsupported (Megatron side uses full causal attention)"
        )
    # Qwen2 always has QKV bias and derives head_dim from hidden/heads.
    return decoder_arch(
        hf_config, "qwen2", qkv_bias=True, head_dim=hf_config.hidden_size // hf_config.num_attention_heads
    )
