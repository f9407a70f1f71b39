"""Tensor-parallel LoRA on megatron-core's parallel linears: one frozen base, one adapter per agent.

An adapter is attached to an existing linear (``linear.lora_adapters[name]``) and applied by a
forward hook, so base parameter names are unchanged; for ``y = W x`` it adds ``(alpha / r) * B A x``.
ColumnParallelLinear (``linear_qkv``, ``linear_fc1``): ``A`` [r, in] full and replicated, ``B``
[out/TP, r] split like W. RowParallelLinear (``linear_proj``, ``linear_fc2``): ``A`` [r, in/TP]
split like W, ``B`` [out, r] full. PEFT export splits the fused QKV / gate-up adapters into exact
per-projection ones sharing ``A`` (``qkv_unpack``, as for the weights). ``A`` is seeded by (seed,
adapter, layer, target) on the full shape, then sliced, so an adapter is the same at every TP/PP
layout; ``B`` starts at zero. Only the local spec's plain Column/RowParallelLinear are supported.
Why not PEFT's Megatron LoRA, and the TP algebra: docs/design-notes.md, "megamarl/models/lora.py".
"""

from __future__ import annotations

# megatron-core (and transformers/safetensors) are imported inside the functions that build, load or run
# models: importing megatron.core costs ~3 s of CPU (9.7 s wall measured on the loaded 2-core box,
# 2026-11-23), and config loading and --dry-run import this module without building a model.
import contextlib
import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from megamarl.config_sections import LoraConfig
from megamarl.models.bridge import is_sender, unwrap
from megamarl.models.mapping import qkv_unpack
from megamarl.parallel.collectives import all_gather_objects, all_gather_tensors

# Megatron target -> (parallel kind, HF module names, HF parent)
LORA_TARGETS = {
    "linear_qkv": ("column", ("q_proj", "k_proj", "v_proj"), "self_attn"),
    "linear_proj": ("row", ("o_proj",), "self_attn"),
    "linear_fc1": ("column", ("gate_proj", "up_proj"), "mlp"),
    "linear_fc2": ("row", ("down_proj",), "mlp"),
}


class LoraAdapter(nn.Module):
    """One adapter on one parallel linear (this TP rank's slices of A and B)."""

    def __init__(
        self,
        full_a: torch.Tensor,
        out_local: int,
        *,
        kind: str,
        tp_rank: int,
        tp: int,
        scaling: float,
        tp_group,
    ):
        super().__init__()
        self.kind, self.scaling, self.tp_group = kind, scaling, tp_group
        rank = full_a.shape[0]
        a = full_a if kind == "column" else full_a.chunk(tp, dim=1)[tp_rank]
        self.A = nn.Parameter(a.clone().contiguous())  # [r, in] (column) or [r, in/TP] (row)
        self.B = nn.Parameter(torch.zeros(out_local, rank, dtype=full_a.dtype))  # [out/TP, r] or [out, r]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        h = nn.functional.linear(x.to(self.A.dtype), self.A)  # [s, b, r]
        if self.kind == "column":
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return nn.functional.linear(h, self.B) * self.scaling


def _lora_hook(module, inputs, output):
    name = getattr(module, "lora_active", None)
    if name is None or name not in module.lora_adapters:
        return output
    out, bias = output
    return out + module.lora_adapters[name](inputs[0]).to(out.dtype), bias


