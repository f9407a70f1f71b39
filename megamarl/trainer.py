"""The training loop: rollout -> advantages -> update each policy -> sync weights -> save/log/eval.

SPMD under torchrun: every rank runs ``Trainer.fit`` over the parts ``megamarl.run.build_run`` built.
Rank 0 is also the *driver* (``RolloutDriver``): it runs the episodes, turns them into the training
batch, plans every policy's update (``rl.dispatch``) and logs; each rank receives its own share over
the CPU control group. The loop runs the phases of ``megamarl.planning.phases`` in order (the list
the dry-run prices): what sleeps, wakes, moves to host memory and is pushed when is decided there.
Components answer "is it due": the weight versions (pushes), the checkpointer (saves), the evaluator.
``Trainer.evaluate_only`` is ``scripts/evaluate.py``'s loop: the same start-up, one evaluation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist

from megamarl.config import RunConfig
from megamarl.driver.rollout_driver import RolloutDriver
from megamarl.errors import NumericalFaultError
from megamarl.parallel.collectives import scatter_objects
from megamarl.parallel.distributed import control_group, wait_for_driver
from megamarl.parallel.hardware import release_cached_memory
from megamarl.planning.phases import Phase
from megamarl.rl.dispatch import RankBatch, rank_batches
from megamarl.rl.offload import offload_train_states, restore_train_states
from megamarl.rl.update_metrics import skipped_updates
from megamarl.rollout.engine_placement import ReplicaPlacement
from megamarl.run import DRIVER, Run, build_run
from megamarl.runtime import step_metrics
from megamarl.runtime.preemption import PreemptionFlag


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        *,
        run_dir: str | Path | None = None,
        eval_only: bool = False,
        plan: dict[str, list[ReplicaPlacement]] | None = None,
        run: Run | None = None,
    ):
        """``eval_only``: the run directory is an evaluation's: a resumed checkpoint's weights are
        loaded and pushed, nothing of its run is continued. ``run``: the parts, when already built."""
        self.cfg, self.run = cfg, run if run is not None else build_run(cfg, plan, run_dir=run_dir)
        self.run_dir, self.driver = self.run.run_dir, self.run.driver
        self.is_driver = self.driver is not None
        self.workers, self.phases, self.say = self.run.workers, self.run.phases, self.run.say
        self.actions = self._actions()
        self._pending: dict[str, float] = {}  # this rank's offload/restore metrics, sent with the update's
        self._received: RankBatch | None = None  # this step's batch (None before the first rollout)
        self._metrics: dict[str, float] = {}  # this step's metrics so far
        self._resynced: dict[str, float] = {}  # the re-sync phase's metrics, logged with the rollout's
        self._step_start = 0.0
        self._evaluate_only: int | None = None  # evaluate_only's label (-1: the checkpoint's step)
        self._eval_results: dict[str, float] = {}
        self.memory = step_metrics.ResidentMemory()  # this rank's memory/... metrics, one window a step
        for replicas in self.run.replicas.values():
            replicas.register_adapters()
        # stop_reason: eval.stop_at was reached (the loop ends after the step's checkpoint)
        self.step, self.stop_reason = self.run.checkpointer.load(rewind=not eval_only) or (0, "")

    def fit(self) -> None:
        """Start-up phases (the weights into the engines, the step-0 evaluation), then each step's
        phases; a run that stops (``eval.stop_at``, preemption) saves in the final-save phases."""
        with self.run.release_on_error():
            self.run.progress.start_at(self.step)
            if self.stop_reason:
                self.say(f"resumed a run that stopped at step {self.step}: {self.stop_reason}; nothing to do")
            else:
                self.run_phases(self.phases.start)
            preemption = PreemptionFlag()
            while self.step < self.cfg.trainer.total_steps and not self.stop_reason:
                self.run_phases(self.phases.step)
                preempted = preemption.agreed(control_group())  # every rank, same step (runtime.preemption)
                # the checkpoint of a run that stops carries its stop reason (a cadence save is rewritten)
                if self.stop_reason or (preempted and self.run.checkpointer.saved_step != self.step):
                    self.run_phases(self.phases.final_save)
                if preempted:
                    requeue = self.is_driver and not self.stop_reason
                    self.say(preemption.stopped(self.run_dir, step=self.step, requeue=requeue))
                    break
                if self.stop_reason:
                    self.say(f"stopping at step {self.step}: {self.stop_reason} (saved)")
            preemption.uninstall()
            self.close()
            self.say(self.run.closing_line(self.step))  # how long, and where its files are

    def run_phases(self, phases: Iterable[Phase]) -> None:
        """Run each phase's action in order (``self.actions``: the phase list's seam)."""
        for phase in phases:
            self.actions[phase.action]()

    def _actions(self) -> dict[str, Callable[[], object]]:  # what an action returns is not read
        """What each phase action of ``megamarl.planning.phases`` does here."""
        run, total = self.run, self.cfg.trainer.total_steps
        return {
            "wake_weights": lambda: self._wake(("weights",)),
            "push_all": lambda: run.pushes.push(list(self.cfg.policies), start_up=True),
            "push": self._push_phase,
            "resync": self._resync_phase,
            "save": lambda: run.checkpointer.save(
                self.step, last=self.step == total, stop_reason=self.stop_reason, line=self._line()
            ),
            "final_save": lambda: run.checkpointer.save(self.step, last=True, stop_reason=self.stop_reason),
            "offload": self._offload_phase,
            "wake_kv": self._wake_kv_phase,
            "evaluate": self._evaluate_phase,
            "rollout": self._rollout_phase,
            "sleep": self._sleep_phase,
            "restore": lambda: self._pending.update(restore_train_states(self.workers, run.offloaded)),
            "train": self._train_phase,
            "release": lambda: release_cached_memory(),  # looked up when called (a test spies on it)
        }

    def _resync_phase(self) -> None:
        """The step's clock starts; replicas restarted since the last push get the current weights now,
        of policies whose train state never left the device (the others in the push phase)."""
        self._step_start = time.perf_counter()
        self._resynced = self.run.pushes.resync_restarted(skip=self.run.offloaded_anywhere)

    def _rollout_phase(self) -> None:
        self._received, self._metrics = self.rollout_and_prepare()
        self._metrics.update(self._resynced)

    def _sleep_phase(self) -> None:
        """Collective: no rank restores its train state before the sleeping replicas' memory is free."""
        for replicas in self.run.replicas.values() if self.is_driver else ():
            replicas.sleep()
        self._wait_for_driver("the engines' sleep")

    def _train_phase(self) -> None:
        self._metrics.update(self.update(cast(RankBatch, self._received), self._pending))
        self._pending = {}
        self.step += 1

    def _push_phase(self) -> None:
        """The due pushes, the re-sync of restarted replicas (train state resident, engine weights
        awake), the opponent-pool snapshot."""
        self._metrics.update(self.run.pushes.push(self.run.versions.due()))
        self._metrics.update(self.run.pushes.resync_restarted())
        self._metrics.update(self.run.pushes.snapshot(self.step))

    def _offload_phase(self) -> None:
        """This rank's offloaded train states to host memory (``rl.offload``), the allocator's cached
        blocks released; every rank done before the driver wakes the KV caches."""
        self._pending.update(offload_train_states(self.workers, self.run.offloaded))
        release_cached_memory()
        dist.barrier(group=control_group())

    def _wake(self, parts: tuple[str, ...]) -> None:
        """On the driver: wake these parts (``weights``, ``kv_cache``) of replicas that sleep."""
        for replicas in self.run.replicas.values() if self.is_driver else ():
            replicas.wake(parts)

    def _wake_kv_phase(self) -> None:
        """The KV caches back, then the probes of this step's pushes (``engine.verify_sync``; collective)."""
        self._wake(("kv_cache",))
        for replicas in self.run.replicas.values():
            self._metrics.update(replicas.verify_pushed())

    def _evaluate_phase(self) -> None:
        """At start-up: the step-0 evaluation (``evaluate_only``: its one evaluation). After a step:
        its metrics logged, then the evaluation when due (which may stop the run)."""
        evaluator = self.run.evaluator
        if self._evaluate_only is not None:
            self.step = self.step if self._evaluate_only < 0 else self._evaluate_only
            self._eval_results = evaluator.evaluate(self.step)
        elif self._received is None:
            if self.step == 0:
                evaluator.stop_reason(self.step)
        else:
            self._metrics = self._line()
            self.run.progress.step_done(self.step, self._metrics["timing_s/step"])
            if self.is_driver:
                cast(RolloutDriver, self.driver).log(self.step, self._metrics)
            if evaluator.due(self.step):
                self.stop_reason = evaluator.stop_reason(self.step)

    def _line(self) -> dict[str, float]:
        """This step's metrics line as it stands: its metrics so far and its time up to now."""
        step_s, summary = time.perf_counter() - self._step_start, cast(RankBatch, self._received).summary
        return {
            **self._metrics,
            **step_metrics.step_end_metrics(self._metrics, step_s=step_s, summary=summary),
        }

    def rollout_and_prepare(self) -> tuple[RankBatch, dict[str, float]]:
        """The driver takes the next batch from its schedule (trainer.mode) and computes advantages;
        each rank receives only its WGs' DP shares and the batch's summary (``rl.dispatch``)."""
        metrics: dict[str, float]
        payloads, metrics, run = None, {}, self.run
        if self.is_driver:
            batch, metrics = cast(RolloutDriver, self.driver).collect(self.step, run.versions.serving())
            layouts = {name: wg.layout for name, wg in run.wgs.items()}
            payloads = rank_batches(batch, run.splits, layouts, world_size=run.world_size)
        self._wait_for_driver(f"the rollout of step {self.step + 1}")
        received, num_bytes = scatter_objects(payloads, src=DRIVER, group=control_group())
        metrics.update(
            {"perf/batch_bytes_per_rank": max(num_bytes), "perf/batch_bytes_total": sum(num_bytes)}
        )
        return received, metrics

    def update(self, received: RankBatch, pending: dict[str, float] | None = None) -> dict[str, float]:
        """Each of this rank's workers trains on its share; every rank counts the updates of every
        policy that had data (the summary is the same everywhere). ``pending``: this rank's metrics
        of the offload and restore phases since the last update, gathered with the update's."""
        start = time.perf_counter()
        metrics: dict[str, float] = dict(pending or {})
        self.run.versions.trained(received.summary.trained_policies, received.summary.stepped_adapters)
        with self.run.progress.phase("train", unit="micro-batches") as phase:
            for name, share in received.shares.items():
                self.workers[name].on_micro_batch = phase.advance
                metrics.update(
                    step_metrics.policy_update_metrics(name, self.workers[name].train_share(share))
                )
        metrics.update(self.memory.step_metrics(self.run.rank, policies=received.shares))
        faults = {name: w.last_fault for name, w in self.workers.items() if w.skip_streak}
        gathered: list[Any] = [None] * self.run.world_size  # each rank's (metrics, faults)
        dist.all_gather_object(gathered, (metrics, faults), group=control_group())
        merged = step_metrics.merge_rank_metrics([rank_metrics for rank_metrics, _ in gathered])
        merged["timing_s/update"] = time.perf_counter() - start
        # on every rank (the metrics are the same), before anything of this step is pushed or saved
        faults = {k: v for _, rank_faults in gathered for k, v in rank_faults.items()}
        limit = self.cfg.trainer.max_nonfinite_updates
        notes, fatal = skipped_updates(merged, faults, step=self.step + 1, limit=limit)
        for note in notes:
            self.say(note)
        if fatal:
            raise NumericalFaultError(f"{fatal}; {self.run.checkpointer.last_complete()}")
        return merged

    def evaluate_only(self, *, step: int | None = None) -> dict[str, float]:
        """One evaluation without training (``scripts/evaluate.py``) after ``fit``'s start-up phases, then
        shut down; labelled ``step`` (default: the checkpoint's). Results on the driver, {} elsewhere."""
        with self.run.release_on_error():
            self._evaluate_only = -1 if step is None else step
            self.run_phases(self.phases.start)
            self.close()
        return self._eval_results

    def _wait_for_driver(self, what: str) -> None:
        wait_for_driver(what, driver=DRIVER, timeout_s=self.cfg.trainer.collective_timeout_s)

    def close(self) -> None:
        self.run.close()
