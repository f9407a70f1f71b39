"""``EnginePool``: several replicas of one policy behind the ``Engine`` protocol.

Routing: the live replica with the fewest requests in flight (ties rotate). A request that raises
``ConnectionError`` on a replica that then fails ``health()`` marks it dead; the request is retried
elsewhere and the replica is rebuilt by ``factory(index)`` in the background, taking traffic again only
once its ``weight_version`` equals the pool's. A failure on a replica that still answers ``health()`` is
retried and the replica stays. A stall watch catches a replica that answers nothing: no answer for
``stall_s`` with requests in flight -> one ``health()`` probe -> dead within ``stall_s + BUSY_PATIENCE_S``.
Weight updates are one barrier over all replicas (stop admitting, pause and drain, tee the stream,
flush caches, resume): no request sees half-updated weights, all replicas share one ``weight_version``.
Details: docs/design-notes.md, "megamarl/rollout/replicas/pool.py".
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch

from megamarl.rollout.engines.base import Engine, Generation, SamplingParams, ServerReplica, ServesAdapters
from megamarl.rollout.engines.batching import AdmissionGate

_DONE = object()
log = logging.getLogger(__name__)


STALL_S = 30.0  # a replica with requests in flight that answered none this long is probed
POLL_S = 1.0  # how often a waiting request checks whether its replica was declared dead


class NoLiveReplicaError(RuntimeError):
    pass


class ReplicaLostError(ConnectionError):
    """The request's replica was declared dead while it waited (the stall watch): it is retried."""


