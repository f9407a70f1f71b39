"""A run's parts, built once: ``build_run(cfg, plan) -> Run``, what ``Trainer`` loops over.

Named factories, each one concern, called in the order a run needs them (the order is part of the
seeded run: the seed is set before the first model is built): the peer watch, the worker groups and
their engines (``create_engine_fleet``), the policy workers (``create_training_models``), the
replicas and the rollout driver (``create_rollout_manager``), then what the loop keeps about them
(weight versions, the checkpointer, the phase lists). Every rank calls ``build_run`` (collective);
only rank 0, the driver, holds a ``RolloutDriver``. A test builds a ``Run`` of fakes instead.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from megamarl.config import RunConfig
from megamarl.driver.engine_pushes import EnginePushes
from megamarl.driver.evaluator import Evaluator, eval_steps
from megamarl.driver.rollout_driver import RolloutDriver
from megamarl.driver.schedules import SCHEDULES, sync_interval
from megamarl.errors import EXIT_LOST_RANKS
from megamarl.parallel.distributed import control_group, init_distributed, wait_for_driver
from megamarl.parallel.hardware import DTYPES, policy_dtype
from megamarl.parallel.network import host_address
from megamarl.parallel.peers import PeerWatch, describe_lost, gather_homes
from megamarl.parallel.placement import build_worker_groups, placement_of
from megamarl.planning.dryrun import engine_memory
from megamarl.planning.engine_budget import server_memory_fractions
from megamarl.planning.model_presets import resolve_model_shape
from megamarl.planning.phases import final_save_phases, start_phases, step_phases
from megamarl.rl.policy_setup import batch_splits, build_workers
from megamarl.rollout.engine_placement import ReplicaPlacement, plan_engines, ranks_per_node
from megamarl.rollout.replicas.policy import build_replicas
from megamarl.rollout.servers.fleet import build_fleet
from megamarl.rollout.weight_versions import WeightVersions
from megamarl.runtime import checkpoint
from megamarl.runtime.checkpointer import Checkpointer, RunDirStorage
from megamarl.runtime.progress import RunProgress

DRIVER = 0


@dataclass
class Run:
    """What the loop works with. ``driver`` is None off rank 0; ``offloaded``: this rank's policies
    whose train state leaves the accelerator during rollouts, ``offloaded_anywhere`` any rank's."""

    cfg: RunConfig
    rank: int
    world_size: int
    run_dir: Path
    progress: RunProgress
    peers: PeerWatch | None
    wgs: dict[str, Any]
    splits: dict[str, Any]
    plan: dict[str, list[ReplicaPlacement]]
    fleet: Any
    workers: dict[str, Any]
    replicas: dict[str, Any]
    driver: RolloutDriver | None
    offloaded: list[str]
    offloaded_anywhere: set[str]
    versions: WeightVersions
    pushes: EnginePushes
    checkpointer: Checkpointer
    evaluator: Evaluator
    phases: SimpleNamespace
    started: float = field(default_factory=time.monotonic)  # build_run's start (time.monotonic)

    def closing_line(self, step: int) -> str:
        """The run's last line (``checkpoint.closing_line``), timed from ``build_run``'s start."""
        return checkpoint.closing_line(
            self.run_dir, self.cfg, step=step, seconds=time.monotonic() - self.started
        )

    def say(self, text: str) -> None:
        """The one way the loop prints: on the driver's console, nothing on the other ranks."""
        if self.driver is not None:
            self.driver.console_print(text)

    @contextmanager
    def release_on_error(self) -> Iterator[None]:
        """On an error leaving the loop, the driver stops its env workers (a local resource: the
        collective ``close`` is for the normal end, which every rank reaches together)."""
        try:
            yield
        except BaseException as exc:
            # gloo reports a peer whose sockets closed as a plain RuntimeError: was it a lost rank?
            # (if so, the watch reports it and ends the process; else the error goes on)
            if self.peers is not None and (type(exc) is RuntimeError or isinstance(exc, dist.DistError)):
                self.peers.suspect()
            if self.driver is not None:
                self.driver.close_env_workers()
            raise

    def close(self) -> None:
        """Collective, at the normal end: the driver's rollout, the replicas, then the engine servers."""
        if self.peers is not None:  # the ranks leave from here: exits, not losses
            self.peers.stop()
        if self.driver is not None:
            self.driver.close()
        self.progress.close()
        self.checkpointer.close()
        wait_for_driver(
            "shutting down engines and plotting",
            driver=DRIVER,
            timeout_s=self.cfg.trainer.collective_timeout_s,
        )
        for replicas in self.replicas.values():
            replicas.close()
        if self.fleet is not None:
            # every rank has released its transfer groups before any rank stops its servers: a release
            # reaching a server in shutdown answers 500 (its engine core rejects the call)
            dist.barrier(group=control_group())
            self.fleet.close()
        dist.barrier(group=control_group())


