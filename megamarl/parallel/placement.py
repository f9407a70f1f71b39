"""Placement: which global ranks hold which worker group (WG), and each WG's process groups.

A WG is one policy's Megatron instance with its own TP x PP x DP mesh on a subset of ranks. Unlike
Megatron-LM's single global ``parallel_state``, every WG gets its own megatron-core
``ProcessGroupCollection`` (passed to models as ``pg_collection``), so several WGs can live side by
side: on disjoint rank sets (disaggregated) or on the same ranks (colocated time-sharing, one rank
holding shards of several WGs).

Rank layout inside a WG follows megatron-core's order (tp fastest, then cp, ep, dp, pp), computed
by ``HyperCommGrid`` on logical ranks 0..n-1 and mapped onto the WG's global ranks, so a WG may sit
on any (even non-contiguous) rank list. Experts (MoE models) have a grid of their own over the same
ranks, as in megatron-core: each pipeline stage's ``tp * dp`` ranks re-divided as ``etp * ep * edp``
(expert TP fastest, then expert parallel, then expert DP); with ``ep = 1`` and ``etp = tp`` its groups are
the dense ones. Process-group creation is collective over the whole world: ``build_worker_groups`` must
run on every rank with the same config.
"""

from __future__ import annotations

# megatron-core (and transformers/safetensors) are imported inside the functions that build, load or run
# models: importing megatron.core costs ~3 s of CPU (9.7 s wall measured on the loaded 2-core box,
# 2026-11-23), and config loading and --dry-run import this module without building a model.
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megamarl.parallel.distributed import device_backend, local_device

if TYPE_CHECKING:  # annotations only: parallel/ stays importable without the config's Hydra stack
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megamarl.config import RunConfig

AXES = ("tp", "cp", "ep", "dp", "pp")  # megatron-core rank order, fastest-varying first
EXPERT_AXES = ("etp", "ep", "edp", "pp")  # megatron-core's expert rank order (experts of MoE layers)
PLACEMENT_MODES = ("colocated", "disaggregated")


@dataclass
class WorkerGroupLayout:
    """Where one policy's WG lives. ``dp`` defaults to ``len(ranks) // (tp * pp)``. ``ep`` / ``etp``: the
    experts of a MoE model split over ``ep`` ranks and each sharded over ``etp`` (default ``tp``) ranks;
    ``etp * ep`` must divide ``tp * dp`` (the rest, ``edp``, replicates experts)."""

    ranks: list[int]
    tp: int = 1
    pp: int = 1
    dp: int | None = None
    ep: int = 1
    etp: int | None = None
    key: str = "placement.worker_groups.<wg>"  # config key used in error messages

    def __post_init__(self) -> None:
        self.ranks = list(self.ranks)
        if self.etp is None:
            self.etp = self.tp
        for axis in ("tp", "pp", "ep", "etp"):
            if getattr(self, axis) < 1:
                raise ValueError(f"{self.key}.{axis} must be >= 1, got {getattr(self, axis)}")
        if not self.ranks:
            raise ValueError(f"{self.key}.ranks is empty")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"{self.key}.ranks has duplicates: {self.ranks}")
        model_parallel = self.tp * self.pp
        if self.dp is None:
            if len(self.ranks) % model_parallel:
                raise ValueError(
                    f"{self.key}: {len(self.ranks)} ranks are not divisible by tp*pp = "
                    f"{self.tp}*{self.pp} = {model_parallel}"
                )
            self.dp = len(self.ranks) // model_parallel
        if self.tp * self.pp * self.dp != len(self.ranks):
            raise ValueError(
                f"{self.key}: tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.tp * self.pp * self.dp} "
                f"differs from the WG's rank count {len(self.ranks)} (ranks={self.ranks})"
            )
        if (self.tp * self.dp) % (self.etp * self.ep):
            raise ValueError(
                f"{self.key}: etp*ep = {self.etp}*{self.ep} does not divide tp*dp = {self.tp}*{self.dp} "
                "(each pipeline stage's ranks hold the experts)"
            )

    @property
    def edp(self) -> int:
        """Expert data parallelism: replicas of each expert shard per pipeline stage."""
        assert self.dp is not None and self.etp is not None  # set by __post_init__
        return self.tp * self.dp // (self.etp * self.ep)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def check_model(self, *, num_heads: int, num_kv_heads: int, num_layers: int) -> None:
        """Raise when the model cannot be sharded with this layout."""
        if num_heads % self.tp:
            raise ValueError(
                f"{self.key}.tp={self.tp} does not divide the model's {num_heads} attention heads"
            )
        if num_kv_heads % self.tp:
            raise ValueError(
                f"{self.key}.tp={self.tp} does not divide the model's {num_kv_heads} KV heads (query groups)"
            )
        if num_layers % self.pp:
            raise ValueError(f"{self.key}.pp={self.pp} does not divide the model's {num_layers} layers")

    def check_experts(self, *, num_experts: int, ffn_hidden_size: int) -> None:
        """Raise when a MoE model's experts cannot be split with this layout."""
        assert self.etp is not None  # set by __post_init__
        if num_experts % self.ep:
            raise ValueError(f"{self.key}.ep={self.ep} does not divide the model's {num_experts} experts")
        if ffn_hidden_size % self.etp:
            raise ValueError(
                f"{self.key}.etp={self.etp} does not divide the experts' intermediate size {ffn_hidden_size}"
            )


