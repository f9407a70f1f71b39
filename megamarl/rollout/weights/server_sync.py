"""Push a policy's weights from one trainer rank into every replica *server* of the policy at once.

Control plane: vLLM's weight-transfer endpoints, the same for every backend
(``/init_weight_transfer_engine`` once, then ``/start_weight_update``, one ``/update_weights`` per
bucket, ``/finish_weight_update {weight_version}``, ``/reset_prefix_cache``). Data plane: megamarl's
backends, loaded into the servers as a vLLM plugin (``vllm_plugin``): ``megamarl_gloo`` (one gloo group
of the sender and every replica's workers; each bucket announced to all replicas, then one broadcast)
and ``megamarl_shm`` (colocated: a safetensors file under ``/dev/shm``). A bucket is one flat byte buffer
(tensors at 64-byte aligned offsets, copied once into a reused pack buffer); each announcement carries
its bucket's number, names, dtypes and shapes. Unlike vLLM's NCCL trainer engine, one sender feeds many
servers. Details: docs/design-notes.md, "megamarl/rollout/weights/server_sync.py".
"""

from __future__ import annotations

import datetime
import itertools
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megamarl.parallel.network import gloo_group
from megamarl.rollout.engines._http import JSONClient
from megamarl.rollout.engines.base import buckets
from megamarl.rollout.weights.weight_sync import SyncStats

