"""Machinery of rollout that runs beside training on the driver: a persistent event loop, episode
groups and their staleness, a bounded buffer of finished groups, and a streaming group producer.

Unlike a synchronous loop (``asyncio.run`` per batch), every engine call runs on one ``RolloutLoop``
(an asyncio loop on a daemon thread), so rollout proceeds while the main thread trains. The unit
streamed is an ``EpisodeGroup`` (all ``group_size`` episodes of one task): a group is never split
across two training batches, so group-relative advantages stay valid. A weight version is one push of
a policy's weights (``EnginePushes.push``); every ``Sample`` carries the version that generated it and
a group's staleness is ``max over its samples of versions[sample.policy] - sample.weight_version``
(an L2 agent's sample: its adapter's version, ``versions["<policy>/<agent>"]``, ``behind``).
Groups beyond ``trainer.max_staleness`` are dropped and counted, never trained on.
Details: docs/design-notes.md, "megamarl/driver/streaming.py".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, cast

from megamarl.errors import RunStoppedError
from megamarl.orchestration.env import Task
from megamarl.orchestration.episodes import EpisodeStats, RolloutResult
from megamarl.rl.sample import Sample


class EpisodeSource(Protocol):
    """What a schedule needs from the driver (``RolloutDriver`` implements it)."""

    def task_chunk(self, index: int) -> tuple[list[Task], int]:
        """The ``index``-th chunk of ``rollout.num_tasks`` training tasks and its sampling seed."""

    def episodes(self, tasks: Sequence[Task], *, group_size: int, seed: int) -> Awaitable[RolloutResult]:
        """Run ``group_size`` episodes of every task (a coroutine for the rollout loop)."""


# --------------------------------------------------------------------------------------------
# the driver's event loop


class RolloutLoop:
    """An asyncio loop running forever on a daemon thread; ``run``/``submit`` hand it coroutines."""

    def __init__(self, name: str = "megamarl-rollout") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule ``coro`` on the loop; the returned future is waitable from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine, timeout: float | None = None):
        """Run ``coro`` on the loop and wait for its result (never call this from the loop thread)."""
        return self.submit(coro).result(timeout)

    def call(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the loop thread and wait until it ran (orders it against loop code)."""

        async def _call():
            fn()

        self.run(_call())

    def close(self, timeout: float = 30.0) -> None:
        """Cancel every task on the loop, stop it and join its thread. Idempotent."""
        if self._closed:
            return
        self._closed = True

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_default_executor()

        try:
            self.run(_cancel_all(), timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self.loop.close()


class BusyClock:
    """Seconds during which at least one rollout episode was in flight and not suspended.

    Thread-safe: episodes enter/exit on the rollout loop, the trainer suspends it around a weight
    update (episodes held at a paused engine are waiting, not generating).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._suspended = False
        self._since: float | None = None  # start of the current busy stretch
        self._busy = 0.0

    def _settle(self, now: float) -> None:
        if self._since is not None:
            self._busy += now - self._since
        running = self._active > 0 and not self._suspended
        self._since = now if running else None

    def _change(self, *, active: int = 0, suspended: bool | None = None) -> None:
        with self._lock:
            now = time.perf_counter()
            self._settle(now)  # close the stretch under the old state...
            self._active += active
            if suspended is not None:
                self._suspended = suspended
            self._settle(now)  # ...and open one under the new state

    def enter(self, n: int = 1) -> None:
        self._change(active=n)

    def exit(self, n: int = 1) -> None:
        self._change(active=-n)

    def suspend(self) -> None:
        self._change(suspended=True)

    def resume(self) -> None:
        self._change(suspended=False)

    @property
    def active(self) -> int:
        return self._active

    def busy_seconds(self) -> float:
        with self._lock:
            self._settle(time.perf_counter())
            return self._busy


# --------------------------------------------------------------------------------------------
# groups and staleness


@dataclass
class EpisodeGroup:
    """The samples of all episodes of one task (or one policy's share of them). ``seq``: admission
    order (fully_async), so a batch lists its groups in the same order however they finished."""

    task_id: str
    samples: list[Sample]
    seq: int = 0

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    def staleness(self, versions: Mapping[str, int]) -> int:
        """Versions behind ``versions`` of the stalest sample; policies missing from ``versions``
        (frozen ones, never trained) count 0."""
        return max((lag for s in self.samples if (lag := behind(versions, s)) is not None), default=0)

    def by_policy(self) -> dict[str, EpisodeGroup]:
        parts: dict[str, list[Sample]] = {}
        for s in self.samples:
            parts.setdefault(s.policy, []).append(s)
        return {policy: EpisodeGroup(self.task_id, samples, self.seq) for policy, samples in parts.items()}


def behind(versions: Mapping[str, int], sample: Sample) -> int | None:
    """Versions ``sample`` is behind: its L2 adapter's current version (key ``<policy>/<agent>``), else
    its policy's, minus its own; None for a policy missing from ``versions`` (frozen, never trained)."""
    current = versions.get(f"{sample.policy}/{sample.agent}", versions.get(sample.policy))
    return None if current is None else current - sample.weight_version


def group_samples(samples: Iterable[Sample]) -> list[EpisodeGroup]:
    """Samples -> one group per task id, in first-appearance order (sample order kept inside)."""
    groups: dict[str, EpisodeGroup] = {}
    for s in samples:
        groups.setdefault(s.task_id, EpisodeGroup(s.task_id, [])).samples.append(s)
    return list(groups.values())


def split_fresh(
    groups: Iterable[EpisodeGroup],
    versions: Mapping[str, int],
    max_staleness: int,
) -> tuple[list[EpisodeGroup], list[EpisodeGroup]]:
    """``(fresh, stale)``: groups within ``max_staleness`` versions, and the rest (to be dropped)."""
    fresh: list[EpisodeGroup]
    stale: list[EpisodeGroup]
    fresh, stale = [], []
    for group in groups:
        (fresh if group.staleness(versions) <= max_staleness else stale).append(group)
    return fresh, stale


@dataclass
class StalenessStats:
    """Per-sample staleness of trained samples (a histogram) and what was dropped as too stale."""

    per_agent: dict[str, Counter] = field(default_factory=dict)  # agent -> versions behind -> samples
    dropped_groups: int = 0
    dropped_samples: int = 0

    @property
    def histogram(self) -> Counter:
        """Versions behind -> number of trained samples, over every agent."""
        return sum(self.per_agent.values(), Counter())

    def record_trained(self, groups: Iterable[EpisodeGroup], versions: Mapping[str, int]) -> None:
        for group in groups:
            for s in group.samples:
                if (lag := behind(versions, s)) is not None:
                    self.per_agent.setdefault(s.agent, Counter())[lag] += 1

    def record_dropped(self, groups: Iterable[EpisodeGroup]) -> None:
        for group in groups:
            self.dropped_groups += 1
            self.dropped_samples += group.num_samples

    def metrics(self, prefix: str = "async/") -> dict[str, float]:
        histogram = self.histogram
        num = sum(histogram.values())
        out = {f"{prefix}staleness/{k}": float(v) for k, v in sorted(histogram.items())}
        out[f"{prefix}staleness_max"] = float(max(histogram, default=0))
        out[f"{prefix}staleness_mean"] = sum(k * v for k, v in histogram.items()) / max(num, 1)
        out[f"{prefix}dropped_stale_groups"] = float(self.dropped_groups)
        out[f"{prefix}dropped_stale_samples"] = float(self.dropped_samples)
        for agent, histogram in sorted(self.per_agent.items()):
            at = f"{prefix}agent/{agent}/"
            out.update({f"{at}staleness/{k}": float(v) for k, v in sorted(histogram.items())})
            out[f"{at}staleness_mean"] = sum(k * v for k, v in histogram.items()) / sum(histogram.values())
        return out


# --------------------------------------------------------------------------------------------
# the bounded buffer between the producer (rollout loop) and the trainer (main thread)

JOINT = "*"  # the single buffer key when groups are not split by policy


class GroupBuffer:
    """Finished groups waiting for the trainer; the producer thread puts, the trainer takes.

    Keyed by policy when ``per_policy`` (each policy's share of a group queues on its own, and a
    policy is ready as soon as *its* queue holds ``groups_per_batch`` parts), else one joint queue.
    Bounded: a new group may start only while ``groups in flight + longest queue < capacity``; a
    queue at capacity therefore always holds a full batch, so the bound cannot deadlock. ``take``
    drops parts beyond the staleness bound before testing readiness, so a trainer never receives
    a stale sample however long a part waited.
    """

    def __init__(self, *, groups_per_batch: int, capacity: int, per_policy: bool) -> None:
        if groups_per_batch < 1:
            raise ValueError(f"groups_per_batch must be >= 1, got {groups_per_batch}")
        if capacity < groups_per_batch:
            raise ValueError(f"buffer capacity {capacity} < groups_per_batch {groups_per_batch}")
        self.groups_per_batch, self.capacity, self.per_policy = groups_per_batch, capacity, per_policy
        self._cond = threading.Condition()
        self._queues: dict[str, deque[EpisodeGroup]] = {}
        self._episodes: list[
            tuple[int, EpisodeStats]
        ] = []  # (group seq, episode) finished since the last take
        self._in_flight = 0
        self._error: BaseException | None = None
        self.last_depth = 0  # longest queue when the last batch was formed
        self.last_in_flight = 0  # groups running when the last batch was formed
        self.peak_occupancy = 0  # max of (groups in flight + longest queue) ever seen: <= capacity
        self._dropped = StalenessStats()  # stale parts removed since the last take
        self.on_space: Callable[[], None] = lambda: None  # wakes the producer (any thread)

    # -- producer side ---------------------------------------------------------------------------
    def has_space(self) -> bool:
        with self._cond:
            longest = max((len(q) for q in self._queues.values()), default=0)
            return self._in_flight + longest < self.capacity

    def start_group(self) -> None:
        with self._cond:
            self._in_flight += 1
            self._note_occupancy()

    def _note_occupancy(self) -> None:
        longest = max((len(q) for q in self._queues.values()), default=0)
        self.peak_occupancy = max(self.peak_occupancy, self._in_flight + longest)

    def put(self, group: EpisodeGroup, episodes: Sequence[EpisodeStats]) -> None:
        """A started group finished (``group.samples`` may be empty: all its episodes failed)."""
        parts = group.by_policy() if self.per_policy else ({JOINT: group} if group.samples else {})
        with self._cond:
            self._in_flight -= 1
            self._episodes.extend((group.seq, e) for e in episodes)
            for key, part in parts.items():
                self._queues.setdefault(key, deque()).append(part)
            self._note_occupancy()
            self._cond.notify_all()
        self.on_space()  # an empty group freed a slot

    def abandon(self) -> None:
        """A started group was cancelled (shutdown)."""
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The producer hit an error that must stop training (e.g. a configuration error)."""
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    # -- trainer side ----------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return self._in_flight

    def depth(self) -> int:
        """Parts waiting in the longest queue (= finished groups waiting, when joint)."""
        with self._cond:
            return max((len(q) for q in self._queues.values()), default=0)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no group is in flight (the producer must be held first)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0 or self._error is not None, timeout)

    def take(
        self,
        versions: Mapping[str, int],
        max_staleness: int,
        *,
        timeout: float | None = None,
        poll_s: float = 1.0,
    ) -> tuple[list[EpisodeGroup], list[EpisodeStats], StalenessStats]:
        """Block until some key holds ``groups_per_batch`` fresh parts; pop that many (oldest first)
        of every ready key. Returns (parts, episodes finished since the last take, drops since the
        last take). Raises ``TimeoutError`` after ``timeout`` seconds (None: wait for ever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if isinstance(self._error, RunStoppedError):  # it stops the run with its own exit code
                    raise self._error
                if self._error is not None:
                    raise RuntimeError(f"rollout producer failed: {self._error!r}") from self._error
                if self._drop_stale(versions, max_staleness):
                    self.on_space()
                ready = [k for k, q in self._queues.items() if len(q) >= self.groups_per_batch]
                if ready:
                    break
                left = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
                if left <= 0:
                    raise TimeoutError(f"no batch of {self.groups_per_batch} fresh groups within {timeout} s")
                self._cond.wait(left)
            self.last_depth = max(len(q) for q in self._queues.values())
            self.last_in_flight = self._in_flight
            # oldest finished first decides *which* groups; admission order decides their order in the
            # batch (micro-batch split, summation order), so it does not depend on finishing times
            parts = [
                part
                for k in ready
                for part in sorted(
                    (self._queues[k].popleft() for _ in range(self.groups_per_batch)), key=lambda p: p.seq
                )
            ]
            episodes = [e for _, e in sorted(self._episodes, key=lambda item: item[0])]
            self._episodes = []
            dropped, self._dropped = self._dropped, StalenessStats()
        self.on_space()
        return parts, episodes, dropped

    def state_dict(self) -> dict:
        """The finished groups waiting, the episodes finished since the last take and the drops not yet
        reported (a checkpoint's rollout_state). Only with no group in flight: hold the producer and
        ``wait_idle`` first, so that no admitted group is lost."""
        with self._cond:
            if self._in_flight:
                raise RuntimeError(f"GroupBuffer.state_dict with {self._in_flight} groups in flight")
            return {
                "queues": {k: list(q) for k, q in self._queues.items()},
                "episodes": list(self._episodes),
                "dropped": self._dropped,
                "last_depth": self.last_depth,
                "peak_occupancy": self.peak_occupancy,
            }

    def load_state_dict(self, state: dict) -> None:
        with self._cond:
            self._queues = {k: deque(parts) for k, parts in state["queues"].items()}
            self._episodes = list(state["episodes"])
            self._dropped = state["dropped"]
            self.last_depth, self.peak_occupancy = state["last_depth"], state["peak_occupancy"]

    def _drop_stale(self, versions: Mapping[str, int], max_staleness: int) -> bool:
        """Remove parts beyond the bound from every queue (counted); True if any was removed."""
        removed = False
        for queue in self._queues.values():
            fresh, stale = split_fresh(queue, versions, max_staleness)
            if stale:
                self._dropped.record_dropped(stale)
                queue.clear()
                queue.extend(fresh)
                removed = True
        return removed


# --------------------------------------------------------------------------------------------
# the streaming producer


class GroupProducer:
    """Keeps episode groups running on the rollout loop and puts each finished group in ``buffer``.

    Admission (checked on the loop thread whenever something changes): not held, at most
    ``max_concurrency`` episodes in flight (one group always may run), and ``buffer.has_space()``.
    Tasks come from ``source.task_chunk(first_chunk)``, then the next chunks; each task id gets an
    ``@chunk`` suffix so tasks drawn twice (file-backed envs) never merge into one group.

    The cursor (next chunk, tasks of the current chunk not yet admitted, next admission number) is
    state: ``state_dict`` / ``load_state_dict`` carry it through a checkpoint. Groups cancelled by
    ``stop`` go back to the front of the cursor, so no admitted task is skipped.
    """

    def __init__(
        self,
        source: EpisodeSource,
        loop: RolloutLoop,
        buffer: GroupBuffer,
        clock: BusyClock,
        *,
        group_size: int,
        max_concurrency: int,
    ) -> None:
        self.source, self.loop, self.buffer, self.clock = source, loop, buffer, clock
        self.group_size, self.max_concurrency = group_size, max_concurrency
        self._held = False
        self._stopped = False
        self._wake: asyncio.Event | None = None
        self._future: concurrent.futures.Future | None = None
        self._next_chunk: int | None = None  # None: not started (start() sets it)
        self._pending: deque[tuple[Task, int, int]] = deque()  # (task, seed, seq) of the current chunk
        self._next_seq = 0
        buffer.on_space = self.poke

    @property
    def running(self) -> bool:
        return self._future is not None

    def start(self, first_chunk: int) -> None:
        """Start producing; from ``first_chunk`` unless a cursor was restored (``load_state_dict``)."""
        if self._future is None:
            if self._next_chunk is None:
                self._next_chunk = first_chunk
            self._stopped = False
            self._future = self.loop.submit(self._produce())

    def state_dict(self) -> dict:
        """The cursor; call while held or stopped (no admission can be mid-way)."""
        return {"next_chunk": self._next_chunk, "pending": list(self._pending), "next_seq": self._next_seq}

    def load_state_dict(self, state: dict) -> None:
        if self._future is not None:
            raise RuntimeError("GroupProducer.load_state_dict while running")
        self._next_chunk, self._next_seq = state["next_chunk"], state["next_seq"]
        self._pending = deque(state["pending"])

    def poke(self) -> None:
        """Re-check admission (callable from any thread)."""
        if self._wake is not None and not self.loop.loop.is_closed():
            self.loop.loop.call_soon_threadsafe(self._wake.set)

    def hold(self) -> None:
        """Admit no new group; returns once the loop has seen it (no admission is mid-way)."""
        self.loop.call(lambda: setattr(self, "_held", True))

    def release(self) -> None:
        self._held = False
        self.poke()

    def stop(self) -> None:
        self._stopped = True
        self.poke()
        if self._future is not None:
            try:
                self._future.result(timeout=60)
            except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):
                pass
            self._future = None

    def _may_start(self, num_running: int) -> bool:
        if self._held or self._stopped:
            return False
        fits = num_running == 0 or (num_running + 1) * self.group_size <= self.max_concurrency
        return fits and self.buffer.has_space()

    async def _produce(self) -> None:
        self._wake = asyncio.Event()
        running: dict[asyncio.Task, tuple[Task, int, int]] = {}
        try:
            while not self._stopped:
                self._wake.clear()
                while self._may_start(len(running)):
                    if not self._pending:
                        chunk = self._next_chunk
                        assert chunk is not None  # start() set it
                        tasks, seed = self.source.task_chunk(chunk)
                        for t in tasks:
                            self._pending.append(
                                (replace(t, task_id=f"{t.task_id}@{chunk}"), seed, self._next_seq)
                            )
                            self._next_seq += 1
                        self._next_chunk = chunk + 1
                    entry = self._pending.popleft()
                    self.buffer.start_group()  # before any await: hold() then sees it in flight
                    job = asyncio.ensure_future(self._run_group(*entry))
                    running[job] = entry
                    job.add_done_callback(lambda j: running.pop(j, None))
                    job.add_done_callback(lambda _: cast(asyncio.Event, self._wake).set())  # set above
                await self._wake.wait()
        finally:
            jobs = dict(running)
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            cancelled = sorted((entry for job, entry in jobs.items() if job.cancelled()), key=lambda e: e[2])
            self._pending.extendleft(
                reversed(cancelled)
            )  # regenerated (from their seeds) if production resumes

    async def _run_group(self, task: Task, seed: int, seq: int) -> None:
        self.clock.enter(self.group_size)
        try:
            result = await self.source.episodes([task], group_size=self.group_size, seed=seed)
        except asyncio.CancelledError:
            self.buffer.abandon()
            raise
        except BaseException as exc:  # run_episodes raises only for config errors
            self.buffer.abandon()
            self.buffer.fail(exc)
            raise
        finally:
            self.clock.exit(self.group_size)
        self.buffer.put(EpisodeGroup(task.task_id, result.samples, seq), result.episodes)