@dataclass
class PlacementConfig:
    """All WGs of a run. ``colocated``: WGs may share ranks; ``disaggregated``: rank sets are disjoint."""

    worker_groups: dict[str, WorkerGroupLayout]
    mode: str = "colocated"

    def __post_init__(self) -> None:
        if self.mode not in PLACEMENT_MODES:
            raise ValueError(f"placement.mode='{self.mode}' unknown; allowed: {list(PLACEMENT_MODES)}")
        if not self.worker_groups:
            raise ValueError("placement.worker_groups is empty: at least one policy needs a worker group")
        for name, layout in self.worker_groups.items():
            if layout.key == WorkerGroupLayout.key:  # not named by the caller (e.g. policies.<p>)
                layout.key = f"placement.worker_groups.{name}"
        if self.mode == "disaggregated":
            owner: dict[int, str] = {}
            for name, layout in self.worker_groups.items():
                for rank in layout.ranks:
                    if rank in owner:
                        raise ValueError(
                            f"placement.mode=disaggregated but {layout.key}.ranks and "
                            f"{self.worker_groups[owner[rank]].key}.ranks overlap at rank {rank}"
                        )
                    owner[rank] = name

    def validate_world(self, world_size: int) -> None:
        for layout in self.worker_groups.values():
            bad = [r for r in layout.ranks if not 0 <= r < world_size]
            if bad:
                raise ValueError(f"{layout.key}.ranks {bad} out of range for world size {world_size}")


@dataclass
class WorkerGroup:
    """One WG as seen from this rank. ``pgs`` is None on ranks that hold none of its shards.

    ``device``: where every tensor of the WG's schedule lives (weights, batches, masks, position
    ids, logprobs, the gradient-norm scalar its groups all-reduce); the device of the groups'
    backend (``distributed.local_device``). Control objects stay on ``control_group()``.
    """

    name: str
    layout: WorkerGroupLayout
    pgs: ProcessGroupCollection | None = None
    coords: dict[str, int] = field(default_factory=dict)  # this rank's tp/pp/dp index
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_member(self) -> bool:
        return self.pgs is not None

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1


def _logical_grid(layout: WorkerGroupLayout, shape: list[int], axes: tuple[str, ...]):
    import os

    from megatron.core.hyper_comm_grid import HyperCommGrid

    # HyperCommGrid checks its size against WORLD_SIZE; the grid is logical, so size it to the WG.
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(max(layout.world_size, int(saved or 0)))
    try:
        return HyperCommGrid(shape, list(axes))
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = saved


def _dense_shape(layout: WorkerGroupLayout) -> list[int]:
    assert layout.dp is not None  # set by WorkerGroupLayout.__post_init__
    return [layout.tp, 1, 1, layout.dp, layout.pp]