def _target_modules(model, targets):
    """(global layer index, target name, linear module) for this stage's layers."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for layer in model.decoder.layers:
        for target in targets:
            parent = layer.self_attention if target in ("linear_qkv", "linear_proj") else layer.mlp
            module = getattr(parent, target)
            expected = ColumnParallelLinear if LORA_TARGETS[target][0] == "column" else RowParallelLinear
            if type(module) is not expected:
                raise ValueError(
                    f"LoRA needs megatron-core's local {expected.__name__} for {target}, "
                    f"got {type(module).__name__} (Transformer Engine spec is unsupported)"
                )
            yield layer.layer_number - 1, target, module


def add_lora_adapter(model, wg, name: str, config: LoraConfig) -> list[nn.Parameter]:
    """Add adapter ``name`` to every target linear of this stage; freeze the base; return its params.

    Call on every rank of the WG, before wrapping the model in DDP (DDP allocates grad buffers for
    the parameters that require grad at wrap time).
    """
    model = unwrap(model)
    params = []
    for layer, target, module in _target_modules(model, config.modules):
        if not hasattr(module, "lora_adapters"):
            module.lora_adapters = nn.ModuleDict()
            module.lora_active = None
            module.register_forward_hook(_lora_hook)
        if name in module.lora_adapters:
            raise ValueError(f"LoRA adapter '{name}' already exists")
        kind = LORA_TARGETS[target][0]
        weight = module.weight
        in_full = weight.shape[1] * (wg.layout.tp if kind == "row" else 1)
        gen = torch.Generator().manual_seed(zlib.crc32(f"{config.seed}/{name}/{layer}/{target}".encode()))
        bound = 1.0 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)), as PEFT/nn.Linear
        full_a = (torch.rand(config.rank, in_full, generator=gen, dtype=torch.float32) * 2 - 1) * bound
        out_local = weight.shape[0]
        adapter = LoraAdapter(
            full_a.to(weight.dtype),
            out_local,
            kind=kind,
            tp_rank=wg.tp_rank,
            tp=wg.layout.tp,
            scaling=config.scaling,
            tp_group=wg.pgs.tp,
        ).to(weight.device)
        module.lora_adapters[name] = adapter
        params += list(adapter.parameters())
    model.lora_configs = {**getattr(model, "lora_configs", {}), name: config}
    for pname, param in model.named_parameters():
        if ".lora_adapters." not in pname:
            param.requires_grad_(False)
    return params


def lora_parameters(model, name: str | None = None) -> list[nn.Parameter]:
    """The parameters of adapter ``name`` (all adapters when None) on this rank."""
    return [
        p
        for n, p in unwrap(model).named_parameters()
        if ".lora_adapters." in n and (name is None or f".lora_adapters.{name}." in n)
    ]


def set_active_adapter(model, name: str | None) -> None:
    """Select the adapter used by subsequent forwards (None: the bare base model)."""
    model = unwrap(model)
    if name is not None and name not in getattr(model, "lora_configs", {}):
        raise ValueError(
            f"LoRA adapter '{name}' unknown; added: {sorted(getattr(model, 'lora_configs', {}))}"
        )
    for module in model.modules():
        if hasattr(module, "lora_adapters"):
            module.lora_active = name


@contextlib.contextmanager
def active_adapter(model, name: str | None):
    """``with active_adapter(model, "solver"): ...`` - forward/backward with one agent's adapter."""
    previous = next((m.lora_active for m in unwrap(model).modules() if hasattr(m, "lora_adapters")), None)
    set_active_adapter(model, name)
    try:
        yield
    finally:
        set_active_adapter(model, previous)


@torch.no_grad()
def export_lora_weights(model, wg, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream adapter ``name`` of this PP stage as PEFT tensors (HF module names, full shapes).

    Same contract as ``bridge.export_hf_weights``: every TP rank of the stage iterates (TP gathers)
    and yields identical tensors; ``bridge.is_sender(wg)`` marks the rank that should push them.
    Keys look like ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``.
    """
    model = unwrap(model)
    arch = model.hf_arch
    config = model.lora_configs[name]
    for layer, target, module in _target_modules(model, config.modules):
        adapter = module.lora_adapters[name]
        kind, hf_names, parent = LORA_TARGETS[target]
        if kind == "column":
            a_full = adapter.A.detach()
            b_shards = all_gather_tensors(adapter.B.detach(), wg.pgs.tp)
            if target == "linear_qkv":
                b_parts = qkv_unpack(torch.cat(b_shards, dim=0), arch)
            else:  # linear_fc1: per TP rank [gate_r; up_r]
                halves = [s.chunk(2, dim=0) for s in b_shards]
                b_parts = [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
        else:
            a_full = torch.cat(all_gather_tensors(adapter.A.detach(), wg.pgs.tp), dim=1)
            b_parts = [adapter.B.detach()]
        for hf_name, b in zip(
            hf_names, b_parts, strict=False
        ):  # strict=False: the target's table gives one B part per HF name
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{hf_name}"
            yield f"{prefix}.lora_A.weight", a_full.clone()  # q/k/v (gate/up) share A: one copy each
            yield f"{prefix}.lora_B.weight", b.contiguous()


def hf_target_modules(config: LoraConfig) -> list[str]:
    """The HF module names ``config.targets`` adapt (sorted): an exported adapter's ``target_modules``,
    and what an engine that loads such adapters later must be started with (SGLang's
    ``--lora-target-modules``)."""
    return sorted(n for t in config.modules for n in LORA_TARGETS[t][1])


def peft_adapter_config(config: LoraConfig, *, base_model_name_or_path: str | None = None) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path,
        "target_modules": hf_target_modules(config),
    }


def save_peft_adapter(
    model,
    wg,
    name: str,
    path: str | Path,
    *,
    base_model_name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Write adapter ``name`` as a PEFT directory (adapter_config.json + adapter_model.safetensors).

    Collective over the WG's ranks (TP gathers; with PP>1 the stages' tensors are gathered over the
    WG's PP group). The first stage's sender writes; returns the path there, None elsewhere.
    ``dtype``: cast the tensors (export in the base's dtype); None keeps the training dtype.
    """
    from safetensors.torch import save_file

    tensors = {k: v.cpu().to(dtype or v.dtype) for k, v in export_lora_weights(model, wg, name)}
    if wg.layout.pp > 1:
        stages = all_gather_objects(tensors if is_sender(wg) else {}, wg.pgs.pp)
        tensors = {k: v for stage in stages for k, v in stage.items()}
    if not (is_sender(wg) and wg.is_first_stage):
        return None
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = peft_adapter_config(
        unwrap(model).lora_configs[name], base_model_name_or_path=base_model_name_or_path
    )
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path
