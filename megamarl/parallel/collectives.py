"""The collectives model and RL code needs, over process groups it is handed.

docs/style.md "Models never call torch.distributed": ``megamarl/models`` and ``megamarl/rl`` receive process
groups and never call ``torch.distributed`` themselves; the few collectives they need live here, each taking
the group explicitly (never the default world) and short-circuiting a one-rank group without communication.
``scatter_objects`` is the loop's: the driver sends each rank its share of a step's batch.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Ranks in ``group`` (1 for None: no group means no peers)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in ``group`` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


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


def scatter_objects(objects: Sequence[Any] | None, *, src: int, group) -> tuple[Any, list[int]]:
    """Group rank ``i`` receives ``objects[i]`` (given on ``src``, a group rank; None elsewhere),
    pickled and sent point to point, so each rank's traffic is its own object: torch's
    ``scatter_object_list`` pads every rank's message to the largest one. Returns this rank's object
    (``src`` keeps its own without a copy) and every rank's pickled size in bytes (the sizes travel
    first, one broadcast: each rank sizes its buffer, and every rank can report them)."""
    size = group_size(group)
    rank = dist.get_rank(group) if size > 1 else 0
    if rank == src:
        if objects is None or len(objects) != size:
            raise ValueError(f"scatter_objects: src needs one object per rank of the group ({size})")
        blobs = [pickle.dumps(obj) for obj in objects]
        sizes = torch.tensor([len(blob) for blob in blobs], dtype=torch.long)
    else:
        sizes = torch.zeros(size, dtype=torch.long)
    if size == 1:
        assert objects is not None  # checked above: this rank is src
        return objects[0], sizes.tolist()
    dist.broadcast(sizes, group=group, group_src=src)
    if rank == src:
        sends = [
            dist.isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8), group=group, group_dst=dst)
            for dst, blob in enumerate(blobs)
            if dst != src
        ]
        for work in sends:
            work.wait()
        assert objects is not None  # checked above (rank == src)
        return objects[src], sizes.tolist()
    buffer = torch.empty(int(sizes[rank]), dtype=torch.uint8)
    dist.recv(buffer, group=group, group_src=src)
    return pickle.loads(buffer.numpy()), sizes.tolist()
