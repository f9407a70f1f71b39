"""A PP>1 policy's stages moved between training ranks before a push, point to point over the training
world's default group: on GPU that group is NCCL, the one that moves device memory, so a bucket goes
GPU to GPU over NVLink / the training fabric and lands in a buffer on the receiver's own device
(``forward_device``), never in host memory. A bucket's names, shapes and dtypes travel first as one
object; its tensors follow one by one (each in its own dtype; no cast, no packing copy). On CUDA a
sender waits until each bucket has left before exporting the next (NCCL sends return at once: without
that, a whole stage could queue on the sender's GPU).

- Gathered (``transport.GATHERS``: vLLM's NCCL engine holds ONE transfer group per worker): stage
  ``s > 0``'s sender streams its export to stage 0's sender (``forward_stage``), which sends its own
  stage, then each later stage's tensors as they arrive, through its one connection.
- Relayed (``transport.RELAYS``: colocated replicas fed through local memory by their leader rank):
  each leader receives the stages it does not hold from the same DP replica's ranks of those stages
  (``relay_roles``; ``relay_stage`` forwards while the leader consumes its own), in pp order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megamarl.parallel.placement import WorkerGroupLayout, rank_coords
from megamarl.rollout.engines.base import buckets


def forward_device(*, on_gpu: bool) -> torch.device:
    """Where a forwarded bucket is received: this rank's GPU on GPU (the default group is NCCL,
    which moves device memory only), host memory on CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


def forward_stage(
    named: Iterable[tuple[str, torch.Tensor]],
    *,
    dst: int,
    bucket_bytes: int,
    device: torch.device,
    group=None,
) -> int:
    """Send a stage's export to ``dst`` (stage 0's sender) in buckets; returns the number of buckets.
    ``group``: the default group (None) unless a test names another."""
    num_buckets = 0
    for bucket in buckets(named, bucket_bytes):
        num_buckets += 1
        _send_bucket(bucket, (dst,), device=device, group=group)
    _send_end((dst,), device=device, group=group)
    return num_buckets


def relay_stage(
    named: Iterable[tuple[str, torch.Tensor]],
    *,
    destinations: tuple[int, ...],
    bucket_bytes: int,
    device: torch.device,
    group=None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield this stage's export to the caller (a leader feeding its own replica; anyone else drains it)
    and send it, in buckets of ``bucket_bytes``, to every rank in ``destinations`` (``receive_stage``
    there). A bucket's tensors stay alive until it has been sent."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        yield name, tensor
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            _send_bucket(bucket, destinations, device=device, group=group)
            bucket, size = [], 0
    if bucket:
        _send_bucket(bucket, destinations, device=device, group=group)
    _send_end(destinations, device=device, group=group)


def _send_bucket(
    bucket: list[tuple[str, torch.Tensor]], destinations: tuple[int, ...], *, device: torch.device, group
) -> None:
    meta = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
    for dst in destinations:
        dist.send_object_list([meta], dst=dst, group=group, device=device)
        for _, tensor in bucket:
            dist.send(tensor.detach().to(device).contiguous(), dst=dst, group=group)
    if device.type == "cuda":  # NCCL's send only enqueues: wait until the bucket has left (one in flight)
        torch.cuda.synchronize(device)


def _send_end(destinations: tuple[int, ...], *, device: torch.device, group) -> None:
    for dst in destinations:
        dist.send_object_list([None], dst=dst, group=group, device=device)


def receive_stage(src: int, *, device: torch.device, group=None) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors ``forward_stage`` sends from ``src``, each received into a fresh buffer on ``device``."""
    while True:
        holder = [None]
        dist.recv_object_list(holder, src=src, group=group, device=device)
        if holder[0] is None:
            return
        for name, shape, dtype in holder[0]:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(tensor, src=src, group=group)
            yield name, tensor


@dataclass(frozen=True)
class RelayRole:
    """One rank's part in a relayed push (``relay_roles``)."""

    stage: int  # its pipeline stage
    exports: bool  # runs its stage's export (its TP group's gathers): its DP replica feeds some leader
    feeds: bool  # the leader of a target replica: feeds it every stage, in pp order
    sources: dict[int, int] = field(default_factory=dict)  # (feeds) stage -> the rank that sends it here
    destinations: tuple[int, ...] = ()  # the leaders (other stages) it forwards its stage to


def relay_roles(layout: WorkerGroupLayout, leaders: Iterable[int]) -> dict[int, RelayRole]:
    """Every rank of the WG's part in feeding ``leaders`` (the target replicas' leader ranks, all in the
    WG) every stage. Leader (stage s, dp d, tp i) gets stage t from the rank at (t, d, i): each DP
    replica exports on its own and its stages swap pairwise, so a node's traffic is its leader's
    missing stages in and its own stage out, never more; a rank exports when its DP replica holds a
    leader (its peers' TP gathers need it)."""
    leaders = set(leaders)
    tp, dp, pp = layout.tp, layout.dp, layout.pp
    assert dp is not None  # set by WorkerGroupLayout.__post_init__

    def at(stage: int, dp_rank: int, tp_rank: int) -> int:  # megatron order: tp fastest, then dp, then pp
        return layout.ranks[(stage * dp + dp_rank) * tp + tp_rank]

    coords = {rank: rank_coords(layout, rank) for rank in layout.ranks}
    outside = leaders - set(coords)
    if outside:
        raise ValueError(f"relay_roles: leaders {sorted(outside)} hold no shard of {layout.key}")
    fed_dps = {coords[rank]["dp"] for rank in leaders}
    roles = {}
    for rank, c in coords.items():
        stage, dp_rank, tp_rank = c["pp"], c["dp"], c["tp"]
        others = [t for t in range(pp) if t != stage]
        feeds = rank in leaders
        roles[rank] = RelayRole(
            stage,
            exports=dp_rank in fed_dps,
            feeds=feeds,
            sources={t: at(t, dp_rank, tp_rank) for t in others} if feeds else {},
            destinations=tuple(r for r in (at(t, dp_rank, tp_rank) for t in others) if r in leaders),
        )
    return roles
