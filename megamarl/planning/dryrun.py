"""Cluster dry-run: check a run's placement and per-GPU memory on one CPU process, before asking Slurm.

``dry_run(cfg)`` takes the declared cluster (``cluster.num_nodes * cluster.gpus_per_node`` ranks,
node-major like torchrun), builds the placement (layout errors name the config key), builds every
worker group's process groups in a FAKE world of that size (no GPUs, milliseconds), checks each
policy's model shape (an architecture preset or a local ``config.json``: no weights downloaded)
against its layout and engine TP, and prints which GPU holds which WG shard and engine replica with
a per-GPU memory estimate, raising ``ValueError`` naming the policy, GPU and numbers when one does
not fit ``cluster.gpu_memory_gib``. Memory comes from ``megamarl.planning.memory`` and the engines'
weights, KV cache and adapters, priced phase by phase in the order the trainer runs them
(``megamarl.planning.phases``): a GPU needs its peak phase, reported by name. Engine placement is
``rollout.engine_placement.plan_engines``'s. A CPU config (``cluster.gpus_per_node: 0``) is reported in
RAM per rank and checked against this host's (``megamarl.planning.host_report``). Details (the training
setup, engine formulas, what each phase holds): docs/design-notes.md, "megamarl/planning/dryrun.py".
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from megamarl.config import PolicyConfig, RunConfig
from megamarl.models.spec import planned_layer_spec, tree_attention_choice
from megamarl.parallel.hardware import HostMemory, host_memory, resolve_dtype
from megamarl.parallel.placement import (
    NCCL_COMMUNICATOR_BYTES,
    PlacementConfig,
    build_worker_groups,
    communicator_rank_sets,
    group_enumeration,
    nccl_reserve_bytes,
    placement_of,
    rank_coords,
)
from megamarl.planning.host_report import CPU_RANK_BASELINE_BYTES, host_memory_warning, print_host_report
from megamarl.planning.memory import (
    DTYPE_BYTES,
    Memory,
    TrainingSetup,
    num_micro_batches,
    relay_buffer_bytes,
    tokens_per_micro_batch,
    train_memory,
    tree_attention_cost,
)
from megamarl.planning.model_presets import ModelShape, resolve_model_shape
from megamarl.planning.moe_report import expert_communicators, expert_grid_lines, moe_plan, moe_table
from megamarl.planning.phases import TRAIN_STATE, Phase, run_phases, step_phases
from megamarl.planning.report import (
    GIB,
    DryRunReport,
    EngineReport,
    EngineShard,
    GpuReport,
    PhaseBytes,
    Shard,
    WorkerGroupReport,
    engines_table,
    gib,
    rank_ranges,
    tree_line,
)
from megamarl.rollout.engine_placement import ReplicaPlacement, plan_engines
from megamarl.rollout.weights.stage_gather import relay_roles
from megamarl.rollout.weights.transport import relays_stages


def dry_run(
    cfg: RunConfig,
    *,
    overlaps_training: bool,
    console=None,
    world_size: int | None = None,
    host: HostMemory | None = None,
) -> DryRunReport:
    """Validate ``cfg`` against its declared cluster, print the placement and memory tables.
    ``overlaps_training``: the schedule of ``trainer.mode`` rolls out while it trains (its
    ``ScheduleTraits``, given by the caller: the planner sits below the driver). CPU ranks
    (``cluster.gpus_per_node: 0``) get the host report (``planning.host_report``), checked against
    ``host`` (default: this host's ``/proc/meminfo``).

    Raises ``ValueError`` on a layout that cannot be built, a model that cannot be sharded with its
    layout, a GPU whose estimate exceeds ``cluster.gpu_memory_gib``, or CPU ranks that need more RAM
    together than the host has.
    """
    from rich.console import Console

    # Log files (Slurm, CI) are not terminals: rich would wrap the tables at 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    cluster = cfg.cluster
    on_gpus = cluster.gpus_per_node > 0
    if world_size is None:
        world_size = declared_world_size(cfg)
    placement = placement_of(cfg, world_size)
    gpus_per_node = cluster.gpus_per_node or world_size

    shapes = {
        name: resolve_model_shape(policy.model, key=f"policies.{name}.model")
        for name, policy in cfg.policies.items()
    }
    for name, policy in cfg.policies.items():  # shape errors first: they say why a tp cannot work at all
        placement.worker_groups[name].check_model(
            num_heads=shapes[name].num_heads,
            num_kv_heads=shapes[name].num_kv_heads,
            num_layers=shapes[name].num_layers,
        )
        check_engine_shape(name, policy, shapes[name])
    report = plan_memory(
        cfg,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        on_gpus=on_gpus,
        shapes=shapes,
        overlaps_training=overlaps_training,
    )

    group_sizes = build_fake_groups(placement, world_size)
    for name, sizes in group_sizes.items():
        layout = placement.worker_groups[name]
        expected = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}
        if sizes != expected:  # a bug in placement, not in the user's config
            raise RuntimeError(f"worker group {name}: built groups {sizes} differ from the layout {expected}")

    for note in seq_len_notes(cfg, report):
        console.print(note)
    if not on_gpus:  # CPU ranks: RAM per rank, checked against this host's (planning.host_report)
        report.host = host or host_memory()
        print_host_report(report, cfg, console)
        warning = host_memory_warning(report)
        if warning:
            console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
        return report
    report.gpu_memory_gib = capacity_gib(cluster.gpu_memory_gib, device_total_bytes())
    print_report(report, console)
    _check_capacity(report, cfg)
    return report


def plan_memory(
    cfg: RunConfig,
    *,
    world_size: int,
    gpus_per_node: int,
    on_gpus: bool,
    overlaps_training: bool,
    shapes: dict[str, ModelShape] | None = None,
    offload_applies: bool | None = None,
) -> DryRunReport:
    """Every WG's and engine's bytes and what each GPU holds in each phase, for ``world_size`` ranks
    (no checks, no printing; ``dry_run`` adds them, and engine servers take their memory fraction
    from it: ``megamarl.planning.engine_budget``). ``offload_applies``: the train state really
    leaves the device (default: ``on_gpus``; a CPU test forces it)."""
    placement = placement_of(cfg, world_size)
    shapes = shapes or {
        name: resolve_model_shape(p.model, key=f"policies.{name}.model") for name, p in cfg.policies.items()
    }
    plan = plan_engines(cfg, world_size, gpus_per_node)
    worker_groups, engines, warnings = {}, {}, []
    for name, policy in cfg.policies.items():
        layout, shape = placement.worker_groups[name], shapes[name]
        setup = training_setup(cfg, name, on_gpus=on_gpus)
        # micro-batches in flight are capped by those of an optimizer step when rows alone count them
        # (agents' own sizes split steps per agent, packing splits by tokens: no cap, the safe side)
        overridden = policy.pack or any(
            a.micro_batch_size or a.mini_batch_size for a in cfg.agents.values() if a.policy == name
        )
        assert layout.dp is not None  # set by WorkerGroupLayout.__post_init__
        micro_batches = (
            None if policy.mini_batch_size is None or overridden else num_micro_batches(policy, layout.dp)
        )
        stages = [
            train_memory(shape, policy, layout, setup, stage=s, num_micro_batches=micro_batches)
            for s in range(layout.pp)
        ]
        width = DTYPE_BYTES[engine_dtype(policy, on_gpus=on_gpus)]
        worker_groups[name] = WorkerGroupReport(
            name,
            policy.model,
            shape,
            layout,
            setup,
            stages,
            tree_attention_cost(shape, policy, layout, setup),
            moe_plan(shape, policy, layout, setup, engine_width=width),
        )
        engines[name] = _engine_report(
            name,
            policy,
            shape,
            plan[name],
            setup.num_adapters,
            dtype=engine_dtype(policy, on_gpus=on_gpus),
            on_gpus=on_gpus,
        )
        warnings += _cross_node_warnings(name, layout, gpus_per_node)
    offload_applies = on_gpus if offload_applies is None else offload_applies
    gpus = _gpu_totals(
        cfg,
        worker_groups,
        engines,
        world_size,
        gpus_per_node,
        offload_applies=offload_applies,
        on_gpus=on_gpus,
        overlap=overlaps_training,
    )
    return DryRunReport(
        world_size,
        gpus_per_node,
        cfg.cluster.gpu_memory_gib,
        worker_groups,
        engines,
        gpus,
        warnings,
        on_gpus=on_gpus,
    )


def seq_len_notes(cfg: RunConfig, report: DryRunReport) -> list[str]:
    """One line per policy that leaves ``seq_len`` at its default while every agent on it replies in far
    fewer tokens (``sampling.max_tokens`` at most an eighth of it): what that length prices."""
    default = PolicyConfig.seq_len
    notes = []
    for name, policy in cfg.policies.items():
        replies = [a.sampling.max_tokens for a in cfg.agents.values() if a.policy == name]
        if policy.seq_len != default or not replies or max(replies) * 8 > policy.seq_len:
            continue
        wg = report.worker_groups[name]
        tokens = tokens_per_micro_batch(policy, wg.setup)
        notes.append(
            f"note: policies.{name}.seq_len={policy.seq_len} (the default) prices every sample of "
            f"{name} at {policy.seq_len} tokens (micro-batches of {tokens:,} tokens, "
            f"{'the engine KV cache, ' if policy.engine.kv_cache_setting(on_gpu=report.on_gpus) == 0 else ''}"
            f"a server's max-model-len) while its agents reply in at most {max(replies)} "
            "(sampling.max_tokens): set it to the longest prompt + reply"
        )
    return notes


def declared_world_size(cfg: RunConfig) -> int:
    """``cluster.num_nodes * cluster.gpus_per_node``; CPU runs declare no cluster: take the smallest
    world the config can run on (WORLD_SIZE under torchrun), i.e. every explicit rank and one full
    model-parallel group of each rank-less policy."""
    import os

    if cfg.cluster.gpus_per_node > 0:
        return cfg.cluster.num_nodes * cfg.cluster.gpus_per_node

    needed = [int(os.environ.get("WORLD_SIZE", "1"))]
    for policy in cfg.policies.values():
        needed += [max(policy.ranks) + 1] if policy.ranks else [policy.tp * policy.pp]
        needed += [max(policy.engine.ranks) + 1] if policy.engine.ranks else []
    return max(needed)


# ----------------------------------------------------------------------------------- memory


def training_setup(cfg: RunConfig, name: str, *, on_gpus: bool) -> TrainingSetup:
    """What ``megamarl.rl.policy_setup.build_workers`` decides for policy ``name`` besides its config
    section, as it will decide it on the declared cluster (``on_gpus``: ``cluster.gpus_per_node > 0``)."""
    policy = cfg.policies[name]
    agents = [a for a in cfg.agents.values() if a.policy == name]
    declared = policy.engine.dtype if policy.dtype == "auto" else policy.dtype
    # auto: bf16 where the device computes it natively (hardware.resolve_dtype); every GPU megatron-core
    # trains on does, CPU ranks are this machine's kind
    dtype = "bf16" if declared == "auto" and on_gpus else resolve_dtype(declared)
    return TrainingSetup(
        dtype=dtype,
        num_adapters=_num_adapters(cfg, name),
        reference=policy.lora is None and (policy.kl_coef > 0 or any((a.kl_coef or 0) > 0 for a in agents)),
        micro_batch_size=max(
            [policy.micro_batch_size] + [a.micro_batch_size for a in agents if a.micro_batch_size]
        ),
        # the model build's own choice (bridge.build_model). A GPU cluster has TE: the documented GPU
        # install is megamarl[gpu], and cli.front_door.check_layer_specs refuses a node without it
        spec=planned_layer_spec(lora=policy.lora is not None, on_gpus=on_gpus),
        # the model build's own choice too (bridge.build_model: NodeKernels.tree_attention)
        tree_attention=tree_attention_choice(prefix_tree=policy.prefix_tree, cuda=on_gpus),
    )


def engine_memory(
    shape: ModelShape,
    policy: PolicyConfig,
    *,
    num_adapters: int = 0,
    dtype: str = "bf16",
    on_gpus: bool = True,
) -> Memory:
    """One engine GPU's bytes; ``dtype``: the engine's weight dtype (``engine_dtype``); ``on_gpus``:
    how ``engine.kv_cache_gib: null`` resolves (``EngineConfig.kv_cache_setting``)."""
    engine = policy.engine
    tp = engine.tp
    width = DTYPE_BYTES[dtype]
    memory = Memory(weights=width * shape.num_params / tp)
    kv_cache_gib = engine.kv_cache_setting(on_gpu=on_gpus)
    if kv_cache_gib > 0:
        memory.kv_cache = kv_cache_gib * GIB
    else:
        kv_heads = math.ceil(shape.num_kv_heads / tp)  # vLLM replicates KV heads when tp > kv heads
        per_token = 2 * shape.num_layers * kv_heads * shape.head_dim * 2
        memory.kv_cache = engine.max_num_seqs * policy.seq_len * per_token
    if policy.lora is not None:
        adapters = num_adapters * shape.num_layers * _lora_params_per_layer(shape, policy.lora)
        memory.lora = width * adapters / tp
    return memory


def _lora_params_per_layer(shape: ModelShape, lora) -> int:
    """Adapter parameters of one layer: r * (in + out) for every targeted linear (fused as in Megatron)."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    dims = {"qkv": (h, q + 2 * kv), "proj": (q, h), "fc1": (h, 2 * f), "fc2": (f, h)}
    return sum(lora.rank * (dims[t][0] + dims[t][1]) for t in lora.targets)


def _num_adapters(cfg: RunConfig, policy_name: str) -> int:
    policy = cfg.policies[policy_name]
    if policy.lora is None:
        return 0
    names = {a.lora for a in cfg.agents.values() if a.policy == policy_name and a.lora is not None}
    return max(1, len(names))


def check_engine_shape(name: str, policy: PolicyConfig, shape: ModelShape) -> None:
    """Raise when the model's heads cannot be sharded over ``engine.tp``."""
    engine = policy.engine
    key = f"policies.{name}.engine"
    if shape.num_heads % engine.tp:
        raise ValueError(
            f"{key}.tp={engine.tp} does not divide the model's {shape.num_heads} attention heads"
        )
    if shape.num_kv_heads % engine.tp and engine.tp % shape.num_kv_heads:
        raise ValueError(
            f"{key}.tp={engine.tp}: the model's {shape.num_kv_heads} KV heads can be neither split "
            "nor replicated evenly over it"
        )


def engine_dtype(policy: PolicyConfig, *, on_gpus: bool) -> str:
    """``engine.dtype`` as the engine will load it: ``auto`` is bf16 on GPUs, this machine's kind on CPU
    ranks."""
    return "bf16" if policy.engine.dtype == "auto" and on_gpus else resolve_dtype(policy.engine.dtype)


def _engine_report(
    name,
    policy: PolicyConfig,
    shape,
    replicas: list[ReplicaPlacement],
    num_adapters,
    *,
    dtype: str = "bf16",
    on_gpus: bool = True,
) -> EngineReport:
    """The policy's engine memory on the ranks ``plan_engines`` puts its replicas on (the same plan
    every rank computes at start-up)."""
    engine = policy.engine
    placed = [list(r.ranks) for r in replicas if r.launch != "external"]
    colocated = bool(placed) and all(r.colocated for r in replicas)
    return EngineReport(
        name,
        engine.backend,
        engine.tp,
        placed,
        colocated,
        engine_memory(shape, policy, num_adapters=num_adapters, dtype=dtype, on_gpus=on_gpus),
        launch=replicas[0].launch if replicas else "external",
    )


def _gpu_totals(
    cfg: RunConfig,
    worker_groups,
    engines,
    world_size,
    gpus_per_node,
    *,
    offload_applies: bool,
    on_gpus: bool,
    overlap: bool,
) -> list[GpuReport]:
    """Every GPU priced phase by phase (``megamarl.planning.phases``), as the trainer runs them."""
    gpus = [GpuReport(r, r // gpus_per_node, r % gpus_per_node) for r in range(world_size)]
    holdings: list[list] = [[] for _ in range(world_size)]  # (Memory, offloaded) of each WG shard
    engines_on: list[list] = [[] for _ in range(world_size)]  # (Memory, kinds it releases asleep) per shard
    for name, engine in engines.items():
        released: tuple[str, ...] = ()
        if engine.colocated and engine.launch == "server" and not overlap:
            # colocated servers hand their memory over when training never overlaps
            # (fleet.PolicyServers.hands_over)
            released = ("engine_weights", "kv_cache")
        elif engine.launch == "in_process" and not overlap:
            # in-process engines sleep too (PolicyReplicas.sleep); on CPU their weights stay in the
            # rank's RAM and only the KV cache's pages go back (vLLM-CPU's sleep)
            released = ("engine_weights", "kv_cache") if on_gpus else ("kv_cache",)
        for replica, ranks in enumerate(engine.replicas):
            for tp_rank, rank in enumerate(ranks):
                gpus[rank].engines.append(EngineShard(name, replica, tp_rank))
                engines_on[rank].append((engine.memory, released))
    for name, wg in worker_groups.items():
        layout = wg.layout
        for rank in layout.ranks:
            coords = rank_coords(layout, rank)
            gpus[rank].shards.append(Shard(name, coords["tp"], coords["pp"], coords["dp"]))
            # run.offload_targets: sync mode, an engine replica on this rank, an accelerator
            offloaded = (
                offload_applies
                and not overlap
                and bool(engines_on[rank])
                and cfg.policies[name].offload_train_state
            )
            holdings[rank].append((wg.stages[coords["pp"]], offloaded))
    # a GPU's reserve (CUDA context, fragmentation); a CPU rank's process baseline
    reserved = cfg.cluster.reserved_gib * GIB if on_gpus else CPU_RANK_BASELINE_BYTES
    layouts = [
        wg.layout for wg in worker_groups.values()
    ]  # NCCL communicators: only on GPUs (gloo on CPU ranks)
    nccl = [nccl_reserve_bytes(layouts, r, world_size) if on_gpus else 0.0 for r in range(world_size)]
    for wg in worker_groups.values():  # an MoE WG's expert groups: communicators of their own
        if wg.moe is not None and on_gpus:
            for rank in wg.layout.ranks:
                own = expert_communicators(wg.moe, communicator_rank_sets(wg.layout, rank), rank)
                nccl[rank] += own * NCCL_COMMUNICATOR_BYTES
    relayed, partners = _relay_buffers(cfg, worker_groups, engines, world_size, on_gpus=on_gpus)
    if on_gpus:  # a relay's point-to-point pairs on the default group: an NCCL communicator each
        nccl = [n + partners[r] * NCCL_COMMUNICATOR_BYTES for r, n in enumerate(nccl)]
    for gpu in gpus:
        if not (gpu.shards or gpu.engines):
            continue
        # one entry per phase name, in a step's order (start-up runs the push half of the same phases)
        for phase in (*step_phases(overlaps_training=overlap), *run_phases(overlaps_training=overlap)):
            priced = price_phase(
                phase,
                holdings[gpu.rank],
                engines_on[gpu.rank],
                reserved=reserved,
                nccl=nccl[gpu.rank],
                push_buffers=relayed[gpu.rank],
            )
            if priced.total > gpu.phases.get(phase.name, PhaseBytes(phase.name)).total:
                gpu.phases[phase.name] = priced
        peak = max(gpu.phases.values(), key=lambda p: p.total)
        gpu.peak_phase, gpu.total = peak.name, peak.total
    return gpus


def _relay_buffers(
    cfg: RunConfig, worker_groups, engines, world_size: int, *, on_gpus: bool
) -> tuple[list[float], list[int]]:
    """Per rank: the device bytes a relayed push holds (``memory.relay_buffer_bytes``) and its number of
    point-to-point partners, for every policy whose colocated PP>1 servers are fed by their leaders
    (``transport.relays_stages``; the roles of ``stage_gather.relay_roles``); plus an MoE policy's
    experts gathered over EP (``moe_report.MoePlan.gather``)."""
    buffers, partners = [0.0] * world_size, [0] * world_size
    for name, engine in engines.items():
        policy, wg = cfg.policies[name], worker_groups[name]
        if not (
            engine.colocated
            and engine.launch == "server"
            and policy.pp > 1
            and relays_stages(policy, colocated=True, on_gpu=on_gpus)
        ):
            continue
        width = DTYPE_BYTES[engine_dtype(policy, on_gpus=on_gpus)]
        bucket_bytes = int(policy.engine.bucket_mb * 2**20)
        for rank, role in relay_roles(wg.layout, [ranks[0] for ranks in engine.replicas]).items():
            held = relay_buffer_bytes(
                wg.shape,
                width=width,
                bucket_bytes=bucket_bytes,
                forwards=bool(role.destinations),
                feeds=role.feeds,
            )
            buffers[rank] = max(buffers[rank], held)  # policies push one after another
            partners[rank] += len(set(role.destinations) | set(role.sources.values()))
    for wg in worker_groups.values():  # an MoE push gathers each layer's experts over EP (the safe side:
        if wg.moe is not None:  # on top of a relay's buffers)
            for rank in wg.moe.gather_ranks:
                buffers[rank] += wg.moe.gather
    return buffers, partners


def device_total_bytes() -> int | None:
    """This host's GPU memory as the driver reports it (``total_memory``; an "80 GB" H100 reports
    79.6 GiB); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def capacity_gib(declared_gib: float, device_bytes: int | None) -> float:
    """The memory per GPU a plan is checked against: ``cluster.gpu_memory_gib`` on a host without CUDA
    (a dry-run on a login node); on a GPU host the smaller of it and the device's reported total (the
    device cannot give more; a smaller declared figure is a cap the user chose)."""
    return declared_gib if device_bytes is None else min(declared_gib, device_bytes / GIB)


def _capacity_key(report: DryRunReport, cfg: RunConfig) -> str:
    declared = cfg.cluster.gpu_memory_gib
    if report.gpu_memory_gib < declared:
        return f"this GPU's {report.gpu_memory_gib:.1f} GiB (< cluster.gpu_memory_gib={declared})"
    return f"cluster.gpu_memory_gib={declared}"


def price_phase(
    phase: Phase,
    shards: list[tuple[Memory, bool]],
    engines: list[tuple[Memory, tuple[str, ...]]],
    *,
    reserved: float,
    nccl: float = 0.0,
    push_buffers: float = 0.0,
) -> PhaseBytes:
    """What one GPU holds in ``phase``: ``shards`` its WG shards' ``Memory`` and whether the trainer
    offloads that train state here; ``engines`` its engine shards' ``Memory`` and the kinds each
    releases asleep; ``push_buffers`` what a relayed push holds here (``_relay_buffers``) in the
    phases that push."""
    out = PhaseBytes(phase.name)
    for memory, offloaded in shards:
        for kind in TRAIN_STATE:
            if phase.holds(kind) or not offloaded:
                amount = getattr(memory, kind) + (memory.lora if kind == "weights" else 0.0)
                out.kinds[kind] = out.kinds.get(kind, 0.0) + amount
        out.kinds["reference"] = out.kinds.get("reference", 0.0) + memory.reference
    for kind in ("activations", "cached_blocks"):  # WGs on one GPU update one after another
        if phase.holds(kind) and shards:
            out.kinds[kind] = max(memory.peak for memory, _ in shards)
    for memory, released in engines:
        for kind, amount in (("engine_weights", memory.weights + memory.lora), ("kv_cache", memory.kv_cache)):
            if phase.holds(kind) or kind not in released:
                out.kinds[kind] = out.kinds.get(kind, 0.0) + amount
    if phase.holds("push_buffers") and push_buffers:
        out.kinds["push_buffers"] = push_buffers
    out.kinds["nccl"] = nccl
    out.kinds["reserve"] = reserved
    return out


def _check_capacity(report: DryRunReport, cfg: RunConfig) -> None:
    capacity = report.gpu_memory_gib * GIB
    over = [g for g in report.gpus if g.total > capacity]
    if not over:
        return
    gpu = over[0]
    holders = sorted({s.policy for s in gpu.shards} | {e.policy for e in gpu.engines})
    detail = []
    for shard in gpu.shards:
        m = report.worker_groups[shard.policy].stages[shard.pp]
        detail.append(
            f"policies.{shard.policy} training (tp{shard.tp} pp{shard.pp} dp{shard.dp}): weights "
            f"{gib(m.weights)} + grads {gib(m.grads)} + main params {gib(m.main_params)} + optimizer "
            f"{gib(m.optimizer)} + reference {gib(m.reference)} + lora {gib(m.lora)} + "
            f"{'activations' if m.activations >= m.reference_visit else 'reference visit'} {gib(m.peak)} "
            f"= {gib(m.total)} GiB"
        )
    for engine in gpu.engines:
        m = report.engines[engine.policy].memory
        detail.append(
            f"policies.{engine.policy} engine replica {engine.replica}: weights {gib(m.weights)} + kv cache "
            f"{gib(m.kv_cache)} + lora {gib(m.lora)} = {gib(m.total)} GiB"
        )
    peak = gpu.phases[gpu.peak_phase]
    held = " + ".join(f"{kind} {gib(amount)}" for kind, amount in peak.kinds.items() if amount)
    raise ValueError(
        f"{' + '.join(f'policies.{h}' for h in holders)}: GPU node {gpu.node} local {gpu.local} (global rank "
        f"{gpu.rank}) needs {gib(gpu.total)} GiB > {_capacity_key(report, cfg)} "
        f"in phase '{gpu.peak_phase}' [{held} GiB; "
        + "; ".join(detail)
        + f"]; {len(over)} of {report.world_size} GPUs over. Raise tp/pp, enable recompute, the "
        "distributed optimizer or ref_offload, lower micro_batch_size/seq_len or engine.kv_cache_gib."
    )


# ----------------------------------------------------------------------------------- groups


def build_fake_groups(placement: PlacementConfig, world_size: int) -> dict[str, dict[str, int]]:
    """Build every WG's process groups in a fake world of ``world_size`` ranks, as seen from one member
    rank of each WG; return each WG's built tp/pp/dp group sizes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("dry_run builds a fake world of its own: call it before init_distributed()")
    sizes = {}
    for name, layout in placement.worker_groups.items():
        dist.init_process_group("fake", store=FakeStore(), rank=layout.ranks[0], world_size=world_size)
        try:
            pgs = build_worker_groups(placement, backend="fake")[name].pgs
            assert pgs is not None  # this rank (the WG's first) is a member
            sizes[name] = {"tp": pgs.tp.size(), "pp": pgs.pp.size(), "dp": pgs.dp.size()}
        finally:
            dist.destroy_process_group()
    return sizes


def _cross_node_warnings(name, layout, gpus_per_node: int) -> list[str]:
    """Training TP groups may span nodes (slow, but they run); an engine replica may not
    (``plan_engines`` rejects it)."""
    if any(len({r // gpus_per_node for r in group}) > 1 for group in group_enumeration(layout, ["tp"])):
        return [f"policies.{name}.tp={layout.tp}: TP groups span nodes (TP all-reduces leave NVLink)"]
    return []


# ----------------------------------------------------------------------------------- printing


def print_report(report: DryRunReport, console) -> None:
    """Three rich tables: worker groups (per stage), engines, and every GPU with what it holds."""
    from rich.table import Table

    per_node = report.gpus_per_node
    numbers: tuple[str, ...] = ("weights", "grads", "main", "adam", "ref", "lora", "activ.", "total GiB")
    wgs = Table(title=f"Worker groups ({report.world_size} GPUs, {per_node} per node; GiB per GPU)")
    for col in ("policy", "model", "ranks", "nodes", "tp x pp x dp", "dtype", "stage") + numbers:
        wgs.add_column(col, justify="right" if col in numbers else "left")
    for name, wg in report.worker_groups.items():
        lay = wg.layout
        head = [
            name,
            f"{wg.model} ({wg.shape.num_params / 1e9:.1f}B)",
            rank_ranges(lay.ranks),
            rank_ranges(sorted({r // per_node for r in lay.ranks})),
            f"{lay.tp} x {lay.pp} x {lay.dp}" + (f" (ep {wg.moe.grid.ep})" if wg.moe else ""),
            wg.setup.dtype,
        ]
        for stage, m in enumerate(wg.stages):
            cells = head if stage == 0 else [""] * len(head)
            # a ref_offload reference model costs nothing at rest; shown as its visit
            ref = gib(m.reference) if not m.reference_visit else f"(visit {gib(m.reference_visit)})"
            memory = (
                gib(m.weights),
                gib(m.grads),
                gib(m.main_params),
                gib(m.optimizer),
                ref,
                gib(m.lora),
                gib(m.activations),
                gib(m.total),
            )
            wgs.add_row(*cells, f"pp{stage}", *memory)
    console.print(wgs)
    for name, wg in report.worker_groups.items():
        if wg.tree is not None:
            console.print(tree_line(name, wg.tree))
        if wg.moe is not None and wg.shape.moe is not None:
            for line in expert_grid_lines(name, wg.moe.grid, num_experts=wg.shape.moe.num_experts):
                console.print(line, highlight=False)
            console.print(moe_table(name, wg.shape, wg.moe, dtype=wg.setup.dtype))

    launches = {"external": "external", "in_process": "in rank 0's process"}
    engines = engines_table(
        report,
        title="Engines (GiB per GPU)",
        place="placement",
        where=lambda e: launches.get(e.launch) or ("colocated (sleep/wake)" if e.colocated else "own GPUs"),
    )
    console.print(engines)

    gpus = Table(
        title=f"GPUs (GiB; capacity {round(report.gpu_memory_gib, 1)}, total: the peak phase, reserved "
        "included)"
    )
    for col in ("rank", "node:gpu", "WG shards", "engine replicas", "peak phase", "total"):
        gpus.add_column(col, justify="right" if col == "total" else "left")
    capacity = report.gpu_memory_gib * GIB
    for g in report.gpus:
        shards = ", ".join(map(str, g.shards)) or "-"
        replicas = ", ".join(map(str, g.engines)) or "-"
        style = "bold red" if g.total > capacity else None
        gpus.add_row(
            str(g.rank),
            f"{g.node}:{g.local}",
            shards,
            replicas,
            g.peak_phase or "-",
            gib(g.total),
            style=style,
        )
    console.print(gpus)
    console.print(phase_table(report))
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    peak = max(report.gpus, key=lambda g: g.total)
    console.print(
        f"peak {report.peak_gib:.1f} GiB of {round(report.gpu_memory_gib, 1)} GiB per GPU: phase "
        f"'{peak.peak_phase}' "
        f"on rank {peak.rank}"
    )


def phase_table(report: DryRunReport):
    """One row per phase, in the trainer's order; one column per set of GPUs that hold the same in
    every phase (its ranks), with what the phase holds there; the peak phase of each set in bold."""
    from rich.table import Table

    groups: dict[tuple, list[GpuReport]] = {}
    for g in report.gpus:
        if g.phases:
            key = tuple((name, round(p.total / GIB, 2)) for name, p in g.phases.items())
            groups.setdefault(key, []).append(g)
    table = Table(
        title="Phases of a step (GiB per GPU, reserved included; the trainer's order, "
        "megamarl.planning.phases; "
        "start-up runs wake weights .. evaluate first)"
    )
    table.add_column("phase", justify="left")
    for members in groups.values():
        table.add_column(f"ranks {rank_ranges([g.rank for g in members])}", justify="right")
    table.add_column("held (first column)", justify="left")
    names = list(next(iter(groups.values()))[0].phases) if groups else []
    for name in names:
        cells = []
        for members in groups.values():
            g = members[0]
            cell = gib(g.phase(name))
            cells.append(f"[bold]{cell}[/bold]" if name == g.peak_phase else cell)
        first = next(iter(groups.values()))[0].phases[name]
        held = ", ".join(f"{kind} {gib(amount)}" for kind, amount in first.kinds.items() if amount)
        table.add_row(name, *cells, held)
    return table


if (
    __name__ == "__main__"
):  # the command moved up to the launch floor; say so rather than exit 0 having checked nothing
    raise SystemExit(
        "python -m megamarl.planning.dryrun is now python -m megamarl.cli.dry_run_command "
        "(or scripts/train.py --config ... --dry-run)"
    )
