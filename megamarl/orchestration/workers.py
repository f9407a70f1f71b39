"""Env workers: run slow or untrusted env steps off the driver's event loop, with per-call timeouts.

``await workers.call(fn, *args, timeout_s=...)`` runs the picklable ``fn(*args)`` elsewhere and returns
its result or raises ``EnvWorkerError`` with a ``reason`` ("timeout", "crash", "error: ..."), which the
driver turns into a failed episode. An env step goes there when the env declares ``Env.remote_step``:
the env object travels to the worker and back. The run's workers (``rollout.env_workers``) are built
once by the rollout driver, only when an env has remote steps. Backends (``WORKERS``, traits in
``WorkerTraits``): ``inline`` (default; on the event loop, bit-identical, no timeout), ``process``
(``num_workers`` single-process pool slots, forkserver; a crash or hang is attributed to its one call
and only that slot is replaced) and ``ray`` (actors, replaced when timed out or dead; ``address``,
``resources``). Details: docs/design-notes.md, "megamarl/orchestration/workers.py".
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import importlib.util
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from megamarl.config_sections import WorkersConfig
from megamarl.registry import Registry


class EnvWorkerError(RuntimeError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class WorkerTraits:
    package: str = ""  # a package the backend imports (checked at load time: importable here)
    takes_address: bool = False  # the backend can join an existing cluster (rollout.env_workers.address)


class EnvWorkers(abc.ABC):
    def __init__(self, config: WorkersConfig) -> None:
        self.config = config
        self.num_calls = 0
        self.num_failures: dict[str, int] = {}  # reason (timeout, crash, error) -> calls

    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """Run ``fn(*args)`` in a worker; raise ``EnvWorkerError`` on timeout/crash/exception."""
        self.num_calls += 1
        return await self._run(fn, *args, timeout_s=timeout_s)

    @abc.abstractmethod
    async def _run(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """The backend's ``call``."""

    def counters(self) -> dict[str, float]:
        """Cumulative counts for the step metrics (``env_workers/...``, docs/metrics.md)."""
        failures = {
            name: float(self.num_failures.get(reason, 0))
            for reason, name in (("timeout", "timeouts"), ("crash", "crashes"), ("error", "errors"))
        }
        return {"calls": float(self.num_calls), **failures}

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op unless the backend holds workers
        """Stop the workers now (a call still running is killed). Idempotent."""

    def _fail(self, reason: str) -> EnvWorkerError:
        key = reason.split(":")[0]
        self.num_failures[key] = self.num_failures.get(key, 0) + 1
        return EnvWorkerError(reason)


WORKERS: Registry[type[EnvWorkers]] = Registry(
    "env worker backend",
    traits=WorkerTraits,
    signature="class(EnvWorkers); cls(config: WorkersConfig); async _run(fn, *args, timeout_s)",
    keys=("rollout.env_workers.backend",),
)


def make_workers(config: WorkersConfig | None = None, **overrides: Any) -> EnvWorkers:
    config = config or WorkersConfig(**overrides)
    return WORKERS.get(config.backend, key="rollout.env_workers.backend")(config)


