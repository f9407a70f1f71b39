"""Pure-CPU checks of the model registry, HF config -> DecoderArch/TransformerConfig and the
HF <-> Megatron packing rules (no process groups)."""

from __future__ import annotations

import pytest
import torch

from megamarl.models import mapping
from megamarl.models.families import MODEL_FAMILIES, arch_from_hf
from megamarl.models.spec import DecoderArch, rope_from_hf, transformer_config
from megamarl.models.tiny import tiny_config

ARCH = DecoderArch(
    family="llama",
    num_layers=2,
    hidden_size=16,
    num_heads=8,
    num_kv_heads=4,
    head_dim=3,
    ffn_hidden_size=12,
    vocab_size=10,
    max_position_embeddings=32,
    norm_eps=1e-6,
    rope_theta=1e4,
)


def test_registry_lists_supported_families_on_unknown_model_type():
    from transformers import GPT2Config

    assert MODEL_FAMILIES.names() == ["llama", "qwen2", "qwen3"]
    with pytest.raises(
        ValueError, match=r"model_type='gpt2'.*supported model_type: \['llama', 'qwen2', 'qwen3'\]"
    ):
        arch_from_hf(GPT2Config())


@pytest.mark.parametrize(
    "family,checks",
    [
        ("llama", {"tied_embeddings": True, "qkv_bias": False, "qk_norm": False}),
        ("qwen2", {"tied_embeddings": False, "qkv_bias": True, "qk_norm": False}),
        ("qwen3", {"tied_embeddings": False, "qkv_bias": False, "qk_norm": True, "head_dim": 24}),
    ],
)
def test_arch_from_hf_per_family(family, checks):
    overrides = {"head_dim": 24} if family == "qwen3" else {}
    arch = arch_from_hf(tiny_config(family, **overrides))
    assert arch.family == family and arch.num_kv_heads == 2 and arch.num_layers == 4
    for key, value in checks.items():
        assert getattr(arch, key) == value, key
    config = transformer_config(arch, tp=2, pp=2)
    assert config.kv_channels == arch.head_dim and config.add_qkv_bias == arch.qkv_bias
    assert config.qk_layernorm == arch.qk_norm and config.num_query_groups == 2


def test_family_quirks_rejected():
    with pytest.raises(ValueError, match="sliding_window"):
        arch_from_hf(tiny_config("qwen2", use_sliding_window=True))
    with pytest.raises(ValueError, match="attention_bias"):
        arch_from_hf(tiny_config("llama", attention_bias=True))


def test_rope_parameters():
    from transformers import LlamaConfig

    llama3 = LlamaConfig(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    )
    assert rope_from_hf(llama3) == (5e5, 32.0)
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        rope_from_hf(LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}))


def test_padded_vocab():
    assert ARCH.padded_vocab_size(1) == 10 and ARCH.padded_vocab_size(4) == 12
    assert ARCH.padded_vocab_size(2, multiple=8) == 16


def _random_hf(rule, layer=0):
    shapes = {
        "qkv": [(8 * 3, 16), (4 * 3, 16), (4 * 3, 16)],
        "gate_up": [(12, 16), (12, 16)],
        "row": [(16, 8 * 3)],
        "vocab": [(10, 16)],
        "replicated": [(16,)],
    }[rule.kind]
    return [torch.randn(s) for s in shapes]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    "megatron_name",
    [
        "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.bias",
        "mlp.linear_fc1.weight",
        "self_attention.linear_proj.weight",
        "input_layernorm.weight",
        "embedding.word_embeddings.weight",
    ],
)
def test_shard_then_merge_is_identity(tp, megatron_name):
    rule = mapping.MODEL_RULES.get(megatron_name) or mapping.LAYER_RULES[megatron_name]
    hf = _random_hf(rule)
    if megatron_name.endswith("bias"):
        hf = [t[:, 0].contiguous() for t in hf]
    padded = ARCH.padded_vocab_size(tp)
    shards = [
        mapping.shard_from_hf(rule, hf, tp_rank=r, tp=tp, arch=ARCH, padded_vocab=padded) for r in range(tp)
    ]
    merged = mapping.hf_from_shards(rule, shards, arch=ARCH)
    assert all(torch.equal(a, b) for a, b in zip(merged, hf)) and len(merged) == len(hf)
    if rule.kind == "vocab":
        assert sum(s.shape[0] for s in shards) == padded
        assert padded == 10 or torch.all(shards[-1][-(padded - 10) :] == 0)  # zero padding rows


def test_qkv_layout_is_per_query_group():
    # 8 query heads, 4 groups, head_dim 3: group g = [q_{2g}; q_{2g+1}; k_g; v_g]
    q = torch.arange(8).repeat_interleave(3)[:, None].float()
    k, v = q[:12] + 100, q[:12] + 200
    fused = mapping.qkv_pack(q, k, v, ARCH)[:, 0].reshape(4, 4, 3)[:, :, 0]
    assert fused[1].tolist() == [2, 3, 101, 201]
    # TP=2: rank 1 holds groups 2 and 3
    shard = mapping.shard_from_hf(
        mapping.LAYER_RULES["self_attention.linear_qkv.weight"],
        [q, k, v],
        tp_rank=1,
        tp=2,
        arch=ARCH,
        padded_vocab=10,
    )
    assert shard[0, 0] == 4 and shard.shape == (24, 1)


def test_gate_up_per_rank_layout():
    gate, up = torch.arange(4.0)[:, None], torch.arange(4.0)[:, None] + 10
    shard = mapping.shard_from_hf(
        mapping.LAYER_RULES["mlp.linear_fc1.weight"], [gate, up], tp_rank=1, tp=2, arch=ARCH, padded_vocab=10
    )
    assert shard[:, 0].tolist() == [2, 3, 12, 13]


def test_rule_for_unknown_name_raises():
    with pytest.raises(KeyError, match="no HF mapping"):
        mapping.rule_for("decoder.layers.0.mystery.weight")
    assert mapping.rule_for("decoder.layers.3.mlp.linear_fc2.weight")[:2] == (
        mapping.LAYER_RULES["mlp.linear_fc2.weight"],
        3,
    )


def test_attention_mask_for_padding():
    from megamarl.models.bridge import attention_mask_for, default_position_ids

    ids = torch.zeros(1, 3, dtype=torch.long)
    pad = torch.tensor([[0, 1, 1]])
    mask = attention_mask_for(ids, pad)
    assert mask.shape == (1, 1, 3, 3) and mask[0, 0, 2].tolist() == [True, False, False]
    assert default_position_ids(ids, pad).tolist() == [[0, 0, 1]]


def test_lora_config_validation():
    from megamarl.models.lora import LoraConfig

    with pytest.raises(ValueError, match="lora.targets"):
        LoraConfig(targets=("q_proj",))
    assert LoraConfig(rank=4, alpha=8).scaling == 2.0
