"""Env workers: run slow or untrusted env steps off the driver's event loop, with per-call timeouts.

``await workers.call(fn, *args, timeout_s=...)`` runs the picklable ``fn(*args)`` elsewhere and
returns its result, or raises ``EnvWorkerError`` with a short ``reason`` ("timeout", "crash",
"error: ..."). The driver turns that into a *failed episode* (counted by reason); the run goes on.

Backends (``WORKERS`` registry):

* ``process``: ``num_workers`` single-process ``concurrent.futures.ProcessPoolExecutor`` slots
  (forkserver start with ``megamarl.orchestration`` preloaded: workers do not inherit the driver's
  threads or CUDA state and start in milliseconds). Each call holds one slot, so a worker crash
  (``BrokenProcessPool``) or a hang (timeout; the slot's process is killed) is attributed to
  exactly that call, and only that slot is replaced; one shared pool would break every in-flight
  call on a single crash.
* ``ray``: a fixed set of Ray actors; a timed-out or dead actor is killed and replaced.
* ``inline``: calls ``fn`` directly in the driver (no isolation, no timeout); for tests and
  cheap envs.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import multiprocessing
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from megamarl.registry import Registry


class EnvWorkerError(RuntimeError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class WorkersConfig:
    kind: str = "process"  # process | ray | inline
    num_workers: int = 2
    timeout_s: float = 30.0  # default per-call timeout

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"env_workers.num_workers must be >= 1, got {self.num_workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"env_workers.timeout_s must be > 0, got {self.timeout_s}")


class EnvWorkers(abc.ABC):
    def __init__(self, config: WorkersConfig) -> None:
        self.config = config
        self.num_failures: dict[str, int] = {}

    @abc.abstractmethod
    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """Run ``fn(*args)`` in a worker; raise ``EnvWorkerError`` on timeout/crash/exception."""

    def close(self) -> None:
        pass

    def _fail(self, reason: str) -> EnvWorkerError:
        key = reason.split(":")[0]
        self.num_failures[key] = self.num_failures.get(key, 0) + 1
        return EnvWorkerError(reason)


WORKERS: Registry[type[EnvWorkers]] = Registry(
    "env worker backend", signature="class(EnvWorkers); cls(config: WorkersConfig); async call(fn, *args, timeout_s)")


def make_workers(config: WorkersConfig | None = None, **overrides: Any) -> EnvWorkers:
    config = config or WorkersConfig(**overrides)
    return WORKERS.get(config.kind, key="env_workers.kind")(config)


@WORKERS.register("inline")
class InlineWorkers(EnvWorkers):
    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # reported as an episode failure
            raise self._fail(f"error: {exc!r}") from exc


@WORKERS.register("process")
class ProcessWorkers(EnvWorkers):
    """``num_workers`` single-process ``ProcessPoolExecutor`` slots: one call per slot at a time, so a
    crash or hang is attributed to exactly the call that caused it and only that slot is replaced."""

    def __init__(self, config: WorkersConfig) -> None:
        super().__init__(config)
        self._context = multiprocessing.get_context("forkserver")
        # Imported once in the fork server, so every (re)started worker forks with envs loaded and a
        # call's timeout never pays for interpreter start-up and imports.
        self._context.set_forkserver_preload(["megamarl.orchestration"])
        self._slots = [self._new_slot() for _ in range(config.num_workers)]
        for slot in self._slots:
            slot.submit(_noop).result()
        self._free: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _new_slot(self) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(1, mp_context=self._context)

    def _queue(self) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        if self._free is None or self._loop is not loop:  # a new event loop (e.g. a new asyncio.run)
            self._free, self._loop = asyncio.Queue(), loop
            for slot in self._slots:
                self._free.put_nowait(slot)
        return self._free

    def _replace(self, slot: concurrent.futures.Executor) -> concurrent.futures.ProcessPoolExecutor:
        # ProcessPoolExecutor cannot cancel a running task; killing its process is the only way to
        # reclaim a hung worker (``_processes`` is private but stable since Python 3.3).
        for process in list((getattr(slot, "_processes", None) or {}).values()):
            process.kill()
        slot.shutdown(wait=False, cancel_futures=True)
        fresh = self._new_slot()
        self._slots[self._slots.index(slot)] = fresh
        return fresh

    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        free = self._queue()
        slot = await free.get()
        try:
            future = slot.submit(fn, *args)
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s or self.config.timeout_s)
        except asyncio.TimeoutError:
            slot = self._replace(slot)
            raise self._fail("timeout") from None
        except BrokenProcessPool:
            slot = self._replace(slot)
            raise self._fail("crash") from None
        except Exception as exc:  # the env raised: that episode fails
            raise self._fail(f"error: {exc!r}") from exc
        finally:
            free.put_nowait(slot)

    def close(self) -> None:
        for slot in self._slots:
            slot.shutdown(wait=False, cancel_futures=True)


def _noop() -> None:
    return None


def _warm_up() -> None:
    import megamarl.orchestration  # noqa: F401 - envs and agents imported before the first timed call


def _ray_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class _EnvActor:
        def call(self, fn, *args):
            return fn(*args)

    return _EnvActor


@WORKERS.register("ray")
class RayWorkers(EnvWorkers):
    """Ray actors (``ray.init`` is called if Ray is not initialised yet). Actors are started and
    warmed up (imports done) in the constructor, so call timeouts never include actor start-up; a
    replacement actor after a timeout or crash is warmed up before it serves calls."""

    def __init__(self, config: WorkersConfig) -> None:
        super().__init__(config)
        try:
            import ray
        except ImportError as exc:
            raise ValueError("env_workers.kind='ray' needs the 'ray' package: pip install ray") from exc
        self._ray = ray
        if not ray.is_initialized():
            ray.init(num_cpus=config.num_workers, include_dashboard=False, log_to_driver=False)
        self._actor_cls = _ray_actor_class()
        self._actors = [self._actor_cls.remote() for _ in range(config.num_workers)]
        ray.get([actor.call.remote(_warm_up) for actor in self._actors])
        self._free: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _queue(self) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        if self._free is None or self._loop is not loop:
            self._free, self._loop = asyncio.Queue(), loop
            for actor in self._actors:
                self._free.put_nowait(actor)
        return self._free

    async def _replace(self, actor):
        self._ray.kill(actor)
        fresh = self._actor_cls.remote()
        await asyncio.wrap_future(fresh.call.remote(_warm_up).future())
        self._actors[self._actors.index(actor)] = fresh
        return fresh

    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        ray = self._ray
        free = self._queue()
        actor = await free.get()
        try:
            ref = actor.call.remote(fn, *args)
            timeout = timeout_s or self.config.timeout_s
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
        except asyncio.TimeoutError:
            actor = await self._replace(actor)
            raise self._fail("timeout") from None
        except ray.exceptions.RayActorError:
            actor = await self._replace(actor)
            raise self._fail("crash") from None
        except ray.exceptions.RayTaskError as exc:
            raise self._fail(f"error: {exc.cause!r}") from exc
        finally:
            free.put_nowait(actor)

    def close(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor)
