"""Rollout schedules: when episodes run relative to training, one class per ``trainer.mode``.

The trainer's loop is the same in every mode (next batch -> update -> push the weights of the
policies that are due); ``SCHEDULES[trainer.mode]`` decides where the next batch comes from and what
a weight push must wait for. ``sync``: roll out the step's tasks, nothing runs while training (0
versions stale). ``one_step_off``: step k+1's rollout runs on the current weights while step k
trains (exactly 1 version stale). ``fully_async``: a ``GroupProducer`` keeps episodes in flight a
group at a time into a bounded ``GroupBuffer``; a batch is handed out once ``rollout.num_tasks``
fresh groups are ready, weights are pushed every ``trainer.sync_every`` updates (in-flight episodes
drained, or paused with ``trainer.partial_rollout``). Groups more than ``trainer.max_staleness``
versions behind are dropped and counted. ``state_dict`` saves what the rollout side owns at a step
boundary, so a resumed run continues as the saving run would have. Overlapping modes lower the GIL
switch interval while they run. Details (buffer sizing, checkpoints, the GIL, the utilisation
metrics): docs/design-notes.md, "megamarl/driver/schedules.py".
"""

from __future__ import annotations

import abc
import concurrent.futures
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from megamarl.config import AlgorithmConfig, RunConfig, TrainerConfig
from megamarl.driver.streaming import (
    BusyClock,
    EpisodeGroup,
    EpisodeSource,
    GroupBuffer,
    GroupProducer,
    RolloutLoop,
    StalenessStats,
    group_samples,
    split_fresh,
)
from megamarl.orchestration.episodes import EpisodeStats, RolloutResult
from megamarl.registry import Registry
from megamarl.rl.advantages import ADVANTAGE_ESTIMATORS

GIL_SWITCH_INTERVAL_S = 0.0005  # while rollout overlaps training (why: design-notes, driver/schedules.py)


def policy_separable(algo: AlgorithmConfig) -> bool:
    """True when no advantage, reward-shaping or dynamic-sampling group can mix two policies, so a
    policy's batch may be formed from its own samples alone. Advantages and dynamic sampling both
    group by the estimator's key (``EstimatorTraits.key``); its registered traits answer."""
    return ADVANTAGE_ESTIMATORS.traits(algo.estimator, key="algorithm.estimator").policy_separable(
        algo.group_by
    )