def build_run(
    cfg: RunConfig,
    plan: dict[str, list[ReplicaPlacement]] | None = None,
    *,
    run_dir: str | Path | None = None,
) -> Run:
    """Collective. ``plan``: the engine plan when the launch already computed it
    (``front_door.preflight``), computed here otherwise."""
    started = time.monotonic()
    init_distributed(timeout_s=cfg.trainer.collective_timeout_s)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # the driver shows the run (live on a terminal, one line per phase in logs); others are silent
    progress = RunProgress(
        total_steps=cfg.trainer.total_steps,
        enabled=cfg.logger.progress and rank == DRIVER,
        quiet=rank != DRIVER,
        eval_steps=eval_steps(cfg.eval, total_steps=cfg.trainer.total_steps),
    )
    run_dir = Path(run_dir or Path(cfg.output_dir) / cfg.name)
    per_node = ranks_per_node(cfg.cluster, world_size)
    peers = create_peer_watch(
        cfg, rank=rank, world_size=world_size, run_dir=run_dir, multi_node=world_size > per_node
    )
    checkpoint.seed_everything(cfg.trainer.seed)
    wgs = build_worker_groups(placement_of(cfg, world_size))
    plan = plan if plan is not None else plan_engines(cfg, world_size, per_node)
    fleet = create_engine_fleet(
        cfg, plan, rank=rank, world_size=world_size, per_node=per_node, run_dir=run_dir
    )
    workers = create_training_models(cfg, wgs, fleet=fleet, progress=progress)
    replicas, driver = create_rollout_manager(
        cfg, wgs, workers, fleet=fleet, run_dir=run_dir, progress=progress, is_driver=rank == DRIVER
    )
    offloaded = offload_targets(cfg, workers, plan, rank=rank)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, offloaded, group=control_group())
    overlaps = SCHEDULES.traits(cfg.trainer.mode, key="trainer.mode").overlaps_training
    versions = WeightVersions(
        list(cfg.policies),
        sync_every=sync_interval(cfg.trainer),
        adapters={a: (c.policy, c.lora) for a, c in cfg.agents.items() if c.lora is not None},
    )
    say = driver.console_print if driver is not None else lambda text: None  # Run.say, before there is a Run
    return Run(
        started=started,
        cfg=cfg,
        rank=rank,
        world_size=world_size,
        run_dir=run_dir,
        progress=progress,
        peers=peers,
        wgs=wgs,
        splits=batch_splits(cfg.policies, cfg.agents, cfg.policy_algorithms()),
        plan=plan,
        fleet=fleet,
        workers=workers,
        replicas=replicas,
        driver=driver,
        offloaded=offloaded,
        offloaded_anywhere={name for names in gathered for name in names},
        versions=versions,
        pushes=EnginePushes(
            cfg.policies,
            cfg.rollout.opponent_pool,
            replicas=replicas,
            versions=versions,
            driver=driver,
            progress=progress,
        ),
        checkpointer=Checkpointer(
            cfg.trainer,
            cfg.policies,
            RunDirStorage(run_dir),
            rank=rank,
            world_size=world_size,
            workers=workers,
            wgs=wgs,
            versions=versions,
            driver=driver,
            say=say,
        ),
        evaluator=Evaluator(
            cfg.eval,
            total_steps=cfg.trainer.total_steps,
            driver=driver,
            timeout_s=cfg.trainer.collective_timeout_s,
        ),
        phases=SimpleNamespace(
            start=start_phases(overlaps_training=overlaps),
            step=step_phases(overlaps_training=overlaps),
            final_save=final_save_phases(overlaps_training=overlaps),
        ),
    )


def create_peer_watch(
    cfg: RunConfig, *, rank: int, world_size: int, run_dir: Path, multi_node: bool
) -> PeerWatch | None:
    """Every rank watches the others' heartbeats (``trainer.peer_timeout_s``; megamarl.parallel.peers);
    a lost rank ends every surviving one (``exit_lost_ranks``)."""
    if world_size == 1:
        return None
    try:
        address = host_address(multi_node=multi_node)
    except RuntimeError:  # only names the node in a report
        address = "address unknown"
    homes = gather_homes(address=address, group=control_group())
    watch = PeerWatch(
        rank=rank,
        homes=homes,
        timeout_s=cfg.trainer.peer_timeout_s,
        on_lost=lambda lost, why: exit_lost_ranks(watch, lost, why, rank=rank, run_dir=run_dir),
    )
    return watch


