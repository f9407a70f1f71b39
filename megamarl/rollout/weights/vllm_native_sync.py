"""Push weights into vLLM servers on GPUs through vLLM's OWN weight-transfer backends.

On CPU megamarl feeds vLLM servers through its plugin backends (``server_sync.WeightSender``); on GPU
the servers run vLLM's built-in ``nccl`` or ``ipc`` backend unchanged and this sender drives them.
``transport="nccl"`` (disaggregated replicas): one NCCL group per sender, each replica's workers at
their own ``rank_offset`` (one ``/init_weight_transfer_engine`` per replica), then per bucket
``/update_weights`` to every replica with ONE packed broadcast. ``transport="ipc"`` (a colocated
replica at engine TP=1): per bucket, the tensors as CUDA IPC handles keyed by the GPU's UUID. Then
``/finish_weight_update {weight_version}`` and ``/reset_prefix_cache``. ``engine.weight_transfer:
megamarl`` keeps the plugin backends on GPU. The payloads are checked on CPU against vLLM's own
dataclasses (tests/unit/test_vllm_native_sync.py); the CUDA calls are three functions that test
replaces. Details (the handshake, stream order, what has run where):
docs/design-notes.md, "megamarl/rollout/weights/vllm_native_sync.py".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch

from megamarl.rollout.engines.base import buckets
from megamarl.rollout.weights.server_sync import WeightSender, dtype_name, join_replicas, wire_dtype
from megamarl.rollout.weights.weight_sync import SyncStats

TRANSPORTS = ("nccl", "ipc")
PACKED_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES
PACKED_NUM_BUFFERS = 2


# -- the CUDA-only calls (vLLM's code; replaced in the CPU test) ----------------------------------------


def _open_nccl(master_address: str, master_port: int, world_size: int) -> Any:
    """The sender's endpoint (rank 0) of the transfer group: vLLM's ``PyNcclCommunicator``."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init(
        {"master_address": master_address, "master_port": master_port, "world_size": world_size}, rank=0
    )


