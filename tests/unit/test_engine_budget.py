"""``planning.engine_budget``: each engine server's GPU memory fraction from the dry-run's plan (the
GPU's memory minus the trainer's bytes while the engine is awake minus ``cluster.reserved_gib``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megamarl.cli.configure import load_config
from megamarl.driver.schedules import overlaps_training
from megamarl.planning.dryrun import GIB, plan_memory
from megamarl.planning.engine_budget import engine_memory_fractions, server_memory_fractions

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "70b_hetero.yaml"


def _fractions(overrides=(), capacity_gib: float = 80.0):
    cfg = load_config(CONFIG, list(overrides))
    world = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    fractions = engine_memory_fractions(
        cfg,
        world_size=world,
        gpus_per_node=cfg.cluster.gpus_per_node,
        capacity_bytes=capacity_gib * GIB,
        overlaps_training=overlaps_training(cfg.trainer),
    )
    report = plan_memory(
        cfg,
        world_size=world,
        gpus_per_node=cfg.cluster.gpus_per_node,
        on_gpus=True,
        overlaps_training=overlaps_training(cfg.trainer),
    )
    return cfg, fractions, report


def test_sync_mode_leaves_the_engine_what_the_rollout_phase_does_not_hold():
    """70b_hetero, sync: a planner GPU keeps its bf16 reference model (8.2 GiB) and its 7 training NCCL
    communicators (1.75 GiB; a replica's leader 8, one with its relay partner: 2 GiB) while the engine is
    awake, so its TP=8 replica may take (80 - 8.2 - 2 - 4) / 80 of each GPU; executor GPUs keep their 4
    communicators (1 GiB)."""
    _cfg, fractions, report = _fractions()
    assert set(fractions) == {("planner", i) for i in range(6)} | {("executor", i) for i in range(16)}
    for (policy, index), fraction in fractions.items():
        ranks = report.engines[policy].replicas[index]
        rollout = [report.gpus[r].phases["rollout"] for r in ranks]  # the engines' whole memory is awake
        expected = min((80 * GIB - (p.total - p.engine - 4 * GIB) - 4 * GIB) / (80 * GIB) for p in rollout)
        assert fraction == math.floor(expected * 1000) / 1000
        assert fraction * 80 * GIB >= report.engines[policy].memory.total  # at least the plan's engine bytes
    assert fractions[("planner", 0)] == pytest.approx((80 - 4 - 8.2 - 2.0) / 80, abs=2e-3)
    assert fractions[("executor", 0)] == pytest.approx((80 - 4 - 1) / 80, abs=1e-3)


def test_async_modes_leave_the_engine_what_training_does_not_take():
    """one_step_off: training and generation overlap, so the trainer's whole planned peak stays; the
    planner's engine (54.7 GiB of training at peak on its GPUs, + 2.0 of NCCL communicators on a leader) no
    longer fits an 80 GiB GPU (the dry-run refuses this layout too, docs/cluster.md)."""
    with pytest.raises(
        ValueError,
        match=r"^policies\.planner engine replica 0: GPU rank 0 leaves 19\.3 GiB for its "
        r"engines \(GPU 80\.0 GiB - trainer 56\.7 GiB while they are awake - "
        r"cluster\.reserved_gib 4\.0\) < their planned 40\.4 GiB.* set "
        r"policies\.planner\.engine\.gpu_memory_utilization",
    ):
        _fractions(["trainer.mode=one_step_off"])
    _, fractions, report = _fractions(["trainer.mode=one_step_off"], capacity_gib=200.0)
    train = report.gpus[48].phases["train"]  # the trainer's whole peak, next to the awake engine
    trainer = train.total - train.engine - 4 * GIB
    assert (
        fractions[("executor", 0)] == math.floor((200 * GIB - trainer - 4 * GIB) / (200 * GIB) * 1000) / 1000
    )


def test_an_explicit_fraction_replaces_the_plan_and_its_check():
    _, fractions, _ = _fractions(["policies.planner.engine.gpu_memory_utilization=0.6"])
    assert not any(policy == "planner" for policy, _ in fractions)
    with pytest.raises(ValueError, match=r"^policies\.planner engine replica 0"):
        _fractions(capacity_gib=40.0)  # the 70B replica's 40.4 GiB cannot fit next to the reference model


def test_no_fractions_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(CONFIG)
    assert (
        server_memory_fractions(
            cfg, world_size=64, gpus_per_node=8, overlaps_training=overlaps_training(cfg.trainer)
        )
        == {}
    )


def test_fractions_on_the_measured_gpu(monkeypatch):
    """At start-up the capacity is the local GPU's memory (here a fake 80 GiB device)."""
    from types import SimpleNamespace

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB)
    )
    cfg = load_config(CONFIG)
    assert (
        server_memory_fractions(
            cfg, world_size=64, gpus_per_node=8, overlaps_training=overlaps_training(cfg.trainer)
        )
        == _fractions()[1]
    )
    external = load_config(
        CONFIG,
        [
            (
                "policies.planner.engine.server_urls=[http://a:1,http://b:1,http://c:1,"
                "http://d:1,http://e:1,http://f:1]"
            )
        ],
    )  # nobody here starts them
    assert not any(
        p == "planner"
        for p, _ in server_memory_fractions(
            external, world_size=64, gpus_per_node=8, overlaps_training=overlaps_training(external.trainer)
        )
    )
