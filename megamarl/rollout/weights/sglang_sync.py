"""Push a policy's weights from one trainer rank into every replica *SGLang server* of the policy.

The SGLang counterpart of ``server_sync.WeightSender`` (same ``connect/begin/send/end/push/close``).
``transport="gloo"`` (CPU) / ``"nccl"`` (GPU): every replica joins one update group with this rank as
rank 0 (replica r's TP workers at ``1 + sum(tp of replicas < r) + tp_rank``); per bucket the update is
announced to ALL replicas concurrently, then one broadcast reaches them all (one flattened tensor
when the bucket has one dtype, else one per tensor). ``transport="cuda_ipc"`` (GPU, colocated): the
tensors as SGLang-serialized CUDA IPC handles, one string per TP rank. Updates run inside SGLang's
``/begin_weight_update`` .. ``/end_weight_update`` session; ``end(version)`` stamps the version and
flushes the cache. A failed reply raises naming the replica. Tensors travel in the engine's dtype.
The endpoints and payloads: docs/design-notes.md, "megamarl/rollout/weights/sglang_sync.py".
"""

from __future__ import annotations

import copyreg
import datetime
import io
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import torch
import torch.distributed as dist

from megamarl.rollout.engines._http import JSONClient
from megamarl.rollout.engines.base import buckets
from megamarl.rollout.weights.server_sync import dtype_name, join_replicas, push_whole
from megamarl.rollout.weights.weight_sync import SyncStats

TRANSPORTS = ("gloo", "nccl", "cuda_ipc")
FLATTENED = "flattened_bucket"  # SGLang's load_format for one broadcast per bucket


def join_update_group(
    backend: str,
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float,
):
    """A process group outside the default world, formed the way SGLang's ``init_custom_process_group``
    forms it: the store of a ``tcp://`` rendezvous (rank 0 hosts it), a ``PrefixStore(group_name)``,
    and torch's group constructor (which prefixes the group name and the device type once more). Both
    sides must build it the same way, or their store keys never meet. The store is made directly,
    not through ``rendezvous``: under torchrun (``TORCHELASTIC_USE_AGENT_STORE``) a rendezvous would
    dial the agent's store instead of hosting one, and the servers would never find it."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {
        i: i for i in range(world_size)
    }  # dist.broadcast(src=0) means group rank 0
    return group


def broadcast_from_rank0(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def announce(bucket: list[tuple[str, torch.Tensor]], group_name: str, *, flatten: bool) -> dict[str, Any]:
    """The ``/update_weights_from_distributed`` body for ``bucket``."""
    flat = flatten and len({t.dtype for _, t in bucket}) == 1
    return {
        "names": [n for n, _ in bucket],
        "dtypes": [dtype_name(t.dtype) for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "flush_cache": False,
        "load_format": FLATTENED if flat else None,
    }


# -- CUDA IPC payload (colocated on GPU) ------------------------------------------------------------


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _reduce_with_uuid(tensor: torch.Tensor):
    """torch's tensor reduction, with a CUDA tensor's device index replaced by its UUID (what SGLang's
    ``monkey_patch_torch_reductions`` does on both of its sides)."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(tensor)
    if tensor.is_cuda:
        args = list(args)
        args[6] = _device_uuid(args[6])  # rebuild_cuda_tensor's storage_device argument
        args = tuple(args)
    return rebuild, args


