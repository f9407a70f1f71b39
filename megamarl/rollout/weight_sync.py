"""Push a worker group's new weights into its engines, resharded from the training layout.

Training layout (TP_t, PP_t, DP_t) -> HF-named full tensors -> the engine, which shards them for its
own layout. Per pipeline stage, the ranks with dp_rank 0 run the streaming export (a TP gather per
tensor inside the stage's TP group); the stage's *sender* (tp_rank 0, dp_rank 0) packs tensors into
buckets of ``bucket_mb`` and sends each bucket to the engine host. When the sender is the engine host
itself (colocated), tensors are handed over in-process with no copy. The engine is paused before the
first tensor and resumed after the last, with its caches flushed, so it never serves a half-updated
model; the update stamps ``version`` on everything it generates afterwards.

Transport: point-to-point over the default group (gloo on CPU; on GPU an NCCL broadcast group
between senders and engine ranks is the intended path for disaggregated engines).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from megamarl.parallel.placement import WorkerGroup


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


def stage_sender(wg: WorkerGroup, pp_rank: int) -> int:
    """Global rank that sends pipeline stage ``pp_rank`` (tp 0, dp 0 of that stage)."""
    layout = wg.layout
    return layout.ranks[pp_rank * layout.tp * layout.dp]  # megatron order: tp fastest, then dp, then pp


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into lists of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    bucket, size = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _send_buckets(named: Iterable[tuple[str, torch.Tensor]], dst: int, bucket_bytes: int) -> None:
    for bucket in buckets(named, bucket_bytes):
        meta = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
        dist.send_object_list([meta], dst=dst)
        dtype = bucket[0][1].dtype
        if any(t.dtype != dtype for _, t in bucket):
            for _, t in bucket:
                dist.send(t.contiguous(), dst=dst)
        else:
            dist.send(torch.cat([t.reshape(-1) for _, t in bucket]), dst=dst)
    dist.send_object_list([None], dst=dst)


def _recv_buckets(src: int, stats: SyncStats) -> Iterator[tuple[str, torch.Tensor]]:
    while True:
        holder = [None]
        dist.recv_object_list(holder, src=src)
        meta = holder[0]
        if meta is None:
            return
        stats.num_buckets += 1
        dtypes = {m[2] for m in meta}
        if len(dtypes) > 1:
            for name, shape, dtype in meta:
                t = torch.empty(shape, dtype=dtype)
                dist.recv(t, src=src)
                yield name, t
            continue
        flat = torch.empty(sum(_numel(shape) for _, shape, _ in meta), dtype=meta[0][2])
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
) -> SyncStats:
    """Collective over the WG's dp-rank-0 ranks and ``engine_rank``. ``export`` is the WG's streaming
    HF export (None on ranks outside the WG); ``engines`` the engine replicas (on ``engine_rank``)."""
    rank = dist.get_rank()
    stats = SyncStats()
    start = time.perf_counter()
    bucket_bytes = int(bucket_mb * 2**20)
    if wg.is_member and wg.dp_rank == 0 and export is not None:
        sender = stage_sender(wg, wg.pp_rank)
        if rank != engine_rank:
            named = export()
            if rank == sender:
                _send_buckets(named, engine_rank, bucket_bytes)
            else:
                for _ in named:  # TP peers take part in the gathers
                    pass
    if rank == engine_rank:
        stream = _engine_stream(wg, export, stats, rank)
        for engine in engines or []:
            engine.pause()
        materialised = list(stream) if len(engines or []) > 1 else None
        for engine in engines or []:
            engine.update_weights(iter(materialised) if materialised is not None else stream, version=version)
            engine.flush_cache()
            engine.resume()
        if not engines:
            for _ in stream:
                pass
    stats.seconds = time.perf_counter() - start
    return stats


def _engine_stream(wg: WorkerGroup, export, stats: SyncStats, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    for pp_rank in range(wg.layout.pp):
        src = stage_sender(wg, pp_rank)
        named = export() if src == rank else _recv_buckets(src, stats)
        for name, tensor in named:
            stats.num_tensors += 1
            stats.num_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor
