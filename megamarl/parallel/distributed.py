"""Process start-up: backends, devices and the CPU control group, chosen from what the machine has.

NCCL + CUDA when a GPU is present, gloo + CPU otherwise (with the megatron-core CPU compatibility
layer switched on). Works under torchrun (env://) and in a single process (world size 1).
"""

from __future__ import annotations

import itertools
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megamarl.parallel.cpu_compat import enable_cpu_compat
from megamarl.parallel.network import free_port, pin_gloo_interface


def device_backend() -> str:
    """Backend for bulk tensors: NCCL on CUDA machines, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_device() -> torch.device:
    """This rank's accelerator (``LOCAL_RANK``-th GPU) or the CPU: the one place that decides where a
    WG's tensors live (``WorkerGroup.device``), paired with ``device_backend`` for its groups. NCCL
    reduces device tensors only, so every tensor a WG's groups reduce is made on this device."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(*, timeout_s: float = 600.0) -> torch.device:
    """Initialise the default process group from the torchrun environment (or as a 1-rank world).

    Returns this rank's device. Idempotent.
    """
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        enable_cpu_compat()
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python scripts/train.py`: a one-rank world
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        pin_gloo_interface()  # several nodes: the world's gloo device on the host-address rule's interface
        dist.init_process_group(
            backend=device_backend(),
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    _init_megatron_globals()
    return device


def _init_megatron_globals() -> None:
    """The few megatron-core globals that stay process-wide even with per-WG process groups."""
    from megatron.core import parallel_state

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()


_CONTROL_GROUP = None


def control_group():
    """A gloo group over all ranks for small control messages (objects, barriers), even on GPU."""
    global _CONTROL_GROUP
    if _CONTROL_GROUP is None:
        _CONTROL_GROUP = dist.new_group(backend="gloo") if device_backend() != "gloo" else dist.group.WORLD
    return _CONTROL_GROUP


_DRIVER_WAITS = itertools.count()  # advances identically on every rank: one key per rendezvous


def wait_for_driver(what: str, *, driver: int = 0, timeout_s: float, poll_s: float = 0.25) -> None:
    """Rendezvous after the driver's long work (rollout, eval, engine start-up, plotting), called on
    every rank at the same point: the driver marks it done, the others block until it does.

    Why not just enter the next collective: a rank waiting inside a gloo collective dies when the
    group's timeout passes, however legitimately busy the driver is. Here the others poll the
    process group's key-value store (``check``: it answers at once, where a timed ``wait`` that
    expires logs c10d's "waitForInput ... timed out" warning each time), every ``poll_s`` at most,
    so only ``timeout_s`` (``trainer.collective_timeout_s``) bounds the wait, and a real hang names
    what was awaited.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    key = f"megamarl/driver_done/{next(_DRIVER_WAITS)}"
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    if rank == driver:
        store.set(key, what)
        return
    start, pause = time.monotonic(), 0.005
    while not store.check([key]):
        if time.monotonic() - start >= timeout_s:
            raise TimeoutError(
                f"rank {rank} waited {time.monotonic() - start:.0f} s for the driver (rank {driver}) to "
                "finish "
                f"{what}; raise trainer.collective_timeout_s (now {timeout_s:.0f}) if that work is "
                "legitimately longer"
            )
        time.sleep(pause)
        pause = min(2 * pause, poll_s)  # short waits return fast, long ones cost a request per poll_s
