"""HF <-> Megatron tensor mapping for llama-style decoders (Llama, Qwen2, Qwen3).

Every Megatron parameter is described by a ``Rule``: which HF tensors it comes from and how it is
packed and split over tensor-parallel ranks. Packings: ``qkv`` (per query group: its query heads, key,
value; TP rank ``r`` holds contiguous groups; biases alike), ``gate_up`` (fc1 on rank ``r`` is
``[gate_r; up_r]``), ``column``/``row`` (split on dim 0 / dim 1), ``vocab`` (rows zero-padded to a
multiple of TP, stripped again on export) and ``replicated`` (norms). Layers are named by their global
index on the HF side (``model.layers.{i}``) and their local index per pipeline stage
(``decoder.layers.{l}``), ``i = layer.layer_number - 1``. MoE layers (``models.moe``): the router and the
shared expert like the dense parts; a routed expert's tensors (``Rule.expert``) are split over the
expert-TP group instead of TP and are named by their global expert index ``{e}`` on the HF side, their
local index on this EP rank on the Megatron side (``SequentialMLP``'s ``local_experts.{j}`` or
``TEGroupedMLP``'s ``weight{j}``).
The layouts element by element: docs/design-notes.md, "megamarl/models/mapping.py".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megamarl.models.spec import DecoderArch

TP_KINDS = ("column", "row", "vocab", "qkv", "gate_up")  # kinds that are split over TP ranks


@dataclass(frozen=True)
class Rule:
    kind: str  # replicated | column | row | vocab | qkv | gate_up
    hf_names: tuple[str, ...]  # templates; "{i}" = global layer index, "{e}" = global expert index
    expert: bool = False  # a routed expert's tensor: split over expert TP, one per expert over EP

    def names(self, layer: int | None, expert: int | None = None) -> list[str]:
        return [n.format(i=layer, e=expert) for n in self.hf_names]


_ATTN = "model.layers.{i}.self_attn."
_MLP = "model.layers.{i}.mlp."
# Megatron name (layer-relative for decoder layers) -> Rule. Local spec and TE spec names both listed.
LAYER_RULES: dict[str, Rule] = {
    "input_layernorm.weight": Rule("replicated", ("model.layers.{i}.input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": Rule(
        "replicated", ("model.layers.{i}.input_layernorm.weight",)
    ),
    "self_attention.linear_qkv.weight": Rule(
        "qkv", (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight")
    ),
    "self_attention.linear_qkv.bias": Rule(
        "qkv", (_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias")
    ),
    "self_attention.q_layernorm.weight": Rule("replicated", (_ATTN + "q_norm.weight",)),
    "self_attention.k_layernorm.weight": Rule("replicated", (_ATTN + "k_norm.weight",)),
    "self_attention.linear_proj.weight": Rule("row", (_ATTN + "o_proj.weight",)),
    "pre_mlp_layernorm.weight": Rule("replicated", ("model.layers.{i}.post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": Rule(
        "replicated", ("model.layers.{i}.post_attention_layernorm.weight",)
    ),
    "mlp.linear_fc1.weight": Rule("gate_up", (_MLP + "gate_proj.weight", _MLP + "up_proj.weight")),
    "mlp.linear_fc2.weight": Rule("row", (_MLP + "down_proj.weight",)),
}
_EXPERT = _MLP + "experts.{e}."
_SHARED = _MLP + "shared_expert."
# MoE layers (Qwen2-MoE, Qwen3-MoE names); "{j}" stands for the local expert index (``expert_index``).
MOE_RULES: dict[str, Rule] = {
    "mlp.router.weight": Rule("replicated", (_MLP + "gate.weight",)),
    "mlp.shared_experts.linear_fc1.weight": Rule(
        "gate_up", (_SHARED + "gate_proj.weight", _SHARED + "up_proj.weight")
    ),
    "mlp.shared_experts.linear_fc2.weight": Rule("row", (_SHARED + "down_proj.weight",)),
    "mlp.shared_experts.gate_weight": Rule("replicated", (_MLP + "shared_expert_gate.weight",)),
}
_EXPERT_FC1 = Rule("gate_up", (_EXPERT + "gate_proj.weight", _EXPERT + "up_proj.weight"), expert=True)
_EXPERT_FC2 = Rule("row", (_EXPERT + "down_proj.weight",), expert=True)
for _fc, _rule in (("linear_fc1", _EXPERT_FC1), ("linear_fc2", _EXPERT_FC2)):
    MOE_RULES[f"mlp.experts.local_experts.{{j}}.{_fc}.weight"] = _rule  # SequentialMLP
    MOE_RULES[f"mlp.experts.{_fc}.weight{{j}}"] = _rule  # TEGroupedMLP
LAYER_RULES.update(MOE_RULES)
_EXPERT_RE = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(?P<sequential>\d+)\.linear_fc[12]\.weight|linear_fc[12]\.weight(?P<grouped>\d+))$"
)
MODEL_RULES: dict[str, Rule] = {
    "embedding.word_embeddings.weight": Rule("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": Rule("replicated", ("model.norm.weight",)),
    "output_layer.weight": Rule("vocab", ("lm_head.weight",)),
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
LORA_MARKER = ".lora_adapters."  # parameters of LoRA adapters live under this attribute (lora.py)


def _expert_template(rest: str) -> tuple[str, int | None]:
    """(``rest`` with its local expert index replaced by ``{j}``, that index) or (``rest``, None)."""
    match = _EXPERT_RE.match(rest)
    if not match:
        return rest, None
    if match["sequential"] is not None:
        local = match["sequential"]
        return rest.replace(f"local_experts.{local}.", "local_experts.{j}.", 1), int(local)
    return rest[: -len(match["grouped"])] + "{j}", int(match["grouped"])


def expert_index(name: str) -> int | None:
    """The local expert index of a routed expert's Megatron parameter name (None for any other)."""
    match = _LAYER_RE.match(name)
    return _expert_template(match.group(2))[1] if match else None