def _expert_shape(layout: WorkerGroupLayout) -> list[int]:
    assert layout.etp is not None  # set by WorkerGroupLayout.__post_init__
    return [layout.etp, layout.ep, layout.edp, layout.pp]


def rank_grid(layout: WorkerGroupLayout):
    """megatron-core ``HyperCommGrid`` over the WG's logical ranks 0..n-1 (axes tp, cp, ep, dp, pp)."""
    return _logical_grid(layout, _dense_shape(layout), AXES)


def expert_rank_grid(layout: WorkerGroupLayout):
    """The experts' ``HyperCommGrid`` over the same logical ranks (axes etp, ep, edp, pp)."""
    return _logical_grid(layout, _expert_shape(layout), EXPERT_AXES)


def group_enumeration(
    layout: WorkerGroupLayout, axes: list[str], *, experts: bool = False
) -> list[list[int]]:
    """Global-rank lists of every group spanning ``axes`` (what ``new_subgroups_by_enumeration`` takes)
    of the dense grid, or of the experts' grid with ``experts=True``."""
    grid = expert_rank_grid(layout) if experts else rank_grid(layout)
    return [[layout.ranks[i] for i in group] for group in grid.get_rank_enum(axes)]


def rank_coords(layout: WorkerGroupLayout, global_rank: int) -> dict[str, int]:
    """This rank's index along every axis of the WG (tp fastest)."""
    return _grid_coords(layout.ranks.index(global_rank), AXES, _dense_shape(layout))


def expert_coords(layout: WorkerGroupLayout, global_rank: int) -> dict[str, int]:
    """This rank's index along every axis of the WG's experts' grid (etp fastest)."""
    return _grid_coords(layout.ranks.index(global_rank), EXPERT_AXES, _expert_shape(layout))


def _grid_coords(index: int, axes: tuple[str, ...], shape: list[int]) -> dict[str, int]:
    coords = {}
    for axis, size in zip(axes, shape, strict=True):
        coords[axis] = index % size
        index //= size
    return coords


# the process groups megatron-core's ProcessGroupCollection takes, by the mesh axes each spans
GROUP_AXES = {
    "tp": ["tp"],
    "pp": ["pp"],
    "dp": ["dp"],
    "cp": ["cp"],
    "ep": ["ep"],
    "mp": ["tp", "pp"],
    "tp_cp": ["tp", "cp"],
    "dp_cp": ["cp", "dp"],
    "tp_dp_cp": ["tp", "cp", "dp"],
}
# ... and those of the experts' grid (megatron-core's expert-parallel groups)
EXPERT_GROUP_AXES = {
    "ep": ["ep"],
    "expt_tp": ["etp"],
    "expt_dp": ["edp"],
    "intra_expt_dp": ["edp"],  # one distributed-optimizer instance per WG
    "tp_ep": ["etp", "ep"],
    "tp_ep_pp": ["etp", "ep", "pp"],
}


def wg_enumerations(layout: WorkerGroupLayout) -> dict[str, list[list[int]]]:
    """Every group of one WG by its ProcessGroupCollection name, as the global-rank lists of each."""
    out = {name: group_enumeration(layout, axes) for name, axes in GROUP_AXES.items()}
    out.update(
        {name: group_enumeration(layout, axes, experts=True) for name, axes in EXPERT_GROUP_AXES.items()}
    )
    # The distributed optimizer reduces gradient statistics over every rank of the WG (megatron-core's
    # "intra distributed-optimizer instance" group; one instance per WG).
    out["intra_dist_opt"] = [list(layout.ranks)]
    # Tied embeddings: the first and last pipeline stage of each pipeline share the embedding grads.
    out["embd"] = [sorted({p[0], p[-1]}) for p in out["pp"]]
    out["pos_embd"] = [[p[0]] for p in out["pp"]]
    return out


def communicator_rank_sets(layout: WorkerGroupLayout, rank: int) -> set[tuple[int, ...]]:
    """The distinct multi-rank groups of the WG that ``rank`` belongs to: one communicator each (NCCL on
    GPUs: its own device buffers), however many names share it (with cp = ep = 1, tp_cp is tp, dp_cp is dp,
    tp_ep_pp is mp, ...; ``build_worker_group`` creates each rank set once). Single-rank groups need no peer.
    """
    return {
        tuple(sorted(ranks))
        for enumeration in wg_enumerations(layout).values()
        for ranks in enumeration
        if rank in ranks and len(ranks) > 1
    }