def serialize_for_sglang(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` format."""
    import base64
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # registers the tensor reducers with ForkingPickler

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table = copyreg.dispatch_table.copy()
    # a private, untyped table of multiprocessing's (torch's tensor reducers register there)
    pickler.dispatch_table.update(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
    pickler.dispatch_table[torch.Tensor] = _reduce_with_uuid
    for cls in torch._tensor_classes:
        pickler.dispatch_table[cls] = _reduce_with_uuid
    pickler.dump(named_tensors)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def tensor_payload(bucket: list[tuple[str, torch.Tensor]], *, tp: int) -> dict[str, Any]:
    """The ``/update_weights_from_tensor`` body: every TP rank of the replica opens the same handles."""
    serialized = serialize_for_sglang(bucket)
    return {"serialized_named_tensors": [serialized] * tp, "load_format": None, "flush_cache": False}


class SGLangWeightSender:
    """The trainer side of a weight update into ``urls`` (one SGLang server per replica).

    ``replica_tp[i]``: TP ranks of replica ``i`` (each joins the group); ``dtype``: the engines' dtype
    (floating tensors are cast to it; None: as given); ``master_addr``/``master_port``: where this
    rank hosts the group's rendezvous (reachable from every server's node); ``flatten``: one broadcast
    per bucket (SGLang's ``flattened_bucket``) instead of one per tensor.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        transport: str,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        replica_tp: list[int] | None = None,
        dtype: torch.dtype | None = None,
        timeout_s: float = 600.0,
        flatten: bool = True,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(
                f"SGLangWeightSender transport '{transport}' unknown; allowed: {list(TRANSPORTS)}"
            )
        if transport == "cuda_ipc" and not torch.cuda.is_available():
            raise RuntimeError(
                "SGLangWeightSender(transport='cuda_ipc') needs CUDA (colocated GPU replicas); "
                "on CPU colocated replicas take the gloo path from their leader rank"
            )
        replica_tp = list(replica_tp) if replica_tp is not None else [1] * len(urls)
        if len(replica_tp) != len(urls):
            raise ValueError(f"replica_tp has {len(replica_tp)} entries for {len(urls)} server urls")
        if transport != "cuda_ipc" and master_port <= 0:
            raise ValueError(
                f"SGLangWeightSender(transport='{transport}') needs master_port (the rendezvous port)"
            )
        self.urls, self.transport, self.dtype, self.flatten = list(urls), transport, dtype, flatten
        self.master_addr, self.master_port, self.replica_tp = master_addr, master_port, replica_tp
        self.timeout_s = timeout_s
        self.clients = [JSONClient(u, timeout_s=timeout_s) for u in self.urls]
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(urls)), thread_name_prefix="sglang-sender")
        self.group = None
        self.group_name: str | None = None
        self.connected = False

    # -- control plane -----------------------------------------------------------------------------

    def _all(self, path: str, payload: Any = None, *, payloads: list | None = None) -> list[Any]:
        """POST to every replica concurrently; raise the first failure (naming the replica)."""
        payloads = payloads if payloads is not None else [payload] * len(self.clients)
        futures = [
            self._pool.submit(c.post, path, p) for c, p in zip(self.clients, payloads, strict=False)
        ]  # strict=False: payloads, when given, are the caller's: one per client
        return [self._checked(f.result(), path, url) for f, url in zip(futures, self.urls, strict=True)]

    @staticmethod
    def _checked(reply: Any, path: str, url: str) -> Any:
        if isinstance(reply, dict) and reply.get("success") is False:
            raise RuntimeError(f"SGLang server {url}: {path} failed: {reply.get('message')}")
        return reply

    def connect(self) -> None:
        """Every replica's TP ranks join this rank's update group (not needed for ``cuda_ipc``)."""
        if self.transport == "cuda_ipc":
            self.connected = True
            return
        world_size = 1 + sum(self.replica_tp)
        self.group_name = f"megamarl-sglang-{uuid.uuid4().hex[:8]}"
        self.group, replies = join_replicas(
            self._pool,
            self.clients,
            "/init_weights_update_group",
            self.replica_tp,
            lambda offset: {
                "master_address": self.master_addr,
                "master_port": self.master_port,
                "rank_offset": offset,
                "world_size": world_size,
                "group_name": self.group_name,
                "backend": self.transport,
            },
            lambda size: join_update_group(
                self.transport,
                self.master_addr,
                self.master_port,
                rank=0,
                world_size=size,
                group_name=cast(str, self.group_name),  # set above
                timeout_s=self.timeout_s,
            ),
        )
        for reply, url in zip(replies, self.urls, strict=True):
            self._checked(reply, "/init_weights_update_group", url)
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
        replicas pause first (``/pause_generation``, requests keep their place) and continue after
        the caches are flushed."""
        return push_whole(self, named, version=version, bucket_bytes=bucket_bytes, pause=pause)

    # ``push`` in three parts for several senders into the same replicas (one per pipeline stage):
    # one calls ``begin``, every stage ``send``s on its own group, then one calls ``end``.

    def begin(self, *, pause: bool = True) -> None:
        if not self.connected:
            raise RuntimeError("SGLangWeightSender.begin/push before connect()")
        if pause:
            self._all("/pause_generation", {"mode": "in_place"})
        self._all("/begin_weight_update", {})

    def send(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int = 64 * 2**20,
        stats: SyncStats | None = None,
    ) -> SyncStats:
        """Send ``named`` in buckets; each bucket reaches every replica before the next is announced
        (an SGLang server handles one update request at a time)."""
        if not self.connected:
            raise RuntimeError("SGLangWeightSender.send before connect()")
        stats = stats if stats is not None else SyncStats()
        for bucket in buckets(self._cast(named), bucket_bytes):
            stats.num_buckets += 1
            stats.num_tensors += len(bucket)
            stats.num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            if self.transport == "cuda_ipc":
                self._all(
                    "/update_weights_from_tensor",
                    payloads=[tensor_payload(bucket, tp=tp) for tp in self.replica_tp],
                )
                continue
            assert self.group_name is not None  # connected
            body = announce(bucket, self.group_name, flatten=self.flatten)
            futures = [
                self._pool.submit(c.post, "/update_weights_from_distributed", body) for c in self.clients
            ]
            try:
                if body["load_format"] == FLATTENED:
                    broadcast_from_rank0(self.group, torch.cat([t.detach().reshape(-1) for _, t in bucket]))
                else:
                    for _, tensor in bucket:  # SGLang posts its receives in the order of ``names``
                        broadcast_from_rank0(self.group, tensor.detach().contiguous())
            finally:
                replies = [f.result() for f in futures]
            for reply, url in zip(replies, self.urls, strict=True):
                self._checked(reply, "/update_weights_from_distributed", url)
        return stats

    def end(self, *, version: int, resume: bool = True) -> None:
        """Close the update session, stamp ``version``, flush the caches, continue."""
        self._all("/end_weight_update", {})
        self._all("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        self._all("/flush_cache", {})
        if resume:
            self.resume()

    def resume(self) -> None:
        """The replicas continue generating (paused requests keep their place)."""
        self._all("/continue_generation", {})

    def _cast(self, named: Iterable[tuple[str, torch.Tensor]]):
        device = torch.device("cuda", torch.cuda.current_device()) if self.transport != "gloo" else None
        for name, tensor in named:
            if self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype:
                tensor = tensor.to(self.dtype)
            if device is not None and tensor.device != device:
                tensor = tensor.to(device)  # nccl and CUDA IPC move device memory
            elif device is None and tensor.device.type != "cpu":
                tensor = tensor.cpu()
            yield name, tensor

    def close(self) -> None:
        """Leave the group on every replica (``/destroy_weights_update_group``) and here."""
        if self.group is not None:
            for client in self.clients:
                try:
                    client.post(
                        "/destroy_weights_update_group", {"group_name": self.group_name}, timeout_s=30
                    )
                except Exception:  # noqa: BLE001, S110 - the server may already be gone
                    pass
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001, S110 - a peer already left
                pass
        for client in self.clients:
            client.close()
        self._pool.shutdown(wait=False)
        self.group = None
        self.connected = False
