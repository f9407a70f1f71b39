"""The training loop: rollout -> advantages -> update each policy -> sync weights -> save/log/eval.

SPMD under torchrun: every rank runs ``Trainer.fit``. Rank 0 is also the *driver*
(``megamarl.driver.RolloutDriver``): it hosts the engines (colocated, in-process), runs the episodes,
turns them into the training batch (``megamarl.rl.prepare``) and logs. Workers are built by
``megamarl.rl.policy_setup``; checkpoints are ``megamarl.runtime.checkpoint``. Every rank holding a
shard of a policy's worker group (WG) trains it; the driver plans every policy's update
(``megamarl.rl.dispatch``) and each rank receives only its own share over the CPU control group,
with a summary of the batch's counts (``perf/batch_bytes_per_rank``). Variants (estimators, engines,
envs, orchestras) are looked up by name in registries; the loop itself has no per-variant branches.
``trainer.mode`` names the driver's rollout schedule (``megamarl.driver.schedules``: sync, one_step_off,
fully_async; docs/async.md): where the next batch comes from and what a weight push waits for.
``Trainer.evaluate_only`` is ``scripts/evaluate.py``'s loop: the same start-up, one evaluation, shut down.
The loop runs the phases of ``megamarl.planning.phases`` in order (the list the dry-run prices): what
sleeps, wakes, moves to host memory and is pushed when is decided there, not here.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from megamarl.config import RunConfig
from megamarl.driver.opponent_pool import snapshot_slot
from megamarl.driver.rollout_driver import RolloutDriver
from megamarl.driver.schedules import SCHEDULES, sync_interval
from megamarl.errors import EXIT_LOST_RANKS, NumericalFaultError
from megamarl.parallel.collectives import scatter_objects
from megamarl.parallel.distributed import control_group, init_distributed, wait_for_driver
from megamarl.parallel.hardware import DTYPES, policy_dtype, release_cached_memory
from megamarl.parallel.network import host_address
from megamarl.parallel.peers import PeerWatch, describe_lost, gather_homes
from megamarl.parallel.placement import build_worker_groups, placement_of
from megamarl.planning.dryrun import engine_memory
from megamarl.planning.engine_budget import server_memory_fractions
from megamarl.planning.model_presets import resolve_model_shape
from megamarl.planning.phases import Phase, final_save_phases, start_phases, step_phases
from megamarl.rl.dispatch import RankBatch, rank_batches
from megamarl.rl.policy_setup import batch_splits, build_workers
from megamarl.rollout.engine_placement import ReplicaPlacement, plan_engines, ranks_per_node
from megamarl.rollout.replicas.policy import build_replicas, stale_replicas
from megamarl.rollout.servers.fleet import build_fleet
from megamarl.runtime import checkpoint
from megamarl.runtime.preemption import PreemptionFlag, mark_stopped
from megamarl.runtime.progress import RunProgress
from megamarl.runtime.step_metrics import (
    idle_seconds,
    merge_rank_metrics,
    peak_memory_gib,
    throughput_metrics,
)

DRIVER = 0


class Trainer:
    def __init__(self, cfg: RunConfig, *, run_dir: str | Path | None = None, eval_only: bool = False,
                 plan: dict[str, list[ReplicaPlacement]] | None = None):
        """``eval_only``: the run directory is an evaluation's (``evaluate_only``), not the resumed
        checkpoint's run: resuming loads and pushes the weights but rewinds nothing there. ``plan``: the
        run's engine plan when the launch already computed it (``front_door.preflight``); computed here
        otherwise, once, and handed to whoever needs it."""
        init_distributed(timeout_s=cfg.trainer.collective_timeout_s)
        self.cfg = cfg
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_driver = self.rank == DRIVER
        # the driver shows the run (live on a terminal, one line per phase in logs); others are silent
        self.progress = RunProgress(total_steps=cfg.trainer.total_steps, enabled=cfg.logger.progress) if self.is_driver \
            else RunProgress(total_steps=cfg.trainer.total_steps, enabled=False, quiet=True)
        self.run_dir = Path(run_dir or Path(cfg.output_dir) / cfg.name)
        per_node = ranks_per_node(cfg.cluster, self.world_size)
        self.peers = self._watch_peers(multi_node=self.world_size > per_node)
        self.step = 0
        self.stop_reason = ""  # set when eval.stop_at is reached: the loop ends after this step's checkpoint
        self.versions = {name: 0 for name in cfg.policies}  # weight pushes into the engines so far
        self.updates_since_sync = {name: 0 for name in cfg.policies}
        self.sync_every = sync_interval(cfg.trainer)  # updates of a policy per weight push
        checkpoint.seed_everything(cfg.trainer.seed)
        self.wgs = build_worker_groups(placement_of(cfg, self.world_size))
        self.splits = batch_splits(cfg.policies, cfg.agents, cfg.policy_algorithms())  # the driver plans every policy's update
        self.plan = plan if plan is not None else plan_engines(cfg, self.world_size, per_node)
        # engine servers start now (in threads), sized on GPU from the memory plan; on CPU they overlap
        # model preparation, on GPU colocated ones are up and asleep first (ServerFleet.model_preparation)
        overlaps = SCHEDULES.traits(cfg.trainer.mode, key="trainer.mode").overlaps_training
        fractions = server_memory_fractions(cfg, world_size=self.world_size, gpus_per_node=per_node, plan=self.plan,
                                            overlaps_training=overlaps)
        self.fleet = build_fleet(cfg, plan=self.plan, rank=self.rank, world_size=self.world_size, run_dir=self.run_dir,
                                 control_group=control_group(), overlaps_training=overlaps, kv_estimate=self._kv_estimate,
                                 memory_fractions=fractions)
        with self.fleet.model_preparation() if self.fleet is not None else nullcontext(), \
                self.progress.phase("model preparation", total=len(cfg.policies), unit="policies", in_step=False) as phase:
            self.workers = build_workers(cfg.policies, cfg.agents, cfg.policy_algorithms(), self.wgs, seed=cfg.trainer.seed,
                                         dtypes={n: DTYPES[policy_dtype(cfg, n)] for n in cfg.policies},
                                         total_steps=cfg.trainer.total_steps,
                                         on_policy=phase.advance)
        # every policy's replicas: the one object that pauses, sleeps, wakes and pushes into them
        self.replicas = build_replicas(cfg, wgs=self.wgs, workers=self.workers, fleet=self.fleet, run_dir=self.run_dir,
                                       driver_rank=DRIVER, control_group=control_group())
        self.driver = RolloutDriver(cfg, self.run_dir, self.progress, replicas=self.replicas) if self.is_driver else None
        if self.is_driver and self.fleet is not None:
            (self.run_dir / "engine_servers.json").write_text(json.dumps(self.fleet.table(), indent=1))
        self._wait_for_driver("engine start-up")
        self._offloaded = self._offload_targets()
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, self._offloaded, group=control_group())
        self._offloaded_anywhere = {name for names in gathered for name in names}
        overlaps = SCHEDULES.traits(cfg.trainer.mode, key="trainer.mode").overlaps_training
        self.phases = SimpleNamespace(start=start_phases(overlaps_training=overlaps),
                                      step=step_phases(overlaps_training=overlaps),
                                      final_save=final_save_phases(overlaps_training=overlaps))
        self.actions = self._actions()
        self._pending: dict[str, float] = {}  # this rank's offload/restore metrics, gathered with the update's
        self._received: RankBatch | None = None  # this step's batch (None before the first rollout)
        self._metrics: dict[str, float] = {}  # this step's metrics so far
        self._step_start = 0.0
        self._resynced: dict[str, float] = {}  # the re-sync phase's metrics, logged with the rollout's
        self._saved_at = -1  # the step last saved
        self._evaluate_only: int | None = None  # evaluate_only's label (-1: the checkpoint's step)
        self._eval_results: dict[str, float] = {}
        for replicas in self.replicas.values():
            replicas.register_adapters()
        self._maybe_resume(rewind=not eval_only)

    def _kv_estimate(self, policy: str, path: Path) -> float:
        """The KV cache (GiB) an engine server of ``policy`` gets with ``engine.kv_cache_gib: 0``: what
        ``max_num_seqs`` sequences of ``seq_len`` need (the dry-run's estimate, so start-up gives the
        server what the plan counted)."""
        shape = resolve_model_shape(str(path), key="policies.<p>.model")
        return engine_memory(shape, self.cfg.policies[policy]).kv_cache / 2**30

    def _offload_targets(self) -> list[str]:
        """This rank's policies whose training state leaves the accelerator during rollouts."""
        if SCHEDULES.traits(self.cfg.trainer.mode, key="trainer.mode").overlaps_training:
            return []
        engine_here = any(self.rank in rep.ranks for reps in self.plan.values() for rep in reps)
        return [name for name, worker in self.workers.items()
                if engine_here and self.cfg.policies[name].offload_train_state and worker.train_state.applies]

    def _watch_peers(self, *, multi_node: bool) -> PeerWatch | None:
        """Every rank watches the others' heartbeats (``trainer.peer_timeout_s``; megamarl.parallel.peers)."""
        if self.world_size == 1:
            return None
        try:
            address = host_address(multi_node=multi_node)
        except RuntimeError:  # only names the node in a report
            address = "address unknown"
        homes = gather_homes(address=address, group=control_group())
        return PeerWatch(rank=self.rank, homes=homes, timeout_s=self.cfg.trainer.peer_timeout_s, on_lost=self._lost)

    def _lost(self, lost: list[int], why: str) -> None:
        """Ranks were lost: the lowest surviving rank prints one line, every surviving rank exits at once
        (its main thread may be blocked in a collective that would wait trainer.collective_timeout_s)."""
        if self.peers.reporter():
            found = checkpoint.list_checkpoints(self.run_dir)
            last = (f"{found[-1]} (step {checkpoint.checkpoint_step(found[-1])})" if found
                    else "none (a relaunch starts afresh)")
            print(f"training stopped: {describe_lost(lost, self.peers.homes)}: {why}, seen by rank {self.rank}; "
                  f"last complete checkpoint {last}; relaunch the same command with trainer.resume=auto to "
                  "continue from it", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_LOST_RANKS)

    def _wait_for_driver(self, what: str) -> None:
        wait_for_driver(what, driver=DRIVER, timeout_s=self.cfg.trainer.collective_timeout_s)

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self) -> None:
        """Start-up phases (the weights into the engines, the step-0 evaluation), then each step's
        phases in ``megamarl.planning.phases`` order, the list the dry-run prices."""
        with self._release_on_error():
            total = self.cfg.trainer.total_steps
            self.progress.start_at(self.step)
            if self.stop_reason and self.is_driver:
                self.driver.console_print(f"resumed a run that stopped at step {self.step}: {self.stop_reason}; nothing to do")
            if not self.stop_reason:
                self.run_phases(self.phases.start)
            preemption = PreemptionFlag()
            while self.step < total and not self.stop_reason:
                self.run_phases(self.phases.step)
                preempted = preemption.agreed(control_group())  # every rank, same step (megamarl.runtime.preemption)
                # the checkpoint of a run that stops carries its stop reason (a cadence save of this step is rewritten)
                if self.stop_reason or (preempted and self._saved_at != self.step):
                    self.run_phases(self.phases.final_save)
                if preempted:
                    if self.is_driver and not self.stop_reason:  # eval.stop_at ended it: finished, nothing to requeue
                        mark_stopped(self.run_dir, step=self.step, received=preemption.received)  # train.sbatch requeues on it
                    if self.is_driver:
                        self.driver.console_print(f"preempted ({preemption.received.name if preemption.received else 'another rank'}): saved step "
                                                  f"{self.step}; trainer.resume=auto continues from it")
                    break
                if self.stop_reason and self.is_driver:
                    self.driver.console_print(f"stopping at step {self.step}: {self.stop_reason} (saved)")
            preemption.uninstall()
            self.close()

    def run_phases(self, phases: Iterable[Phase]) -> None:
        """Run each phase's action in order (``self.actions``: the phase list's seam)."""
        for phase in phases:
            self.actions[phase.action]()

    def _actions(self) -> dict[str, Callable[[], None]]:
        """What each phase action of ``megamarl.planning.phases`` does here."""
        return {
            "wake_weights": lambda: self.hand_over(wake=("weights",)),
            "push_all": lambda: self.sync_all_weights(),
            "push": self._push_phase,
            "resync": self._resync_phase,
            "save": self._save_phase,
            "final_save": self._final_save,
            "offload": self._offload_phase,
            "wake_kv": self._wake_kv_phase,
            "evaluate": self._evaluate_phase,
            "rollout": self._rollout_phase,
            "sleep": self.sleep_engines,
            "restore": lambda: self._pending.update(self.restore_train_state()),
            "train": self._train_phase,
            "release": release_cached_memory,
        }

    def hand_over(self, *, wake: tuple[str, ...]) -> None:
        """On the driver: wake these parts (``weights``, ``kv_cache``) of every policy's replicas that
        sleep (``PolicyReplicas``: nothing for replicas that never sleep)."""
        if self.is_driver:
            for replicas in self.replicas.values():
                replicas.wake(wake)

    def _wake_kv_phase(self) -> None:
        """The KV caches back (the train state has left), then the probes of this step's pushes
        into replicas that sleep (``engine.verify_sync``; collective)."""
        self.hand_over(wake=("kv_cache",))
        for replicas in self.replicas.values():
            self._metrics.update(replicas.verify_pushed())

    def sleep_engines(self) -> None:
        """Collective: the driver puts the sleeping kind of replicas to sleep; no rank restores its
        train state before their memory is free."""
        if self.is_driver:
            for replicas in self.replicas.values():
                replicas.sleep()
        self._wait_for_driver("the engines' sleep")

    def _rollout_phase(self) -> None:
        self._received, self._metrics = self.rollout_and_prepare()
        self._metrics.update(self._resynced)

    def _train_phase(self) -> None:
        self._metrics.update(self.update(self._received, self._pending))
        self._pending = {}
        self.step += 1

    def _push_phase(self) -> None:
        """The due pushes, then the re-sync of restarted replicas (the train state is resident and the
        engines' weights awake), then the opponent-pool snapshot."""
        self._metrics.update(self.sync_all_weights(self.due_for_sync()))
        self._metrics.update(self.resync_restarted())
        self._metrics.update(self.snapshot_opponents())

    def _resync_phase(self) -> None:
        """Before the rollout: replicas restarted since the last push get the current weights now, of
        policies whose train state never left the device (the others in the push phase). The step's clock starts."""
        self._step_start = time.perf_counter()
        self._resynced = self.resync_restarted(resident_only=True)

    def _save_phase(self) -> None:
        """Cadence and last-step saves here, with the train state resident; a run that stops after
        an evaluation saves in the final-save phases (``fit``)."""
        if self._due(self.cfg.trainer.save_every) or self.step == self.cfg.trainer.total_steps:
            self._final_save()

    def _final_save(self) -> None:
        self.save()
        self._saved_at = self.step

    def _offload_phase(self) -> None:
        """The train state (of policies that offload it here) to host memory, the allocator's cached
        blocks released on every rank; all ranks done before the driver wakes the KV caches."""
        self._pending.update(self.offload_train_state())
        release_cached_memory()
        dist.barrier(group=control_group())

    def _evaluate_phase(self) -> None:
        """At start-up: the step-0 evaluation (``evaluate_only``: its one evaluation). After a step:
        its metrics logged, then the evaluation when due (which may stop the run)."""
        if self._evaluate_only is not None:
            self.step = self.step if self._evaluate_only < 0 else self._evaluate_only
            self._eval_results = self._eval_on_driver()
            return
        if self._received is None:
            if self.step == 0:
                self.evaluate()
            return
        metrics, received = self._metrics, self._received
        metrics["timing_s/step"] = time.perf_counter() - self._step_start
        metrics["timing_s/idle"] = idle_seconds(metrics)
        metrics.update(throughput_metrics(
            num_train_tokens=received.summary.num_train_tokens, update_s=metrics["timing_s/update"],
            num_samples=received.summary.num_samples, step_s=metrics["timing_s/step"],
        ))
        self.progress.step_done(self.step, metrics["timing_s/step"])
        self.log(metrics)
        if self._due(self.cfg.eval.every) or self.step == self.cfg.trainer.total_steps:
            self.stop_reason = self.evaluate()

    @contextmanager
    def _release_on_error(self) -> Iterator[None]:
        """On an error leaving the loop, the driver stops its env workers (a local resource: the
        collective ``close`` is for the normal end, which every rank reaches together). Preemption and
        the normal end go through ``close``."""
        try:
            yield
        except BaseException as exc:
            # gloo reports a peer whose sockets closed as a plain RuntimeError: was it a lost rank?
            # (if so, the watch reports it and ends the process; else the error goes on)
            if self.peers is not None and (type(exc) is RuntimeError or isinstance(exc, dist.DistError)):
                self.peers.suspect()
            if self.is_driver:
                self.driver.close_env_workers()
            raise

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def rollout_and_prepare(self) -> tuple[RankBatch, dict[str, float]]:
        """Driver takes the next batch from its schedule (trainer.mode) and computes advantages; it
        may hold only some policies (fully_async, per-policy). The driver plans every policy's update
        and each rank receives only its WGs' DP shares and the batch's summary (``rl.dispatch``).
        The step's metrics stay on the driver, which logs them."""
        payloads, metrics = None, {}
        if self.is_driver:
            batch, metrics = self.driver.collect(self.step, self.versions)
            payloads = rank_batches(batch, self.splits, {name: wg.layout for name, wg in self.wgs.items()},
                                    world_size=self.world_size)
        self._wait_for_driver(f"the rollout of step {self.step + 1}")
        received, num_bytes = scatter_objects(payloads, src=DRIVER, group=control_group())
        metrics.update({"perf/batch_bytes_per_rank": max(num_bytes), "perf/batch_bytes_total": sum(num_bytes)})
        return received, metrics

    def offload_train_state(self) -> dict[str, float]:
        """After the push, before the KV caches wake: policies with ``offload_train_state`` whose
        shards on this rank share their device with an engine replica move weights, gradient buffers
        and optimizer state to host memory (sync mode only: the async modes train while the engines
        generate). Nothing moves on a CPU rank (``megamarl.rl.offload``)."""
        metrics = {}
        for name in self._offloaded:
            stats = self.workers[name].train_state.offload()
            metrics[f"perf/offloaded_gib/{name}"] = stats.num_bytes / 2**30
            metrics[f"timing_s/{name}/offload"] = stats.seconds
        return metrics

    def restore_train_state(self) -> dict[str, float]:
        return {f"timing_s/{name}/restore": self.workers[name].train_state.restore().seconds for name in self._offloaded}

    def update(self, received: RankBatch, pending: dict[str, float] | None = None) -> dict[str, float]:
        """Each of this rank's workers trains on its share; every rank counts the updates of every
        policy that had data (the summary is the same everywhere). ``pending``: this rank's metrics
        of the offload and restore phases since the last update, gathered with the update's."""
        start = time.perf_counter()
        metrics: dict[str, float] = dict(pending or {})
        for name in received.summary.trained_policies:
            self.updates_since_sync[name] += 1
        with self.progress.phase("train", unit="micro-batches") as phase:
            for name, share in received.shares.items():
                self.workers[name].on_micro_batch = phase.advance
                for key, value in self.workers[name].train_share(share).items():
                    # the worker's sections (timing_s/<section>) become timing_s/<policy>/<section>
                    section = key.removeprefix("timing_s/")
                    if key in ("padding_fraction", "forwarded_tokens"):  # throughput figures: perf/<key>/<policy>
                        metrics[f"perf/{key}/{name}"] = value
                    else:
                        metrics[f"timing_s/{name}/{section}" if section != key else f"policy/{name}/{key}"] = value
                metrics[f"perf/max_memory_gib/{name}"] = peak_memory_gib()
        faults = {name: w.last_fault for name, w in self.workers.items() if w.skip_streak}
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, (metrics, faults), group=control_group())
        merged = merge_rank_metrics([rank_metrics for rank_metrics, _ in gathered])
        merged["timing_s/update"] = time.perf_counter() - start
        self._check_numerics(merged, {k: v for _, rank_faults in gathered for k, v in rank_faults.items()})
        return merged

    def _check_numerics(self, metrics: dict[str, float], faults: dict[str, str]) -> None:
        """Skipped (non-finite) updates are reported; too many in a row stop the run on every rank
        (the metrics are the same everywhere) before anything of this step is pushed or saved."""
        limit = self.cfg.trainer.max_nonfinite_updates
        for name, fault in faults.items():
            streak = int(metrics.get(f"policy/{name}/nonfinite_streak", 0))
            if self.is_driver:
                self.driver.console_print(f"step {self.step + 1}: skipped the update of '{name}' ({streak} in a row): {fault}")
            if streak >= limit:
                good = checkpoint.list_checkpoints(self.run_dir)
                last = f"the last good checkpoint is {good[-1]}" if good else "no checkpoint was saved yet"
                raise NumericalFaultError(
                    f"{streak} non-finite updates in a row (trainer.max_nonfinite_updates={limit}); last: {fault}; "
                    f"no NaN weights were applied or pushed; {last}")

    def due_for_sync(self) -> list[str]:
        """Policies with ``sync_every`` updates since their last weight push (same on every rank)."""
        return [name for name, num in self.updates_since_sync.items() if num >= self.sync_every]

    def sync_all_weights(self, policies: list[str] | None = None) -> dict[str, float]:
        """Push ``policies`` (default: all) into their engines; each push is one new weight version,
        stamped on everything the engines generate afterwards. Frozen policies get the version but
        no push (their engines already serve the checkpoint)."""
        names = list(self.cfg.policies) if policies is None else policies
        if not names:
            return {}
        start = time.perf_counter()
        metrics = {}
        with self.driver.weight_update() if self.is_driver else nullcontext():  # drain/pause rollout
            for name in names:
                self.versions[name] += 1
                self.updates_since_sync[name] = 0
                policy = self.cfg.policies[name]
                if policy.frozen:
                    continue
                with self.progress.phase(f"weight sync {name}", unit=""):
                    metrics.update(self.replicas[name].push(self.versions[name]))
        dist.barrier(group=control_group())
        metrics["timing_s/weight_sync"] = time.perf_counter() - start
        return metrics

    def snapshot_opponents(self) -> dict[str, float]:
        """``rollout.opponent_pool``: after every ``every``-th step, the learner's weights go into the next
        snapshot slot (a frozen policy's engines), a new version of that policy (collective)."""
        pool = self.cfg.rollout.opponent_pool
        slot = snapshot_slot(self.step, every=pool.every, num_slots=len(pool.snapshots)) if pool.enabled else None
        if slot is None:
            return {}
        name = pool.snapshots[slot]
        self.versions[name] += 1
        with self.driver.weight_update() if self.is_driver else nullcontext(), \
                self.progress.phase(f"snapshot {pool.learner} -> {name}", unit=""):
            metrics = self.replicas[name].snapshot_from(self.replicas[pool.learner], self.versions[name])
        if self.is_driver:
            self.driver.opponent_pool.record(slot, self.step)
        dist.barrier(group=control_group())
        return metrics

    def resync_restarted(self, *, resident_only: bool = False) -> dict[str, float]:
        """Engine servers restarted since the last push get the current weights now instead of idling
        until the next push (collective; nothing when none restarted). ``resident_only``: only of
        policies whose train state is on the device everywhere (no rank offloaded it)."""
        metrics = {}
        stale = stale_replicas(self.replicas, driver_rank=DRIVER, control_group=control_group())
        for name, indices in stale.items():
            if resident_only and name in self._offloaded_anywhere:
                continue
            with self.progress.phase(f"re-sync {name} replicas {indices}", unit=""):
                metrics.update(self.replicas[name].resync(self.versions[name], indices))
        return metrics

    def evaluate(self) -> str:
        """Eval on the driver; after a training step, returns (on every rank) why ``eval.stop_at``
        stops the run, or ""."""
        if self.cfg.eval.num_tasks <= 0:
            return ""
        results = self._eval_on_driver()
        stop_at = self.cfg.eval.stop_at
        if not stop_at or self.step == 0 or self.step >= self.cfg.trainer.total_steps:
            return ""  # not before training, and the last step ends the run anyway
        reason = [", ".join(f"{k}={results[k]:.3f} >= {v}" for k, v in stop_at.items())
                  if self.is_driver and all(results.get(k, float("-inf")) >= v for k, v in stop_at.items()) else ""]
        dist.broadcast_object_list(reason, src=DRIVER, group=control_group())
        return f"eval.stop_at reached ({reason[0]})" if reason[0] else ""

    def evaluate_only(self, *, step: int | None = None) -> dict[str, float]:
        """One evaluation without training (``scripts/evaluate.py``), then shut down. The engines serve
        the checkpoint ``trainer.resume`` named (pushed by ``_maybe_resume``) or, without one, the
        configured models, pushed here as ``fit`` pushes them before its step-0 evaluation. The
        eval.json entry is labelled ``step`` (default: the checkpoint's, 0 without one). Returns the
        results on the driver, {} on the other ranks."""
        with self._release_on_error():
            self._evaluate_only = -1 if step is None else step
            self.run_phases(self.phases.start)  # the same start-up order as ``fit``
            results = self._eval_results
            self.close()
        return results

    def _eval_on_driver(self) -> dict[str, float]:
        """Collective: the driver evaluates at ``self.step`` while the other ranks serve and wait.
        Returns the results on the driver, {} elsewhere."""
        results = self.driver.evaluate(self.step) if self.is_driver else {}
        self._wait_for_driver(f"the evaluation at step {self.step}")
        return results

    def log(self, metrics: dict[str, float]) -> None:
        if self.is_driver:
            self.driver.log(self.step, metrics)

    # ---- checkpoint / resume --------------------------------------------------------------------
    def save(self) -> None:
        """Collective: every policy's shards (layout-free), every rank's RNG, then the driver commits
        the run state and the COMPLETE marker atomically (megamarl.runtime.checkpoint, docs/checkpointing.md).
        A failed write on any rank (disk full, quota, I/O error) is agreed by all ranks: the partial
        directory is removed and ``CheckpointWriteError`` stops the run, naming the previous complete
        checkpoint, which nothing touched."""
        final = checkpoint.checkpoint_path(self.run_dir, self.step)
        staging = checkpoint.staging_path(final)
        if self.is_driver:
            checkpoint.clear(staging)  # left by a run killed while saving this step
        dist.barrier(group=control_group())
        error = checkpoint.attempt_write(lambda: (checkpoint.save_policies(staging, self.cfg.policies, self.workers, self.wgs),
                                  checkpoint.save_rng(staging, self.rank)))
        num_updates = [None] * self.world_size
        dist.all_gather_object(
            num_updates, ({name: (w.num_updates, w.scheduler.num_steps) for name, w in self.workers.items()}, error),
            group=control_group()
        )
        errors = [f"rank {rank}: {e}" for rank, (_, e) in enumerate(num_updates) if e]
        if self.is_driver and not errors:
            state = {
                "step": self.step, "versions": dict(self.versions), "world_size": self.world_size,
                "num_updates": {k: v[0] for counts, _ in num_updates for k, v in counts.items()},
                "lr_steps": {k: v[1] for counts, _ in num_updates for k, v in counts.items()},
                "driver": self.driver.state_dict(),
                "stop_reason": self.stop_reason,  # a resumed run that stopped at eval.stop_at stays stopped
            }
            error = checkpoint.attempt_write(lambda: checkpoint.commit(staging, final, state))
            errors += [f"rank {self.rank}: {error}"] if error else []
            if not errors:
                checkpoint.prune(self.run_dir, keep_last=self.cfg.trainer.keep_last)
        outcome = [errors]
        dist.broadcast_object_list(outcome, src=DRIVER, group=control_group())
        if outcome[0]:
            if self.is_driver:
                checkpoint.attempt_write(lambda: checkpoint.clear(staging))
            dist.barrier(group=control_group())
            raise checkpoint.CheckpointWriteError(final, outcome[0], checkpoint.list_checkpoints(self.run_dir))

    def _maybe_resume(self, *, rewind: bool = True) -> None:
        path = checkpoint.find_checkpoint(self.cfg.trainer.resume, self.run_dir)
        if path is None:
            if self.is_driver and self.cfg.trainer.resume == "auto":
                self.driver.console_print(f"trainer.resume=auto: no checkpoint in {self.run_dir}; from step 0")
            return
        state = checkpoint.load_trainer_state(path)
        checkpoint.load_policies(path, self.cfg.policies, self.workers, self.wgs)  # at this run's layout
        for name, worker in self.workers.items():
            worker.num_updates = state["num_updates"][name]
            worker.scheduler.step(increment=state.get("lr_steps", {}).get(name, 0))  # the schedule's position
        self.step = state["step"]
        self.stop_reason = state.get("stop_reason", "")
        # sync_all_weights stamps version + 1: start one below so engines carry the saved versions
        self.versions = {name: state["versions"].get(name, 1) - 1 for name in self.cfg.policies}  # pushed at start-up
        if not checkpoint.load_rng(path, self.rank):  # saved with fewer ranks
            checkpoint.seed_everything(self.cfg.trainer.seed + 1_000_003 * self.step + self.rank)
        if self.is_driver and not rewind:  # evaluate_only: nothing of the run is continued here
            self.driver.console_print(f"loaded {path} (step {self.step})")
        elif self.is_driver:
            self.driver.load_state_dict(state["driver"])
            checkpoint.rewind_run_dir(self.run_dir, self.step)  # later metrics lines are logged again
            self.driver.console_print(f"resumed from {path} at step {self.step}")

    def close(self) -> None:
        if self.peers is not None:  # the ranks leave from here: exits, not losses
            self.peers.stop()
        if self.is_driver:
            self.driver.close()
        self.progress.close()
        self._wait_for_driver("shutting down engines and plotting")
        for replicas in self.replicas.values():
            replicas.close()
        if self.fleet is not None:
            # every rank has released its transfer groups before any rank stops its servers: a release
            # reaching a server in shutdown answers 500 (its engine core rejects the call)
            dist.barrier(group=control_group())
            self.fleet.close()
        dist.barrier(group=control_group())
