"""Cluster dry-run: 64 fake ranks in one process, placement table, hand-checked memory estimate."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch.distributed as dist
from rich.console import Console

from megamarl.cli.configure import load_config
from megamarl.driver.schedules import overlaps_training
from megamarl.parallel.placement import NCCL_COMMUNICATOR_BYTES, WorkerGroupLayout
from megamarl.planning.dryrun import GIB, dry_run, engine_memory, rank_ranges
from megamarl.planning.memory import TrainingSetup, ddp_buffer_numel, rank_parameters, train_memory
from megamarl.planning.model_presets import PRESETS, ModelShape, resolve_model_shape

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# Hand computation from the public configs (tied=False, SwiGLU, GQA, head_dim 128):
# layer = h*(h + 2*kv*hd) [q, k, v] + h*h [o] + 3*h*ffn [gate, up, down] + 2*h [norms]
LLAMA3_8B_LAYER = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096  # 218_112_000
LLAMA3_70B_LAYER = 8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672 + 2 * 8192  # 855_654_400


def _console() -> Console:
    return Console(file=io.StringIO(), width=220)


def _run(path: Path, overrides=()):
    console = _console()
    cfg = load_config(path, list(overrides))
    report = dry_run(cfg, overlaps_training=overlaps_training(cfg.trainer), console=console)
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

    # Static state by hand: the trainer's layout (bf16 on GPUs, Transformer Engine spec: norms in bf16
    # too), megatron-core DDP buffers in fp32, the distributed optimizer's fp32 main params and Adam
    # moments sharded over dp. Was (before the reference model, main params and unsplit norms were
    # counted, and before activations followed the no-sequence-parallel layout): executor GPU 58.96,
    # planner GPU 45.82.
    #
    # executor (llama3-8b, tp=2, dp=8, pp=1, untied): per rank 32 layers of matrices / tp and two
    # replicated norms, embedding and output layer / tp, the final norm. Every tensor is a multiple of
    # 64 and the sum a multiple of lcm(8, 128): no padding.
    params = 32 * ((LLAMA3_8B_LAYER - 2 * 4096) // 2 + 2 * 4096) + 2 * 128256 * 4096 // 2 + 4096
    assert params == 4_015_263_744
    stage = executor.stages[0]
    assert stage.weights == 2 * params  # bf16, views of DDP's param_data
    assert stage.grads == 4 * params  # fp32 grad_data
    assert stage.main_params == 4 * params / 8  # fp32 main params, this rank's 1/dp shard
    assert stage.optimizer == 8 * params / 8  # Adam exp_avg + exp_avg_sq, 1/dp
    assert stage.reference == stage.lora == 0  # kl_coef = 0
    # activations, flash attention (TE), no recompute, T = 2 x 4096 tokens, q_t 2048, kv_t 512, f_t 7168
    tokens = 2 * 4096
    per_token = (
        2 * (2 * 2 * 4096 + 4) + (2 * (2048 + 512) + 2 * (2048 + 2 * 512) + 2 * 2048 + 4 * 16) + 5 * 2 * 7168
    )
    final_norm, token_ids = (2 * 2 * 4096 + 4) * tokens, 8 * tokens
    logits = (
        (2 + 24) * tokens * 128256 / 2
    )  # bf16 logits + six fp32 [T, V/tp] tensors in the log-prob function
    assert stage.activations == 32 * per_token * tokens + token_ids + final_norm + logits
    assert round(stage.activations / GIB, 2) == 42.11
    assert round(stage.total / GIB, 2) == 70.16
    engine = report.engines["executor"].memory  # tp=1: all weights + 40 GiB KV
    assert engine.weights == 2 * PRESETS["llama3-8b"].num_params and engine.kv_cache == 40 * GIB
    gpu48 = report.gpus[48]
    # NCCL communicators of an executor rank: world, tp (2), dp (8), tp x dp (the WG's 16): 4 x 256 MiB
    nccl48 = 4 * NCCL_COMMUNICATOR_BYTES
    assert nccl48 == GIB and gpu48.phases["train"].kinds["nccl"] == nccl48
    assert (
        gpu48.peak_phase == "train" and gpu48.total == stage.total + nccl48 + 4 * GIB
    )  # engine asleep; + reserved
    assert gpu48.phase("rollout") == engine.total + nccl48 + 4 * GIB  # the train state offloaded
    assert round(gpu48.total / GIB, 2) == 75.16  # 74.16 before the communicators were counted

    # planner stage 0 (llama3-70b, tp=8, pp=2, dp=3, recompute full, kl_coef > 0): 40 layers + embedding;
    # the buffer is padded to a multiple of lcm(3, 128) = 384 (128 elements here)
    p0 = 40 * ((LLAMA3_70B_LAYER - 2 * 8192) // 8 + 2 * 8192) + 128256 * 8192 // 8
    buffer = -(-p0 // 384) * 384
    assert buffer - p0 == 128
    s0 = planner.stages[0]
    assert (s0.weights, s0.grads, s0.main_params, s0.optimizer) == (
        2 * buffer,
        4 * buffer,
        4 * buffer / 3,
        8 * buffer / 3,
    )
    assert s0.reference == 2 * p0  # the KL reference model: bf16, no DDP buffer, no optimizer
    # full recompute: each layer's input for 2 micro-batches in flight (1F1B), not split over tp (no
    # sequence parallelism), plus one layer being rebuilt (q_t 1024, kv_t 128, f_t 3584) and token ids
    rebuilt = (
        2 * (2 * 2 * 8192 + 4) + (2 * (1024 + 128) + 2 * (1024 + 2 * 128) + 2 * 1024 + 4 * 8) + 5 * 2 * 3584
    ) * 4096
    assert s0.activations == 2 * 40 * 2 * 4096 * 8192 + rebuilt + 2 * 8 * 4096
    assert round(s0.total / GIB, 2) == 54.70
    gpu0, e0 = report.gpus[0], report.engines["planner"].memory
    # NCCL communicators of a planner rank: world, tp (8), pp (2), dp (3), tp x pp (16), tp x dp (24),
    # the WG (48): 7 x 256 MiB; a replica's leader (rank 0) one more: its relay partner (rank 24)
    nccl0 = 8 * NCCL_COMMUNICATOR_BYTES
    # rollout: the engine and the reference model (PolicyWorker.train_state does not offload it)
    assert gpu0.phase("rollout") == e0.total + s0.reference + nccl0 + 4 * GIB
    assert round(gpu0.phase("train") / GIB, 2) == 60.70  # 58.70 + 2.00
    # the peak: the push, with the train state resident, the engine's weights woken (no KV cache yet)
    # and the relay's buffers: the leader forwards stage 0 to rank 24 in 512 MiB buckets (overshot by
    # at most one tensor, the largest: the bf16 embedding) and receives stage 1 a tensor at a time
    relay = 512 * 2**20 + 2 * 128256 * 8192
    assert gpu0.peak_phase == "push" and gpu0.phase("push") == gpu0.total
    assert gpu0.phase("push") - gpu0.phase("wake weights") == relay
    assert gpu0.total == s0.static + e0.weights + relay + nccl0 + 4 * GIB
    assert round(gpu0.total / GIB, 2) == 74.17  # was max(54.7 + 4, 48.6 + 4) = 58.7 under max(train, rollout)
    # a TP peer of the leader forwards nothing (the leader holds its stage whole) and pairs with no one
    assert report.gpus[1].phase("push") == report.gpus[1].phase("wake weights")
    assert report.peak_gib < 80


def test_oversized_variant_fails_naming_policy_and_gpu():
    with pytest.raises(ValueError) as err:
        _run(CONFIGS / "70b_hetero_oversized.yaml")
    message = str(err.value)
    # was 221.6 GiB before the reference model (65.7) was counted and activations followed the
    # unsplit (no sequence parallelism) layout; 295.7 under max(train, rollout): the push phase holds
    # the train state and the woken engine weights together; 299.7 before the 7 NCCL communicators (1.0)
    assert message.startswith("policies.planner: GPU node 0 local 0 (global rank 0) needs 300.7 GiB")
    assert "in phase 'wake weights'" in message
    assert "cluster.gpu_memory_gib=80.0" in message
    assert "weights 65.7 + grads 131.4 + main params 5.5 + optimizer 11.0 + reference 65.7" in message
    assert "48 of 64 GPUs over" in message
    assert not dist.is_initialized()


def test_async_mode_adds_train_and_rollout():
    # engines no longer sleep during training: planner GPU train 54.7 + engine 40.4 + 4 reserved (was 86.3
    # with a 41.8 GiB training estimate that left out the reference model and fp32 main params), + 1.75
    # GiB of NCCL communicators (99.1 before they were counted), + 0.25 for the leader's relay partner
    match = r"policies.planner: GPU node 0 local 0 .* needs 101.1 GiB .* 64 of 64 GPUs"
    with pytest.raises(ValueError, match=match):
        _run(CONFIGS / "70b_hetero.yaml", ["trainer.mode=one_step_off"])


@pytest.mark.parametrize(
    "override, match",
    [
        ("policies.planner.tp=5", r"policies.planner: 48 ranks are not divisible by tp\*pp"),
        ("policies.planner.pp=3", r"policies.planner.pp=3 does not divide the model's 80 layers"),
        (
            "policies.executor.engine.num_replicas=17",
            r"policies.executor.engine.num_replicas=17: num_replicas \* tp = 17",
        ),
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
    policy = PolicyConfig(
        model="smollm2-135m-instruct", lora=LoraConfig(rank=8), distributed_optimizer=False, kl_coef=0.1
    )
    setup = TrainingSetup(dtype="bf16", num_adapters=2, reference=False)  # LoRA: the base is the reference
    memory = train_memory(shape, policy, WorkerGroupLayout(ranks=[0]), setup, stage=0)
    # r * (in + out) per target: qkv (576, 576 + 2*192), proj (576, 576), fc1 (576, 2*1536), fc2 (1536, 576)
    per_layer = 8 * ((576 + 960) + (576 + 576) + (576 + 3072) + (1536 + 576))
    adapters = 2 * 30 * per_layer
    assert memory.lora == 2 * adapters  # bf16 adapter weights
    assert (memory.grads, memory.main_params, memory.optimizer) == (4 * adapters, 4 * adapters, 8 * adapters)
    assert memory.weights == 2 * shape.num_params and memory.reference == 0  # frozen bf16 base, no copy
    policy.engine.kv_cache_gib = 0  # derived: seqs * tokens * (K, V) * layers * kv heads * head_dim * bf16
    assert engine_memory(shape, policy).kv_cache == 64 * 2048 * 2 * 30 * 3 * 64 * 2


def test_lora_adapters_split_like_their_linear_at_tp2():
    """Column-parallel (qkv, fc1): A [r, in] whole, B [out/tp, r]; row-parallel (proj, fc2): A [r, in/tp],
    B [out, r]."""
    from megamarl.config import LoraConfig

    shape = PRESETS["llama3-8b"]  # h 4096, q 4096, kv 1024, f 14336
    params = rank_parameters(shape, tp=2, pp=1, stage=0, lora=LoraConfig(rank=16), num_adapters=1)
    qkv = (16 * 4096, 6144 // 2 * 16)  # column: A [r, h], B [(q + 2kv)/tp, r]
    proj = (16 * 4096 // 2, 4096 * 16)  # row: A [r, q/tp], B [h, r]
    fc1 = (16 * 4096, 28672 // 2 * 16)  # column: A [r, h], B [2f/tp, r]
    fc2 = (16 * 14336 // 2, 4096 * 16)  # row: A [r, f/tp], B [h, r]
    assert params.adapters[:8] == qkv + proj + fc1 + fc2
    assert sum(params.adapters) == 32 * sum(qkv + proj + fc1 + fc2)


def test_rank_parameters_pads_the_vocabulary_and_places_the_tied_copy():
    shape = PRESETS["qwen2.5-0.5b"]  # tied, QKV bias, vocab 151936; 14 heads, 2 KV heads
    one = rank_parameters(shape, tp=1, pp=1, stage=0)
    assert one.num_base == shape.num_params and one.shared_embedding == 0  # tied at pp=1: one embedding
    first, last = (rank_parameters(shape, tp=2, pp=2, stage=s) for s in (0, 1))
    padded = -(-151936 // 2) * 2 * 896 // 2
    assert first.shared_embedding == last.shared_embedding == padded  # the last stage holds a copy
    odd = ModelShape(2, 64, 4, 2, 128, 49155)  # 49155 rows -> 49156 at tp=2 (DecoderArch.padded_vocab_size)
    assert rank_parameters(odd, tp=2, pp=1, stage=0).matrices[-1] == 49156 * 64 // 2
    qwen3 = PRESETS["qwen3-8b"]  # QK-norm: two head_dim-sized norms per layer, replicated over tp
    assert sum(rank_parameters(qwen3, tp=4, pp=1, stage=0).norms) == 36 * (2 * 4096 + 2 * 128) + 4096


def test_ddp_buffer_padding_follows_megatron_core():
    assert ddp_buffer_numel([100, 30], dp=4, distributed=False, own_bucket=7) == 137  # no padding
    # distributed: each tensor starts at a multiple of 64, the bucket ends at a multiple of lcm(dp, 128)
    assert ddp_buffer_numel([100, 30], dp=4, distributed=True) == 256  # 128 + 30 -> 158 -> 256
    assert ddp_buffer_numel([100, 30], dp=3, distributed=True) == 384  # lcm(3, 128)
    assert (
        ddp_buffer_numel([100], dp=2, distributed=True, own_bucket=1) == 128 + 128
    )  # shared embedding bucket


def _setup_memory(**policy_keys):
    from megamarl.config import PolicyConfig

    shape = PRESETS["llama3-8b"]
    policy = PolicyConfig(model="llama3-8b", seq_len=1024, **policy_keys)
    layout = WorkerGroupLayout(ranks=list(range(8)), tp=2, pp=2)  # dp 2
    reference = policy.kl_coef > 0
    return lambda dtype="bf16", stage=0, **kw: train_memory(
        shape, policy, layout, TrainingSetup(dtype=dtype, reference=reference), stage=stage, **kw
    )


def test_every_training_key_changes_the_plan():
    base = _setup_memory()()
    # dtype: fp32 parameters have no main copy; weights double
    fp32 = _setup_memory()("fp32")
    assert fp32.main_params == 0 and fp32.weights == 2 * base.weights and fp32.optimizer == base.optimizer
    # distributed_optimizer off: main params and Adam moments whole on every DP rank, no padding
    whole = _setup_memory(distributed_optimizer=False)()
    assert whole.optimizer == pytest.approx(2 * base.optimizer, rel=1e-6)
    assert whole.main_params == pytest.approx(2 * base.main_params, rel=1e-6)
    # kl_coef > 0: a resident bf16 reference; ref_offload: none at rest, its visit is a peak instead
    ref = _setup_memory(kl_coef=0.1)()
    assert ref.reference == pytest.approx(base.weights, rel=1e-6) and ref.static > base.static
    offloaded = _setup_memory(kl_coef=0.1, ref_offload=True)()
    assert offloaded.reference == 0 and offloaded.static == base.static
    assert offloaded.reference_visit == ref.reference  # stage 0: weights only (no logits there)
    # recompute: none >= selective (core attention) > full
    none, selective, full = (_setup_memory(recompute=r)().activations for r in ("none", "selective", "full"))
    assert none > selective > full
    # mini_batch_size: one micro-batch per step cannot fill the 1F1B pipeline
    assert _setup_memory()(num_micro_batches=1).activations < base.activations
    report, _ = _run(CONFIGS / "70b_hetero.yaml", ["policies.planner.mini_batch_size=3"])  # 1 row per DP rank
    planner = report.worker_groups["planner"].stages[0]
    assert planner.activations == pytest.approx(5.413 * GIB - 40 * 2 * 4096 * 8192 - 8 * 4096, rel=1e-3)
    # frozen: build_workers builds no worker
    assert _setup_memory(frozen=True)().total == 0


def test_packed_micro_batches_scale_with_the_token_budget():
    from megamarl.config import PolicyConfig
    from megamarl.planning.memory import attention_row, tokens_per_micro_batch

    setup = TrainingSetup(micro_batch_size=4)
    padded = PolicyConfig(model="llama3-8b", seq_len=1024, micro_batch_size=4)
    packed = PolicyConfig(
        model="llama3-8b", seq_len=1024, micro_batch_size=4, pack=True, max_tokens_per_micro_batch=2048
    )
    assert (tokens_per_micro_batch(padded, setup), attention_row(padded, setup)) == (4096, 1024)
    assert (tokens_per_micro_batch(packed, setup), attention_row(packed, setup)) == (
        2048,
        2048,
    )  # one packed row
    small = PolicyConfig(
        model="llama3-8b", seq_len=1024, pack=True, max_tokens_per_micro_batch=100, micro_batch_size=4
    )
    assert (
        tokens_per_micro_batch(small, setup) == 1024
    )  # a sample longer than the budget gets a micro-batch alone
    layout = WorkerGroupLayout(ranks=[0, 1], tp=2)
    shape = PRESETS["llama3-8b"]
    te = [train_memory(shape, p, layout, setup, stage=0).activations for p in (padded, packed)]
    assert te[1] == pytest.approx(te[0] / 2, rel=1e-6)  # TE (THD): activations are linear in the tokens


def test_auto_dtype_plans_bf16_on_gpu_clusters():
    from megamarl.planning.dryrun import training_setup

    cfg = load_config(CONFIGS / "70b_hetero.yaml")
    assert (
        cfg.policies["planner"].dtype == "auto"
        and training_setup(cfg, "planner", on_gpus=True).dtype == "bf16"
    )
    assert training_setup(cfg, "planner", on_gpus=True).reference  # kl_coef 0.001
    assert not training_setup(cfg, "executor", on_gpus=True).reference
    fp32 = load_config(CONFIGS / "70b_hetero.yaml", ["policies.planner.dtype=fp32"])
    assert training_setup(fp32, "planner", on_gpus=True).dtype == "fp32"


def test_rank_ranges():
    assert rank_ranges([5, 0, 1, 2, 6, 9]) == "0-2,5-6,9"


def test_main_dry_run_returns_status_and_cpu_clusters_are_checked_against_the_host(capsys):
    from megamarl.cli.dry_run_command import main_dry_run
    from megamarl.parallel.hardware import HostMemory

    oversized = load_config(CONFIGS / "70b_hetero_oversized.yaml")
    assert main_dry_run(oversized, console=_console()) == 1
    assert "dry-run failed: policies.planner: GPU node 0 local 0" in capsys.readouterr().err
    # gpus_per_node=0 declares CPU ranks: the world comes from the ranks, their RAM is checked against
    # the host's (tests/unit/test_dry_run_host.py)
    cpu = load_config(CONFIGS / "70b_hetero_oversized.yaml", ["cluster.gpus_per_node=0"])
    console = _console()
    dry_run(
        cpu,
        overlaps_training=overlaps_training(cpu.trainer),
        console=console,
        host=HostMemory(total=1024 * GIB, available=1024 * GIB),
    )
    out = " ".join(console.file.getvalue().split())
    assert re.search(r"warning: .*CPU ranks 0-63 need .* GiB of RAM together in phase 'train'", out), out
