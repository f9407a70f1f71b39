"""A PP>1 policy's stages gathered to stage 0's sender, for a transport whose server side holds ONE
transfer group per worker (vLLM's NCCL engine, ``transport.GATHERS``).

Stage ``s > 0``'s sender streams its export to stage 0's sender in buckets, point to point over the
training world's default group: on GPU that group is NCCL, the one that moves device memory, so a
bucket goes GPU to GPU over NVLink / the training fabric and lands in a buffer on the receiver's own
device (``forward_device``), never in host memory. Stage 0's sender sends its own stage, then each
later stage's tensors as they arrive, through its one connection: one group, one update per replica.
A bucket's names, shapes and dtypes travel first as one object; its tensors follow one by one (each
stays in its own dtype; no cast, no packing copy).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from megamarl.rollout.engines.base import buckets


def forward_device(*, on_gpu: bool) -> torch.device:
    """Where a forwarded bucket is received: this rank's GPU on GPU (the default group is NCCL,
    which moves device memory only), host memory on CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


def forward_stage(named: Iterable[tuple[str, torch.Tensor]], *, dst: int, bucket_bytes: int,
                  device: torch.device, group=None) -> int:
    """Send a stage's export to ``dst`` (stage 0's sender) in buckets; returns the number of buckets.
    ``group``: the default group (None) unless a test names another."""
    num_buckets = 0
    for bucket in buckets(named, bucket_bytes):
        num_buckets += 1
        meta = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
        dist.send_object_list([meta], dst=dst, group=group, device=device)
        for _, tensor in bucket:
            dist.send(tensor.detach().to(device).contiguous(), dst=dst, group=group)
    dist.send_object_list([None], dst=dst, group=group, device=device)
    return num_buckets


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
