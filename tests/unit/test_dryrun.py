"""Cluster dry-run: 64 fake ranks in one process, placement table, hand-checked memory estimate."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch.distributed as dist
from rich.console import Console

from megamarl.config import load_config
from megamarl.planning.dryrun import GIB, dry_run, engine_memory, rank_ranges, train_memory
from megamarl.planning.model_presets import PRESETS, resolve_model_shape
from megamarl.parallel.placement import WorkerGroupLayout

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# Hand computation from the public configs (tied=False, SwiGLU, GQA, head_dim 128):
# layer = h*(h + 2*kv*hd) [q, k, v] + h*h [o] + 3*h*ffn [gate, up, down] + 2*h [norms]
LLAMA3_8B_LAYER = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096  # 218_112_000
LLAMA3_70B_LAYER = 8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672 + 2 * 8192  # 855_654_400


def _console() -> Console:
    return Console(file=io.StringIO(), width=220)


def _run(path: Path, overrides=()):
    console = _console()
    report = dry_run(load_config(path, list(overrides)), console=console)
    return report, console.file.getvalue()


def test_presets_match_public_parameter_counts():
    assert PRESETS["llama3-8b"].layer_params == LLAMA3_8B_LAYER == 218_112_000
    assert PRESETS["llama3-8b"].num_params == 32 * LLAMA3_8B_LAYER + 2 * 128256 * 4096 + 4096  # 8.03B
    assert round(PRESETS["llama3-70b"].num_params / 1e9, 2) == 70.55
    assert round(PRESETS["qwen2.5-7b"].num_params / 1e9, 2) == 7.62
    assert round(PRESETS["qwen3-8b"].num_params / 1e9, 2) == 8.19


def test_70b_hetero_dry_run_passes_and_prints_the_placement():
    report, text = _run(CONFIGS / "70b_hetero.yaml")
    assert not dist.is_initialized()  # the fake world is torn down
    assert report.world_size == 64
    planner, executor = report.worker_groups["planner"], report.worker_groups["executor"]
    assert (planner.layout.tp, planner.layout.pp, planner.layout.dp) == (8, 2, 3)
    assert (executor.layout.tp, executor.layout.pp, executor.layout.dp) == (2, 1, 8)
    # global rank 17 = node 2, GPU 1: planner tp1 (tp fastest), dp2, pp0; planner engine replica 2
    gpu17 = report.gpus[17]
    assert (gpu17.node, gpu17.local) == (2, 1)
    assert [str(s) for s in gpu17.shards] == ["planner tp1 pp0 dp2"]
    assert [str(e) for e in gpu17.engines] == ["planner#2 tp1"]
    assert report.engines["executor"].replicas == [[r] for r in range(48, 64)]
    for needle in ("planner tp1 pp0 dp2", "planner#2 tp1", "executor tp1 pp0 dp7", "2:1", "0-47", "48-63"):
        assert needle in text

    # executor GPU (llama3-8b, tp=2, dp=8, pp=1, micro_batch 2 x seq 4096, no recompute)
    params = (32 * LLAMA3_8B_LAYER + 2 * 128256 * 4096 + 4096) / 2  # layers + embedding + head + norm, / tp
    stage = executor.stages[0]
    assert stage.weights == 2 * params  # bf16
    assert stage.grads == 4 * params  # fp32 main grads
    assert stage.optimizer == 12 * params / 8  # fp32 master + m + v, distributed over dp=8
    tokens = 2 * 4096
    per_layer = 2 * tokens * (4 * 4096 + 4096 + 2 * 1024 + 4096 + 3 * 14336) / 2
    assert stage.activations == 32 * per_layer + 4 * tokens * 128256 / 2  # + fp32 logits
    assert round(stage.total / GIB, 2) == 47.00
    engine = report.engines["executor"].memory  # tp=1: all weights + 40 GiB KV
    assert engine.weights == 2 * 2 * params and engine.kv_cache == 40 * GIB
    gpu48 = report.gpus[48]
    assert gpu48.total == max(stage.total, engine.total) + 4 * GIB  # sync: max(train, rollout) + reserved
    assert round(gpu48.total / GIB, 2) == 58.96

    # planner stage 0 (llama3-70b, tp=8, pp=2, dp=3, recompute): 40 layers + embedding
    p0 = (40 * LLAMA3_70B_LAYER + 128256 * 8192) / 8
    s0 = planner.stages[0]
    assert (s0.weights, s0.grads, s0.optimizer) == (2 * p0, 4 * p0, 12 * p0 / 3)
    full_layer = 2 * 4096 * (4 * 8192 + 8192 + 2 * 1024 + 8192 + 3 * 28672) / 8
    assert s0.activations == 2 * 40 * (2 * 4096 * 8192 / 8) + full_layer  # 2 micro-batches in flight (1F1B)
    assert round(report.gpus[0].total / GIB, 2) == 45.82


def test_oversized_variant_fails_naming_policy_and_gpu():
    with pytest.raises(ValueError) as err:
        _run(CONFIGS / "70b_hetero_oversized.yaml")
    message = str(err.value)
    assert message.startswith("policies.planner: GPU node 0 local 0 (global rank 0) needs 221.6 GiB")
    assert "cluster.gpu_memory_gib=80.0" in message and "weights 65.7 + grads 131.4" in message
    assert "48 of 64 GPUs over" in message
    assert not dist.is_initialized()


def test_async_mode_adds_train_and_rollout():
    # engines no longer sleep during training: planner GPU 41.8 + 40.4 + 4 reserved
    match = r"policies.planner: GPU node 0 local 0 .* needs 86.3 GiB .* 64 of 64 GPUs"
    with pytest.raises(ValueError, match=match):
        _run(CONFIGS / "70b_hetero.yaml", ["trainer.mode=one_step_off"])


@pytest.mark.parametrize(
    "override, match",
    [
        ("policies.planner.tp=5", r"policies.planner: 48 ranks are not divisible by tp\*pp"),
        ("policies.planner.pp=3", r"policies.planner.pp=3 does not divide the model's 80 layers"),
        ("policies.executor.engine.num_replicas=17", r"policies.executor.engine.num_replicas=17: num_replicas \* tp = 17"),
        ("policies.executor.engine.tp=3", r"policies.executor.engine.tp=3 does not divide"),
        ("policies.planner.model=llama-nonexistent", r"policies.planner.model='llama-nonexistent'"),
        ("cluster.num_nodes=4", r"planner.ranks \[32, .*\] out of range for world size 32"),
    ],
)
def test_layout_errors_name_the_key(override, match):
    with pytest.raises(ValueError, match=match):
        _run(CONFIGS / "70b_hetero.yaml", [override])


def test_lora_trains_only_adapters_and_kv_can_be_derived():
    from megamarl.config import LoraConfig, PolicyConfig

    shape = resolve_model_shape("smollm2-135m-instruct")  # preset: no GGUF conversion needed
    policy = PolicyConfig(model="smollm2-135m-instruct", lora=LoraConfig(rank=8), distributed_optimizer=False)
    memory = train_memory(shape, policy, WorkerGroupLayout(ranks=[0]), stage=0, num_adapters=2)
    assert memory.grads == memory.optimizer == 0
    # r * (in + out) per target: qkv (576, 576 + 2*192), proj (576, 576), fc1 (576, 2*1536), fc2 (1536, 576)
    per_layer = 8 * ((576 + 960) + (576 + 576) + (576 + 3072) + (1536 + 576))
    assert memory.lora == 18 * 2 * 30 * per_layer  # 2 + 4 + 12 bytes per adapter parameter
    policy.engine.kv_cache_gib = 0  # derived: seqs * tokens * (K, V) * layers * kv heads * head_dim * bf16
    assert engine_memory(shape, policy).kv_cache == 64 * 2048 * 2 * 30 * 3 * 64 * 2


def test_rank_ranges():
    assert rank_ranges([5, 0, 1, 2, 6, 9]) == "0-2,5-6,9"


def test_main_dry_run_returns_status_and_cpu_clusters_are_not_checked(capsys):
    from megamarl.planning.dryrun import main_dry_run

    oversized = load_config(CONFIGS / "70b_hetero_oversized.yaml")
    assert main_dry_run(oversized, console=_console()) == 1
    assert "dry-run failed: policies.planner: GPU node 0 local 0" in capsys.readouterr().err
    # gpus_per_node=0 declares CPU ranks: the world comes from the ranks, memory is shown, not checked
    cpu = load_config(CONFIGS / "70b_hetero_oversized.yaml", ["cluster.gpus_per_node=0"])
    report = dry_run(cpu, console=_console())
    assert report.world_size == 64 and report.peak_gib > 80