BACKENDS = ("megamarl_gloo", "megamarl_shm")
ALIGN = 64  # bytes: every tensor of a packed bucket starts at a multiple of this
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def wire_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` travels in: ``dtype`` for a floating tensor (None: its own)."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def bucket_info(
    bucket: list[tuple[str, torch.Tensor]], *, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """The ``update_info`` announcing a bucket: names, dtypes (floating tensors cast to ``dtype``),
    shapes, byte offsets and the packed byte size."""
    offsets, dtypes, total = [], [], 0
    for _, tensor in bucket:
        offsets.append(total)
        dtypes.append(wire_dtype(tensor, dtype))
        total = _aligned(total + tensor.numel() * dtypes[-1].itemsize)
    return {
        "names": [n for n, _ in bucket],
        "dtype_names": [dtype_name(d) for d in dtypes],
        "shapes": [list(t.shape) for _, t in bucket],
        "offsets": offsets,
        "num_bytes": total,
    }


def pack_bucket(
    bucket: list[tuple[str, torch.Tensor]], info: dict[str, Any], *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One uint8 buffer [num_bytes] holding every tensor of the bucket at its offset, in its
    announced dtype. Each tensor is copied once, straight into place (the cast, if any, happens in
    that copy); ``out`` (uint8, at least ``num_bytes``) is packed into instead of a fresh buffer, so
    a reused buffer takes no page faults."""
    flat = out[: info["num_bytes"]] if out is not None else torch.empty(info["num_bytes"], dtype=torch.uint8)
    for (_, tensor), name, offset in zip(
        bucket, info["dtype_names"], info["offsets"], strict=False
    ):  # strict=False: info announces this bucket: one entry per tensor
        dtype = getattr(torch, name)
        dst = flat[offset : offset + tensor.numel() * dtype.itemsize].view(dtype).view(tensor.shape)
        dst.copy_(tensor.detach())
    return flat


def unpack_bucket(flat: torch.Tensor, info: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat`` (no copy): the inverse of ``pack_bucket``."""
    named = []
    for name, dtype, shape, offset in zip(  # strict=False: info's lists: one entry per announced tensor
        info["names"], info["dtype_names"], info["shapes"], info["offsets"], strict=False
    ):
        dtype = getattr(torch, dtype)
        numel = 1
        for s in shape:
            numel *= s
        named.append((name, flat[offset : offset + numel * dtype.itemsize].view(dtype).view(shape)))
    return named


def unshared(buffer: torch.Tensor) -> bool:
    """True when no tensor but ``buffer`` itself uses its storage (no views of it are alive): the
    count is ``buffer``'s reference plus the temporary storage handle taken to read it."""
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) <= 2


def push_whole(
    sender, named: Iterable[tuple[str, torch.Tensor]], *, version: int, bucket_bytes: int, pause: bool
) -> SyncStats:
    """One sender's whole push, its three parts in a row: ``begin`` (pausing the replicas), ``send``,
    ``end`` without resuming; then ``resume``, also when the push failed (the senders of every
    backend: ``WeightSender``, ``SGLangWeightSender``)."""
    stats = SyncStats()
    start = time.perf_counter()
    sender.begin(pause=pause)
    try:
        sender.send(named, bucket_bytes=bucket_bytes, stats=stats)
        sender.end(version=version, resume=False)
    finally:
        if pause:
            sender.resume()
    stats.seconds = time.perf_counter() - start
    return stats


class BufferPool:
    """Receive buffers reused across buckets and updates, so a bucket lands in pages that are
    already mapped (a fresh 64 MiB buffer per bucket costs ~16k page faults). A buffer is handed
    out again only once nothing holds a view of it: vLLM's layerwise reload keeps the loaded
    tensors of a layer (views into their bucket) until the layer's last tensor arrives, possibly
    in a later bucket. At most ``max_buffers`` are kept; beyond that a fresh one is allocated."""

    def __init__(self, max_buffers: int = 3) -> None:
        self.max_buffers = max_buffers
        self.buffers: list[torch.Tensor] = []

    def take(self, num_bytes: int) -> torch.Tensor:
        for i, buffer in enumerate(self.buffers):
            if unshared(buffer):
                if buffer.numel() < num_bytes:
                    buffer = self.buffers[i] = torch.empty(num_bytes, dtype=torch.uint8)
                return buffer[:num_bytes]
        buffer = torch.empty(num_bytes, dtype=torch.uint8)
        if len(self.buffers) < self.max_buffers:
            self.buffers.append(buffer)
        return buffer[:num_bytes]


def new_gloo_group(
    master_addr: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float,
    is_master: bool = False,
    address: str | None = None,
) -> tuple[Any, Any]:
    """A gloo process group outside the default world (vLLM's workers have their own): a TCPStore
    (hosted by rank 0) with a per-group prefix; this rank's gloo device binds ``address`` (None:
    gloo's own choice; ``network.gloo_group``). Returns ``(group, store)``; keep the store alive."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_addr, master_port, world_size, is_master=is_master, timeout=timeout, wait_for_workers=False
    )
    group = gloo_group(dist.PrefixStore(group_name, store), rank, world_size, timeout, address=address)
    return group, store


def gloo_broadcast(group, tensor: torch.Tensor, *, src: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()


def join_replicas(
    pool: ThreadPoolExecutor,
    clients: list[JSONClient],
    path: str,
    replica_tp: list[int],
    init_body: Callable[[int], Any],
    open_group: Callable[[int], Any],
) -> tuple[Any, list[Any]]:
    """The handshake of every broadcast transport (megamarl_gloo, vLLM's nccl, SGLang's update
    groups): the sender is rank 0 of a group of ``1 + sum(replica_tp)`` ranks and replica ``r``'s
    workers sit from ``rank_offset = 1 + sum(replica_tp[:r])``. Each server blocks in ``path`` until the
    group forms, so every replica's ``init_body(rank_offset)`` is posted first (concurrently, in
    ``pool``), then this rank joins (``open_group(world_size)``). Returns the group and the replies."""
    world_size = 1 + sum(replica_tp)
    offsets = itertools.accumulate([1, *replica_tp[:-1]])
    futures = [
        pool.submit(c.post, path, init_body(offset)) for c, offset in zip(clients, offsets, strict=True)
    ]
    group = open_group(world_size)
    return group, [f.result() for f in futures]


class WeightSender:
    """The trainer side of a weight update into ``urls`` (one vLLM server per replica).

    ``replica_tp[i]``: tensor-parallel workers of replica ``i`` (each joins the gloo group);
    ``dtype``: the engines' dtype (floating tensors are cast to it before they travel; None: as
    given). ``master_addr``/``master_port``: where this rank hosts the group's TCPStore
    (``megamarl_gloo`` only; it must be reachable from every server's node).
    """

    backends = BACKENDS  # the data planes this sender drives (VLLMNativeSender: vLLM's nccl / ipc)

    def __init__(
        self,
        urls: list[str],
        *,
        backend: str,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        replica_tp: list[int] | None = None,
        dtype: torch.dtype | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if backend not in self.backends:
            raise ValueError(
                f"{type(self).__name__} backend '{backend}' unknown; allowed: {list(self.backends)}"
            )
        replica_tp = list(replica_tp) if replica_tp is not None else [1] * len(urls)
        if len(replica_tp) != len(urls):
            raise ValueError(f"replica_tp has {len(replica_tp)} entries for {len(urls)} server urls")
        if backend in ("megamarl_gloo", "nccl") and master_port <= 0:
            raise ValueError(
                f"{type(self).__name__}(backend='{backend}') needs master_port (the group's rendezvous port)"
            )
        self.urls, self.backend, self.dtype = list(urls), backend, dtype
        self.master_addr, self.master_port, self.replica_tp = master_addr, master_port, replica_tp
        self.timeout_s = timeout_s
        self.clients = [JSONClient(u, timeout_s=timeout_s) for u in self.urls]
        # two buckets in flight per replica (``send``)
        self._pool = ThreadPoolExecutor(max_workers=2 * max(1, len(urls)), thread_name_prefix="weight-sender")
        self.group = self._store = None
        self.group_name: str | None = None
        self.connected = False
        self._seq = 0  # megamarl_gloo: buckets announced so far (each announcement carries its number)
        # Every bucket is packed into this buffer, reused for every bucket and update (the broadcast
        # has delivered it, or the shm file holds a copy, when the next bucket is packed): a fresh
        # buffer per bucket cost 4x the copy itself in page faults on a 2-core machine.
        self._pack_buffer = torch.empty(0, dtype=torch.uint8)

    # -- control plane -----------------------------------------------------------------------------

    def _all(self, path: str, payload: Any = None, *, query: dict | None = None) -> list[Any]:
        """POST ``path`` to every replica concurrently; raise the first failure."""
        futures = [self._pool.submit(c.post, path, payload, query=query) for c in self.clients]
        return [f.result() for f in futures]

    def connect(self) -> None:
        """Every replica's workers join this rank's transfer group (``megamarl_gloo``) or learn
        the shared-memory directory (``megamarl_shm``)."""
        if self.backend == "megamarl_shm":
            self._all("/init_weight_transfer_engine", {"init_info": {"shm_dir": str(SHM_DIR)}})
            self.connected = True
            return
        world_size = 1 + sum(self.replica_tp)
        group_name = self.group_name = f"megamarl-weights-{uuid.uuid4().hex[:8]}"
        # The store must exist before the servers dial it; the group forms once all have joined.
        self._store = dist.TCPStore(
            self.master_addr,
            self.master_port,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=self.timeout_s),
            wait_for_workers=False,
        )
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.group, _ = join_replicas(
            self._pool,
            self.clients,
            "/init_weight_transfer_engine",
            self.replica_tp,
            lambda offset: {
                "init_info": {
                    "master_address": self.master_addr,
                    "master_port": self.master_port,
                    "rank_offset": offset,
                    "world_size": world_size,
                    "group_name": group_name,
                    "timeout_s": self.timeout_s,
                }
            },
            # the sender's gloo device binds the address it advertised (parallel.network.host_address)
            lambda size: gloo_group(
                dist.PrefixStore(group_name, self._store), 0, size, timeout, address=self.master_addr
            ),
        )
        self.connected = True

    # -- data plane --------------------------------------------------------------------------------

    def push(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        bucket_bytes: int = 64 * 2**20,
        pause: bool = True,
    ) -> SyncStats:
        """Send ``named`` (HF names) to every replica and stamp ``version``. With ``pause`` the
        replicas stop scheduling first (in-flight requests finish: ``/pause?mode=wait``) and resume
        after the prefix caches are flushed, so no request sees half-updated weights."""
        return push_whole(self, named, version=version, bucket_bytes=bucket_bytes, pause=pause)

    # ``push`` in three parts, for several senders into the same replicas (one per pipeline stage):
    # one of them calls ``begin``, then every stage ``send``s its tensors concurrently (each on its
    # own group; the servers take the buckets in turn), then that one calls ``end``. The trainer
    # orders the three with a barrier on its control group.

    def begin(self, *, pause: bool = True) -> None:
        """Pause the replicas (in-flight requests finish first) and open an update."""
        if not self.connected:
            raise RuntimeError("WeightSender.begin/push before connect()")
        if pause:
            self._all("/pause", query={"mode": "wait"})
        self._all("/start_weight_update")

    def send(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int = 64 * 2**20,
        stats: SyncStats | None = None,
    ) -> SyncStats:
        """Send ``named`` in buckets into the open update of every replica.

        Pipelined: bucket k+1 is announced while the servers still load bucket k, and over gloo each
        announcement carries the next bucket's size (one bucket of look-ahead), so a worker posts
        the receive of bucket k+1 before it loads bucket k: transfer and load overlap, and no HTTP
        round trip sits between buckets (measured: the round trip through API server, engine core
        and worker cost as much as receiving a 64 MiB bucket on a loaded 2-core machine)."""
        if not self.connected:
            raise RuntimeError("WeightSender.send before connect()")
        stats = stats if stats is not None else SyncStats()
        previous: _InFlight | None = None
        stream = buckets(named, bucket_bytes, dtype=self.dtype)
        current = next(stream, None)
        try:
            while current is not None:
                following = next(stream, None)
                next_bytes = (
                    bucket_info(following, dtype=self.dtype)["num_bytes"] if following is not None else 0
                )
                in_flight = self._start_bucket(current, stats, previous, next_bytes=next_bytes)
                if previous is not None:
                    previous.settle()
                previous, current = in_flight, following
        finally:
            if previous is not None:
                previous.settle()
        return stats

    def end(self, *, version: int, resume: bool = True) -> None:
        """Finish the update (layers re-processed, ``version`` stamped), flush caches, resume."""
        self._all("/finish_weight_update", {"weight_version": str(version)})
        self._all("/reset_prefix_cache")
        if resume:
            self.resume()

    def resume(self) -> None:
        """The replicas schedule requests again."""
        self._all("/resume")

    def _start_bucket(
        self,
        bucket: list[tuple[str, torch.Tensor]],
        stats: SyncStats,
        previous: _InFlight | None,
        *,
        next_bytes: int,
    ) -> _InFlight:
        info = bucket_info(bucket, dtype=self.dtype)
        stats.num_buckets += 1
        stats.num_tensors += len(bucket)
        stats.num_bytes += sum(t.numel() * wire_dtype(t, self.dtype).itemsize for _, t in bucket)
        if self._pack_buffer.numel() < info["num_bytes"]:
            self._pack_buffer = torch.empty(info["num_bytes"], dtype=torch.uint8)
        flat = pack_bucket(bucket, info, out=self._pack_buffer)
        if self.backend == "megamarl_gloo":
            # Each server posts the bucket's receive in /update_weights (without waiting for it:
            # vllm_plugin.GlooWeightTransferEngine) and loads it once it is there: announce to all,
            # then one broadcast reaches every replica. Announcements travel on separate
            # connections, so bucket k+1's may reach a server before bucket k's (seen under load):
            # each carries its number, and the worker pairs bytes and names by it. A failed
            # previous bucket would leave the servers never receiving this one: check it first (a
            # later failure surfaces at settle, or as the group's timeout).
            self._seq += 1
            announce = {
                "update_info": dict(
                    info, group_name=self.group_name, next_num_bytes=next_bytes, seq=self._seq
                )
            }
            futures = [self._pool.submit(c.post, "/update_weights", announce) for c in self.clients]
            if previous is not None:
                previous.raise_if_failed()
            gloo_broadcast(self.group, flat)
            return _InFlight(futures)
        # One write of the packed buffer into a fresh file (measured: as fast as packing into a
        # mapping of the file, which takes a page fault per 4 KiB on the sender, and steadier under
        # load). A fresh file per bucket, never a rewritten one: the server's layerwise reload may
        # keep views into a bucket until a later bucket completes their layer.
        path = SHM_DIR / f"megamarl-bucket-{os.getpid()}-{uuid.uuid4().hex[:12]}.bin"
        with open(path, "wb", buffering=0) as f:
            f.write(memoryview(flat.numpy()))
        announce = {"update_info": dict(info, path=str(path))}
        return _InFlight([self._pool.submit(c.post, "/update_weights", announce) for c in self.clients], path)

    def close(self) -> None:
        """Release this sender's transfer state on the servers. ``megamarl_gloo``: its own group only,
        by name (several senders, one per pipeline stage, share the servers, and vLLM's
        ``/shutdown_weight_transfer_engine`` drops every group a server joined); the other backends
        keep one connection per server and shut it down."""
        for client in self.clients:
            try:
                if self.backend == "megamarl_gloo":
                    if self.group_name is not None:
                        client.post(
                            "/init_weight_transfer_engine",
                            {"init_info": {"group_name": self.group_name, "release": True}},
                            timeout_s=30,
                        )
                else:
                    client.post("/shutdown_weight_transfer_engine", timeout_s=30)
            except Exception:  # noqa: BLE001, S110 - the server may already be gone
                pass
            client.close()
        self._pool.shutdown(wait=False)
        self.group = self._store = None
        self._pack_buffer = torch.empty(0, dtype=torch.uint8)
        self.connected = False


class _InFlight:
    """One bucket's pending ``/update_weights`` answers (and its shm file, deleted once all answered)."""

    def __init__(self, futures: list, path: Path | None = None) -> None:
        self.futures, self.path = futures, path

    def raise_if_failed(self) -> None:
        for f in self.futures:
            if f.done() and f.exception() is not None:
                raise f.exception()

    def settle(self) -> None:
        try:
            for f in self.futures:
                f.result()
        finally:
            if self.path is not None:
                self.path.unlink(missing_ok=True)
