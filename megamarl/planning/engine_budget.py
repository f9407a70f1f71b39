"""How much of each GPU an engine server may take: its memory fraction (vLLM
``--gpu-memory-utilization``, SGLang ``--mem-fraction-static``), from the dry-run's own plan.

Per GPU (``dryrun.plan_memory``, phase by phase, ``megamarl.planning.phases``): the GPU's measured
memory minus what the trainer keeps there while the engines hold all their memory, minus
``cluster.reserved_gib``. Sync mode: what stays resident once the train state is offloaded; async
modes: the trainer's whole planned peak; disaggregated GPUs: the whole GPU less the reserve. Replicas
sharing a GPU split the budget by planned bytes; a replica spanning GPUs takes the smallest fraction.
A budget below a replica's planned bytes stops start-up with the numbers;
``policies.<p>.engine.gpu_memory_utilization`` overrides the figure (``fleet``).
Details: docs/design-notes.md, "megamarl/planning/engine_budget.py".
"""

from __future__ import annotations

import math

import torch

from megamarl.config import RunConfig
from megamarl.planning.dryrun import GIB, plan_memory
from megamarl.rollout.engine_placement import ReplicaPlacement, plan_engines


def engine_memory_fractions(
    cfg: RunConfig, *, world_size: int, gpus_per_node: int, capacity_bytes: float, overlaps_training: bool
) -> dict[tuple[str, int], float]:
    """``(policy, replica) -> fraction`` for every engine server replica (module docstring) on GPUs
    of ``capacity_bytes`` each; policies with ``engine.gpu_memory_utilization`` set are left out.
    ``overlaps_training``: the run's schedule rolls out while it trains (``plan_memory``)."""
    report = plan_memory(
        cfg,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        on_gpus=True,
        overlaps_training=overlaps_training,
    )
    reserved = cfg.cluster.reserved_gib * GIB
    engines_kv = [0.0] * report.world_size  # the KV cache of every engine shard on a GPU
    for engine in report.engines.values():
        for ranks in engine.replicas:
            for rank in ranks:
                engines_kv[rank] += engine.memory.kv_cache
    fractions = {}
    for name, engine in report.engines.items():
        if engine.launch != "server" or cfg.policies[name].engine.gpu_memory_utilization is not None:
            continue
        need = engine.memory.total
        for index, ranks in enumerate(engine.replicas):
            shares = []
            for rank in ranks:
                gpu = report.gpus[rank]
                # the phases where this GPU's engines hold weights and KV cache; the rest is the trainer's
                whole = [p for p in gpu.phases.values() if p.kinds.get("kv_cache", 0.0) >= engines_kv[rank]]
                trainer = max(p.total - p.engine - p.kinds["reserve"] for p in whole)
                engine_bytes = max(p.engine for p in whole)
                budget = capacity_bytes - trainer - reserved
                share = budget * need / engine_bytes
                if share < need:
                    raise ValueError(
                        f"policies.{name} engine replica {index}: GPU rank {rank} leaves {budget / GIB:.1f} "
                        "GiB for "
                        f"its engines (GPU {capacity_bytes / GIB:.1f} GiB - trainer {trainer / GIB:.1f} GiB "
                        "while they "
                        f"are awake - cluster.reserved_gib {cfg.cluster.reserved_gib}) < their planned "
                        f"{engine_bytes / GIB:.1f} GiB; check the plan with --dry-run "
                        "(cluster.gpu_memory_gib), or set "
                        f"policies.{name}.engine.gpu_memory_utilization"
                    )
                shares.append(share)
            fractions[(name, index)] = math.floor(min(shares) / capacity_bytes * 1000) / 1000
    return fractions


def server_memory_fractions(
    cfg: RunConfig,
    *,
    world_size: int,
    gpus_per_node: int,
    overlaps_training: bool,
    plan: dict[str, list[ReplicaPlacement]] | None = None,
) -> dict[tuple[str, int], float]:
    """``engine_memory_fractions`` on this node's GPUs (their memory measured here); empty without CUDA
    (CPU servers are sized by ``engine.kv_cache_gib`` alone) or engine servers. ``plan``: the run's
    engine plan (computed here when not given: tests)."""
    if not torch.cuda.is_available():
        return {}
    plan = plan if plan is not None else plan_engines(cfg, world_size, gpus_per_node)
    if not any(r.launch == "server" for reps in plan.values() for r in reps):
        return {}
    capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return engine_memory_fractions(
        cfg,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        capacity_bytes=capacity,
        overlaps_training=overlaps_training,
    )