def _broadcast_bucket(
    group: Any, bucket: list[tuple[str, torch.Tensor]], *, buffer_bytes: int, num_buffers: int
) -> None:
    """One packed broadcast of ``bucket`` from rank 0 (what the servers' packed consumer expects).

    ``bucket``'s tensors were just cast (``VLLMNativeSender._wire``) on the current stream, and vLLM's
    producer packs them on streams of its own, which do not wait for it: an event recorded here,
    after the casts, is waited on by each packing stream before it reads a tensor (``post_iter_func``
    runs inside the producer's ``torch.cuda.stream(...)``, once per tensor, before its pack), so a
    pack never reads a half-written cast. The tensors stay referenced (``bucket``) until the producer
    has synchronized its streams, so their memory is not reused while a pack may still read it."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

    cast_done = torch.cuda.Event()
    cast_done.record()  # on the casting (current) stream, after the bucket's casts

    def after_cast(item: tuple[str, torch.Tensor]) -> torch.Tensor:
        torch.cuda.current_stream().wait_event(cast_done)  # the producer's packing stream
        return item[1]

    packed_nccl_broadcast_producer(
        iterator=iter(bucket),
        group=group,
        src=0,
        post_iter_func=after_cast,
        buffer_size_bytes=buffer_bytes,
        num_buffers=num_buffers,
    )
    torch.cuda.current_stream().synchronize()


def _ipc_handles(tensor: torch.Tensor) -> dict[str, tuple]:
    """``{gpu uuid: rebuild_cuda_tensor args}`` for one CUDA tensor (vLLM's unpacked IPC format)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    return {str(torch.cuda.get_device_properties(tensor.device.index).uuid): args}


class VLLMNativeSender(WeightSender):
    """The trainer side of a weight update into ``urls`` through vLLM's ``nccl`` or ``ipc`` backend.

    Same interface as ``WeightSender`` (connect / push / begin / send / end / close); ``replica_tp``
    as there; ``dtype``: the engines' dtype (floating tensors travel cast to it)."""

    backends = TRANSPORTS

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
        buffer_bytes: int = PACKED_BUFFER_BYTES,
        num_buffers: int = PACKED_NUM_BUFFERS,
    ) -> None:
        super().__init__(
            urls,
            backend=transport,
            master_addr=master_addr,
            master_port=master_port,
            replica_tp=replica_tp,
            dtype=dtype,
            timeout_s=timeout_s,
        )
        if transport == "ipc" and any(tp != 1 for tp in self.replica_tp):
            raise ValueError(
                f"VLLMNativeSender(transport='ipc') feeds replicas at engine TP=1 (one GPU, the "
                f"sender's); got replica_tp={self.replica_tp}"
            )
        self.buffer_bytes, self.num_buffers = buffer_bytes, num_buffers

    @property
    def transport(self) -> str:
        return self.backend

    def connect(self) -> None:
        if self.transport == "ipc":
            self._all("/init_weight_transfer_engine", {"init_info": {"packed": False}})
            self.connected = True
            return
        # the servers' workers block in the rendezvous until the sender joins as rank 0
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
                    "world_size": 1 + sum(self.replica_tp),
                    "packed": True,
                    "packed_buffer_size_bytes": self.buffer_bytes,
                    "packed_num_buffers": self.num_buffers,
                }
            },
            lambda world_size: _open_nccl(self.master_addr, self.master_port, world_size),
        )
        self.connected = True

    def send(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int = 64 * 2**20,
        stats: SyncStats | None = None,
    ) -> SyncStats:
        """One ``/update_weights`` per bucket to every replica, with its bytes (one broadcast, or IPC
        handles in the request). Buckets go one at a time: the packed NCCL producer keeps its own
        buffers in flight within a bucket."""
        if not self.connected:
            raise RuntimeError("VLLMNativeSender.send before connect()")
        stats = stats if stats is not None else SyncStats()
        for bucket in buckets(named, bucket_bytes, dtype=self.dtype):
            bucket = [(name, self._wire(t)) for name, t in bucket]
            stats.num_buckets += 1
            stats.num_tensors += len(bucket)
            stats.num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            info = {
                "names": [n for n, _ in bucket],
                "dtype_names": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
            }
            if self.transport == "ipc":
                info["ipc_handles_pickled"] = _pickled([_ipc_handles(t) for _, t in bucket])
                self._all("/update_weights", {"update_info": info})  # the bucket stays referenced until here
                del bucket
                if torch.cuda.is_available():
                    torch.cuda.ipc_collect()  # the server has loaded (copied) the bucket: free what it shared
                continue
            futures = [
                self._pool.submit(c.post, "/update_weights", {"update_info": info}) for c in self.clients
            ]
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:  # refused before any receive: the broadcast would wait for nobody
                raise cast(BaseException, failed[0].exception())  # not None: filtered above
            _broadcast_bucket(
                self.group, bucket, buffer_bytes=self.buffer_bytes, num_buffers=self.num_buffers
            )
            for f in futures:
                f.result()
        return stats

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor as it travels: on this rank's GPU, in the engine's dtype, contiguous."""
        device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else tensor.device
        )
        return tensor.detach().to(device=device, dtype=wire_dtype(tensor, self.dtype)).contiguous()

    def close(self) -> None:
        group = self.group
        super().close()
        if group is not None and hasattr(group, "destroy"):
            try:
                group.destroy()
            except Exception:  # noqa: BLE001, S110 - the peers may already be gone
                pass


def _pickled(handles: list[dict[str, tuple]]) -> str:
    """What vLLM's HTTP client sends for IPC handles (``ipc_handles_pickled``)."""
    import base64
    import pickle

    return base64.b64encode(pickle.dumps(handles)).decode("utf-8")
