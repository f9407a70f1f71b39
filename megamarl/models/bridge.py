"""HF <-> Megatron bridge: build a worker group's sharded ``GPTModel`` from an HF config, load HF
weights into it, stream it back out as HF-named full tensors, and run it.

- ``build_model`` / ``load_hf_weights``: every rank of the WG builds and fills only its own stage and
  TP shard (no communication).
- ``export_hf_weights``: yields ``(hf_name, full_tensor)`` one at a time, each stage its own tensors
  under global ``model.layers.{i}`` names, TP-gathered (routed experts: expert-TP-gathered, then
  gathered over EP, every expert under its global index), so TP peers must iterate in lockstep; ranks
  with ``dp_rank > 0`` may skip when ``ep == 1`` (with ``ep > 1`` every rank of the EP group iterates).
  ``is_sender(wg)`` marks the one rank per stage that pushes.
- ``model_forward`` (one stage, explicit causal mask); ``run_forward_backward`` (megatron-core's
  pipeline schedule, any PP).
Collectives go over the WG's groups (``wg.pgs``), never the default group.
Details: docs/design-notes.md, "megamarl/models/bridge.py".
"""

from __future__ import annotations

# megatron-core (and transformers/safetensors) are imported inside the functions that build, load or run
# models: importing megatron.core costs ~3 s of CPU (9.7 s wall measured on the loaded 2-core box,
# 2026-11-23), and config loading and --dry-run import this module without building a model.
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from megamarl.models.families import arch_from_hf
from megamarl.models.mapping import (
    LORA_MARKER,
    TP_KINDS,
    Rule,
    expert_index,
    hf_from_shards,
    rule_for,
    shard_from_hf,
)
from megamarl.models.moe import define_router_gemm_without_te, stage_layer_specs
from megamarl.models.spec import (
    DecoderArch,
    NodeKernels,
    gpt_model_kwargs,
    kernel_fusions,
    layer_spec,
    transformer_config,
)
from megamarl.parallel.collectives import all_gather_tensors, group_rank, group_size

# ---- config and model ------------------------------------------------------------------------------


