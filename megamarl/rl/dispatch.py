"""What each rank trains on: the driver plans every policy's update from the step's batch and each
rank receives only its own share.

On the driver, ``plan_policy`` is a pure function of a policy's rows, its ``BatchSplit`` and its WG's
DP size: trainable rows (frozen and adapter-less agents dropped; L2: the rows of adapters below
``lora.min_samples`` too, ``rl.adapters``) -> PPO mini-batches
(``mini_batch_size``) -> per mini-batch its global loss counts and one token-balanced part per DP rank
(an empty part becomes a zero-weight stand-in row, so the rank still joins the all-reduce) -> one
``PolicyShare`` per DP rank. ``rank_batches`` gives every rank a ``RankBatch`` (its DP share of each
policy with a shard there, TP/PP peers alike, plus a ``BatchSummary``), sent point to point over the
control group (``scatter_objects``). Unlike verl's whole-batch dispatch or Megatron-LM's TP broadcast,
a rank's traffic and memory are its own share. Details: docs/design-notes.md, "megamarl/rl/dispatch.py".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from megamarl.parallel.placement import WorkerGroupLayout, rank_coords
from megamarl.rl.adapters import adapter_plan
from megamarl.rl.batch import SampleBatch
from megamarl.rl.losses import loss_counts


@dataclass(frozen=True)
class BatchSplit:
    """How one policy's rows become its update's mini-batches (``policy_setup.batch_splits``)."""

    mini_batch_size: int | None = None  # policies.<p>.mini_batch_size (None: one mini-batch)
    agent_mini_batch_sizes: Mapping[str, int] = field(default_factory=dict)  # agents.<a>.mini_batch_size
    frozen_agents: frozenset[str] = frozenset()  # agents whose rows do not train
    adapters: Mapping[str, str] = field(default_factory=dict)  # L2: agent -> its LoRA adapter
    min_samples: int = 0  # policies.<p>.lora.min_samples (rl.adapters.adapter_plan)


@dataclass
class MiniBatchPart:
    """One DP rank's rows of one PPO mini-batch (one optimizer step)."""

    rows: SampleBatch  # a zero-weight stand-in row when the rank has none of the mini-batch's rows
    counts: dict[str, int]  # loss_counts of the whole mini-batch (every DP rank's rows)


@dataclass
class PolicyShare:
    """One DP rank's data for one policy update: its part of every mini-batch, in order (empty when
    every row of the policy belonged to a frozen agent)."""

    minis: list[MiniBatchPart] = field(default_factory=list)
    stepping: tuple[str, ...] | None = None  # L2: the adapters that step (None: not L2, every parameter)
    dropped: dict[str, int] = field(default_factory=dict)  # L2: adapter -> rows below its minimum


@dataclass(frozen=True)
class BatchSummary:
    """What every rank needs of the step's batch: counts, never rows."""

    trained_policies: tuple[str, ...]  # non-frozen policies with rows this step, in batch order
    num_samples: int  # rows of the whole batch
    num_train_tokens: int  # tokens (prompt + response) of the trained policies' rows
    # L2 policies: the adapters that step in this update (what the next push carries)
    stepped_adapters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass
class RankBatch:
    """What one rank receives: its WGs' shares (in batch order) and the summary."""

    summary: BatchSummary
    shares: dict[str, PolicyShare] = field(default_factory=dict)


def trainable_rows(batch: SampleBatch, frozen_agents: frozenset[str]) -> SampleBatch:
    """Rows of agents that train."""
    if not frozen_agents:
        return batch
    keep = torch.tensor(
        [a not in frozen_agents for a in batch.names("agent")], dtype=torch.bool, device=batch.device
    )
    return batch.select(keep)


