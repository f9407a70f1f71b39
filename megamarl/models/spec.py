"""What every decoder family shares: the architecture facts read from an HF config, and how they
become a megatron-core ``TransformerConfig``, a layer spec and ``GPTModel`` arguments.

A family (``megamarl/models/<family>/``) only turns its HF config into a ``DecoderArch`` (rejecting
what it cannot express); everything downstream reads the ``DecoderArch``. The Megatron side is always
one pre-norm decoder: RMSNorm, non-interleaved rotary, SwiGLU, GQA, optional QKV bias (Qwen2) and QK
RMSNorm (Qwen3). ``layer_spec_choice`` is the one layer-spec decision (model build and planner call
it): Transformer Engine on a CUDA node with TE and no LoRA, megatron-core's local spec otherwise; both
have the same parameter layout. ``kernel_fusions`` are on where megatron-core's checks pass on CUDA
(``NodeKernels.probe``), off on CPU. Details: docs/design-notes.md, "megamarl/models/spec.py".
"""

from __future__ import annotations

# megatron-core (and transformers/safetensors) are imported inside the functions that build, load or run
# models: importing megatron.core costs ~3 s of CPU (9.7 s wall measured on the loaded 2-core box,
# 2026-11-23), and config loading and --dry-run import this module without building a model.
import copy
import functools
import importlib.util
from dataclasses import dataclass

import torch

from megamarl.models.moe import MoEArch, moe_config_kwargs
from megamarl.models.tree_attention import FlexTreeAttention
from megamarl.parallel.distributed import local_device


@dataclass(frozen=True)
class DecoderArch:
    """The HF-config facts a llama-style decoder needs; built by a family's ``arch_from_hf``."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None = None  # llama3-style rope scaling (megatron: factor only)
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_embeddings: bool = False
    moe: MoEArch | None = None  # sparse layers (``models.moe``); None: a dense model

    def padded_vocab_size(self, tp: int, *, multiple: int = 1) -> int:
        """Vocab rows on the Megatron side: a multiple of ``tp * multiple`` (extra rows are zeros)."""
        step = tp * multiple
        return -(-self.vocab_size // step) * step


def decoder_arch(hf_config, family: str, **quirks) -> DecoderArch:
    """The fields every llama-style HF config shares; a family passes only its ``quirks``
    (e.g. ``qkv_bias=True``, ``qk_norm=True``, a ``head_dim`` rule) as ``DecoderArch`` overrides."""
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"{family}: hidden_act='{hf_config.hidden_act}' unsupported; allowed: ['silu']")
    theta, scaling = rope_from_hf(hf_config)
    num_heads = hf_config.num_attention_heads
    fields = {
        "family": family,
        "num_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": getattr(hf_config, "num_key_value_heads", None) or num_heads,
        "head_dim": getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        "ffn_hidden_size": hf_config.intermediate_size,
        "vocab_size": hf_config.vocab_size,
        "max_position_embeddings": hf_config.max_position_embeddings,
        "norm_eps": hf_config.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling_factor": scaling,
        "tied_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
    }
    fields.update(quirks)
    return DecoderArch(**fields)


def rope_from_hf(hf_config) -> tuple[float, float | None]:
    """(theta, llama3 scaling factor or None) from an HF config (transformers 4.x or 5.x layout)."""
    params = dict(
        getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        # megatron-core's RotaryEmbedding hard-codes the Llama-3.1 constants except the factor.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        bad = {k: params.get(k) for k, v in fixed.items() if k in params and float(params[k]) != v}
        if bad:
            raise ValueError(f"rope_parameters {bad} unsupported: megatron-core fixes them to {fixed}")
        return float(theta), float(params.get("factor", 8.0))
    raise ValueError(f"rope_type='{rope_type}' unsupported; allowed: ['default', 'llama3']")


LAYER_SPECS = ("te", "local")


def transformer_engine_importable() -> bool:
    """``transformer_engine`` is installed here (a file-system look-up: imports nothing)."""
    return importlib.util.find_spec("transformer_engine") is not None


def layer_spec_choice(*, lora: bool, cuda: bool, transformer_engine: bool) -> str:
    """The layer spec a policy is built with: ``"te"`` or ``"local"``. The model build
    (``node_layer_spec``) asks with this node's facts, the planner (``planning.dryrun.training_setup``)
    with the declared cluster's."""
    if lora:  # models.lora hooks the local linears; TE's fused norm+linear hides the normed input
        return "local"
    return "te" if cuda and transformer_engine else "local"