def exit_lost_ranks(peers: PeerWatch, lost: list[int], why: str, *, rank: int, run_dir: Path) -> None:
    """Ranks were lost: the lowest surviving rank prints one line, every surviving rank exits at once
    (its main thread may be blocked in a collective that would wait trainer.collective_timeout_s)."""
    if peers.reporter():
        found = checkpoint.list_checkpoints(run_dir)
        last = (
            f"{found[-1]} (step {checkpoint.checkpoint_step(found[-1])})"
            if found
            else "none (a relaunch starts afresh)"
        )
        print(
            f"training stopped: {describe_lost(lost, peers.homes)}: {why}, seen by rank {rank}; "
            f"last complete checkpoint {last}; relaunch the same command with trainer.resume=auto to "
            "continue from it",
            file=sys.stderr,
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_LOST_RANKS)


def create_engine_fleet(
    cfg: RunConfig,
    plan: dict[str, list[ReplicaPlacement]],
    *,
    rank: int,
    world_size: int,
    per_node: int,
    run_dir: Path,
) -> Any:
    """The engine servers of this rank, started now (in threads), sized on GPU from the memory plan; on
    CPU they overlap model preparation, on GPU colocated ones are up and asleep first. None without
    servers."""
    overlaps = SCHEDULES.traits(cfg.trainer.mode, key="trainer.mode").overlaps_training
    fractions = server_memory_fractions(
        cfg, world_size=world_size, gpus_per_node=per_node, plan=plan, overlaps_training=overlaps
    )

    def kv_estimate(policy: str, path: Path) -> float:
        # engine.kv_cache_gib: 0 gets what max_num_seqs sequences of seq_len need (the dry-run's estimate)
        shape = resolve_model_shape(str(path), key="policies.<p>.model")
        return engine_memory(shape, cfg.policies[policy]).kv_cache / 2**30

    return build_fleet(
        cfg,
        plan=plan,
        rank=rank,
        world_size=world_size,
        run_dir=run_dir,
        control_group=control_group(),
        overlaps_training=overlaps,
        kv_estimate=kv_estimate,
        memory_fractions=fractions,
    )


def create_training_models(cfg: RunConfig, wgs: dict, *, fleet: Any, progress: RunProgress) -> dict[str, Any]:
    """Every policy's worker on this rank (``rl.policy_setup``), while the engine servers start."""
    with (
        fleet.model_preparation() if fleet is not None else nullcontext(),
        progress.phase("model preparation", total=len(cfg.policies), unit="policies", in_step=False) as phase,
    ):
        return build_workers(
            cfg.policies,
            cfg.agents,
            cfg.policy_algorithms(),
            wgs,
            seed=cfg.trainer.seed,
            dtypes={n: DTYPES[policy_dtype(cfg, n)] for n in cfg.policies},
            total_steps=cfg.trainer.total_steps,
            on_policy=phase.advance,
        )


def create_rollout_manager(
    cfg: RunConfig,
    wgs: dict,
    workers: dict,
    *,
    fleet: Any,
    run_dir: Path,
    progress: RunProgress,
    is_driver: bool,
) -> tuple[dict[str, Any], RolloutDriver | None]:
    """Every policy's replicas (the one object that pauses, sleeps, wakes and pushes into them) and, on
    the driver, the rollout driver; returns once the driver's engines are up (collective)."""
    replicas = build_replicas(
        cfg,
        wgs=wgs,
        workers=workers,
        fleet=fleet,
        run_dir=run_dir,
        driver_rank=DRIVER,
        control_group=control_group(),
    )
    driver = RolloutDriver(cfg, run_dir, progress, replicas=replicas) if is_driver else None
    if is_driver and fleet is not None:
        (run_dir / "engine_servers.json").write_text(json.dumps(fleet.table(), indent=1))
    wait_for_driver("engine start-up", driver=DRIVER, timeout_s=cfg.trainer.collective_timeout_s)
    return replicas, driver


def offload_targets(
    cfg: RunConfig, workers: dict, plan: dict[str, list[ReplicaPlacement]], *, rank: int
) -> list[str]:
    """This rank's policies whose training state leaves the accelerator during rollouts: sync mode, an
    engine replica on this rank, ``offload_train_state`` and an accelerator to leave."""
    if SCHEDULES.traits(cfg.trainer.mode, key="trainer.mode").overlaps_training:
        return []
    engine_here = any(rank in rep.ranks for reps in plan.values() for rep in reps)
    return [
        name
        for name, worker in workers.items()
        if engine_here and cfg.policies[name].offload_train_state and worker.train_state.applies
    ]
