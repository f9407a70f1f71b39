"""Mixture-of-experts facts of a decoder and how they become megatron-core MoE settings.

``MoEArch`` is what a MoE family (``qwen3_moe``, ``qwen2_moe``) reads from its HF config: the expert
count, top-k, the expert and shared-expert FFN sizes and which layers are sparse. Megatron side: a
``MoELayer`` per sparse layer with a softmax ``TopKRouter`` (HF's ``norm_topk_prob=True``, softmax over
the top-k logits, is megatron's default; ``False``, top-k of the softmax over all experts, is
``moe_router_pre_softmax``), the alltoall token dispatcher, no token dropping, no load-balancing loss
(the loss would change the RL objective; the routing itself is HF's), and ``SequentialMLP`` experts on the
local spec / ``TEGroupedMLP`` on the TE spec. Experts are split over the WG's expert-parallel group:
EP rank ``r`` holds global experts ``r * E / ep ... (r + 1) * E / ep - 1`` (megatron-core's order), each
sharded over the expert-TP group like a dense MLP over TP.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEArch:
    """The HF-config facts of a MoE decoder's sparse layers (``DecoderArch.moe``)."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int  # one routed expert's intermediate size (HF moe_intermediate_size)
    sparse_layers: tuple[bool, ...]  # per global layer: MoE block (True) or dense MLP (False)
    norm_topk_prob: bool  # the top-k probabilities renormalised to sum to 1
    shared_expert_ffn_hidden_size: int | None = None  # an always-on shared expert (Qwen2-MoE)
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x . gate)

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..num_experts={self.num_experts}")

    def num_local_experts(self, ep: int) -> int:
        if self.num_experts % ep:
            raise ValueError(f"ep={ep} does not divide the model's {self.num_experts} experts")
        return self.num_experts // ep

    def global_expert(self, local: int, *, ep_rank: int, ep: int) -> int:
        """The HF expert index of EP rank ``ep_rank``'s ``local``-th expert."""
        return ep_rank * self.num_local_experts(ep) + local


def qwen_moe_arch(hf_config, *, shared_expert: bool) -> MoEArch:
    """``MoEArch`` of a Qwen2-MoE / Qwen3-MoE config: layer ``i`` is sparse unless it is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (transformers' rule)."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    num_experts = hf_config.num_experts
    sparse = tuple(
        i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers)
    )
    shared = getattr(hf_config, "shared_expert_intermediate_size", None) if shared_expert else None
    return MoEArch(
        num_experts=num_experts,
        top_k=hf_config.num_experts_per_tok,
        ffn_hidden_size=hf_config.moe_intermediate_size,
        sparse_layers=sparse,
        norm_topk_prob=bool(hf_config.norm_topk_prob),
        shared_expert_ffn_hidden_size=shared or None,
        shared_expert_gate=bool(shared),
    )


def moe_config_kwargs(moe: MoEArch | None, *, ep: int, etp: int, grouped_gemm: bool) -> dict:
    """megatron-core ``TransformerConfig`` fields for ``moe`` at ``ep`` x ``etp`` (none for a dense model)."""
    if moe is None:
        return {}
    moe.num_local_experts(ep)  # raises when ep does not divide the experts
    return {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.top_k,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_layer_freq": [int(s) for s in moe.sparse_layers],
        # HF: softmax over all experts, then top-k (renormalised when norm_topk_prob). Megatron's default
        # takes the top-k logits and softmaxes them, which equals the renormalised form.
        "moe_router_pre_softmax": not moe.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "alltoall",
        "moe_expert_capacity_factor": None,  # dropless, as HF
        "moe_grouped_gemm": grouped_gemm,
        "moe_permute_fusion": False,
        "moe_shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size,
        "moe_shared_expert_gate": moe.shared_expert_gate,
        "moe_shared_expert_overlap": False,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
    }


def stage_layer_specs(moe: MoEArch, *, dense, sparse, config, pp_rank: int):
    """megatron-core ``TransformerBlockSubmodules`` of one pipeline stage: the ``sparse`` layer spec where
    ``moe.sparse_layers`` says so, ``dense`` elsewhere."""
    from megatron.core.transformer import transformer_block as block
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    count = block.get_num_layers_to_build(config, pp_rank=pp_rank)
    specs = [sparse if moe.sparse_layers[i] else dense for i in range(offset, offset + count)]
    # the final norm megatron-core gives a block built from one layer spec
    return block.TransformerBlockSubmodules(layer_specs=specs, layer_norm=block.LayerNormImpl)


def define_router_gemm_without_te() -> None:
    """Make megatron-core's router run without Transformer Engine (CPU, or a GPU without TE).

    ``moe_utils.RouterGatingLinearFunction`` tests ``te_general_gemm is not None``, but megatron-core
    0.16.1 binds that name only when TE imports: without TE every router forward raises ``NameError``.
    Bound to None, the function takes its own ``torch.mm`` path. A no-op where TE defined it."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
