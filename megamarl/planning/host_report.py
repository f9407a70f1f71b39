"""The dry-run of a CPU config (``cluster.gpus_per_node: 0``): RAM per rank, checked against this host.

CPU ranks are processes on one host and share its RAM: each holds its WG shards' training state,
reference model and activations (the log-prob peak shown apart), the engine replicas it runs in its
process or starts beside it (weights and KV cache), and a process baseline (``CPU_RANK_BASELINE_BYTES``)
where a GPU plan has its reserve. Nothing is offloaded on CPU ranks. The ranks run a step's phases
together, so the host needs, in the worst phase, the sum of what its ranks hold then; that is checked
against MemTotal from ``/proc/meminfo`` (MemAvailable is shown: it is less while other programs run).
Same plan objects as the GPU report (``planning.dryrun.plan_memory``); GPU wording stays there.
"""

from __future__ import annotations

from megamarl.config import RunConfig
from megamarl.planning.memory import logits_peak_bytes
from megamarl.planning.report import DryRunReport, GpuReport, engines_table, gib, rank_ranges, tree_line

# What an idle CPU rank's process holds after its imports (torch, megatron-core, transformers, the
# trainer): VmRSS of ``python -c "import megamarl.trainer, megamarl.run"`` measured 577 MiB on the
# 2-core Xeon (torch 2.13.0+cpu); gloo's buffers and the allocator's slack come on top, unpriced.
CPU_RANK_BASELINE_BYTES = 577 * 2**20


def node_peak(report: DryRunReport, ranks: list[GpuReport]) -> tuple[str, float]:
    """The phase in which ``ranks`` (one host's) hold the most together, and those bytes."""
    names = [name for g in ranks for name in g.phases]
    totals = {name: sum(g.phase(name) for g in ranks) for name in dict.fromkeys(names)}
    name = max(totals, key=lambda n: totals[n])
    return name, totals[name]


def _split(report: DryRunReport, cfg: RunConfig, g: GpuReport) -> tuple[float, float]:
    """The peak phase's activations of rank ``g``, as (activations without the log-prob peak, the
    log-prob peak of the shard they belong to)."""
    held = g.phases[g.peak_phase].kinds.get("activations", 0.0)
    if not held:
        return 0.0, 0.0
    logits = 0.0
    for shard in g.shards:
        wg = report.worker_groups[shard.policy]
        memory = wg.stages[shard.pp]
        last = shard.pp == wg.layout.pp - 1
        if memory.peak == held and last and memory.activations >= memory.reference_visit:
            logits = logits_peak_bytes(wg.shape, cfg.policies[shard.policy], wg.layout, wg.setup)
            break
    return held - logits, logits


