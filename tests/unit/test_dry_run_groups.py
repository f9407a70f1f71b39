"""Cluster-scale placement without GPUs: 64 fake ranks build every WG's groups in one process."""

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups


def test_64_rank_hybrid_placement_builds_with_fake_process_groups():
    placement = PlacementConfig(
        {
            "planner": WorkerGroupLayout(ranks=list(range(48)), tp=8, pp=2),  # dp=3
            "executor": WorkerGroupLayout(ranks=list(range(48, 64)), tp=2),  # dp=8
        },
        mode="disaggregated",
    )
    dist.init_process_group("fake", store=FakeStore(), rank=17, world_size=64)
    try:
        wgs = build_worker_groups(placement, backend="fake")
        planner, executor = wgs["planner"], wgs["executor"]
        assert planner.is_member and not executor.is_member
        # rank 17 = tp 1, dp 2, pp 0 in the planner (tp fastest, 8 * 3 = 24 ranks per stage)
        assert (planner.tp_rank, planner.dp_rank, planner.pp_rank) == (1, 2, 0)
        assert planner.pgs.tp.size() == 8 and planner.pgs.pp.size() == 2 and planner.pgs.dp.size() == 3
    finally:
        dist.destroy_process_group()
