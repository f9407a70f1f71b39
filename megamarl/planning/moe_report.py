"""What the dry-run shows of a mixture-of-experts policy: its expert grid (which ranks form each EP and
expert-DP group) and one table whose rows are the experts, the router and the dispatcher.

Every figure comes from the functions the memory plan sums (``memory.trainable_buffers``,
``planning.expert_plan``), so a row and the worker-group table cannot disagree: the buffers of a stage add up
to its weights, grads, main params and Adam columns. Activation rows are per layer and micro-batch
(the WG table's activations hold them times the layers and micro-batches kept, by ``recompute``).
"""

from __future__ import annotations

from megamarl.config import PolicyConfig
from megamarl.parallel.placement import WorkerGroupLayout, rank_coords
from megamarl.planning.expert_plan import (
    ExpertLayout,
    dispatcher_bytes,
    expert_gather_bytes,
    expert_layout,
    moe_saved_bytes,
    routed_rows,
    router_bytes_per_token,
)
from megamarl.planning.memory import (
    DTYPE_BYTES,
    TrainingSetup,
    buffer_elements,
    rank_parameters,
    tokens_per_micro_batch,
    trainable_buffers,
)
from megamarl.planning.model_presets import ModelShape
from megamarl.planning.report import MoePlan, gib, rank_ranges


def moe_plan(
    shape: ModelShape,
    policy: PolicyConfig,
    layout: WorkerGroupLayout,
    setup: TrainingSetup,
    *,
    engine_width: int,
) -> MoePlan | None:
    """The figures of ``moe_table`` (None for a dense model)."""
    moe = shape.moe
    if moe is None or policy.frozen:  # a frozen policy has no worker: nothing trains, nothing is pushed
        return None
    grid = expert_layout(layout, ep=policy.ep)
    b, cf = DTYPE_BYTES[setup.dtype], policy.moe.capacity_factor
    tokens = tokens_per_micro_batch(policy, setup)
    buffers, params = [], []
    for stage in range(layout.pp):
        numels = rank_parameters(shape, tp=layout.tp, pp=layout.pp, stage=stage, ep=policy.ep)
        buffers.append(trainable_buffers(numels, policy, layout, setup))
        elements = buffer_elements(numels, setup).items()
        params.append({name: sum(sizes) + shared for name, (_, sizes, shared) in elements})
    # a push gathers each layer's experts on the EP groups of the stage senders (tp 0, dp 0)
    senders = [r for r in layout.ranks if rank_coords(layout, r)["tp"] == rank_coords(layout, r)["dp"] == 0]
    gather_ranks = sorted({r for g in grid.groups("ep") if set(g) & set(senders) for r in g})
    moves = policy.base_moves
    return MoePlan(
        grid,
        buffers,
        params,
        tokens,
        routed_rows(moe, tokens=tokens, capacity_factor=cf),
        cf,
        tokens * router_bytes_per_token(moe),
        moe_saved_bytes(shape, tokens=tokens, dtype_bytes=b, tp=layout.tp, capacity_factor=cf),
        dispatcher_bytes(shape, tokens=tokens, dtype_bytes=b, capacity_factor=cf),
        expert_gather_bytes(shape, width=engine_width) if moves else 0.0,
        tuple(gather_ranks) if moves else (),
    )


def expert_grid_lines(name: str, grid: ExpertLayout, *, num_experts: int) -> list[str]:
    """Which ranks form each expert group of policy ``name`` (as megatron-core builds them) and which
    experts each EP index holds (megatron-core's local experts: a contiguous block of global ids)."""
    local = num_experts // grid.ep
    head = (
        f"policies.{name} expert grid: etp x ep x edp = {grid.etp} x {grid.ep} x {grid.edp} per pipeline "
        f"stage (x pp {grid.pp}); megatron-core's expert RankGenerator, order tp-cp-ep-dp-pp"
    )
    lines = [head]
    for axis, what in (("ep", "experts split over"), ("edp", "expert grads reduced over")):
        groups = [rank_ranges(g) if _contiguous(g) else ",".join(map(str, g)) for g in grid.groups(axis)]
        lines.append(f"  {axis} groups ({what}): " + "; ".join(groups))
    held = [f"ep{k}: {k * local}-{(k + 1) * local - 1}" for k in range(grid.ep)]
    lines.append(f"  experts held by each ep index ({local} per rank, every layer): " + ", ".join(held))
    return lines