TREE_ATTENTIONS = ("mask", "flex")


def tree_attention_choice(*, prefix_tree: bool, cuda: bool) -> str | None:
    """How a ``prefix_tree`` policy's attention sees the trie (None without it): ``"flex"``
    (``models.tree_attention``: block-sparse, no N x N tensor) on CUDA, whatever the layer spec;
    ``"mask"`` (the local spec's core attention with a dense ``[1, 1, N, N]`` mask) on a CPU, where
    torch 2.13 runs no flex-attention backward. The model build and the planner both ask here."""
    if not prefix_tree:
        return None
    return "flex" if cuda else "mask"


def planned_layer_spec(*, lora: bool, on_gpus: bool) -> str:
    """``layer_spec_choice`` for a plan: a GPU cluster is planned with Transformer Engine (the ``gpu``
    extra installs it; ``cli.front_door.check_layer_specs`` refuses a node without it)."""
    return layer_spec_choice(lora=lora, cuda=on_gpus, transformer_engine=on_gpus)


def node_layer_spec(*, lora: bool) -> str:
    """``layer_spec_choice`` on this node."""
    return layer_spec_choice(
        lora=lora, cuda=torch.cuda.is_available(), transformer_engine=transformer_engine_importable()
    )


def transformer_engine_available() -> bool:
    """This node builds non-LoRA policies on the TE spec."""
    return node_layer_spec(lora=False) == "te"


@dataclass(frozen=True)
class NodeKernels:
    """What this node can run, each read where megatron-core itself looks (``probe``)."""

    cuda: bool
    transformer_engine: bool  # the TE layer spec
    wgrad_fusion: (
        bool  # apex's fused_weight_gradient_mlp_cuda (tensor_parallel.layers._grad_accum_fusion_available)
    )
    softmax_fusion: bool  # apex's scaled_masked_softmax_cuda (FusedScaleMaskSoftmax imports it to use it)
    rope_fusion: bool  # TE's fused RoPE (rope_utils.fused_apply_rotary_pos_emb[_thd] not None)
    triton: bool  # torch.compile on CUDA tensors (megatron.core.jit.jit_fuser is torch.compile)

    @staticmethod
    @functools.cache
    def probe() -> NodeKernels:
        """This node's kernels (imports megatron-core: call it where a model is built)."""
        from megatron.core.models.common.embeddings import rope_utils
        from megatron.core.tensor_parallel import layers

        def importable(name: str) -> bool:
            return importlib.util.find_spec(name) is not None

        return NodeKernels(
            cuda=torch.cuda.is_available(),
            transformer_engine=transformer_engine_importable(),
            wgrad_fusion=layers._grad_accum_fusion_available,
            softmax_fusion=importable("scaled_masked_softmax_cuda")
            and importable("scaled_upper_triang_masked_softmax_cuda"),
            rope_fusion=rope_utils.fused_apply_rotary_pos_emb is not None
            and rope_utils.fused_apply_rotary_pos_emb_thd is not None,
            triton=importable("triton"),
        )

    def layer_spec(self, *, lora: bool) -> str:
        return layer_spec_choice(lora=lora, cuda=self.cuda, transformer_engine=self.transformer_engine)

    def tree_attention(self, *, prefix_tree: bool) -> str | None:
        return tree_attention_choice(prefix_tree=prefix_tree, cuda=self.cuda)