# Device memory one NCCL communicator of a few local peers keeps for its buffers (NCCL_BUFFSIZE 4 MiB per
# channel and peer for the Simple protocol, plus LL/LL128, over the channels NCCL opens on NVLink): a
# planning figure, not a measurement (docs/design-notes.md), charged per communicator in the plan's reserve.
NCCL_COMMUNICATOR_BYTES = 256 * 2**20


def num_communicators(layouts: Iterable[WorkerGroupLayout], rank: int, world_size: int) -> int:
    """Device communicators ``rank`` holds for training: its WGs' distinct multi-rank groups plus the
    default (world) group. Weight-transfer groups belong to the engines' side."""
    return (world_size > 1) + sum(
        len(communicator_rank_sets(layout, rank)) for layout in layouts if rank in layout.ranks
    )


def nccl_reserve_bytes(layouts: Iterable[WorkerGroupLayout], rank: int, world_size: int) -> float:
    """What the plan reserves on ``rank``'s GPU for its NCCL communicators (``num_communicators``)."""
    return num_communicators(layouts, rank, world_size) * NCCL_COMMUNICATOR_BYTES


def _member_group(enumeration: list[list[int]], backend: str, made: dict[tuple[int, ...], object], rank: int):
    """``new_subgroups_by_enumeration`` with a memory: a rank set made before (by another of the WG's
    enumerations) is reused, not made again. Every rank walks the same enumerations in the same order,
    so every rank makes the same ``new_group`` calls (a collective over the world)."""
    mine = None
    for ranks in enumeration:
        key = tuple(sorted(ranks))
        if key not in made:
            made[key] = dist.new_group(list(key), backend=backend)
        if rank in key:
            mine = made[key]
    return mine


def build_worker_group(name: str, layout: WorkerGroupLayout, *, backend: str | None = None) -> WorkerGroup:
    """Create every process group of one WG (collective over the world) and return this rank's view."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    backend = backend or device_backend()
    rank = dist.get_rank()
    made: dict[tuple[int, ...], object] = {}
    groups = {
        attr: _member_group(enumeration, backend, made, rank)
        for attr, enumeration in wg_enumerations(layout).items()
    }
    device = local_device()
    if rank not in layout.ranks:
        return WorkerGroup(name, layout, device=device)
    pgs = ProcessGroupCollection()
    for attr, group in groups.items():
        setattr(pgs, attr, group)
    pgs.intra_dp_cp = groups["dp_cp"]
    pgs.hcp = []
    return WorkerGroup(name, layout, pgs, rank_coords(layout, rank), device)


def build_worker_groups(placement: PlacementConfig, *, backend: str | None = None) -> dict[str, WorkerGroup]:
    """Build every WG of ``placement`` on every rank (same order everywhere: group creation is collective)."""
    placement.validate_world(dist.get_world_size())
    return {
        name: build_worker_group(name, layout, backend=backend)
        for name, layout in placement.worker_groups.items()
    }


def placement_of(cfg: RunConfig, world_size: int) -> PlacementConfig:
    """The run's WG layouts for a world of ``world_size`` ranks (policies without ranks take all),
    checked against the world."""
    layouts = {
        name: WorkerGroupLayout(
            ranks=list(p.ranks) if p.ranks else list(range(world_size)),
            tp=p.tp,
            pp=p.pp,
            ep=p.ep,
            key=f"policies.{name}",
        )
        for name, p in cfg.policies.items()
    }
    placement = PlacementConfig(layouts, mode=cfg.placement_mode)
    placement.validate_world(world_size)
    return placement


def check_placement_mode(cfg: RunConfig) -> None:
    if cfg.placement_mode not in PLACEMENT_MODES:
        raise ValueError(f"placement_mode='{cfg.placement_mode}' unknown; allowed: {list(PLACEMENT_MODES)}")