def mini_batches(batch: SampleBatch, split: BatchSplit) -> list[SampleBatch]:
    """The policy batch cut into PPO mini-batches. Without a mini-batch size (policy or agent): one
    mini-batch, the whole batch. With per-agent sizes, mini-batch k holds chunk k of every agent's
    rows (in row order)."""
    sizes: dict[str | None, int] = {a: s for a, s in split.agent_mini_batch_sizes.items() if s}
    if not split.mini_batch_size and not sizes:
        return [batch]
    names = batch.names("agent")
    chunks: list[list[int]] = []
    by_agent = sorted(set(names)) if sizes else [None]
    for agent in by_agent:
        rows = [i for i, n in enumerate(names) if agent is None or n == agent]
        size = sizes.get(agent) or split.mini_batch_size or len(rows)
        for k, first in enumerate(range(0, len(rows), size)):
            if k == len(chunks):
                chunks.append([])
            chunks[k].extend(rows[first : first + size])
    return [batch.select(sorted(rows)) for rows in chunks]


def zero_weight_rows(batch: SampleBatch) -> SampleBatch:
    """``batch`` with no response tokens: every loss term is masked out, so its gradient is exactly 0."""
    return batch.replace(response_mask=torch.zeros_like(batch.response_mask))


def dp_parts(batch: SampleBatch, num_dp: int) -> list[SampleBatch]:
    """One part per DP rank, balanced by tokens. A rank whose part is empty (fewer rows than DP
    ranks) gets one row with an empty response mask instead: zero loss and zero gradient, but the
    same forward/backward, so it joins the DP gradient all-reduce the other ranks are waiting in."""
    stand_in = zero_weight_rows(batch.select([0])) if batch.num_samples else None
    return [
        part if part.num_samples or stand_in is None else stand_in for part in batch.balance_across_dp(num_dp)
    ]


def plan_policy(batch: SampleBatch, split: BatchSplit, *, num_dp: int) -> list[PolicyShare]:
    """Every DP rank's share of one policy's rows (``batch``: that policy's rows only)."""
    rows = trainable_rows(batch, split.frozen_agents)
    stepping, dropped = None, {}
    if split.adapters:  # L2: adapters below policies.<p>.lora.min_samples do not step; their rows go
        plan = adapter_plan(
            rows.names("agent"),
            split.adapters,
            min_samples=split.min_samples,
            frozen_agents=split.frozen_agents,
        )
        stepping, dropped = plan.stepping, dict(plan.dropped)
        if dropped:
            keep = [split.adapters.get(a) not in dropped for a in rows.names("agent")]
            rows = rows.select(torch.tensor(keep, dtype=torch.bool, device=rows.device))
    shares = [PolicyShare(stepping=stepping, dropped=dropped) for _ in range(num_dp)]
    if not rows.num_samples:
        return shares
    for mini in mini_batches(rows, split):
        counts = loss_counts(mini.response_mask)
        for share, part in zip(shares, dp_parts(mini, num_dp), strict=True):
            share.minis.append(MiniBatchPart(part, counts))
    return shares


def rank_batches(
    batch: SampleBatch,
    splits: Mapping[str, BatchSplit],
    layouts: Mapping[str, WorkerGroupLayout],
    *,
    world_size: int,
) -> list[RankBatch]:
    """Every rank's ``RankBatch`` of the step's ``batch``. ``splits`` names the trained policies
    (frozen ones have none: their rows train nobody); ``layouts`` places each policy's WG. A batch
    may hold only some policies (the async modes): the others are absent from every rank's batch."""
    by_policy = {name: rows for name, rows in batch.split_by_policy().items() if name in splits}
    plans = {}
    for name, rows in by_policy.items():
        num_dp = layouts[name].dp
        assert num_dp is not None  # set by WorkerGroupLayout.__post_init__
        plans[name] = plan_policy(rows, splits[name], num_dp=num_dp)
    summary = BatchSummary(
        trained_policies=tuple(by_policy),
        num_samples=batch.num_samples,
        num_train_tokens=sum(rows.num_tokens for rows in by_policy.values()),
        stepped_adapters={
            name: shares[0].stepping if shares[0].minis else ()
            for name, shares in plans.items()
            if shares[0].stepping is not None
        },
    )
    out = [RankBatch(summary) for _ in range(world_size)]
    for name, shares in plans.items():
        layout = layouts[name]
        for rank in layout.ranks:
            out[rank].shares[name] = shares[rank_coords(layout, rank)["dp"]]
    return out
