"""Weight-sync building blocks without process groups: bucketing, stage senders, stats."""

from __future__ import annotations

import torch

from megamarl.parallel.placement import WorkerGroup, WorkerGroupLayout, rank_coords
from megamarl.rollout.engines.base import buckets
from megamarl.rollout.weights.weight_sync import SyncStats, stage_ranks, stage_sender


def named(*numels: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"t{i}", torch.full((n,), float(i))) for i, n in enumerate(numels)]  # float32: 4 bytes each


def test_buckets_respect_the_limit_and_keep_order():
    tensors = named(10, 10, 10, 30, 5, 5)  # 40, 40, 40, 120, 20, 20 bytes
    out = list(buckets(tensors, bucket_bytes=80))
    assert [[n for n, _ in b] for b in out] == [
        ["t0", "t1"],
        ["t2"],
        ["t3"],
        ["t4", "t5"],
    ]  # t3 alone: too big
    assert [t for b in out for t in b] == tensors  # same tensors, same order, no copies
    assert all(sum(t.numel() * 4 for _, t in b) <= 80 for b in out if len(b) > 1)
    assert list(buckets([], bucket_bytes=80)) == []


def test_buckets_count_the_wire_dtype():
    tensors = named(10, 10, 10, 30) + [("ids", torch.arange(10))]  # cast to bf16: 20, 20, 20, 60; int64: 80
    out = list(buckets(tensors, bucket_bytes=80, dtype=torch.bfloat16))
    assert [[n for n, _ in b] for b in out] == [["t0", "t1", "t2"], ["t3"], ["ids"]]


def test_stage_ranks_follow_megatron_order():
    layout = WorkerGroupLayout(ranks=[4, 5, 6, 7, 8, 9, 10, 11], tp=2, pp=2)  # dp=2
    wg = WorkerGroup("p", layout)
    assert stage_ranks(wg, 0) == [4, 5] and stage_ranks(wg, 1) == [8, 9]
    assert [stage_sender(wg, p) for p in (0, 1)] == [4, 8]
    for pp in (0, 1):
        for tp, rank in enumerate(stage_ranks(wg, pp)):
            assert rank_coords(layout, rank) == {"tp": tp, "cp": 0, "ep": 0, "dp": 0, "pp": pp}


def test_sync_stats_rates():
    stats = SyncStats(num_tensors=3, num_bytes=2_000_000_000, num_buckets=2, seconds=4.0)
    assert stats.as_dict("weight_sync/p") == {
        "weight_sync/p/bytes": 2e9,
        "weight_sync/p/seconds": 4.0,
        "weight_sync/p/gbps": 0.5,
    }