def _contiguous(group: list[int]) -> bool:
    return group == list(range(group[0], group[0] + len(group)))


def moe_table(name: str, shape: ModelShape, plan: MoePlan, *, dtype: str):
    """Rows: each DDP buffer of each stage (dense, routers, experts) with its elements per rank and
    bytes; the router's and the experts' saved activations, the dispatcher's buffers (one layer, one
    micro-batch) and the push's expert gather."""
    from rich.table import Table

    moe = shape.moe
    assert moe is not None  # moe_plan returned a plan
    numbers = ("params/rank", "weights", "grads", "main", "adam", "MiB")
    table = Table(
        title=f"policies.{name}: {moe.num_experts} experts, top-{moe.top_k}, expert ffn {moe.ffn_hidden_size}"
        f" ({shape.num_active_params / 1e9:.2f}B of {shape.num_params / 1e9:.2f}B active); GiB per GPU"
    )
    for col in ("part", "stage") + numbers + ("what",):
        table.add_column(col, justify="right" if col in numbers else "left")
    grid = plan.grid
    dense = "attention, embeddings, norms" + (", routers" if dtype == "fp32" else "")
    what = {
        "dense fp32": "routers [E, h], replicated (and the local spec's norms): over dp",
        f"dense {dtype}": f"{dense}: over dp ({grid.edp * grid.ep})",
        "experts": f"{moe.num_experts // grid.ep} of {moe.num_experts} per layer, over edp ({grid.edp})",
    }
    for stage, buffers in enumerate(plan.buffers):
        for part, m in buffers.items():
            params = plan.params[stage][part]
            cells = (gib(m.weights), gib(m.grads), gib(m.main_params), gib(m.optimizer), "")
            table.add_row(part, f"pp{stage}", f"{params:,}", *cells, what.get(part, ""))
    routing = (
        "dropless, balanced routing"
        if plan.capacity_factor is None
        else (f"capacity factor {plan.capacity_factor}: every expert padded to its capacity")
    )
    table.caption = (
        f"activation rows: one layer, one micro-batch of {plan.tokens:,} tokens -> {plan.rows:,} routed "
        f"rows per rank ({routing})"
    )
    rows = (
        ("router activations", plan.router, "fp32 logits and probabilities, routing map [T, E]"),
        ("expert activations", plan.experts, "router + permuted input, SwiGLU, combine per routed row"),
        ("dispatcher buffers", plan.dispatcher, "all-to-all send + receive buffers, rows x h"),
    )
    for part, amount, text in rows:
        table.add_row(part, "all", "", "", "", "", "", _mib(amount), text)
    if plan.gather:
        table.add_row(
            "expert gather (push)",
            "all",
            "",
            "",
            "",
            "",
            "",
            _mib(plan.gather),
            f"one layer's {moe.num_experts} experts (engine dtype) on {rank_ranges(list(plan.gather_ranks))}",
        )
    return table


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.1f}"


def expert_communicators(plan: MoePlan, dense: set[tuple[int, ...]], rank: int) -> int:
    """The expert groups of ``rank`` (etp, ep, edp; multi-rank) that are not one of its dense groups'
    rank sets ``dense`` (``placement.communicator_rank_sets``): one more communicator each."""
    sets = {
        tuple(sorted(g))
        for axis in ("etp", "ep", "edp")
        for g in plan.grid.groups(axis)
        if rank in g and len(g) > 1
    }
    return len(sets - dense)
