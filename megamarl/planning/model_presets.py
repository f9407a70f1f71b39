"""Model shapes for planning without weights: named architecture presets and HF ``config.json`` reading.

A 70B checkpoint cannot be downloaded here (and a cluster dry-run should not need one), so the
dry-run and memory estimate work from a ``ModelShape``: a policy's ``model:`` is either a preset
name below (values copied from the public ``config.json`` of each model) or a local HF directory.
Only shape facts live here; weight conversion belongs to ``megamarl.models``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megamarl.models.packaged import resolve_model_path


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int  # SwiGLU: gate and up are each [hidden, ffn]
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on queries and keys (Qwen3)

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention (q, k, v, o), SwiGLU MLP, two RMSNorms
        (and the QK-norms)."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size
        if self.qkv_bias:
            attention += q_out + 2 * kv_out
        if self.qk_norm:
            attention += 2 * self.head_dim
        mlp = 3 * self.hidden_size * self.ffn_hidden_size
        return attention + mlp + 2 * self.hidden_size

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rows of the Megatron model at ``tp``: the rule of
        ``megamarl.models.spec.DecoderArch.padded_vocab_size`` with ``build_model``'s ``vocab_multiple=1``."""
        return -(-self.vocab_size // tp) * tp

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        head = 0 if self.tied_embeddings else self.embedding_params
        return self.num_layers * self.layer_params + self.embedding_params + head + self.hidden_size


# name -> shape, from each model's public config.json (hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, tie_word_embeddings).
PRESETS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": ModelShape(80, 8192, 64, 8, 28672, 128256),
    "llama3.2-1b": ModelShape(16, 2048, 32, 8, 8192, 128256, head_dim=64, tied_embeddings=True),
    "llama3.2-3b": ModelShape(28, 3072, 24, 8, 8192, 128256, head_dim=128, tied_embeddings=True),
    "qwen2.5-0.5b": ModelShape(24, 896, 14, 2, 4864, 151936, tied_embeddings=True, qkv_bias=True),
    "qwen2.5-7b": ModelShape(28, 3584, 28, 4, 18944, 152064, qkv_bias=True),
    "qwen2.5-72b": ModelShape(80, 8192, 64, 8, 29568, 152064, qkv_bias=True),
    "qwen3-8b": ModelShape(36, 4096, 32, 8, 12288, 151936, head_dim=128, qk_norm=True),
    "qwen3-32b": ModelShape(64, 5120, 64, 8, 25600, 151936, head_dim=128, qk_norm=True),
    "smollm2-135m-instruct": ModelShape(30, 576, 9, 3, 1536, 49152, tied_embeddings=True),
}


def shape_from_hf_config(config: dict) -> ModelShape:
    """A ``ModelShape`` from the dict of a HF ``config.json`` (Llama / Qwen2 / Qwen3 style)."""
    num_heads = config["num_attention_heads"]
    return ModelShape(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        ffn_hidden_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        head_dim=config.get("head_dim") or 0,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
        qk_norm=config.get("model_type") == "qwen3",  # the families of megamarl.models.families
    )


def resolve_model_shape(model: str, *, key: str = "model") -> ModelShape:
    """Preset name -> preset; local HF directory -> its config.json; packaged model -> its config."""
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():  # a packaged model name (materialized once into the cache)
        try:
            path = resolve_model_path(model, key=key)
        except ValueError as exc:
            raise ValueError(f"{exc}; or an architecture preset: {sorted(PRESETS)}") from None
    return shape_from_hf_config(json.loads((path / "config.json").read_text()))
