"""Run a function on N CPU ranks (spawned processes over gloo) and collect each rank's result.

Used by the distributed test tier and by benchmarks: ``run_ranks(fn, 4, arg)`` starts 4 processes
with a torchrun-like environment, initialises ``torch.distributed`` in each, calls
``fn(rank, *args)`` and returns the per-rank return values in rank order. A failure on any rank
raises ``RuntimeError`` carrying that rank's traceback; a hang is killed after ``timeout_s``.
``fn`` must be importable by name (a module-level function), as with any spawn start method.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from megamarl.parallel.distributed import init_distributed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    import torch  # noqa: F401 - after the environment above, as in a torchrun child

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        init_distributed(timeout_s=120)
        value = fn(rank, *args)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` spawned gloo ranks; return results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, port, fn, args, results), daemon=False)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcomes) < world_size:
            try:
                rank, ok, payload = results.get(timeout=timeout_s)
            except queue.Empty:
                raise RuntimeError(
                    f"run_ranks({fn.__name__}): ranks {sorted(set(range(world_size)) - set(outcomes))} "
                    f"gave no result within {timeout_s:.0f}s"
                ) from None
            outcomes[rank] = (ok, payload)
            if not ok:
                raise RuntimeError(f"run_ranks({fn.__name__}): rank {rank} failed:\n{payload}")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """Under torchrun, this process is one of the ranks: run ``fn(rank, *args)`` here and return
    ``[its result]``; otherwise spawn ``world_size`` ranks (``run_ranks``). The torchrun world must
    be exactly ``world_size`` ranks."""
    if "RANK" not in os.environ:
        return run_ranks(fn, world_size, *args, timeout_s=timeout_s)
    init_distributed()
    if dist.get_world_size() != world_size:
        raise ValueError(f"torchrun world size {dist.get_world_size()} != {world_size} ranks needed")
    return [fn(dist.get_rank(), *args)]
