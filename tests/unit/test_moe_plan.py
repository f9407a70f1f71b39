"""Mixture-of-experts policies on paper: presets, HF config reading, the load-time checks of ``ep`` and
``moe``, the 30B-A3B preset's dry-run against hand arithmetic (docs/moe.md), its expert grid, and the
front door that stops a training launch."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
from rich.console import Console
from script_loader import load_script  # tests/ helper

from megamarl.cli.configure import load_config
from megamarl.driver.schedules import overlaps_training
from megamarl.parallel.placement import NCCL_COMMUNICATOR_BYTES
from megamarl.planning.dryrun import GIB, dry_run
from megamarl.planning.expert_plan import routed_rows
from megamarl.planning.model_presets import PRESETS, MoeShape, shape_from_hf_config
from megamarl.planning.placement_view import show_placement

ROOT = Path(__file__).resolve().parents[2]
MOE_CONFIG = ROOT / "configs" / "moe_30b_a3b.yaml"

# Qwen3-30B-A3B (config.json: hidden 2048, 48 layers, 32 heads / 4 KV heads of 128, 128 experts, top-8,
# moe_intermediate_size 768, vocab 151936, untied): per layer attention q,k,v + o, 2 norms, 2 QK-norms
ATTENTION = 2048 * (4096 + 2 * 512) + 4096 * 2048 + 2 * 2048 + 2 * 128  # 18_878_720
EXPERT = 3 * 2048 * 768  # gate, up, down: 4_718_592
ROUTER = 128 * 2048  # fp32, replicated
EMBEDDING = 151936 * 2048


def test_moe_presets_match_public_parameter_counts():
    qwen = PRESETS["qwen3-30b-a3b"]
    assert qwen.layer_params == ATTENTION + 128 * EXPERT + ROUTER
    assert qwen.num_params == 48 * (ATTENTION + 128 * EXPERT + ROUTER) + 2 * EMBEDDING + 2048
    assert qwen.num_params == 30_532_122_624  # "30.5B"
    assert qwen.num_active_params == qwen.num_params - 48 * 120 * EXPERT == 3_353_032_704  # "A3B"
    assert round(PRESETS["qwen3-235b-a22b"].num_params / 1e9, 1) == 235.1
    assert round(PRESETS["qwen3-235b-a22b"].num_active_params / 1e9, 1) == 22.2
    assert round(PRESETS["mixtral-8x7b"].num_params / 1e9, 1) == 46.7
    assert round(PRESETS["mixtral-8x7b"].num_active_params / 1e9, 1) == 12.9


def test_hf_configs_of_the_moe_families():
    base = {"hidden_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 16, "vocab_size": 100}
    qwen3 = shape_from_hf_config(
        {
            **base,
            "model_type": "qwen3_moe",
            "intermediate_size": 6144,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "mlp_only_layers": [],
            "decoder_sparse_step": 1,
        }
    )
    assert qwen3.moe == MoeShape(128, 8, 768) and qwen3.qk_norm
    qwen2 = shape_from_hf_config(
        {
            **base,
            "model_type": "qwen2_moe",
            "intermediate_size": 5632,
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
        }
    )
    assert qwen2.moe == MoeShape(60, 4, 1408, 5632, shared_expert_gate=True) and qwen2.qkv_bias
    assert qwen2.shared_expert_params == 3 * 2048 * 5632 + 2048
    mixtral = shape_from_hf_config(
        {
            **base,
            "model_type": "mixtral",
            "intermediate_size": 14336,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        }
    )
    assert mixtral.moe == MoeShape(8, 2, 14336) and mixtral.expert_params == 3 * 2048 * 14336
    assert shape_from_hf_config({**base, "model_type": "llama", "intermediate_size": 64}).moe is None
    with pytest.raises(ValueError, match="mlp_only_layers=\\[0\\]"):
        shape_from_hf_config(
            {
                **base,
                "model_type": "qwen3_moe",
                "intermediate_size": 64,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "mlp_only_layers": [0],
            }
        )


def test_routed_rows_dropless_and_capacity_padded():
    moe = MoeShape(128, 8, 768)
    assert routed_rows(moe, tokens=4096, capacity_factor=None) == 32768  # balanced: T x top-k
    # capacity ceil(4096 * 8 / 128 * 1.25) = 320 rows per expert, padded: 128 x 320
    assert routed_rows(moe, tokens=4096, capacity_factor=1.25) == 128 * 320 == 40960
    assert routed_rows(moe, tokens=100, capacity_factor=1.0) == 128 * math.ceil(800 / 128)  # 896


def _dry_run(overrides=()):
    cfg = load_config(MOE_CONFIG, list(overrides))
    console = Console(file=io.StringIO(), width=240)
    report = dry_run(cfg, overlaps_training=overlaps_training(cfg.trainer), console=console)
    return report, console.file.getvalue()


def test_30b_a3b_dry_run_equals_the_hand_arithmetic_of_docs_moe():
    """docs/moe.md, "Hand arithmetic": tp=1, dp=16, ep=8 -> edp=2; bf16, TE spec, distributed
    optimizer; every tensor a multiple of 64 and every buffer of lcm(dp, 128): no padding."""
    report, text = _dry_run()
    wg = report.worker_groups["team"]
    plan = wg.moe
    assert plan is not None and (plan.grid.etp, plan.grid.ep, plan.grid.edp) == (1, 8, 2)
    dense = 48 * ATTENTION + 2 * EMBEDDING + 2048  # attention + norms, embedding, output layer, final norm
    routers = 48 * ROUTER
    experts = 48 * 16 * EXPERT  # 16 of 128 experts per layer
    assert (dense, routers, experts) == (1_528_510_464, 12_582_912, 3_623_878_656)
    assert plan.params[0] == {"dense bf16": dense, "dense fp32": routers, "experts": experts}
    buffers = plan.buffers[0]
    assert (buffers["dense bf16"].weights, buffers["dense bf16"].grads) == (2 * dense, 4 * dense)
    assert (buffers["dense bf16"].main_params, buffers["dense bf16"].optimizer) == (
        4 * dense / 16,
        8 * dense / 16,
    )
    # fp32 routers: no main copy, fp32 Adam moments over dp=16
    assert (buffers["dense fp32"].weights, buffers["dense fp32"].main_params) == (4 * routers, 0)
    assert buffers["dense fp32"].optimizer == 8 * routers / 16
    # experts: grads reduced and optimizer sharded over edp=2, not dp=16
    assert (buffers["experts"].weights, buffers["experts"].grads) == (2 * experts, 4 * experts)
    assert (buffers["experts"].main_params, buffers["experts"].optimizer) == (
        4 * experts / 2,
        8 * experts / 2,
    )
    stage = wg.stages[0]
    assert stage.weights == 2 * dense + 4 * routers + 2 * experts == 10_355_109_888
    assert stage.grads == 4 * (dense + routers + experts) == 20_659_888_128
    assert stage.main_params == 4 * dense / 16 + 4 * experts / 2 == 7_629_884_928
    assert stage.optimizer == 8 * (dense + routers) / 16 + 8 * experts / 2 == 15_266_061_312
    # activations (recompute full, 4,096 tokens): 48 layer inputs, the last stage's norm/output input,
    # token ids, one layer rebuilt (attention + MoE MLP), the dispatcher's buffers, the log-prob peak
    tokens, rows = 4096, 32768
    router = tokens * 9 * 128  # fp32 logits + probabilities, bool routing map
    moe_layer = router + rows * (2 * 2 * 2048 + 5 * 2 * 768 + 4)
    attention = 2 * (2 * 2 * 2048 + 4) + 2 * (4096 + 512) + 2 * (4096 + 1024) + 2 * 4096 + 4 * 32
    dispatcher = 2 * rows * 2048 * 2
    logits = (2 + 24) * tokens * 151936
    saved = 48 * 2 * 2048 * tokens + 8 * tokens + (2 * 2 * 2048 + 4 - 2 * 2048) * tokens + 2 * 2048 * tokens
    assert (plan.router, plan.experts, plan.dispatcher) == (router, moe_layer, dispatcher)
    assert (router, dispatcher) == (4_718_592, 268_435_456)  # 4.5 MiB, 256 MiB
    assert stage.activations == saved + attention * tokens + moe_layer + dispatcher + logits
    # a push gathers one layer's 128 experts in bf16 on the sender's EP group (ranks 0-7)
    assert plan.gather == 2 * 128 * EXPERT == 1_207_959_552 and plan.gather_ranks == tuple(range(8))
    gpu0, gpu8 = report.gpus[0], report.gpus[8]
    assert (
        gpu0.phases["push"].kinds["push_buffers"] == plan.gather
        and "push_buffers" not in gpu8.phases["push"].kinds
    )
    # communicators: world, dp (16), and the expert groups ep (8) and edp (2)
    assert gpu0.phases["train"].kinds["nccl"] == 4 * NCCL_COMMUNICATOR_BYTES
    assert gpu0.peak_phase == "train" and round(gpu0.total / GIB, 1) == 72.0
    for needle in (
        "1 x 1 x 16 (ep 8)",
        "ep groups (experts split over): 0-7; 8-15",
        "0,8; 1,9",
        "dispatcher buffers",
    ):
        assert needle in text


def test_capacity_factor_and_ep_change_the_plan():
    base = _dry_run()[0].worker_groups["team"]
    capped = _dry_run(["policies.team.moe.capacity_factor=1.25"])[0].worker_groups["team"]
    assert capped.moe.rows == 40960 and capped.moe.dispatcher == 2 * 40960 * 2048 * 2
    assert capped.stages[0].activations > base.stages[0].activations
    ep16 = _dry_run(["policies.team.ep=16"])[0].worker_groups["team"]  # 8 experts per rank, edp=1
    assert ep16.moe.grid.edp == 1 and ep16.moe.params[0]["experts"] == 48 * 8 * EXPERT
    assert ep16.moe.buffers[0]["experts"].optimizer == 8 * 48 * 8 * EXPERT  # unsharded over edp=1
    frozen = _dry_run(["policies.team.frozen=true"])[0]  # no worker: no expert rows, no gather
    assert (
        frozen.worker_groups["team"].moe is None and "push_buffers" not in frozen.gpus[0].phases["push"].kinds
    )


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("policies.team.ep=3", "policies.team.ep=3 must divide the 128 experts"),
        ("policies.team.ep=32", "policies.team.ep=32 must divide the tp\\*dp = 16 ranks"),
        ("policies.team.ep=0", "policies.<p>.ep must be >= 1|policies.team.ep must be >= 1"),
        ("policies.team.tp=2", "policies.team.tp=2: megatron-core trains MoE layers with tp > 1"),
        ("policies.team.moe.capacity_factor=0", "policies.team.moe.capacity_factor must be > 0"),
        ("+policies.team.lora.rank=8", "policies.team.lora: .* mixture-of-experts"),
        (
            "policies.team.model=qwen3-8b",
            "policies.team.ep=8: policies.team.model='qwen3-8b' is a dense model",
        ),
    ],
)
def test_load_time_errors_name_the_key(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(MOE_CONFIG, [override])


def test_capacity_factor_on_a_dense_model_is_an_error():
    with pytest.raises(ValueError, match="policies.team.moe.capacity_factor is set but .* dense model"):
        load_config(
            MOE_CONFIG,
            ["policies.team.model=qwen3-8b", "policies.team.ep=1", "policies.team.moe.capacity_factor=1.25"],
        )


def test_training_launch_stops_at_the_front_door_while_plans_pass(capsys):
    train = load_script("scripts/train.py", name="train_script")
    assert train.main(["--config", str(MOE_CONFIG), "--check"]) == 2
    err = capsys.readouterr().err
    assert "config error: policies.team.model='qwen3-30b-a3b' is a mixture-of-experts model" in err
    assert "--dry-run / --show-placement only for now" in err
    assert train.main(["--config", str(MOE_CONFIG), "--show-placement"]) == 0
    out = capsys.readouterr().out
    assert "policies.team expert grid: etp x ep x edp = 1 x 8 x 2" in out
    assert "ep0: 0-15, ep1: 16-31" in out and "ep7: 112-127" in out


def test_show_placement_expert_groups_follow_megatron_core_order():
    """pp=2 on 16 ranks: each stage's 8 ranks re-divided as ep=4 x edp=2 (ep fastest after etp)."""
    cfg = load_config(MOE_CONFIG, ["policies.team.pp=2", "policies.team.ep=4"])
    out = io.StringIO()
    show_placement(cfg, out=out)
    text = out.getvalue()
    assert "ep groups (experts split over): 0-3; 4-7; 8-11; 12-15" in text
    assert "edp groups (expert grads reduced over): 0,4; 1,5; 2,6; 3,7; 8,12; 9,13; 10,14; 11,15" in text
