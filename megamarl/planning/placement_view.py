"""Show a run's placement as every rank computes it at start-up, for its declared cluster, on one CPU process.

``scripts/train.py --config C --show-placement`` runs, for each rank r of the declared world
(``cluster.num_nodes * cluster.gpus_per_node`` ranks; on CPU the smallest world the config needs),
what rank r runs before any model loads: it joins a FAKE world of that size as rank r
(``torch.testing._internal.distributed.fake_pg``: no devices, no network), builds every worker
group's process groups (``build_worker_groups``) and the engine plan (``plan_engines``), and
records which WG shards it holds and which engine replicas it starts. The plans of all ranks must be
identical (each rank computes its own; nothing is exchanged). Unlike ``--dry-run`` there is no
memory model here: it is the run-time placement code itself, not an estimate. An MoE policy adds its
expert grid: which ranks form each EP and expert-DP group and which experts each EP index holds.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch.distributed as dist

from megamarl.config import RunConfig
from megamarl.parallel.placement import build_worker_groups, placement_of
from megamarl.planning.dryrun import Shard, declared_world_size, rank_ranges
from megamarl.planning.expert_plan import expert_layout
from megamarl.planning.model_presets import declared_moe
from megamarl.planning.moe_report import expert_grid_lines
from megamarl.rollout.engine_placement import (
    ReplicaPlacement,
    format_table,
    placement_table,
    plan_engines,
    replicas_led_by,
)


@dataclass
class RankView:
    """What one rank holds and starts."""

    rank: int
    node: int
    device: int  # local index on its node
    shards: list[Shard] = field(default_factory=list)  # WG shards (tp/pp/dp coordinates)
    starts: list[ReplicaPlacement] = field(default_factory=list)  # replicas this rank leads
    serves: list[tuple[ReplicaPlacement, int]] = field(default_factory=list)  # (replica, engine tp rank)


def fake_world_views(cfg: RunConfig, world_size: int, ranks_per_node: int):
    """Run the start-up placement as each rank of a fake ``world_size`` world; return the (common)
    engine plan and every rank's view."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "fake_world_views builds a fake world of its own: call it before init_distributed()"
        )
    placement = placement_of(cfg, world_size)
    first_plan, views = None, []
    for rank in range(world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            groups = build_worker_groups(placement, backend="fake")
            plan = plan_engines(cfg, world_size, ranks_per_node)
        finally:
            dist.destroy_process_group()
        first_plan = first_plan or plan
        if plan != first_plan:  # a bug in the planner (it must depend on the config and world only)
            raise RuntimeError(f"rank {rank} computed a different engine plan than rank 0")
        view = RankView(
            rank, rank // ranks_per_node, rank % ranks_per_node, starts=replicas_led_by(plan, rank)
        )
        for name, wg in groups.items():
            if wg.is_member:
                assert wg.pgs is not None  # is_member
                if wg.pgs.tp.size() != wg.layout.tp or wg.pgs.pp.size() != wg.layout.pp:
                    raise RuntimeError(f"worker group {name}: rank {rank}'s groups differ from its layout")
                view.shards.append(Shard(name, wg.tp_rank, wg.pp_rank, wg.dp_rank))
        view.serves = [
            (r, r.ranks.index(rank)) for replicas in plan.values() for r in replicas if rank in r.ranks
        ]
        views.append(view)
    return first_plan, views


def _replica_name(replica: ReplicaPlacement) -> str:
    return f"{replica.policy}#{replica.index}"


def rank_table(views: list[RankView]) -> str:
    """One row per rank: node:device, WG shards, the replicas it starts, the replica blocks it is in."""
    rows = []
    for v in views:
        starts = ", ".join(
            f"{_replica_name(r)} {r.launch} tp{len(r.ranks)} devices {rank_ranges(list(r.devices))}"
            for r in v.starts
        )
        serves = ", ".join(f"{_replica_name(r)} tp{tp_rank}" for r, tp_rank in v.serves)
        rows.append(
            (
                str(v.rank),
                f"{v.node}:{v.device}",
                ", ".join(map(str, v.shards)) or "-",
                starts or "-",
                serves or "-",
            )
        )
    return format_table(("rank", "node:dev", "WG shards", "starts", "engine blocks"), rows)


def show_placement(
    cfg: RunConfig, *, world_size: int | None = None, ranks_per_node: int | None = None, out=None
) -> tuple[dict, list[RankView]]:
    """Print the replica table and the per-rank table for the declared cluster; return them."""
    out = out or sys.stdout
    world_size = world_size or declared_world_size(cfg)
    ranks_per_node = ranks_per_node or cfg.cluster.gpus_per_node or world_size
    plan, views = fake_world_views(cfg, world_size, ranks_per_node)
    num_nodes = -(-world_size // ranks_per_node)
    print(
        f"Engine replicas ({world_size} ranks, {ranks_per_node} per node, {num_nodes} "
        f"node{'s' if num_nodes > 1 else ''}; "
        "every rank computed this same plan in a fake world):",
        file=out,
    )
    print(placement_table(plan), file=out)
    print("\nRanks (WG shards as tp/pp/dp coordinates; 'starts': the replicas the rank launches):", file=out)
    print(rank_table(views), file=out)
    placement = placement_of(cfg, world_size)
    for name, policy in cfg.policies.items():  # MoE policies: the expert groups the stages re-divide into
        moe = declared_moe(policy.model)
        if moe is not None:
            grid = expert_layout(placement.worker_groups[name], ep=policy.ep)
            print("\n" + "\n".join(expert_grid_lines(name, grid, num_experts=moe.num_experts)), file=out)
    return plan, views


def main_show_placement(cfg: RunConfig) -> int:
    """``scripts/train.py --show-placement``: a placement that cannot be built prints why, returns 1."""
    try:
        show_placement(cfg)
    except ValueError as exc:
        print(f"placement failed: {exc}", file=sys.stderr)
        return 1
    return 0
