"""Which Megatron layer spec and fused kernels a policy is built with, and that the plan agrees.

One decision (``models.spec.layer_spec_choice``: LoRA or not, CUDA or not, Transformer Engine
importable or not) is read by the model build (``bridge.build_model`` via ``load_policy_model``)
and by the planner (``planning.dryrun.training_setup``); the launch refuses a GPU node that would
build another spec than the plan counted (``front_door.check_layer_specs``). Fused kernels
(``kernel_fusions``) follow megatron-core 0.16.1's own availability checks, all off on CPU. There is
no CUDA or TE here: the node's facts are a parameter (``NodeKernels``), and megatron-core's own code
shows what each condition guards.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest
import torch
from rich.console import Console

from megamarl.cli.configure import load_config
from megamarl.cli.front_door import check_layer_specs
from megamarl.models.spec import NodeKernels, kernel_fusions, layer_spec_choice
from megamarl.parallel.launch import run_ranks
from megamarl.planning import dryrun
from megamarl.planning.dryrun import GIB, capacity_gib, training_setup

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GPU_CLUSTER = ["cluster.num_nodes=1", "cluster.gpus_per_node=2"]
CPU = NodeKernels(
    cuda=False,
    transformer_engine=False,
    wgrad_fusion=False,
    softmax_fusion=False,
    rope_fusion=False,
    triton=False,
)
# an NGC PyTorch image: TE (with its fused RoPE), apex's fused kernels, triton
NGC = NodeKernels(
    cuda=True, transformer_engine=True, wgrad_fusion=True, softmax_fusion=True, rope_fusion=True, triton=True
)


# ---- item 5: one decision, LoRA on the local spec ----------------------------------------------------


@pytest.mark.parametrize(
    "lora, cuda, te, spec",
    [
        (False, True, True, "te"),
        (True, True, True, "local"),  # LoRA hooks megatron-core's local linears (models.lora)
        (False, True, False, "local"),
        (False, False, True, "local"),  # no CUDA: TE's modules cannot run
        (True, False, False, "local"),
    ],
)
def test_layer_spec_choice(lora, cuda, te, spec):
    assert layer_spec_choice(lora=lora, cuda=cuda, transformer_engine=te) == spec
    node = dataclasses.replace(CPU, cuda=cuda, transformer_engine=te)
    assert node.layer_spec(lora=lora) == spec


def _build_lora_policy(rank, model_dir):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megamarl.config import PolicyConfig
    from megamarl.config_sections import LoraConfig
    from megamarl.models.lora import add_lora_adapter
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.policy_setup import load_policy_model

    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    lora = LoraConfig(rank=2, alpha=4.0)
    policy = PolicyConfig(model=str(model_dir), micro_batch_size=2, lora=lora)
    # CUDA and TE "available"; no fused kernels (they would need the real libraries on this CPU)
    node = dataclasses.replace(CPU, cuda=True, transformer_engine=True)
    model = load_policy_model(policy, wg, seed=0, node=node).model
    params = add_lora_adapter(model, wg, "a", lora)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    return {
        "spec": model.layer_spec,
        "qkv": type(qkv) is ColumnParallelLinear,
        "adapter_params": len(params),
        "non_lora_spec": node.layer_spec(lora=False),
    }


def test_lora_policy_is_built_on_the_local_spec_where_te_is_available(tmp_path):
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    (r,) = run_ranks(_build_lora_policy, 1, str(model_dir))
    assert r["spec"] == "local" and r["qkv"]
    assert r["adapter_params"] > 0  # models.lora attached (it raises on TE's linears)
    assert r["non_lora_spec"] == "te"  # the same node builds other policies on TE


def test_the_planner_plans_the_spec_the_build_chooses():
    cfg = load_config(CONFIGS / "presets" / "l2_colocated.yaml", GPU_CLUSTER)
    assert cfg.policies["base"].lora is not None
    assert training_setup(cfg, "base", on_gpus=True).spec == "local"  # was "te": LoRA could not build on it
    cfg = load_config(CONFIGS / "presets" / "l1_colocated.yaml", GPU_CLUSTER)
    for name, policy in cfg.policies.items():
        assert policy.lora is None
        assert training_setup(cfg, name, on_gpus=True).spec == "te"
        assert training_setup(cfg, name, on_gpus=False).spec == "local"


def _build_tree_policies(rank, model_dir):
    from megamarl.config import PolicyConfig
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.policy_setup import load_policy_model

    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    policy = PolicyConfig(model=str(model_dir), micro_batch_size=2, pack=True, prefix_tree=True)
    out = {}
    # a CUDA node without TE builds the local spec, whose linears run here; flex replaces its attention
    for name, node in (("cpu", CPU), ("cuda", dataclasses.replace(CPU, cuda=True))):
        model = load_policy_model(policy, wg, seed=0, node=node).model
        core = model.decoder.layers[0].self_attention.core_attention
        out[name] = (model.layer_spec, model.tree_attention, type(core).__name__)
    return out


def test_the_planner_plans_the_tree_attention_the_build_chooses(tmp_path):
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    (r,) = run_ranks(_build_tree_policies, 1, str(model_dir))
    assert r == {
        "cpu": ("local", "mask", "DotProductAttention"),
        "cuda": ("local", "flex", "FlexTreeAttention"),
    }, r
    tree = ["policies.shared.pack=true", "policies.shared.prefix_tree=true"]
    cfg = load_config(CONFIGS / "presets" / "l1_colocated.yaml", GPU_CLUSTER + tree)
    assert training_setup(cfg, "shared", on_gpus=True).tree_attention == r["cuda"][1]
    assert training_setup(cfg, "shared", on_gpus=False).tree_attention == r["cpu"][1]
    assert (
        training_setup(
            load_config(CONFIGS / "presets" / "l1_colocated.yaml"), "shared", on_gpus=True
        ).tree_attention
        is None
    )


# ---- item 6: the launch refuses a GPU node without the spec the plan counted -------------------------


def test_a_gpu_node_without_te_is_refused_naming_the_policy_and_the_fix():
    cfg = load_config(CONFIGS / "presets" / "l1_colocated.yaml", GPU_CLUSTER)
    name = next(iter(cfg.policies))
    with pytest.raises(ValueError) as err:
        check_layer_specs(cfg, cuda=True, transformer_engine=False)
    message = str(err.value)
    assert message.startswith(f"policies.{name}: the memory plan counts Transformer Engine's layer spec")
    assert "megamarl[gpu]" in message and "docs/install.md" in message
    check_layer_specs(cfg, cuda=True, transformer_engine=True)  # the documented GPU install
    check_layer_specs(cfg, cuda=False, transformer_engine=False)  # CPU: local spec planned and built


def test_lora_and_frozen_policies_need_no_te():
    check_layer_specs(
        load_config(CONFIGS / "presets" / "l2_colocated.yaml", GPU_CLUSTER),
        cuda=True,
        transformer_engine=False,
    )
    frozen = load_config(
        CONFIGS / "presets" / "l1_colocated.yaml", GPU_CLUSTER + ["policies.shared.frozen=true"]
    )
    assert frozen.policies["shared"].frozen  # served by its engines only: no Megatron model is built
    check_layer_specs(frozen, cuda=True, transformer_engine=False)


def test_the_gpu_extra_installs_transformer_engine():
    import tomllib

    project = tomllib.loads((CONFIGS.parent / "pyproject.toml").read_text())["project"]
    (te,) = project["optional-dependencies"]["gpu"]
    assert te.startswith("transformer-engine[pytorch]")


# ---- item 6: the plan takes the device's reported total ----------------------------------------------

H100_TOTAL = 85_520_809_984  # torch.cuda.get_device_properties(0).total_memory of an "80 GB" H100


def test_capacity_is_the_smaller_of_declared_and_device():
    assert capacity_gib(80.0, None) == 80.0  # a CPU host (the dry-run on a login node): the declared figure
    assert round(capacity_gib(80.0, H100_TOTAL), 2) == 79.65  # the device cannot give more than it has
    assert capacity_gib(40.0, H100_TOTAL) == 40.0  # a smaller declared figure is a cap the user chose


def test_dry_run_on_a_gpu_host_checks_against_the_device(monkeypatch):
    console = Console(file=io.StringIO(), width=220)
    report = dryrun.dry_run(
        load_config(CONFIGS / "70b_hetero.yaml"), overlaps_training=False, console=console
    )
    assert report.gpu_memory_gib == 79.6 and report.peak_gib > 70  # a CPU host: cluster.gpu_memory_gib
    monkeypatch.setattr(dryrun, "device_total_bytes", lambda: 70 * GIB)  # a GPU host with a 70 GiB device
    with pytest.raises(
        ValueError, match=r"needs \d+\.\d GiB > this GPU's 70\.0 GiB \(< cluster.gpu_memory_gib=79.6\)"
    ):
        dryrun.dry_run(load_config(CONFIGS / "70b_hetero.yaml"), overlaps_training=False, console=console)


# ---- item 12: fused kernels where megatron-core's conditions hold ------------------------------------


def test_fusions_are_off_on_cpu_and_on_where_the_kernels_are():
    assert not any(kernel_fusions(CPU, packed=False).values())
    assert not any(kernel_fusions(dataclasses.replace(NGC, cuda=False), packed=False).values())
    assert all(kernel_fusions(NGC, packed=False).values())
    assert kernel_fusions(NGC, packed=True) == {
        "gradient_accumulation_fusion": True,
        "bias_activation_fusion": True,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": True,
    }
    # a CUDA node with torch alone (the documented install without the gpu extra or apex): SwiGLU only
    bare = dataclasses.replace(CPU, cuda=True, triton=True)
    assert kernel_fusions(bare, packed=False) == {
        "gradient_accumulation_fusion": False,
        "bias_activation_fusion": True,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
    }


def _arch():
    from megamarl.models.families import arch_from_hf
    from megamarl.models.tiny import tiny_config

    return arch_from_hf(tiny_config("llama"))


def test_the_probe_reads_megatron_cores_own_availability():
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    node = NodeKernels.probe()
    assert node.cuda == torch.cuda.is_available()
    assert node.wgrad_fusion == layers._grad_accum_fusion_available
    assert node.rope_fusion == (rope_utils.fused_apply_rotary_pos_emb is not None)


def test_megatron_core_accepts_what_we_turn_on_and_refuses_rope_fusion_without_te():
    from megamarl.models.spec import transformer_config

    arch = _arch()
    node = dataclasses.replace(NodeKernels.probe(), cuda=True)  # this node's libraries, as if CUDA were here
    config = transformer_config(
        arch, **kernel_fusions(node, packed=False)
    )  # TransformerConfig.__post_init__ passes
    assert config.apply_rope_fusion == node.rope_fusion
    if not node.rope_fusion:  # no TE here: megatron-core refuses the flag itself
        with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
            transformer_config(arch, apply_rope_fusion=True)
    # SwiGLU fusion: megatron-core's check accepts our MLP (silu, gated, no bias)
    assert transformer_config(arch, bias_activation_fusion=True).bias_activation_fusion


def _build_with_wgrad_fusion(rank, model_dir):
    from megamarl.models import bridge
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups

    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    try:  # a node that claims apex's wgrad kernel without having it
        bridge.build_model(
            model_dir, wg, init_weights=False, node=dataclasses.replace(CPU, wgrad_fusion=True)
        )
        built_cpu = True
        bridge.build_model(
            model_dir, wg, init_weights=False, node=dataclasses.replace(CPU, cuda=True, wgrad_fusion=True)
        )
    except RuntimeError as exc:
        return {"built_cpu": built_cpu, "error": str(exc)}
    return {"built_cpu": built_cpu, "error": ""}


def test_gradient_accumulation_fusion_needs_apex_as_megatron_core_checks(tmp_path):
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    (r,) = run_ranks(_build_with_wgrad_fusion, 1, str(model_dir))
    assert r["built_cpu"]  # off on CPU whatever the node claims
    assert "fused_weight_gradient_mlp_cuda" in r["error"]  # megatron's ColumnParallelLinear refuses it here


def test_fused_causal_softmax_drops_the_packed_mask(monkeypatch):
    """Why ``masked_softmax_fusion`` stays off for packed rows: megatron-core's fused causal path
    (``ScaledUpperTriangMaskedSoftmax``) never reads the mask. The CUDA kernel is replaced by its
    contract (causal softmax of the scaled scores); the rest is megatron-core's own code."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    def causal_kernel(scores, scale):  # [b*np, sq, sk]
        upper = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        return torch.softmax((scores.float() * scale).masked_fill(upper, float("-inf")), -1).to(scores.dtype)

    monkeypatch.setattr(fused_softmax.ScaledUpperTriangMaskedSoftmax, "apply", causal_kernel)

    def softmax(fused: bool):
        module = fused_softmax.FusedScaleMaskSoftmax(
            input_in_fp16=False,
            input_in_bf16=True,
            attn_mask_type=AttnMaskType.causal,
            scaled_masked_softmax_fusion=fused,
            mask_func=attention_mask_func,
            softmax_in_fp32=True,
            scale=None,
        )
        monkeypatch.setattr(module, "is_kernel_available", lambda *shape: fused)
        return module

    scores = torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    # two packed samples of 4 tokens: block-diagonal causal (True = masked, megatron's convention)
    sample = torch.arange(8) // 4
    mask = (torch.ones(8, 8, dtype=torch.bool).triu(1) | (sample[:, None] != sample[None, :]))[None, None]
    unfused, fused = softmax(False)(scores, mask), softmax(True)(scores, mask)
    assert float(unfused[0, 0, 4, :4].float().abs().sum()) == 0.0  # sample 2 does not see sample 1
    assert float(fused[0, 0, 4, :4].float().sum()) > 0.1  # fused: it does
    plain = torch.ones(8, 8, dtype=torch.bool).triu(1)[None, None]  # unpacked rows: the same result
    assert torch.equal(softmax(False)(scores, plain), softmax(True)(scores, plain))