def rule_for(name: str) -> tuple[Rule, int | None, str]:
    """(rule, local layer index or None, layer-relative name) of a Megatron parameter name."""
    match = _LAYER_RE.match(name)
    if match:
        local, rest = int(match.group(1)), _expert_template(match.group(2))[0]
        if rest in LAYER_RULES:
            return LAYER_RULES[rest], local, rest
    elif name in MODEL_RULES:
        return MODEL_RULES[name], None, name
    raise KeyError(f"no HF mapping for Megatron parameter '{name}'")


# ---- HF full tensors -> this TP rank's Megatron shard ---------------------------------------------


def qkv_pack(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: DecoderArch) -> torch.Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> Megatron's per-query-group fused layout."""
    ng = arch.num_kv_heads
    rest = q.shape[1:]
    parts = [t.reshape(ng, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def qkv_unpack(fused: torch.Tensor, arch: DecoderArch) -> list[torch.Tensor]:
    """Inverse of ``qkv_pack`` on the full (TP-gathered) fused tensor; works on any trailing dims."""
    ng, hd = arch.num_kv_heads, arch.head_dim
    nq = arch.num_heads // ng
    rest = fused.shape[1:]
    grouped = fused.reshape(ng, (nq + 2) * hd, *rest)
    q, k, v = torch.split(grouped, [nq * hd, hd, hd], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def shard_from_hf(
    rule: Rule, hf: list[torch.Tensor], *, tp_rank: int, tp: int, arch: DecoderArch, padded_vocab: int
) -> torch.Tensor:
    """This TP rank's Megatron tensor for ``rule`` from the full HF tensors (in ``rule.hf_names`` order)."""
    if rule.kind == "replicated":
        return hf[0]
    if rule.kind == "column":
        return hf[0].chunk(tp, dim=0)[tp_rank]
    if rule.kind == "row":
        return hf[0].chunk(tp, dim=1)[tp_rank]
    if rule.kind == "vocab":
        full = hf[0]
        if full.shape[0] < padded_vocab:  # zero rows: padded logits are 0 and are stripped on export
            full = torch.cat([full, full.new_zeros(padded_vocab - full.shape[0], *full.shape[1:])])
        return full.chunk(tp, dim=0)[tp_rank]
    if rule.kind == "qkv":
        return qkv_pack(*hf, arch).chunk(tp, dim=0)[tp_rank]  # type: ignore[call-arg]  # hf: (q, k, v)
    if rule.kind == "gate_up":
        gate, up = (t.chunk(tp, dim=0)[tp_rank] for t in hf)
        return torch.cat([gate, up], dim=0)
    raise ValueError(f"unknown mapping kind '{rule.kind}'")


# ---- all TP ranks' Megatron shards -> full HF tensors ---------------------------------------------


def hf_from_shards(rule: Rule, shards: list[torch.Tensor], *, arch: DecoderArch) -> list[torch.Tensor]:
    """Full HF tensors (``rule.hf_names`` order) from the TP shards in TP-rank order."""
    if rule.kind == "replicated":
        return [shards[0]]
    if rule.kind == "column":
        return [torch.cat(shards, dim=0)]
    if rule.kind == "row":
        return [torch.cat(shards, dim=1)]
    if rule.kind == "vocab":
        return [torch.cat(shards, dim=0)[: arch.vocab_size]]
    if rule.kind == "qkv":
        return qkv_unpack(torch.cat(shards, dim=0), arch)
    if rule.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise ValueError(f"unknown mapping kind '{rule.kind}'")


def hf_param_names(arch: DecoderArch) -> list[str]:
    """Every HF parameter name a full model of ``arch`` has (for completeness checks)."""
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        a = _ATTN.format(i=i)
        names += [
            f"model.layers.{i}.input_layernorm.weight",
            a + "q_proj.weight",
            a + "k_proj.weight",
            a + "v_proj.weight",
        ]
        if arch.qkv_bias:
            names += [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
        if arch.qk_norm:
            names += [a + "q_norm.weight", a + "k_norm.weight"]
        names += [a + "o_proj.weight", f"model.layers.{i}.post_attention_layernorm.weight"]
        names += _mlp_names(arch, i)
    names.append("model.norm.weight")
    if not arch.tied_embeddings:
        names.append("lm_head.weight")
    return names


def _mlp_names(arch: DecoderArch, layer: int) -> list[str]:
    """HF names of layer ``layer``'s MLP: a dense one, or a MoE block (router, experts, shared expert)."""
    moe = arch.moe
    m = _MLP.format(i=layer)
    if moe is None or not moe.sparse_layers[layer]:
        return [m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight"]
    names = [m + "gate.weight"]
    for e in range(moe.num_experts):
        names += [n.format(i=layer, e=e) for n in (*_EXPERT_FC1.hf_names, *_EXPERT_FC2.hf_names)]
    if moe.shared_expert_ffn_hidden_size:
        shared = _SHARED.format(i=layer)
        names += [shared + p for p in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")]
        names += [m + "shared_expert_gate.weight"]
    return names