def load_hf_config(source):
    """An HF ``PretrainedConfig`` from a config object, a model, or a checkpoint directory."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    if hasattr(source, "config") and isinstance(source.config, PretrainedConfig):
        return source.config
    return AutoConfig.from_pretrained(str(source))


def build_model(
    hf_config,
    wg,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    init_weights: bool = True,
    lora: bool = False,
    packed: bool = False,
    prefix_tree: bool = False,
    tree_attention: str | None = None,
    node: NodeKernels | None = None,
    vocab_multiple: int = 1,
    **config_overrides,
):
    """This rank's stage/TP shard of a megatron-core ``GPTModel`` for ``hf_config`` in WG ``wg``.

    ``init_weights=False`` skips random init (faster; use when ``load_hf_weights`` follows).
    ``lora``: LoRA adapters will be attached (``models.lora``); ``packed``: rows will be packed
    (``policies.<p>.pack``); ``prefix_tree``: micro-batches will be prefix trees. With ``node`` (this
    node's ``NodeKernels.probe()`` unless given: a seam for tests) they decide the layer spec
    (``NodeKernels.layer_spec``), the tree attention (``NodeKernels.tree_attention``; ``tree_attention``
    overrides it: a seam for tests) and the fused kernels (``kernel_fusions``; ``config_overrides``
    win). The ``DecoderArch`` is attached as ``model.hf_arch`` for the weight mapping, the spec as
    ``model.layer_spec``, the tree attention (None, ``"mask"``, ``"flex"``) as ``model.tree_attention``.
    """
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    hf_config = load_hf_config(hf_config)
    arch = arch_from_hf(hf_config)
    layout = wg.layout
    layout.check_model(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, num_layers=arch.num_layers)
    if arch.moe is not None:
        layout.check_experts(num_experts=arch.moe.num_experts, ffn_hidden_size=arch.moe.ffn_hidden_size)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, tp_rank=wg.tp_rank, ep_rank=group_rank(wg.pgs.ep), etp_rank=group_rank(wg.pgs.expt_tp)
    )
    node = node or NodeKernels.probe()
    spec = node.layer_spec(lora=lora)
    if tree_attention is None:
        tree_attention = node.tree_attention(prefix_tree=prefix_tree)
    config = transformer_config(
        arch,
        tp=layout.tp,
        pp=layout.pp,
        ep=layout.ep,
        etp=layout.etp,
        grouped_experts=spec == "te",
        dtype=dtype,
        init_weights=init_weights,
        **{**kernel_fusions(node, packed=packed), **config_overrides},
    )
    block = layer_spec(arch, spec=spec, tree_attention=tree_attention)
    if arch.moe is not None:  # sparse and dense layers: one spec per layer of this stage
        define_router_gemm_without_te()
        sparse = layer_spec(arch, spec=spec, tree_attention=tree_attention, num_experts=arch.moe.num_experts)
        block = stage_layer_specs(arch.moe, dense=block, sparse=sparse, config=config, pp_rank=wg.pp_rank)
    model = GPTModel(
        config,
        block,
        pre_process=wg.is_first_stage,
        post_process=wg.is_last_stage,
        pg_collection=wg.pgs,
        **gpt_model_kwargs(arch, tp=layout.tp, vocab_multiple=vocab_multiple),
    )
    model.hf_arch = arch
    model.layer_spec = spec
    model.tree_attention = tree_attention
    if not init_weights:
        mark_tensor_parallel_params(model)
    return model


def mark_tensor_parallel_params(model) -> None:
    """Set megatron's ``tensor_model_parallel`` attributes that skipped initialisation leaves unset.

    megatron-core's local parallel layers set them inside their init functions, which do not run with
    ``perform_initialization=False``; without them every TP-sharded weight looks replicated to the
    gradient-norm and distributed-optimizer code (``param_is_not_tensor_parallel_duplicate``)."""
    from megatron.core import tensor_parallel as tp

    dims = {tp.ColumnParallelLinear: 0, tp.RowParallelLinear: 1, tp.VocabParallelEmbedding: 0}
    for module in model.modules():
        dim = next((d for cls, d in dims.items() if isinstance(module, cls)), None)
        if dim is None:
            continue
        for name, param in module.named_parameters(recurse=False):
            if getattr(param, "tensor_model_parallel", False):
                continue
            if name == "weight":
                tp.set_tensor_model_parallel_attributes(param, True, dim, 1)
            elif name == "bias" and isinstance(module, tp.ColumnParallelLinear):
                tp.set_tensor_model_parallel_attributes(param, True, 0, 1)


def unwrap(model):
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while not hasattr(model, "hf_arch") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "hf_arch"):
        raise ValueError("not a model built by megamarl.models.bridge.build_model (no hf_arch)")
    return model


def is_sender(wg) -> bool:
    """The rank of each PP stage that pushes exported tensors (tp_rank 0, dp_rank 0)."""
    return wg.tp_rank == 0 and wg.dp_rank == 0


# ---- HF tensors in ---------------------------------------------------------------------------------


class HFTensorSource:
    """Read HF tensors by name from a state dict or a safetensors checkpoint directory (lazily)."""

    def __init__(self, source):
        self._dict = None
        self._files: dict[str, Path] = {}
        if isinstance(source, dict):
            self._dict = source
            return
        path = Path(source)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: path / file for name, file in weight_map.items()}
        else:
            from safetensors import safe_open

            file = path / "model.safetensors"
            if not file.is_file():
                raise ValueError(f"{path} holds no model.safetensors(.index.json)")
            with safe_open(str(file), "pt") as handle:
                self._files = dict.fromkeys(handle.keys(), file)

    def names(self) -> list[str]:
        return list(self._dict) if self._dict is not None else list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in (self._dict if self._dict is not None else self._files)

    def get(self, name: str) -> torch.Tensor:
        if self._dict is not None:
            return self._dict[name]
        from safetensors import safe_open

        with safe_open(str(self._files[name]), "pt") as handle:
            return handle.get_tensor(name)


def _base_params(model) -> Iterator[tuple[str, torch.nn.Parameter]]:
    for name, param in model.named_parameters():
        if LORA_MARKER not in name:
            yield name, param


def _global_layer(model, local: int | None) -> int | None:
    return None if local is None else model.decoder.layers[local].layer_number - 1


def _hf_names_for(model, name: str, wg):
    rule, local, _ = rule_for(name)
    arch: DecoderArch = model.hf_arch
    expert = None
    if rule.expert:
        expert = _global_expert(arch, name, ep_rank=group_rank(wg.pgs.ep), ep=wg.layout.ep)
    names = rule.names(_global_layer(model, local), expert)
    if name == "output_layer.weight" and arch.tied_embeddings:
        names = ["model.embed_tokens.weight"]  # the last stage's copy of the tied embedding
    return rule, names


def _global_expert(arch: DecoderArch, name: str, *, ep_rank: int, ep: int) -> int:
    """The HF expert index of the routed expert's parameter ``name`` on EP rank ``ep_rank``."""
    local = expert_index(name)
    assert arch.moe is not None and local is not None  # expert parameters exist only in MoE models
    return arch.moe.global_expert(local, ep_rank=ep_rank, ep=ep)


def _split_group(rule: Rule, wg):
    """The group a tensor of ``rule`` is split over: expert TP for routed experts, TP otherwise."""
    return wg.pgs.expt_tp if rule.expert else wg.pgs.tp


@torch.no_grad()
def load_hf_weights(model, source, wg) -> None:
    """Fill this rank's shard from HF tensors: a state dict ``{hf_name: tensor}`` or an HF directory."""
    model = unwrap(model)
    hf = source if isinstance(source, HFTensorSource) else HFTensorSource(source)
    padded_vocab = model.vocab_size
    for name, param in _base_params(model):
        rule, hf_names = _hf_names_for(model, name, wg)
        missing = [n for n in hf_names if n not in hf]
        if missing:
            raise KeyError(f"HF checkpoint lacks {missing} (needed for Megatron '{name}')")
        group = _split_group(rule, wg)
        shard = shard_from_hf(
            rule,
            [hf.get(n) for n in hf_names],
            tp_rank=group_rank(group),
            tp=group_size(group),
            arch=model.hf_arch,
            padded_vocab=padded_vocab,
        )
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(
                f"'{name}': HF gives shape {tuple(shard.shape)}, Megatron shard is {tuple(param.shape)}"
            )
        param.copy_(shard)


# ---- HF tensors out --------------------------------------------------------------------------------


@torch.no_grad()
def export_hf_weights(
    model,
    wg,
    *,
    source: Callable[[torch.nn.Parameter], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream this PP stage's weights as ``(hf_name, full tensor)``, one at a time (see module doc).

    ``source`` picks what to export per parameter (default: the parameter itself); e.g.
    ``lambda p: p.main_grad`` exports DP-reduced gradients under the same HF names.
    Tied embeddings are exported once, as ``model.embed_tokens.weight`` by the first stage.
    """
    model = unwrap(model)
    arch: DecoderArch = model.hf_arch
    source = source or (lambda p: p)
    for name, param in _base_params(model):
        if name == "output_layer.weight" and arch.tied_embeddings:
            continue
        rule, local, _ = rule_for(name)
        tensor = source(param).detach()
        shards = all_gather_tensors(tensor, _split_group(rule, wg)) if rule.kind in TP_KINDS else [tensor]
        full = hf_from_shards(rule, shards, arch=arch)
        layer = _global_layer(model, local)
        if not rule.expert:
            yield from zip(rule.names(layer), full, strict=False)  # one tensor per name
            continue
        # this local expert of every EP rank, in EP-rank order (HF tensors, one list per EP rank)
        per_ep_rank = zip(*(all_gather_tensors(t, wg.pgs.ep) for t in full), strict=True)
        for ep_rank, tensors in enumerate(per_ep_rank):
            expert = _global_expert(arch, name, ep_rank=ep_rank, ep=wg.layout.ep)
            yield from zip(rule.names(layer, expert), tensors, strict=True)


# ---- running the model ----------------------------------------------------------------------------


def attention_mask_for(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Megatron's boolean mask (True = masked): causal, plus key padding when ``attention_mask`` [B, T] is
    given."""
    seq = input_ids.shape[1]
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=input_ids.device), diagonal=1)
    if attention_mask is None:
        return causal
    return causal | ~attention_mask.bool()[:, None, None, :]


def default_position_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    if attention_mask is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens start at 0
