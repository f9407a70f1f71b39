"""What a dry-run found, as data: every worker group's and engine's bytes and what each rank (a GPU, or
a CPU rank's process) holds phase by phase (``planning.dryrun.plan_memory`` fills it; the GPU and the
host report print it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from megamarl.parallel.hardware import HostMemory
from megamarl.parallel.placement import WorkerGroupLayout
from megamarl.planning.expert_plan import ExpertLayout
from megamarl.planning.memory import Memory, TrainingSetup, TreeAttentionCost
from megamarl.planning.model_presets import ModelShape
from megamarl.planning.phases import ENGINE

GIB = 2**30


@dataclass
class MoePlan:
    """One MoE policy's expert figures (per rank; activations per layer and micro-batch)."""

    grid: ExpertLayout
    buffers: list[dict[str, Memory]]  # per pipeline stage: ``memory.trainable_buffers``
    params: list[dict[str, int]]  # per stage: elements per rank of each buffer (``memory.buffer_elements``)
    tokens: int  # tokens of the largest micro-batch
    rows: int  # rows the rank's experts take for it (``moe.routed_rows``)
    capacity_factor: float | None  # policies.<p>.moe.capacity_factor
    router: float  # the router's saved tensors, one layer
    experts: float  # the MLP's saved tensors (router included), one layer
    dispatcher: float  # the all-to-all buffers of the running layer
    gather: float  # a push's experts of one layer gathered over EP (engine dtype); 0: nothing pushed
    gather_ranks: tuple[int, ...]  # the ranks that hold ``gather`` during a push


@dataclass
class WorkerGroupReport:
    name: str
    model: str
    shape: ModelShape
    layout: WorkerGroupLayout
    setup: TrainingSetup
    stages: list[Memory]  # per pipeline stage (every GPU of a stage holds the same)
    tree: TreeAttentionCost | None = None  # prefix_tree: the layout's terms of the activations
    moe: MoePlan | None = None  # mixture-of-experts models: the expert grid and rows (planning.moe_report)


@dataclass
class EngineReport:
    policy: str
    backend: str
    tp: int
    replicas: list[list[int]]  # global ranks of each replica (empty: external servers)
    colocated: bool
    memory: Memory
    launch: str = "server"  # in_process | server | external (rollout.engine_placement.resolve_launch)


@dataclass(frozen=True)
class Shard:
    """One WG shard on a GPU: policy and its (tp, pp, dp) coordinates."""

    policy: str
    tp: int
    pp: int
    dp: int

    def __str__(self) -> str:
        return f"{self.policy} tp{self.tp} pp{self.pp} dp{self.dp}"


@dataclass(frozen=True)
class EngineShard:
    """One engine replica's shard on a GPU."""

    policy: str
    replica: int
    tp: int

    def __str__(self) -> str:
        return f"{self.policy}#{self.replica} tp{self.tp}"


@dataclass
class PhaseBytes:
    """What one GPU holds during one phase, by kind (``phases.KINDS``), in bytes."""

    name: str
    kinds: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.kinds.values())

    @property
    def engine(self) -> float:
        return sum(self.kinds.get(k, 0.0) for k in ENGINE)


@dataclass
class GpuReport:
    rank: int
    node: int
    local: int
    shards: list[Shard] = field(default_factory=list)
    engines: list[EngineShard] = field(default_factory=list)
    phases: dict[str, PhaseBytes] = field(default_factory=dict)  # by phase name, in the trainer's order
    peak_phase: str = ""
    total: float = 0.0  # the peak phase's bytes, cluster.reserved_gib included

    def phase(self, name: str) -> float:
        return self.phases[name].total if name in self.phases else 0.0


@dataclass
class DryRunReport:
    world_size: int
    gpus_per_node: int
    gpu_memory_gib: float
    worker_groups: dict[str, WorkerGroupReport]
    engines: dict[str, EngineReport]
    gpus: list[GpuReport]  # one per rank: a GPU, or on CPU ranks (``on_gpus`` False) a rank's process
    warnings: list[str] = field(default_factory=list)
    on_gpus: bool = True  # cluster.gpus_per_node > 0; else the ranks are CPU processes sharing host RAM
    host: HostMemory | None = None  # CPU ranks: this host's RAM (/proc/meminfo), what the ranks share

    @property
    def peak_gib(self) -> float:
        return max(g.total for g in self.gpus) / GIB


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f}"


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.2f} MiB ({num_bytes:,.0f} B)"


def tree_line(name: str, tree: TreeAttentionCost) -> str:
    """What a ``prefix_tree`` policy's micro-batch layout costs (in the WG table's activations)."""
    if tree.kind == "flex":
        attention = f"flex attention: block mask {mib(tree.mask_bytes)}, no [N, N] mask or scores"
    else:
        attention = (
            f"dense mask: [N, N] mask {mib(tree.mask_bytes)}, attention scores "
            f"{mib(tree.scores_bytes_per_layer)} per layer"
        )
    return (
        f"policies.{name}.prefix_tree: {tree.nodes:,} nodes per micro-batch, {attention}; output layer "
        f"on up to {tree.prediction_rows:,} prediction rows"
    )


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> '0-2,5-6'."""
    if not ranks:
        return "-"
    ranks, spans, start = sorted(ranks), [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            spans.append(f"{start}-{r}" if r != start else f"{r}")
            start = None
    return ",".join(spans)


def engines_table(report: DryRunReport, *, title: str, place: str, where: Callable[[EngineReport], str]):
    """The engines' table of both reports (GPU plan: GiB per GPU; CPU plan: per process): ``place``
    titles the column ``where`` fills for each engine."""
    from rich.table import Table

    table = Table(title=title)
    numbers = ("weights", "kv cache", "lora", "total GiB")
    for col in ("policy", "backend", "replicas x tp", "ranks", place) + numbers:
        table.add_column(col, justify="right" if col in numbers else "left")
    for name, e in report.engines.items():
        ranks = rank_ranges([r for replica in e.replicas for r in replica])
        held = (e.memory.weights, e.memory.kv_cache, e.memory.lora, e.memory.total)
        table.add_row(name, e.backend, f"{len(e.replicas)} x {e.tp}", ranks, where(e), *map(gib, held))
    return table
