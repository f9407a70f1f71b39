"""Model shapes for planning without weights: named architecture presets and HF ``config.json`` reading.

A 70B checkpoint cannot be downloaded here (and a cluster dry-run should not need one), so the
dry-run and memory estimate work from a ``ModelShape``: a policy's ``model:`` is either a preset
name below (values copied from the public ``config.json`` of each model) or a local HF directory.
Only shape facts live here; weight conversion belongs to ``megamarl.models``. A mixture-of-experts
model (Qwen3-MoE, Qwen2-MoE, Mixtral) carries a ``MoeShape``: every decoder layer's MLP is then its
routed experts, its router and an optional shared expert instead of one SwiGLU MLP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megamarl.models.packaged import resolve_model_path

# HF ``model_type`` -> the config.json keys of its experts: (expert count, top-k, expert ffn size)
MOE_CONFIG_KEYS = {
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "mixtral": ("num_local_experts", "num_experts_per_tok", "intermediate_size"),
}


@dataclass(frozen=True)
class MoeShape:
    """The experts of every decoder layer: ``num_experts`` SwiGLU experts of ``ffn_hidden_size``, each
    token routed to ``top_k`` of them by a linear router ``[num_experts, hidden]``; Qwen2-MoE adds a
    shared expert of ``shared_ffn_hidden_size`` that every token passes, scaled by a sigmoid gate
    ``[1, hidden]``."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int
    shared_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoE top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")


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
    moe: MoeShape | None = None  # experts replace every layer's MLP (ffn_hidden_size is then unused)

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
        return attention + self.mlp_params + 2 * self.hidden_size

    @property
    def mlp_params(self) -> int:
        """One layer's MLP: SwiGLU (gate, up, down); MoE: every expert, the router, the shared expert."""
        if self.moe is None:
            return 3 * self.hidden_size * self.ffn_hidden_size
        return self.moe.num_experts * self.expert_params + self.router_params + self.shared_expert_params

    @property
    def expert_params(self) -> int:
        """One routed expert: SwiGLU gate, up and down of ``moe.ffn_hidden_size``."""
        return 3 * self.hidden_size * self.moe.ffn_hidden_size if self.moe else 0

    @property
    def router_params(self) -> int:
        return self.moe.num_experts * self.hidden_size if self.moe else 0

    @property
    def shared_expert_params(self) -> int:
        if self.moe is None:
            return 0
        return 3 * self.hidden_size * self.moe.shared_ffn_hidden_size + (
            self.hidden_size if self.moe.shared_expert_gate else 0
        )

    @property
    def num_active_params(self) -> int:
        """Parameters one token passes through (an MoE model's "A3B"): top-k experts of every layer."""
        if self.moe is None:
            return self.num_params
        return (
            self.num_params - self.num_layers * (self.moe.num_experts - self.moe.top_k) * self.expert_params
        )

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
    # mixture of experts (+ num_experts, num_experts_per_tok, moe_intermediate_size; Mixtral:
    # num_local_experts and intermediate_size per expert); every layer sparse (decoder_sparse_step 1)
    "qwen3-30b-a3b": ModelShape(
        48, 2048, 32, 4, 6144, 151936, head_dim=128, qk_norm=True, moe=MoeShape(128, 8, 768)
    ),
    "qwen3-235b-a22b": ModelShape(
        94, 4096, 64, 4, 12288, 151936, head_dim=128, qk_norm=True, moe=MoeShape(128, 8, 1536)
    ),
    "mixtral-8x7b": ModelShape(32, 4096, 32, 8, 14336, 32000, moe=MoeShape(8, 2, 14336)),
}


def shape_from_hf_config(config: dict) -> ModelShape:
    """A ``ModelShape`` from the dict of a HF ``config.json`` (Llama / Qwen2 / Qwen3 style, and the MoE
    families of ``MOE_CONFIG_KEYS``)."""
    num_heads = config["num_attention_heads"]
    model_type = config.get("model_type")
    return ModelShape(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        ffn_hidden_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        head_dim=config.get("head_dim") or 0,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),  # the families of megamarl.models.families
        moe=moe_from_hf_config(config),
    )


def moe_from_hf_config(config: dict) -> MoeShape | None:
    """The experts of a HF ``config.json`` of an MoE family (None for a dense model). Only models whose
    every layer is sparse are planned: Qwen's ``mlp_only_layers`` / ``decoder_sparse_step`` > 1 (dense
    layers between sparse ones) are refused."""
    keys = MOE_CONFIG_KEYS.get(config.get("model_type", ""))
    if keys is None:
        return None
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"{config['model_type']} config.json with dense layers (mlp_only_layers="
            f"{config.get('mlp_only_layers')}, decoder_sparse_step={config.get('decoder_sparse_step')}): "
            "only models whose every layer is sparse are planned"
        )
    num_experts, top_k, ffn = (config[k] for k in keys)
    shared = config.get("shared_expert_intermediate_size") or 0
    return MoeShape(num_experts, top_k, ffn, shared, shared_expert_gate=bool(shared))


def declared_moe(model: str) -> MoeShape | None:
    """The experts of ``model`` without materialising anything: a preset's, or a local directory's
    ``config.json``'s; packaged models (and anything else) are dense."""
    if model in PRESETS:
        return PRESETS[model].moe
    config = Path(model).expanduser() / "config.json"
    return moe_from_hf_config(json.loads(config.read_text())) if config.is_file() else None


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
