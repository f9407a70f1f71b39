"""Run a function on N CPU ranks (spawned processes over gloo) and collect each rank's result.

Used by the distributed test tier, the converters and benchmarks: ``run_ranks(fn, 4, arg)`` starts 4 processes
with a torchrun-like environment, initialises ``torch.distributed`` in each, calls
``fn(rank, *args)`` and returns the per-rank return values in rank order. A failure on any rank
raises ``RuntimeError`` carrying that rank's traceback; a hang is killed after ``timeout_s``.
``fn`` must be importable by name (a module-level function), as with spawn: ranks are forks of a
fork server that imported torch, megatron-core and transformers once, not of the caller.
"""

from __future__ import annotations

import os
import pickle
import queue
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from megamarl.parallel.distributed import init_distributed
from megamarl.parallel.network import free_port


def set_rank_environ(environ: dict[str, str], rank: int, world_size: int, port: int) -> None:
    """This process's environment: ``environ`` (the caller's as it was at the call: a fork server's
    children inherit the server's, taken when it started, so a variable set since, e.g.
    MEGAMARL_CACHE in a test, would be missing) plus torchrun's rank variables of one local world."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, environ: dict[str, str]
) -> None:
    set_rank_environ(environ, rank, world_size, port)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch  # after the environment above, as in a torchrun child (preloaded: no cost)

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


# Modules every rank body needs, imported once in the fork server (``rank_context``) instead of once per
# rank; callers may add theirs (``rank_context(also_preload)``) before the server starts.
RANK_PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.models.gpt",
    "transformers",
    "megamarl.models.bridge",
    "megamarl.rl.worker",
]


def rank_context(also_preload: Iterable[str] = ()):
    """The multiprocessing context ranks start from: a fork server that has imported ``RANK_PRELOAD``
    (torch, megatron-core, transformers: 10-20 CPU-seconds per process on a 2-core machine, most of a
    short rank's life). Each rank is a fork of it, so it starts with those modules loaded yet shares
    no state with the caller (the server never runs a rank body, only imports). The server starts at
    the first rank and lives as long as the calling process, so later calls pay nothing; modules added
    after it started are imported by each rank as usual. Where fork servers do not exist (not
    Linux/macOS), plain spawn: every rank imports what it needs."""
    RANK_PRELOAD.extend(m for m in also_preload if m not in RANK_PRELOAD)
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))  # read when the server starts, ignored after
    return ctx


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` gloo ranks (forked from a preloaded fork server;
    ``rank_context``); return results in rank order."""
    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, fn, args, results, dict(os.environ)),
            daemon=False,
        )
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
