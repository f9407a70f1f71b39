"""Engine placement: which ranks (and which devices on which node) host each engine replica. It sits
in rollout/ because it reads the engines' registry traits.

Every rank computes the same plan from the config and the world size (``plan_engines``) before any
model loads, then starts the replicas it leads (``replicas_led_by``). A replica is a block of
``engine.tp`` ranks on one node: colocated (replica i on the WG's ranks ``[i*tp, (i+1)*tp)``, asleep
while the WG trains), disaggregated (blocks of ``engine.ranks``, which hold nothing else), in-process
(rank 0's process, TP=1) or external (``engine.server_urls``, no rank). ``launch: auto`` resolves at
start-up (``resolve_launch``). Devices are node-local (``rank % ranks_per_node``). Pure config
arithmetic, no model shape: cheap enough for a pre-flight check on every rank.
Details: docs/design-notes.md, "megamarl/rollout/engine_placement.py".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from megamarl.parallel.placement import placement_of
from megamarl.rollout.engines.base import ENGINES

if TYPE_CHECKING:
    from megamarl.config import ClusterConfig, EngineConfig, PolicyConfig, RunConfig

LAUNCHES = ("auto", "in_process", "server")


@dataclass(frozen=True)
class ReplicaPlacement:
    """One engine replica of one policy. ``launch`` is resolved: in_process | server | external."""

    policy: str
    index: int  # replica index within the policy
    ranks: tuple[int, ...]  # global ranks of the block (len == engine.tp; () for external)
    node: int  # node of the block (a block never crosses nodes; -1 for external)
    devices: tuple[int, ...]  # local device ids on that node (rank % ranks_per_node)
    colocated: bool  # True: on the WG's own ranks; False: on engine.ranks (or external)
    launch: str  # "in_process" | "server" | "external"
    url: str | None = None  # external: engine.server_urls[index]

    @property
    def leader(self) -> int | None:
        """The rank that starts (and restarts) this replica; None for an external server."""
        return self.ranks[0] if self.ranks else None


def can_run_in_process(backend: str) -> bool:
    return ENGINES.traits(backend, key="policies.<p>.engine.backend").in_process


def has_server(backend: str) -> bool:
    """megamarl can start ``backend`` as an inference server (``EngineTraits.server``)."""
    return ENGINES.traits(backend, key="policies.<p>.engine.backend").server


def server_backends() -> list[str]:
    return [name for name in ENGINES.names() if ENGINES.traits(name).server]


def resolve_launch(engine: EngineConfig, wg_ranks: list[int], world_size: int) -> str:
    """``engine.launch`` with ``auto`` resolved: in_process for a one-rank world, or for the
    quickstart shape (one TP=1 replica, no engine.ranks, WG starting at rank 0: the driver's own
    device) when the backend can run in-process, or when the backend has no server; else server.
    ``engine.server_urls`` -> external."""
    if engine.server_urls:
        return "external"
    if engine.launch != "auto":
        return engine.launch
    in_process_ok = can_run_in_process(engine.backend) and engine.tp == 1 and not engine.ranks
    quickstart = engine.num_replicas == 1 and wg_ranks[0] == 0
    if in_process_ok and (world_size == 1 or quickstart or not has_server(engine.backend)):
        return "in_process"
    return "server"


def check_launch(engine: EngineConfig) -> None:
    """Load-time rules of one ``policies.<p>.engine`` section (launch, ranks, server_urls), called
    from its ``__post_init__``; the rules that need the world size are ``plan_engines``'s."""
    key = "policies.<p>.engine"
    if engine.launch not in LAUNCHES:
        raise ValueError(f"{key}.launch='{engine.launch}' unknown; allowed: {list(LAUNCHES)}")
    if len(set(engine.ranks)) != len(engine.ranks):
        raise ValueError(f"{key}.ranks has duplicates: {engine.ranks}")
    needed = engine.num_replicas * engine.tp
    if engine.ranks and len(engine.ranks) != needed:
        raise ValueError(
            f"{key}.ranks has {len(engine.ranks)} ranks; num_replicas * tp = "
            f"{engine.num_replicas} * {engine.tp} = {needed}"
        )
    if engine.server_urls:
        if engine.launch != "auto" or engine.ranks:
            raise ValueError(
                f"{key}.server_urls connects to external servers: leave {key}.launch=auto "
                f"and {key}.ranks empty (got launch={engine.launch}, ranks={engine.ranks})"
            )
        if len(engine.server_urls) != engine.num_replicas:
            raise ValueError(
                f"{key}.server_urls has {len(engine.server_urls)} URLs; one per replica: "
                f"{key}.num_replicas={engine.num_replicas}"
            )
        return
    if engine.launch == "in_process":
        if engine.ranks:
            raise ValueError(
                f"{key}.ranks is set but {key}.launch=in_process: in_process replicas live in "
                "rank 0's process; engine.ranks needs launch=server"
            )
        if engine.tp > 1:
            raise ValueError(
                f"{key}.tp={engine.tp} with {key}.launch=in_process: in-process replicas run at "
                "TP=1; a tensor-parallel replica needs launch=server"
            )
        if not can_run_in_process(engine.backend):
            raise ValueError(
                f"{key}.launch=in_process but {key}.backend={engine.backend} has no in-process "
                "engine; use launch=server (or auto)"
            )
    if not has_server(engine.backend):
        needs = (
            f"{key}.launch=server"
            if engine.launch == "server"
            else f"{key}.ranks"
            if engine.ranks
            else f"{key}.tp={engine.tp}"
            if engine.tp > 1
            else None
        )
        if needs:
            raise ValueError(
                f"{needs} needs an inference server, which {key}.backend={engine.backend} has not "
                f"(backends with a server: {server_backends()})"
            )


