"""Request admission and micro-batching shared by the in-process engines.

``AdmissionGate`` is the pause/resume switch: closed, it holds new requests (they wait, they are
not rejected) and releases them on ``open``. It works across threads and event loops, because the
trainer pauses an engine from synchronous code while episodes await it on an asyncio loop.

``MicroBatcher`` merges concurrent ``submit`` calls into one batch: the first request opens a
window of ``max_wait_ms``; the batch closes when the window ends or ``max_batch_rows`` rows (a
request with ``n`` samples counts ``n`` rows) are collected. The batch runs in a worker thread so
the event loop keeps accepting the next batch's requests meanwhile. It is static batching (a batch
runs to its longest member), the simple counterpart of vLLM's continuous batching.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class AdmissionGate:
    """Open: ``wait`` returns at once. Closed: ``wait`` blocks until ``open`` (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    @property
    def is_open(self) -> bool:
        return self._open

    def close(self) -> None:
        with self._lock:
            self._open = False

    def open(self) -> None:
        with self._lock:
            self._open = True
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_set_result, future, None)

    async def wait(self) -> None:
        while True:
            with self._lock:
                if self._open:
                    return
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                self._waiters.append((loop, future))
            await future


@dataclass
class _Pending:
    payload: Any
    num_rows: int
    future: asyncio.Future


class MicroBatcher:
    """Collects concurrent requests into batches for ``run_batch(payloads) -> results``.

    ``run_batch`` runs in a worker thread and returns one result per payload, in order. Each event
    loop that submits gets its own queue and collector task (tests call ``asyncio.run`` repeatedly).
    """

    def __init__(
        self, run_batch: Callable[[list[Any]], Sequence[Any]], *, max_batch_rows: int, max_wait_ms: float
    ) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self._run_batch = run_batch
        self.max_batch_rows = max_batch_rows
        self.max_wait_s = max_wait_ms / 1000.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[_Pending] | None = None
        self._task: asyncio.Task | None = None
        self.batch_rows: list[int] = []  # rows of every batch run so far (tests, metrics)

    @property
    def num_batches(self) -> int:
        return len(self.batch_rows)

    async def submit(self, payload: Any, *, num_rows: int = 1) -> Any:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._queue, self._task = loop, asyncio.Queue(), None
        future = loop.create_future()
        assert self._queue is not None  # created with the loop's first submit
        self._queue.put_nowait(_Pending(payload, num_rows, future))
        if self._task is None:  # the collector exits when idle, so no task outlives its loop
            self._task = loop.create_task(self._collect(self._queue))
        return await future

    async def _collect(self, queue: asyncio.Queue[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        carry: _Pending | None = None
        while True:
            if carry is None and queue.empty():
                self._task = None  # no await since the check: submit() sees this and restarts us
                return
            first = carry if carry is not None else queue.get_nowait()
            carry = None
            batch, rows = [first], first.num_rows
            deadline = loop.time() + self.max_wait_s
            while rows < self.max_batch_rows:
                try:
                    if queue.empty():
                        timeout = deadline - loop.time()
                        if timeout <= 0:
                            break
                        item = await asyncio.wait_for(queue.get(), timeout)
                    else:
                        item = queue.get_nowait()
                except asyncio.TimeoutError:
                    break
                if rows + item.num_rows > self.max_batch_rows:
                    carry = item  # opens the next batch
                    break
                batch.append(item)
                rows += item.num_rows
            live = [p for p in batch if not p.future.cancelled()]
            if not live:
                continue
            self.batch_rows.append(sum(p.num_rows for p in live))
            try:
                results = await asyncio.to_thread(self._run_batch, [p.payload for p in live])
            except Exception as exc:  # noqa: BLE001 - delivered to every caller of the batch
                for p in live:
                    _set_exception(p.future, exc)
                continue
            for p, result in zip(live, results, strict=True):
                _set_result(p.future, result)