class EnginePool(Engine):
    def __init__(
        self,
        factory: Callable[[int], Engine],
        num_replicas: int,
        *,
        max_attempts: int = 3,
        weights_provider: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
        stall_s: float = STALL_S,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.factory = factory
        self.max_attempts = max_attempts
        self.weights_provider = weights_provider
        self.stall_s = stall_s
        self.replicas: list[Engine] = [factory(i) for i in range(num_replicas)]
        self._answered = [time.monotonic()] * num_replicas  # last answer (or first request after idling)
        self._probing: set[int] = set()  # replicas whose stall probe runs
        self.in_flight = [0] * num_replicas
        self.live = [True] * num_replicas
        self.num_restarts = [0] * num_replicas
        self.served = [0] * num_replicas  # requests answered, per replica (metrics: engine/<policy>/...)
        self.failovers = 0  # requests retried on another replica after theirs died
        self.weight_version = 0
        self._gate = AdmissionGate()
        self._lock = threading.RLock()  # replica table
        self._update_lock = threading.Lock()
        self._restarting: set[int] = set()
        self.restart_errors: list[tuple[int, BaseException]] = []
        self.connection_errors = 0  # requests that raised ConnectionError (each retried), dead replica or not
        self._rotation = itertools.count()
        self.loras: dict[str, str | Path] = {}  # L2 adapters registered with every replica (add_lora)
        self.lora_versions: dict[str, int] = {}  # L2: the version of each adapter's newest directory

    # -- routing ---------------------------------------------------------------------------------

    def _pick(self, exclude: set[int]) -> int:
        with self._lock:
            ready = [
                i
                for i in range(len(self.replicas))
                if self.live[i]
                and i not in exclude
                and self.replicas[i].weight_version == self.weight_version
            ]
            if not ready:
                raise NoLiveReplicaError(
                    f"no live replica at weight_version {self.weight_version} "
                    f"(live={self.live}, restarting={sorted(self._restarting)})"
                )
            start = next(self._rotation)
            ready.sort(key=lambda i: (self.in_flight[i], (i - start) % len(self.replicas)))
            choice = ready[0]
            if self.in_flight[choice] == 0:  # an idle replica's silence so far is no stall
                self._answered[choice] = time.monotonic()
            self.in_flight[choice] += 1
            return choice

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, lora: str | None = None
    ) -> list[Generation]:
        tried: set[int] = set()
        last_error: BaseException | None = None
        for _ in range(self.max_attempts):
            await self._gate.wait()
            try:
                index = self._pick(tried)
            except NoLiveReplicaError:
                if last_error is not None:
                    break
                raise
            replica = self.replicas[index]
            try:
                out = await self._answer(index, replica, replica.generate(prompt_ids, sampling, lora=lora))
                self.served[index] += 1
                if tried:
                    self.failovers += 1
                return out
            except ConnectionError as exc:
                last_error = exc
                self.connection_errors += 1
                if isinstance(exc, ReplicaLostError) or not await asyncio.to_thread(replica.health):
                    tried.add(index)
                    self._mark_dead(index, replica)
            finally:
                with self._lock:
                    self.in_flight[index] -= 1
        raise NoLiveReplicaError(
            f"request failed on replicas {sorted(tried)}: {last_error!r}"
        ) from last_error

    async def _answer(self, index: int, replica: Engine, call) -> list[Generation]:
        """``call``'s result; raises ``ReplicaLostError`` when ``replica`` is declared dead meanwhile (the
        stall watch, or another request's failure), abandoning the call."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=POLL_S)
                if done:
                    with self._lock:
                        self._answered[index] = time.monotonic()
                    return task.result()
                if self.replicas[index] is not replica or not self.live[index]:
                    raise ReplicaLostError(f"replica {index} was declared dead while this request waited")
                self._watch_stall(index, replica)
        finally:
            if not task.done():
                task.cancel()

    def _watch_stall(self, index: int, replica: Engine) -> None:
        """Requests wait on ``replica`` and it answered none for ``stall_s``: probe it once, in a thread."""
        with self._lock:
            if time.monotonic() - self._answered[index] < self.stall_s or index in self._probing:
                return
            self._probing.add(index)

        def probe() -> None:
            try:
                if not replica.health():
                    self._mark_dead(index, replica)
            finally:
                with self._lock:
                    self._answered[index] = time.monotonic()  # the next probe after another stall_s
                    self._probing.discard(index)

        threading.Thread(target=probe, name=f"pool-stall-probe-{index}", daemon=True).start()

    # -- failure handling ------------------------------------------------------------------------

    def _mark_dead(self, index: int, replica: Engine) -> None:
        with self._lock:
            if self.replicas[index] is not replica or index in self._restarting:
                return  # already handled
            self.live[index] = False
            self._restarting.add(index)
        log.warning(
            "engine replica %d is unreachable: out of service until it is rebuilt and re-synced", index
        )
        threading.Thread(target=self._restart, args=(index, replica), daemon=True).start()

    def _restart(self, index: int, dead: Engine) -> None:
        try:
            dead.shutdown()
        except Exception:  # noqa: BLE001, S110 - the replica is already gone
            pass
        try:
            fresh = self.factory(index)
            for name, path in self.loras.items():  # the newest directory of each adapter
                cast(ServerReplica, fresh).add_lora(name, path)  # L2 pools hold server clients
                cast(ServerReplica, fresh).lora_versions[name] = self.lora_versions.get(name, 0)
        except Exception as exc:  # noqa: BLE001 - stays dead; routing skips it, check_health retries
            self.restart_errors.append((index, exc))
            with self._lock:
                self._restarting.discard(index)
            return
        try:
            with self._update_lock:  # no weight update may interleave with the resync
                if self.weight_version != fresh.weight_version and self.weights_provider is not None:
                    fresh.update_weights(self.weights_provider(), version=self.weight_version)
                with self._lock:
                    self.replicas[index] = fresh
                    self.live[index] = True
                    self.num_restarts[index] += 1
        finally:
            with self._lock:
                self._restarting.discard(index)

    def check_health(self) -> list[bool]:
        """Probe every live replica; dead ones are restarted. Returns the health seen."""
        seen = []
        for index, replica in enumerate(list(self.replicas)):
            ok = self.live[index] and replica.health()
            if not ok:
                self._mark_dead(index, replica)
            seen.append(ok)
        return seen

    def wait_restarts(self, timeout_s: float = 300.0) -> None:
        deadline = threading.Event()
        for _ in range(int(timeout_s / 0.05)):
            if not self._restarting:
                return
            deadline.wait(0.05)
        raise TimeoutError(f"replicas {sorted(self._restarting)} still restarting after {timeout_s}s")

    # -- weights ---------------------------------------------------------------------------------

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int, lora: str | None = None
    ) -> None:
        with self._update_lock:
            self._gate.close()
            try:
                targets = [r for i, r in enumerate(self.replicas) if self.live[i]]
                for replica in targets:
                    replica.pause()
                errors = _tee_update(targets, weights, version=version, lora=lora)
                for replica in targets:
                    replica.flush_cache()
                    replica.resume()
                for replica, error in zip(
                    targets, errors, strict=False
                ):  # strict=False: an early failure of _tee_update is one error for all
                    if isinstance(error, ConnectionError):
                        self._mark_dead(self.replicas.index(replica), replica)
                    elif error is not None:
                        raise error
                if lora is None:  # an adapter-only update leaves the base weights' version alone
                    self.weight_version = version
            finally:
                self._gate.open()

    def stale_replicas(self) -> list[int]:
        """Live replicas whose weights are not the pool's (restarted since the last push): they take
        no traffic until a push (``external_update(..., only=...)``) re-synced them."""
        with self._lock:
            return [
                i
                for i, r in enumerate(self.replicas)
                if self.live[i] and i not in self._restarting and r.weight_version != self.weight_version
            ]

    @contextmanager
    def external_update(
        self, version: int, *, lora: str | None = None, only: Iterable[int] | None = None
    ) -> Iterator[list[tuple[int, int]]]:
        """Bracket a weight push that reaches the replicas from outside this process (engine servers
        fed by the training ranks, ``megamarl.rollout.servers.fleet``). Admission stops and every live
        replica pauses (drains); the body gets the ``(index, restart generation)`` pairs that take the
        update and delivers it; afterwards they carry ``version`` (a restarted replica is thereby
        re-synced and takes traffic again), caches are flushed and everything resumes.

        ``only``: re-sync just these replicas at the pool's current version (a restarted replica,
        ``stale_replicas``); the others keep serving, admission stays open (the targets take no
        traffic until they carry the pool's version)."""
        only = set(only) if only is not None else None
        with self._update_lock:
            if only is None:
                self._gate.close()
            targets: list[tuple[int, int]] = []
            try:
                with self._lock:
                    live = [
                        i for i in range(len(self.replicas)) if self.live[i] and (only is None or i in only)
                    ]
                for i in live:
                    try:
                        self.replicas[i].pause()
                        targets.append((i, self.num_restarts[i]))
                    except ConnectionError:
                        self._mark_dead(i, self.replicas[i])
                yield targets
                for i, _ in targets:
                    if lora is None:
                        self.replicas[i].weight_version = version
                if lora is None and only is None:
                    self.weight_version = version
            finally:
                for i, _ in targets:
                    try:
                        self.replicas[i].resume()
                    except ConnectionError:
                        self._mark_dead(i, self.replicas[i])
                if only is None:
                    self._gate.open()

    def counters(self) -> dict[str, float]:
        """Cumulative routing counters, for the step metrics."""
        out = {f"replica{i}/requests": float(n) for i, n in enumerate(self.served)}
        out.update(
            {f"replica{i}/weight_version": float(r.weight_version) for i, r in enumerate(self.replicas)}
        )
        out["failovers"] = float(self.failovers)
        out["connection_errors"] = float(self.connection_errors)
        out["restarts"] = float(sum(self.num_restarts))
        out["live_replicas"] = float(sum(self.live))
        return out

    def add_lora(self, name: str, path, *, version: int = 0) -> None:
        """Register L2 adapter ``name`` (a PEFT directory holding its weights of ``version``) with
        every replica; a rebuilt replica registers the newest directory (``adapter_updated``)."""
        self.adapter_updated(name, path, version)
        for replica in self.replicas:
            cast(ServesAdapters, replica).add_lora(name, path)

    def adapter_updated(self, name: str, path, version: int) -> None:
        """Adapter ``name``'s newest weights (``version``) are in ``path`` (every replica has loaded them)."""
        self.loras[name] = path
        self.lora_versions[name] = version

    # -- lifecycle -------------------------------------------------------------------------------

    def sleep(self, *, level: int = 1) -> None:
        for replica in self.replicas:
            replica.sleep(level=level)

    def wake(self) -> None:
        for replica in self.replicas:
            replica.wake()

    def pause(self) -> None:
        self._gate.close()

    def resume(self) -> None:
        self._gate.open()

    def flush_cache(self) -> None:
        for replica in self.replicas:
            replica.flush_cache()

    def health(self) -> bool:
        return any(self.live)

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()


def _tee_update(
    replicas: list[Engine], weights: Iterable[tuple[str, torch.Tensor]], *, version: int, lora: str | None
) -> list[BaseException | None]:
    """Read ``weights`` once and stream it to every replica's ``update_weights`` concurrently."""
    if len(replicas) == 1:
        try:
            replicas[0].update_weights(weights, version=version, lora=lora)
            return [None]
        except Exception as exc:  # noqa: BLE001 - reported per replica
            return [exc]
    queues: list[queue.Queue[Any]] = [queue.Queue(maxsize=4) for _ in replicas]  # tensors, then _DONE
    errors: list[BaseException | None] = [None] * len(replicas)

    finished = [False] * len(replicas)

    def consume(i: int) -> Iterator[tuple[str, torch.Tensor]]:
        while (item := queues[i].get()) is not _DONE:
            yield item
        finished[i] = True

    def run(i: int) -> None:
        try:
            replicas[i].update_weights(consume(i), version=version, lora=lora)
        except Exception as exc:  # noqa: BLE001
            errors[i] = exc
        finally:
            while not finished[i] and queues[i].get() is not _DONE:  # producer must never block
                pass

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for item in weights:
        for q in queues:
            q.put(item)
    for q in queues:
        q.put(_DONE)
    for t in threads:
        t.join()
    return errors
