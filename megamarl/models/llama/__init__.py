"""Llama family (SmolLM2, Llama-2/3): GQA, no biases, tied or untied embeddings, llama3 rope scaling.

HF ``LlamaConfig`` -> ``DecoderArch``. ``attention_bias`` (q/k/v *and* o bias in HF) and ``mlp_bias``
are rejected: megatron-core's ``add_qkv_bias`` has no output-projection bias, and no checkpoint we
target uses them.
"""

from __future__ import annotations

from megamarl.models.spec import DecoderArch, decoder_arch

MODEL_TYPES = ("llama",)


def arch_from_hf(hf_config) -> DecoderArch:
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ValueError(
            "llama: attention_bias/mlp_bias=True unsupported (megatron has no o_proj/MLP bias here)"
        )
    return decoder_arch(hf_config, "llama")