@WORKERS.register("inline")
class InlineWorkers(EnvWorkers):
    async def _run(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
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
        # call's timeout never pays for interpreter start-up and imports. The fork server starts with
        # the driver's sys.path: env classes of plugins load in the workers as in the driver.
        self._context.set_forkserver_preload(["megamarl.orchestration"])
        self._slots = [self._new_slot() for _ in range(config.num_workers)]
        for slot in self._slots:
            slot.submit(_noop).result()
        self._free: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _new_slot(self) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(
            1, mp_context=self._context, initializer=_exit_with_driver
        )

    def _queue(self) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        if self._free is None or self._loop is not loop:  # a new event loop (e.g. a new asyncio.run)
            self._free, self._loop = asyncio.Queue(), loop
            for slot in self._slots:
                self._free.put_nowait(slot)
        return self._free

    @staticmethod
    def _kill(slot: concurrent.futures.ProcessPoolExecutor) -> None:
        # ProcessPoolExecutor cannot cancel a running task; killing its process is the only way to
        # reclaim a hung worker (``_processes`` is private but stable since Python 3.3). A hung worker
        # left alive would also hold up the interpreter's exit (concurrent.futures joins its workers).
        for process in list((getattr(slot, "_processes", None) or {}).values()):
            process.kill()
        slot.shutdown(wait=False, cancel_futures=True)

    def _replace(self, slot: concurrent.futures.ProcessPoolExecutor, free: asyncio.Queue) -> None:
        """Kill ``slot`` (its call timed out, crashed or was abandoned) and return a fresh slot to
        ``free`` once its process has started: a call's timeout never pays for a worker's start,
        which on a loaded machine takes seconds (the fork server's fork plus the initializer)."""
        self._kill(slot)
        fresh = self._new_slot()
        self._slots[self._slots.index(slot)] = fresh
        loop = asyncio.get_running_loop()

        def started(_: concurrent.futures.Future) -> None:
            # a start that failed is put back all the same: its next call fails as a crash and
            # replaces it again
            try:
                loop.call_soon_threadsafe(free.put_nowait, fresh)
            except RuntimeError:  # the event loop closed meanwhile; _queue() refills from _slots
                pass

        fresh.submit(_noop).add_done_callback(started)

    async def _run(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        free = self._queue()
        slot = await free.get()
        try:
            future = slot.submit(fn, *args)
            result = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:
            self._replace(slot, free)
            raise self._fail("timeout") from None
        except BrokenProcessPool:
            self._replace(slot, free)
            raise self._fail("crash") from None
        except asyncio.CancelledError:  # the episode was abandoned (its own timeout) mid-call
            self._replace(slot, free)
            raise
        except Exception as exc:  # the env raised: that episode fails
            free.put_nowait(slot)
            raise self._fail(f"error: {exc!r}") from exc
        free.put_nowait(slot)
        return result

    def close(self) -> None:
        for slot in self._slots:
            self._kill(slot)


def _noop() -> None:
    return None


def _exit_with_driver() -> None:
    """A process worker's initializer: exit as soon as the driver process that started it is gone, so a
    driver killed without ``close`` (SIGKILL, a node loss) leaves no worker waiting forever on its
    call queue. Not the parent pid: a worker's parent is the fork server, which stays alive as long
    as any worker it forked does. ``parent_process()`` is the driver, watched through its sentinel."""
    # Slurm's time-limit warning (USR1) reaches every process of the job step; the driver acts on it,
    # a worker would die of it (the default action) and fail the episodes it serves.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    driver = multiprocessing.parent_process()
    if driver is None:
        return

    def watch() -> None:
        driver.join()  # returns when the driver's end of the pipe closes: it exited or was killed
        os._exit(0)

    threading.Thread(target=watch, name="megamarl-env-worker-watch", daemon=True).start()


def _ray_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class _EnvActor:
        def call(self, fn, *args):
            return fn(*args)

    return _EnvActor


# imported in each actor before its first timed call (envs and agents registered)
_WARM_UP = (importlib.import_module, "megamarl.orchestration")


def _driver_import_path() -> list[str]:
    """The driver's ``sys.path`` entries outside the interpreter's own libraries (those the workers
    have anyway): the working directory, plugin directories, PYTHONPATH."""
    return [
        p
        for p in sys.path
        if p
        and os.path.isdir(p)
        and "site-packages" not in p
        and not os.path.basename(p).startswith("python3")
        and not p.endswith(".zip")
    ]


@WORKERS.register("ray", traits=WorkerTraits(package="ray", takes_address=True))
class RayWorkers(EnvWorkers):
    """Ray actors. Without ``address`` (and Ray not initialised yet by the caller) a local cluster
    of ``num_workers`` CPUs is started, and stopped by ``close``; with one the driver connects to that
    cluster (``close`` disconnects). Actors are started and warmed up (imports done) in the
    constructor, so call timeouts never include actor start-up; a replacement actor after a timeout
    or crash is warmed up before it serves calls."""

    def __init__(self, config: WorkersConfig) -> None:
        super().__init__(config)
        import ray

        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        # Actors unpickle the env by module name: give them the driver's import path (plugin_paths, a
        # test's helpers), which a local cluster's workers would not have (they start from the raylet).
        runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(_driver_import_path())}}
        if self._owns_ray and config.address:
            ray.init(address=config.address, log_to_driver=False, runtime_env=runtime_env)
        elif self._owns_ray:
            ray.init(
                num_cpus=config.num_workers,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env=runtime_env,
            )
        resources = dict(config.resources)
        self._actor_cls = _ray_actor_class().options(num_cpus=resources.pop("CPU", 0), resources=resources)
        self._actors = [self._actor_cls.remote() for _ in range(config.num_workers)]
        ray.get([actor.call.remote(*_WARM_UP) for actor in self._actors])
        self._free: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

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
        await asyncio.wrap_future(fresh.call.remote(*_WARM_UP).future())
        self._actors[self._actors.index(actor)] = fresh
        return fresh

    async def _run(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        ray = self._ray
        free = self._queue()
        actor = await free.get()
        try:
            ref = actor.call.remote(fn, *args)
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
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
        if self._closed:
            return
        self._closed = True
        for actor in self._actors:
            self._ray.kill(actor)
        if self._owns_ray:  # the local cluster this run started (or its connection to the one at address)
            self._ray.shutdown()


def check_workers(config: WorkersConfig) -> None:
    """Load time: ``rollout.env_workers``' backend is registered, takes an address if one is given,
    and its package imports here."""
    traits = WORKERS.traits(config.backend, key="rollout.env_workers.backend")
    for key in ("address", "resources"):
        if getattr(config, key) and not traits.takes_address:
            takers = [n for n in WORKERS.names() if WORKERS.traits(n).takes_address]
            raise ValueError(
                f"rollout.env_workers.{key} is set but backend={config.backend!r} joins no cluster; "
                f"only {takers} join one"
            )
    if traits.package and importlib.util.find_spec(traits.package) is None:
        raise ValueError(
            f"rollout.env_workers.backend={config.backend} needs the '{traits.package}' package, which "
            f"is not importable here: pip install 'megamarl[{traits.package}]' (or bash "
            f"scripts/setup.sh --extras {traits.package}), or choose backend process"
        )
