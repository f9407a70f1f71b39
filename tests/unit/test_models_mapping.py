"""Pure-CPU checks of the model registry, HF config -> DecoderArch/TransformerConfig and the
HF <-> Megatron packing rules (no process groups)."""

from __future__ import annotations

import pytest
import torch

from megamarl.models import mapping
from megamarl.models.families import MODEL_FAMILIES, arch_from_hf
from megamarl.models.moe import MoEArch
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

    families = sorted(["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
    assert MODEL_FAMILIES.names() == families
    with pytest.raises(ValueError, match=rf"model_type='gpt2'.*supported model_type: \{families}"):
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


def test_moe_arch_from_hf_and_its_megatron_config():
    # Qwen3-MoE: layer 1 dense (mlp_only_layers), top-k renormalised (megatron's default softmax order)
    qwen3 = arch_from_hf(tiny_config("qwen3_moe"))
    sparse = (True, False, True, True)
    assert qwen3.moe == MoEArch(
        num_experts=8, top_k=2, ffn_hidden_size=32, sparse_layers=sparse, norm_topk_prob=True
    )
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.ffn_hidden_size == 128  # the dense layer's MLP
    config = transformer_config(qwen3, tp=2, ep=4, etp=1)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 2, 32)
    assert config.moe_layer_freq == [1, 0, 1, 1] and config.moe_router_pre_softmax is False
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (4, 1)
    assert config.moe_shared_expert_intermediate_size is None
    assert config.moe_router_load_balancing_type == "none"
    # Qwen2-MoE: every second layer sparse, shared expert with a sigmoid gate, top-k of the full softmax
    qwen2 = arch_from_hf(tiny_config("qwen2_moe", decoder_sparse_step=2))
    assert qwen2.moe == MoEArch(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=32,
        sparse_layers=(False, True, False, True),
        norm_topk_prob=False,
        shared_expert_ffn_hidden_size=48,
        shared_expert_gate=True,
    )
    assert qwen2.qkv_bias and not qwen2.qk_norm
    config = transformer_config(qwen2, tp=2)
    assert config.moe_router_pre_softmax is True and config.moe_shared_expert_gate is True
    assert (config.moe_shared_expert_intermediate_size, config.expert_tensor_parallel_size) == (48, 2)
    with pytest.raises(ValueError, match="ep=3 does not divide the model's 8 experts"):
        transformer_config(qwen2, ep=3)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        arch_from_hf(tiny_config("qwen2_moe", shared_expert_intermediate_size=0))


def test_moe_rules_name_experts_by_their_global_index():
    sequential = "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    rule, layer, rest = mapping.rule_for(sequential)
    assert (layer, mapping.expert_index(sequential)) == (3, 5)
    assert rest == "mlp.experts.local_experts.{j}.linear_fc1.weight"
    assert rule.expert and rule.kind == "gate_up"
    assert rule.names(3, 13) == [
        "model.layers.3.mlp.experts.13.gate_proj.weight",
        "model.layers.3.mlp.experts.13.up_proj.weight",
    ]
    grouped = "decoder.layers.0.mlp.experts.linear_fc2.weight7"  # TEGroupedMLP
    rule, _, _ = mapping.rule_for(grouped)
    assert mapping.expert_index(grouped) == 7 and rule.kind == "row" and rule.expert
    assert rule.names(0, 7) == ["model.layers.0.mlp.experts.7.down_proj.weight"]
    for name, kind, hf in [
        ("mlp.router.weight", "replicated", "mlp.gate.weight"),
        ("mlp.shared_experts.linear_fc2.weight", "row", "mlp.shared_expert.down_proj.weight"),
        ("mlp.shared_experts.gate_weight", "replicated", "mlp.shared_expert_gate.weight"),
    ]:
        rule, _, _ = mapping.rule_for(f"decoder.layers.1.{name}")
        assert (rule.kind, rule.expert, rule.names(1)) == (kind, False, [f"model.layers.1.{hf}"])
    assert mapping.expert_index("decoder.layers.1.mlp.router.weight") is None
    # EP rank 3 of 4 holds experts 6 and 7 of 8
    moe = MoEArch(num_experts=8, top_k=2, ffn_hidden_size=4, sparse_layers=(True,), norm_topk_prob=True)
    assert [moe.global_expert(j, ep_rank=3, ep=4) for j in range(2)] == [6, 7]


def test_hf_param_names_of_a_moe_model():
    arch = arch_from_hf(tiny_config("qwen2_moe", num_hidden_layers=2, mlp_only_layers=[0]))
    names = mapping.hf_param_names(arch)
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    layer1 = [n for n in names if n.startswith("model.layers.1.mlp.")]
    # router + 8 experts x 3 + shared expert (3) + its gate
    assert len(layer1) == 1 + 8 * 3 + 3 + 1
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in layer1
    assert "model.layers.1.mlp.shared_expert_gate.weight" in layer1


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