def check_engine_ranks(policies: dict[str, PolicyConfig]) -> None:
    """Load-time, across policies: disaggregated engine ranks hold no worker-group shard and belong
    to one policy (ranks beyond the world size are found by ``plan_engines``)."""
    owner: dict[int, str] = {}
    for name, policy in policies.items():
        key = f"policies.{name}.engine.ranks"
        for rank in policy.engine.ranks:
            if rank in owner:
                raise ValueError(
                    f"{key} and policies.{owner[rank]}.engine.ranks share rank {rank}; "
                    "a disaggregated replica's ranks are its own"
                )
            owner[rank] = name
        if not policy.engine.ranks:
            continue
        for other, wg in policies.items():
            if wg.ranks is None:
                raise ValueError(
                    f"{key}={policy.engine.ranks} but policies.{other}.ranks is unset, so its worker group "
                    f"takes every rank, the engine ranks included; list policies.{other}.ranks"
                )
            held = sorted(set(policy.engine.ranks) & set(wg.ranks))
            if held:
                raise ValueError(
                    f"{key} {held} hold shards of policies.{other} (policies.{other}.ranks); "
                    "disaggregated engine ranks must hold no worker-group shard"
                )


def ranks_per_node(cluster: ClusterConfig, world_size: int, env=os.environ) -> int:
    """Ranks on one node: torchrun's LOCAL_WORLD_SIZE when running, else the declared
    ``cluster.gpus_per_node``, else (CPU, nothing declared) the whole world is one node."""
    if env.get("LOCAL_WORLD_SIZE"):
        return int(env["LOCAL_WORLD_SIZE"])
    return cluster.gpus_per_node or world_size


def plan_engines(cfg: RunConfig, world_size: int, ranks_per_node: int) -> dict[str, list[ReplicaPlacement]]:
    """Every policy's replicas for a world of ``world_size`` ranks, ``ranks_per_node`` per node.

    Raises ``ValueError`` naming the config key when a replica cannot be placed: too many replicas
    for the WG (``engine.num_replicas``), engine ranks outside the world or holding a WG shard
    (``engine.ranks``), a block crossing a node boundary (``engine.tp`` / ``engine.ranks``), or two
    policies' replicas on one rank where neither is colocated there by design.
    """
    if ranks_per_node < 1:
        raise ValueError(
            f"ranks per node must be >= 1 (LOCAL_WORLD_SIZE / cluster.gpus_per_node), got {ranks_per_node}"
        )
    placement = placement_of(
        cfg, world_size
    )  # WG rank lists (every rank for policies without ranks), checked
    shard_owner: dict[int, str] = {}
    for name, layout in placement.worker_groups.items():
        for rank in layout.ranks:
            shard_owner.setdefault(rank, name)
    plan = {}
    for name, policy in cfg.policies.items():
        wg_ranks = placement.worker_groups[name].ranks
        launch = resolve_launch(policy.engine, wg_ranks, world_size)
        plan[name] = _plan_policy(
            name, policy.engine, wg_ranks, launch, world_size, ranks_per_node, shard_owner
        )
    _check_shared_ranks(plan)
    return plan