class Schedule(abc.ABC):
    """Driver-side: hands out training batches and brackets weight pushes (see module docstring)."""

    def __init__(self, cfg: RunConfig, source: EpisodeSource, loop: RolloutLoop) -> None:
        self.cfg, self.source, self.loop = cfg, source, loop
        self.overlaps_training = SCHEDULES.traits(cfg.trainer.mode, key="trainer.mode").overlaps_training
        self._switch_interval = sys.getswitchinterval()
        if self.overlaps_training:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.max_staleness = cfg.trainer.max_staleness
        self.clock = BusyClock()
        self._mark: float | None = None  # start of the current step's interval
        self._busy_mark = 0.0
        self._wait_s = 0.0  # trainer waiting for rollout data in this interval
        self._sync_s = 0.0  # weight pushes (with drain/pause) in this interval

    @classmethod
    def sync_interval(cls, trainer: TrainerConfig) -> int:
        """Updates of a policy between two weight pushes (the same on every rank)."""
        return 1

    def describe(self) -> str:
        t, a = self.cfg.trainer, self.cfg.algorithm
        text = f"trainer.mode={t.mode}, max_staleness={t.max_staleness}"
        if self.overlaps_training and not a.mismatch.enabled:
            text += (
                " (every algorithm.mismatch level off: stale samples get no importance-sampling correction)"
            )
        return text

    # -- batches ---------------------------------------------------------------------------------
    def next_rollout(self, step: int, versions: Mapping[str, int]) -> tuple[RolloutResult, dict[str, float]]:
        """Block until the next batch's groups are ready; ``versions`` are the trainer's current
        weight versions of the trainable policies. Returns the fresh samples (with the episodes to
        report) and the staleness metrics of this batch."""
        start = time.perf_counter()
        if self._mark is None:
            self._mark, self._busy_mark = start, self.clock.busy_seconds()
        groups, episodes, stats, metrics = self._next(step, versions)
        fresh, stale = split_fresh(groups, versions, self.max_staleness)
        stats.record_dropped(stale)
        stats.record_trained(fresh, versions)
        if max(stats.histogram, default=0) > self.max_staleness:  # split_fresh guarantees it
            raise RuntimeError(
                f"staleness {max(stats.histogram)} > trainer.max_staleness={self.max_staleness}"
            )
        self._wait_s += time.perf_counter() - start
        samples = [s for group in fresh for s in group.samples]
        return RolloutResult(samples, list(episodes)), {**stats.metrics(), **metrics}

    @abc.abstractmethod
    def _next(
        self,
        step: int,
        versions: Mapping[str, int],
    ) -> tuple[list[EpisodeGroup], list[EpisodeStats], StalenessStats, dict[str, float]]:
        """(groups, episodes to report, drops already made, extra metrics) of the next batch."""

    async def _rollout_chunk(self, index: int) -> RolloutResult:
        tasks, seed = self.source.task_chunk(index)
        num_episodes = len(tasks) * self.cfg.rollout.group_size
        self.clock.enter(num_episodes)
        try:
            return await self.source.episodes(tasks, group_size=self.cfg.rollout.group_size, seed=seed)
        finally:
            self.clock.exit(num_episodes)

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a resumed run needs to hand out the same next batches (design-notes, schedules.py);
        called by the driver at a step boundary, after the step's weight push."""
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 - optional hook, a no-op unless the schedule keeps state
        pass

    # -- weight pushes ---------------------------------------------------------------------------
    @contextmanager
    def weight_update(self) -> Iterator[None]:
        """Bracket a weight push into the engines (driver side)."""
        start = time.perf_counter()
        waited = self._before_update()
        self.clock.suspend()
        try:
            yield
        finally:
            self.clock.resume()
            self._after_update()
            self._wait_s += waited
            self._sync_s += time.perf_counter() - start - waited

    def _before_update(self) -> float:
        """Make the engines safe to update; returns seconds spent waiting for rollout data."""
        return 0.0

    def _after_update(self) -> None:  # noqa: B027 - optional hook, a no-op unless the schedule keeps state
        pass

    # -- utilisation -----------------------------------------------------------------------------
    def interval_metrics(self) -> dict[str, float]:
        """Utilisation since this step's batch was requested; call once per step (when logging)."""
        if self._mark is None:
            return {}
        wall = max(time.perf_counter() - self._mark, 1e-9)
        busy = self.clock.busy_seconds() - self._busy_mark
        out = {
            "async/rollout_idle_ratio": min(max(1.0 - busy / wall, 0.0), 1.0),
            "async/trainer_idle_ratio": min(self._wait_s / wall, 1.0),
            "async/weight_sync_bubble_s": self._sync_s,
            "async/weight_sync_bubble_ratio": min(self._sync_s / wall, 1.0),
        }
        self._mark, self._wait_s, self._sync_s = None, 0.0, 0.0
        return out

    def close(self) -> None:
        sys.setswitchinterval(self._switch_interval)


@dataclass(frozen=True)
class ScheduleTraits:
    """``overlaps_training``: rollout runs while the trainer trains (samples arrive off-policy);
    ``min_staleness``: the smallest ``trainer.max_staleness`` that does not drop every sample the
    schedule produces (checked when the config loads)."""

    overlaps_training: bool = False
    min_staleness: int = 0


SCHEDULES: Registry[type[Schedule]] = Registry(
    "trainer mode",
    traits=ScheduleTraits,
    signature="class(Schedule); cls(cfg: RunConfig, source: EpisodeSource, loop: RolloutLoop); "
    "next_rollout(step, versions)",
    keys=("trainer.mode",),
)


def build_schedule(cfg: RunConfig, source: EpisodeSource, loop: RolloutLoop) -> Schedule:
    return SCHEDULES.get(cfg.trainer.mode, key="trainer.mode")(cfg, source, loop)


def sync_interval(trainer: TrainerConfig) -> int:
    return SCHEDULES.get(trainer.mode, key="trainer.mode").sync_interval(trainer)


def overlaps_training(trainer: TrainerConfig) -> bool:
    """``trainer.mode``'s schedule rolls out while the trainer trains: what the memory plan is told
    (``planning.dryrun.plan_memory``: the planner sits below the driver and takes it as a parameter)."""
    return SCHEDULES.traits(trainer.mode, key="trainer.mode").overlaps_training


@SCHEDULES.register("sync", traits=ScheduleTraits())
class SyncSchedule(Schedule):
    def _next(self, step, versions):
        result = self.loop.run(self._rollout_chunk(step))
        return group_samples(result.samples), result.episodes, StalenessStats(), {}