def kernel_fusions(node: NodeKernels, *, packed: bool) -> dict[str, bool]:
    """megatron-core's fusion switches (``TransformerConfig`` fields) for a model on ``node``: each on
    where CUDA is and megatron-core's own condition for it holds, all off on CPU. ``packed``: the
    policy packs rows (``policies.<p>.pack``)."""
    cuda = node.cuda
    return {
        # both specs: GPTModel's output layer is always megatron's ColumnParallelLinear, which refuses
        # the flag without apex's kernel; the weights' main_grad comes from megatron's DDP (rl.worker)
        "gradient_accumulation_fusion": cuda and node.wgrad_fusion,
        # SwiGLU through megatron.core.fusions.fused_bias_swiglu (torch.compile: triton on CUDA)
        "bias_activation_fusion": cuda and node.triton,
        # local spec only (TE's attention has its own kernels). The fused causal kernel
        # (ScaledUpperTriangMaskedSoftmax) ignores the mask passed in, and packed rows on the local spec
        # carry a block-diagonal one: fused, packed samples would attend to each other
        "masked_softmax_fusion": cuda and node.softmax_fusion and not packed,
        # TransformerConfig.__post_init__ refuses it without TE's fused RoPE
        "apply_rope_fusion": cuda and node.rope_fusion,
    }


def transformer_config(
    arch: DecoderArch,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    grouped_experts: bool = False,
    dtype: torch.dtype = torch.float32,
    init_weights: bool = True,
    **overrides,
):
    """megatron-core ``TransformerConfig`` for ``arch`` at ``tp`` x ``pp`` (no sequence parallel); a MoE
    ``arch`` has its experts over ``ep`` x ``etp`` (expert TP, default ``tp``), grouped (the TE spec's
    ``TEGroupedMLP``) or one MLP each."""
    from megatron.core.transformer import TransformerConfig

    kwargs = {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_heads,
        "num_query_groups": arch.num_kv_heads,
        "kv_channels": arch.head_dim,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": arch.norm_eps,
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": arch.qkv_bias,
        "qk_layernorm": arch.qk_norm,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "use_cpu_initialization": local_device().type == "cpu",  # else built on the WG's GPU
        "perform_initialization": init_weights,
        "attention_softmax_in_fp32": True,
        "sequence_parallel": False,
        # off unless the caller passes kernel_fusions(...) for a CUDA node (bridge.build_model does)
        "gradient_accumulation_fusion": False,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,  # apex's persistent LayerNorm: these models use RMSNorm
        **moe_config_kwargs(arch.moe, ep=ep, etp=tp if etp is None else etp, grouped_gemm=grouped_experts),
    }
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(
    arch: DecoderArch, *, spec: str, tree_attention: str | None = None, num_experts: int | None = None
):
    """The transformer-layer ``ModuleSpec`` for ``spec`` (``layer_spec_choice``); with
    ``tree_attention="flex"`` its core attention is ``FlexTreeAttention`` (the linears stay the spec's).
    ``num_experts``: a MoE layer's spec (experts: ``TEGroupedMLP`` on TE, ``SequentialMLP`` on local)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if spec not in LAYER_SPECS:
        raise ValueError(f"layer spec '{spec}' unknown; allowed: {list(LAYER_SPECS)}")
    if tree_attention is not None and tree_attention not in TREE_ATTENTIONS:
        raise ValueError(f"tree attention '{tree_attention}' unknown; allowed: {list(TREE_ATTENTIONS)}")
    if spec == "te":
        built = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None, qk_layernorm=arch.qk_norm
        )
    else:  # megatron-core's legacy GroupedMLP needs the grouped_gemm package: SequentialMLP here
        built = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts, qk_layernorm=arch.qk_norm, normalization="RMSNorm"
        )
    if tree_attention == "flex":
        built = copy.deepcopy(built)  # the getters may share submodule specs between calls
        built.submodules.self_attention.submodules.core_attention = FlexTreeAttention
    return built


def gpt_model_kwargs(arch: DecoderArch, *, tp: int, vocab_multiple: int = 1) -> dict:
    """``GPTModel`` constructor arguments other than config, spec and process groups."""
    return {
        "vocab_size": arch.padded_vocab_size(tp, multiple=vocab_multiple),
        "max_sequence_length": arch.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": arch.rope_theta,
        "rope_scaling": arch.rope_scaling_factor is not None,
        "rope_scaling_factor": arch.rope_scaling_factor or 8.0,
        "share_embeddings_and_output_weights": arch.tied_embeddings,
        "parallel_output": True,
    }