def _plan_policy(name, engine, wg_ranks, launch, world_size, per_node, shard_owner) -> list[ReplicaPlacement]:
    key = f"policies.{name}.engine"
    num, tp = engine.num_replicas, engine.tp
    if launch == "external":
        return [
            ReplicaPlacement(name, i, (), -1, (), False, launch, url)
            for i, url in enumerate(engine.server_urls)
        ]
    if launch == "in_process":  # the driver's process, device 0 of node 0
        return [ReplicaPlacement(name, i, (0,), 0, (0,), 0 in wg_ranks, launch) for i in range(num)]
    if engine.ranks:
        bad = [r for r in engine.ranks if r >= world_size]
        if bad:
            raise ValueError(f"{key}.ranks {bad} out of range for world size {world_size}")
        held = {r: shard_owner[r] for r in engine.ranks if r in shard_owner}
        if held:
            where = ", ".join(f"rank {r} (policies.{p})" for r, p in sorted(held.items()))
            raise ValueError(
                f"{key}.ranks {sorted(held)} hold worker-group shards: {where}; disaggregated engine ranks "
                "must hold no shard (list them outside every policies.<p>.ranks)"
            )
        blocks, colocated, what = list(engine.ranks), False, f"{key}.ranks"
    else:
        if num * tp > len(wg_ranks):
            raise ValueError(
                f"{key}.num_replicas={num}: num_replicas * tp = {num} * {tp} = {num * tp} engine ranks but "
                f"policies.{name} has {len(wg_ranks)} ranks to colocate them on; lower it, or put the "
                f"replicas on ranks of their own ({key}.ranks)"
            )
        blocks, colocated, what = (
            list(wg_ranks[: num * tp]),
            True,
            f"{key}.tp={tp} (colocated on policies.{name}.ranks)",
        )
    replicas = []
    for i in range(num):
        ranks = tuple(blocks[i * tp : (i + 1) * tp])
        nodes = sorted({r // per_node for r in ranks})
        if len(nodes) > 1:
            raise ValueError(
                f"{what}: replica {i} on ranks {list(ranks)} crosses nodes {nodes} ({per_node} ranks per "
                f"node); a replica's {tp} ranks must sit on one node (align the ranks to node boundaries, "
                f"or pick an engine.tp that divides {per_node})"
            )
        replicas.append(
            ReplicaPlacement(name, i, ranks, nodes[0], tuple(r % per_node for r in ranks), colocated, launch)
        )
    return replicas


def _check_shared_ranks(plan: dict[str, list[ReplicaPlacement]]) -> None:
    """A rank holds replicas of several policies only when all of them are colocated there by design
    (time-sharing WGs, or in-process engines in the driver); a disaggregated block is exclusive."""
    holders: dict[int, list[ReplicaPlacement]] = {}
    for replicas in plan.values():
        for replica in replicas:
            for rank in replica.ranks:
                holders.setdefault(rank, []).append(replica)
    for rank, replicas in sorted(holders.items()):
        policies = sorted({r.policy for r in replicas})
        exclusive = [r for r in replicas if r.launch == "server" and not r.colocated]
        if len(policies) > 1 and exclusive:
            owner = exclusive[0]
            others = sorted({f"policies.{r.policy}" for r in replicas if r.policy != owner.policy})
            raise ValueError(
                f"policies.{owner.policy}.engine.ranks: rank {rank} hosts its replica {owner.index} and a "
                "replica "
                f"of {', '.join(others)}; a disaggregated replica's ranks are its own"
            )


def replicas_led_by(plan: dict[str, list[ReplicaPlacement]], rank: int) -> list[ReplicaPlacement]:
    """The replicas ``rank`` starts: server replicas it leads and, on rank 0, in-process ones
    (filter on ``launch``); external servers have no leader here."""
    return [r for replicas in plan.values() for r in replicas if r.leader == rank]


def _ranks_text(ranks: tuple[int, ...]) -> str:
    if not ranks:
        return "-"
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def placement_rows(plan: dict[str, list[ReplicaPlacement]]) -> list[tuple[str, ...]]:
    """One row per replica: policy, replica, leader, ranks, node, devices, tp, colocated, launch."""
    rows: list[tuple[str, ...]] = []
    for replicas in plan.values():
        for r in replicas:
            leader = "-" if r.leader is None else str(r.leader)
            node = "-" if r.node < 0 else str(r.node)
            where = cast(str, r.url) if r.launch == "external" else ("yes" if r.colocated else "no")
            rows.append(
                (
                    r.policy,
                    str(r.index),
                    leader,
                    _ranks_text(r.ranks),
                    node,
                    _ranks_text(r.devices),
                    str(len(r.ranks) or "-"),
                    where,
                    r.launch,
                )
            )
    return rows


PLACEMENT_COLUMNS = ("policy", "replica", "leader", "ranks", "node", "devices", "tp", "colocated", "launch")


def placement_table(plan: dict[str, list[ReplicaPlacement]]) -> str:
    """Plain-text table (logs are not terminals): which rank starts which replica on which devices."""
    return format_table(PLACEMENT_COLUMNS, placement_rows(plan))


def format_table(columns: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in rows
    ]  # strict=False: a row has a cell per column by the caller's contract
    return "\n".join(lines)