@SCHEDULES.register("one_step_off", traits=ScheduleTraits(overlaps_training=True, min_staleness=1))
class OneStepOffSchedule(Schedule):
    def __init__(self, cfg: RunConfig, source: EpisodeSource, loop: RolloutLoop) -> None:
        super().__init__(cfg, source, loop)
        self._pending: concurrent.futures.Future | None = None  # the rollout of the next step
        self._pending_chunk = -1  # its task chunk (= the step that trains it)

    def _next(self, step, versions):
        if self._pending is None or self._pending_chunk != step:  # first step: nothing prefetched
            self._pending, self._pending_chunk = self.loop.submit(self._rollout_chunk(step)), step
        result = self._pending.result()
        more = step + 1 < self.cfg.trainer.total_steps
        self._pending = self.loop.submit(self._rollout_chunk(step + 1)) if more else None
        self._pending_chunk = step + 1
        return group_samples(result.samples), result.episodes, StalenessStats(), {}

    def state_dict(self) -> dict:
        """The prefetched rollout, finished (the weight push already waited for it). A prefetch that
        failed is not saved: the resumed step rolls its chunk out again and meets the error itself."""
        if self._pending is None:
            return {"prefetched": None}
        concurrent.futures.wait([self._pending])
        ok = not self._pending.cancelled() and self._pending.exception() is None
        return {
            "prefetched": {"chunk": self._pending_chunk, "result": self._pending.result()} if ok else None
        }

    def load_state_dict(self, state: dict) -> None:
        if state["prefetched"] is not None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(state["prefetched"]["result"])
            self._pending, self._pending_chunk = done, state["prefetched"]["chunk"]

    def _before_update(self) -> float:
        start = time.perf_counter()
        if self._pending is not None:
            concurrent.futures.wait([self._pending])  # its samples must all carry the old version
        return time.perf_counter() - start

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        super().close()


@SCHEDULES.register("fully_async", traits=ScheduleTraits(overlaps_training=True, min_staleness=1))
class FullyAsyncSchedule(Schedule):
    def __init__(self, cfg: RunConfig, source: EpisodeSource, loop: RolloutLoop) -> None:
        super().__init__(cfg, source, loop)
        r, t = cfg.rollout, cfg.trainer
        self.partial = t.partial_rollout
        self.buffer = GroupBuffer(
            groups_per_batch=r.num_tasks,
            capacity=max(1, t.max_staleness) * t.sync_every * r.num_tasks,
            per_policy=all(policy_separable(algo) for algo in cfg.policy_algorithms().values()),
        )
        self.producer = GroupProducer(
            source,
            loop,
            self.buffer,
            self.clock,
            group_size=r.group_size,
            max_concurrency=r.max_concurrency,
        )

    @classmethod
    def sync_interval(cls, trainer: TrainerConfig) -> int:
        return trainer.sync_every

    def describe(self) -> str:
        t = self.cfg.trainer
        return (
            f"{super().describe()}, sync_every={t.sync_every}, partial_rollout={t.partial_rollout}, "
            f"buffer capacity {self.buffer.capacity} groups, "
            f"{'per-policy' if self.buffer.per_policy else 'joint'} batches"
        )

    def _next(self, step, versions):
        self.producer.start(first_chunk=step)
        parts, episodes, dropped = self.buffer.take(versions, self.max_staleness)
        if step + 1 >= self.cfg.trainer.total_steps:
            self.producer.stop()  # the last batch: episodes still running would never be trained on
        metrics = {
            "async/queue_depth": float(self.buffer.last_depth),
            "async/in_flight_groups": float(self.buffer.last_in_flight),
            "async/num_policies_updated": float(len({s.policy for p in parts for s in p.samples})),
        }
        return parts, episodes, dropped, metrics

    def state_dict(self) -> dict:
        """Drain, then snapshot buffer and cursor (design-notes, schedules.py, says why draining)."""
        held = self.producer.running
        if held:
            self.producer.hold()
            self.buffer.wait_idle()
        try:
            return {"buffer": self.buffer.state_dict(), "producer": self.producer.state_dict()}
        finally:
            if held:
                self.producer.release()

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.producer.load_state_dict(state["producer"])

    def _before_update(self) -> float:
        if not self.partial and self.producer.running:
            self.producer.hold()
            self.buffer.wait_idle()  # in-flight groups finish on the old weights
        return 0.0

    def _after_update(self) -> None:
        if not self.partial:
            self.producer.release()

    def close(self) -> None:
        self.producer.stop()
        super().close()


def check_trainer(trainer: TrainerConfig) -> None:
    """Load time: ``trainer.mode`` is a registered schedule; ``trainer.max_staleness`` reaches its minimum."""
    schedule = SCHEDULES.traits(trainer.mode, key="trainer.mode")
    if trainer.max_staleness < schedule.min_staleness:
        raise ValueError(
            f"trainer.max_staleness must be >= {schedule.min_staleness} with trainer.mode={trainer.mode} "
            "(less would drop every sample generated while the trainer trains)"
        )