def print_host_report(report: DryRunReport, cfg: RunConfig, console) -> None:
    """Worker groups and engines per rank's process, then one row per rank with what it holds at its
    peak phase, then the host line."""
    from rich.table import Table

    numbers: tuple[str, ...] = ("weights", "grads", "main", "adam", "ref", "lora", "activ.", "logits")
    numbers += ("total GiB",)
    wgs = Table(title=f"Worker groups ({report.world_size} CPU ranks; GiB per rank)")
    for col in ("policy", "model", "ranks", "tp x pp x dp", "dtype", "stage") + numbers:
        wgs.add_column(col, justify="right" if col in numbers else "left")
    for name, wg in report.worker_groups.items():
        lay = wg.layout
        head = [
            name,
            f"{wg.model} ({wg.shape.num_params / 1e9:.2f}B)",
            rank_ranges(lay.ranks),
            f"{lay.tp} x {lay.pp} x {lay.dp}",
            wg.setup.dtype,
        ]
        for stage, m in enumerate(wg.stages):
            last = stage == lay.pp - 1 and not cfg.policies[name].frozen
            logits = logits_peak_bytes(wg.shape, cfg.policies[name], lay, wg.setup) if last else 0.0
            ref = gib(m.reference) if not m.reference_visit else f"(visit {gib(m.reference_visit)})"
            cells = head if stage == 0 else [""] * len(head)
            wgs.add_row(
                *cells,
                f"pp{stage}",
                *map(gib, (m.weights, m.grads, m.main_params, m.optimizer)),
                ref,
                *map(gib, (m.lora, m.activations - logits, logits, m.total)),
            )
    console.print(wgs)
    for name, wg in report.worker_groups.items():
        if wg.tree is not None:
            console.print(tree_line(name, wg.tree))

    in_process = {"external": "external", "in_process": "rank 0's own"}
    engines = engines_table(
        report,
        title="Engines (GiB in the process that runs each replica)",
        place="process",
        where=lambda e: in_process.get(e.launch, "a server by its rank"),
    )
    console.print(engines)

    per_rank = Table(title="Ranks (RAM, GiB: a rank's process and the engine servers it starts, at its peak)")
    numbers = ("process", "train state", "ref", "engines", "activ.", "logits", "total")
    for col in ("rank", "WG shards", "engine replicas", "peak phase") + numbers:
        per_rank.add_column(col, justify="right" if col in numbers else "left")
    for g in report.gpus:
        if not g.phases:
            continue
        kinds = g.phases[g.peak_phase].kinds
        train_state = sum(kinds.get(k, 0.0) for k in ("weights", "grads", "main_params", "optimizer"))
        activations, logits = _split(report, cfg, g)
        per_rank.add_row(
            str(g.rank),
            ", ".join(map(str, g.shards)) or "-",
            ", ".join(map(str, g.engines)) or "-",
            g.peak_phase,
            *map(
                gib,
                (
                    kinds.get("reserve", 0.0),
                    train_state,
                    kinds.get("reference", 0.0),
                    g.phases[g.peak_phase].engine,
                    activations,
                    logits,
                    g.total,
                ),
            ),
        )
    console.print(per_rank)
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    console.print(host_line(report))


def host_line(report: DryRunReport) -> str:
    """One line: the busiest rank, and what the host's ranks need together against its RAM."""
    busy = [g for g in report.gpus if g.phases]
    peak = max(busy, key=lambda g: g.total)
    phase, together = node_peak(report, busy)
    line = (
        f"peak {gib(peak.total)} GiB on rank {peak.rank} (phase '{peak.peak_phase}'); ranks "
        f"{rank_ranges([g.rank for g in busy])} need {gib(together)} GiB together (phase '{phase}')"
    )
    if report.host is None:
        return line + "; this host's RAM is unknown (no /proc/meminfo): not checked"
    return (
        f"{line} of this host's {gib(report.host.total)} GiB RAM (MemTotal, /proc/meminfo; "
        f"{gib(report.host.available)} GiB MemAvailable now)"
    )


def host_memory_warning(report: DryRunReport) -> str:
    """The warning when the host's ranks need more RAM together than its MemTotal ('' when they fit).
    A warning, not the GPU plan's error: the CPU plan prices a prefix tree as if nothing were shared
    and the kernel lends memory it may never be asked for, so a shipped config that trains on this
    machine may still be priced over it; the line names what to lower if the run is OOM-killed."""
    if report.host is None:
        return ""
    busy = [g for g in report.gpus if g.phases]
    phase, together = node_peak(report, busy)
    if together <= report.host.total:
        return ""
    held: dict[str, list[int]] = {}  # what a rank holds -> the ranks that hold the same
    for g in busy:
        kinds = g.phases[phase].kinds.items()
        line = " + ".join(f"{'process' if k == 'reserve' else k} {gib(v)}" for k, v in kinds if v)
        held.setdefault(line, []).append(g.rank)
    detail = "; ".join(f"rank {rank_ranges(ranks)}: {line}" for line, ranks in held.items())
    keys = " + ".join(f"policies.{name}" for name in report.worker_groups)
    return (
        f"{keys}: CPU ranks {rank_ranges([g.rank for g in busy])} need {gib(together)} GiB of RAM together "
        f"in phase '{phase}' > this host's {gib(report.host.total)} GiB (MemTotal, /proc/meminfo) [{detail} "
        "GiB]. If the run is killed (torchrun: exitcode -9), lower micro_batch_size, seq_len or "
        "max_tokens_per_micro_batch, engine.kv_cache_gib, or run fewer ranks on this host."
    )
