"""The collectives model and RL code needs, over process groups it is handed.

STYLE.md rule 5: ``megamarl/models`` and ``megamarl/rl`` receive process groups and never call
``torch.distributed`` themselves; the few collectives they need live here, each taking the group
explicitly (never the default world) and short-circuiting a one-rank group without communication.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Ranks in ``group`` (1 for None: no group means no peers)."""
    return 1 if group is None else dist.get_world_size(group)


def all_gather_tensors(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's version of ``tensor`` (same shape everywhere), in group-rank order."""
    size = group_size(group)
    if size == 1:
        return [tensor]
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor, group=group)
    return out


def all_gather_objects(obj: Any, group) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order."""
    out = [None] * group_size(group)
    if len(out) == 1:
        return [obj]
    dist.all_gather_object(out, obj, group=group)
    return out


def all_reduce_sum(group) -> Callable[[torch.Tensor], None] | None:
    """An in-place sum over ``group`` for pure functions that take an ``all_reduce`` hook (e.g.
    ``rl.advantages.masked_whiten`` on a DP-sharded batch); None when the group has one rank."""
    if group_size(group) == 1:
        return None
    return lambda tensor: dist.all_reduce(tensor, group=group)
