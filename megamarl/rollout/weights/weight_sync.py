"""Push a worker group's new weights into its engines, resharded from the training layout.

Training layout -> HF-named full tensors -> the engine, which shards them for its own layout. Per
stage, the dp_rank-0 ranks run the streaming export (TP gather per tensor); the stage's sender packs
buckets of ``bucket_mb`` for the engine host, and a colocated host consumes its own stream in-process.
The engine is paused before the first tensor and resumed, caches flushed, after the last, so it never
serves a half-updated model; the update stamps ``version``. L2: the same path with ``lora=<adapter>``,
only the adapter's tensors and version. Transport (``push_transport``): tensors point-to-point on the
backend's device, bucket metadata over the gloo control group, never NCCL.
Details: docs/design-notes.md, "megamarl/rollout/weights/weight_sync.py".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megamarl.parallel.distributed import control_group, device_backend, local_device
from megamarl.parallel.placement import WorkerGroup
from megamarl.rollout.engines.base import buckets

Named = Iterable[tuple[str, torch.Tensor]]
Select = Callable[[Named], Iterator[tuple[str, torch.Tensor]]]  # the tensors of a stream that are pushed


def _all(named: Named) -> Iterator[tuple[str, torch.Tensor]]:
    return iter(named)


@dataclass
class SyncStats:
    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    seconds: float = 0.0

    def as_dict(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}/bytes": float(self.num_bytes),
            f"{prefix}/seconds": self.seconds,
            f"{prefix}/gbps": self.num_bytes / max(self.seconds, 1e-9) / 1e9,
        }


@dataclass(frozen=True)
class PushTransport:
    device: torch.device  # where tensors are sent from and received into (the default group's device)
    objects: object  # the process group the buckets' metadata travels on


def push_transport() -> PushTransport:
    """The default group moves tensors on ``local_device()`` when it is NCCL (a CPU receive buffer
    there fails), on the CPU for gloo; objects always go over the gloo ``control_group()``."""
    device = local_device() if device_backend() == "nccl" else torch.device("cpu")
    return PushTransport(device, control_group())


def stage_ranks(wg: WorkerGroup, pp_rank: int) -> list[int]:
    """Global ranks of pipeline stage ``pp_rank`` with dp_rank 0 (its TP group), in TP order."""
    layout = wg.layout
    assert layout.dp is not None  # set by WorkerGroupLayout.__post_init__
    first = pp_rank * layout.tp * layout.dp  # megatron order: tp fastest, then dp, then pp
    return layout.ranks[first : first + layout.tp]


def stage_sender(wg: WorkerGroup, pp_rank: int) -> int:
    """Global rank that sends pipeline stage ``pp_rank`` (tp 0, dp 0 of that stage)."""
    return stage_ranks(wg, pp_rank)[0]


def stage_role(wg: WorkerGroup, rank: int) -> str | None:
    """``rank``'s part in a push of its worker group's weights, by pipeline stage (the one rule, for the
    in-process path and the engine servers alike): ``"sender"`` (tp 0, dp 0 of its stage: runs the
    export and sends the stage), ``"peer"`` (another dp-0 rank of the stage: runs the export, whose TP
    gathers need it, and sends nothing), None (no shard here, or dp rank > 0: not part of the push)."""
    if not wg.is_member or wg.dp_rank != 0:
        return None
    return "sender" if rank == stage_sender(wg, wg.pp_rank) else "peer"


def tp_group_ranks(wg: WorkerGroup) -> list[int]:
    """The ranks of this rank's TP group (its stage, its DP replica): tp is megatron's fastest axis."""
    layout = wg.layout
    block = layout.tp
    start = (wg.layout.ranks.index(dist.get_rank()) // block) * block
    return layout.ranks[start : start + block]


def _send_buckets(named: Iterable[tuple[str, torch.Tensor]], dst: int, bucket_bytes: int) -> int:
    via = push_transport()
    num_buckets = 0
    for bucket in buckets(named, bucket_bytes):
        num_buckets += 1
        meta = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
        dist.send_object_list([meta], dst=dst, group=via.objects)
        dtype = bucket[0][1].dtype
        if any(t.dtype != dtype for _, t in bucket):
            for _, t in bucket:
                dist.send(t.to(via.device).contiguous(), dst=dst)
        else:
            dist.send(torch.cat([t.reshape(-1) for _, t in bucket]).to(via.device), dst=dst)
    dist.send_object_list([None], dst=dst, group=via.objects)
    return num_buckets


def _recv_buckets(src: int, stats: SyncStats) -> Iterator[tuple[str, torch.Tensor]]:
    via = push_transport()
    while True:
        holder = [None]
        dist.recv_object_list(holder, src=src, group=via.objects)
        meta = holder[0]
        if meta is None:
            return
        stats.num_buckets += 1
        dtypes = {m[2] for m in meta}
        if len(dtypes) > 1:
            for name, shape, dtype in meta:
                t = torch.empty(shape, dtype=dtype, device=via.device)
                dist.recv(t, src=src)
                yield name, t
            continue
        flat = torch.empty(sum(_numel(shape) for _, shape, _ in meta), dtype=meta[0][2], device=via.device)
        dist.recv(flat, src=src)
        offset = 0
        for name, shape, _ in meta:
            n = _numel(shape)
            yield name, flat[offset : offset + n].view(shape)
            offset += n


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def sync_weights(
    wg: WorkerGroup,
    export: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None,
    engines: list | None,
    *,
    version: int,
    engine_rank: int = 0,
    bucket_mb: float = 64,
    lora: str | None = None,
    select: Select | None = None,
) -> SyncStats:
    """Collective over the WG's dp-rank-0 ranks and ``engine_rank``. ``export`` is the WG's streaming
    export (None on ranks outside the WG); ``engines`` the engine replicas (on ``engine_rank``).

    Full sync: ``export`` streams HF-named weights (``PolicyWorker.export``). L2 adapter-only sync:
    ``lora`` names the agent's adapter and ``export`` streams its PEFT tensors
    (``megamarl.models.lora.export_lora_weights``); engines receive ``update_weights(..., lora=lora)``
    and stamp ``version`` on that adapter only. ``select``: the filter a delta push
    (``weights.delta``) applies where a stream starts towards the engines: on each stage's sender,
    and on the engine rank to its own export. Returns this rank's counts (on the engine rank: what
    the engines received).
    """
    select = select or _all
    rank = dist.get_rank()
    stats = SyncStats()
    start = time.perf_counter()
    bucket_bytes = int(bucket_mb * 2**20)
    role = stage_role(wg, rank)
    if rank != engine_rank and role is not None and export is not None:
        named = export()
        if role == "sender" and engine_rank not in stage_ranks(wg, wg.pp_rank):
            stats.num_buckets = _send_buckets(_counted(select(named), stats), engine_rank, bucket_bytes)
        else:
            drain(named)  # TP peers take part in the gathers (an engine rank among them keeps its copy)
    if rank == engine_rank:
        stream = _counted(_engine_stream(wg, export, stats, rank, select), stats)
        engines = list(engines or [])
        for engine in engines:
            engine.pause()
        try:
            replicated = list(stream) if len(engines) > 1 else None  # every replica gets the same tensors
            for engine in engines:
                engine.update_weights(
                    iter(replicated) if replicated is not None else stream, version=version, lora=lora
                )
                engine.flush_cache()
        finally:
            drain(stream)  # the senders finish even when an engine stopped early (or there is none)
            for engine in engines:
                engine.resume()
    stats.seconds = time.perf_counter() - start
    return stats


def drain(named: Iterable) -> None:
    for _ in named:
        pass


def _counted(
    named: Iterable[tuple[str, torch.Tensor]], stats: SyncStats
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named:
        stats.num_tensors += 1
        stats.num_bytes += tensor.numel() * tensor.element_size()
        yield name, tensor


def _engine_stream(
    wg: WorkerGroup, export, stats: SyncStats, rank: int, select: Select
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's tensors, in stage order: the engine rank's own export for a stage whose TP group
    it belongs to (colocated: no copy), else the stage sender's buckets."""
    for pp_rank in range(wg.layout.pp):
        local = wg.is_member and wg.dp_rank == 0 and rank in stage_ranks(wg, pp_rank)
        if local and export is None:
            raise ValueError(
                f"sync_weights: rank {rank} holds stage {pp_rank} of '{wg.name}' but got no export"
            )
        yield from select(export()) if local else _recv_buckets(stage_sender(wg, pp_rank), stats)
