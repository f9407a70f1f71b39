"""The JSON-over-HTTP client of engine servers (vLLM, SGLang).

Generation traffic (``apost``) goes through one ``aiohttp.ClientSession`` per event loop: pooled
keep-alive connections (up to ``max_concurrency`` per server), no thread per request. Control calls
(``post``/``get``: weight-update handshakes, pause, sleep, health) use a plain blocking stdlib call:
they are few, often made from threads outside any event loop, and must not depend on one.

A server that cannot be reached (refused, reset, disconnected, timed out) raises
``EngineConnectionError`` (a ``ConnectionError``), while an HTTP error status raises
``EngineHTTPError``, an ordinary error. Whether such a server is dead is ``answers``' verdict: a
refused, reset or unroutable probe is final at once; a probe that only times out means a server
busy under load (or a path that drops packets), so it is tried again until ``BUSY_PATIENCE_S``.

aiohttp is imported by the generation path only (``_aiohttp``): the control path, and every module that
merely imports this one (the weight senders, the GPU tier on a node without aiohttp), need the stdlib only.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp


def _aiohttp():
    import aiohttp  # the generation path's dependency, imported where it is used

    return aiohttp


BUSY_PATIENCE_S = 60.0  # a server that accepts but does not answer ``/health`` this long counts as dead


class EngineConnectionError(ConnectionError):
    """The engine server is unreachable (refused, reset, timed out)."""


class EngineHTTPError(RuntimeError):
    """The engine server answered with an error status."""


def _timed_out(exc: BaseException | None) -> bool:
    """A probe that got no answer in time (``urlopen`` raises a bare ``TimeoutError`` while reading, a
    ``URLError`` wrapping one while connecting), as opposed to one the peer or the network refused."""
    return isinstance(getattr(exc, "reason", exc), TimeoutError)


def _decode(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body.decode(errors="replace")


class JSONClient:
    def __init__(self, base_url: str, *, timeout_s: float = 600.0, max_concurrency: int = 256) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        # One session per event loop: a session's connections belong to the loop that opened them.
        # loop -> (its session, the async generator that closes it at the loop's shutdown)
        self._sessions: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[aiohttp.ClientSession, AsyncGenerator]
        ] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    # -- blocking control path -------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        *,
        query: dict | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        url = self.base_url + path
        if query:
            url += "?" + urllib.parse.urlencode(query, doseq=True)
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise EngineHTTPError(f"{method} {url} -> HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            raise EngineConnectionError(f"{method} {url} failed: {exc}") from exc
        return _decode(body)

    def post(self, path: str, payload: Any = None, **kwargs) -> Any:
        return self.request("POST", path, {} if payload is None else payload, **kwargs)

    def get(self, path: str, **kwargs) -> Any:
        return self.request("GET", path, **kwargs)

    def answers(
        self, path: str = "/health", *, probe_s: float = 5.0, patience_s: float = BUSY_PATIENCE_S
    ) -> bool:
        """The server is alive: ``path`` answers 200. Refused, reset, unroutable or an error status is
        ``False`` at once; a probe that times out is repeated for ``patience_s`` (a CPU server busy
        generating on a loaded host can take longer than one probe to answer, and declaring it dead
        would take a healthy replica out of service until the next push)."""
        deadline = time.monotonic() + patience_s
        while True:
            try:
                self.get(path, timeout_s=probe_s)
                return True
            except EngineConnectionError as exc:
                if not _timed_out(exc.__cause__) or time.monotonic() >= deadline:
                    return False
            except EngineHTTPError:
                return False

    # -- async generation path -------------------------------------------------------------------

    async def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._sessions.get(loop)
            if entry is not None and not entry[0].closed:
                return entry[0]
            for stale in [k for k, (old, _) in self._sessions.items() if old.closed]:  # finished loops
                del self._sessions[stale]
            aiohttp = _aiohttp()
            connector = aiohttp.TCPConnector(limit=self.max_concurrency, limit_per_host=self.max_concurrency)
            session = aiohttp.ClientSession(connector=connector)
            closer = _close_at_loop_shutdown(session)
            self._sessions[loop] = (session, closer)
        # An async generator parked at its first yield is finalised by the loop's
        # ``shutdown_asyncgens`` (``asyncio.run`` calls it before closing the loop): the session's
        # connections close on their own loop even when the caller never calls ``close``.
        await closer.__anext__()
        return session

    async def apost(
        self, path: str, payload: Any = None, *, query: dict | None = None, timeout_s: float | None = None
    ) -> Any:
        url = self.base_url + path
        aiohttp = _aiohttp()
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            session = await self._session()
            async with session.post(
                url, json={} if payload is None else payload, params=query, timeout=timeout
            ) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    detail = body.decode(errors="replace")[:500]
                    raise EngineHTTPError(f"POST {url} -> HTTP {resp.status}: {detail}")
        except (
            aiohttp.ClientConnectionError,
            aiohttp.ClientPayloadError,
            asyncio.TimeoutError,
            OSError,
        ) as exc:
            raise EngineConnectionError(f"POST {url} failed: {exc!r}") from exc
        return _decode(body)

    def close(self) -> None:
        """Close every loop's session: on its own loop when that loop still runs; a session of a
        finished loop only drops its (already dead) connections."""
        with self._lock:
            sessions, self._sessions = list(self._sessions.items()), weakref.WeakKeyDictionary()
        for loop, (session, _) in sessions:
            if session.closed:
                continue
            try:
                if loop.is_running():
                    asyncio.run_coroutine_threadsafe(session.close(), loop)
                elif not loop.is_closed():
                    loop.run_until_complete(session.close())
                else:
                    session.detach()
            except Exception:  # noqa: BLE001, S110 - closing is best effort; the server may be gone
                pass


async def _close_at_loop_shutdown(session: aiohttp.ClientSession):
    try:
        yield
    finally:
        if not session.closed:
            await session.close()
