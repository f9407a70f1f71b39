"""A small JSON-over-HTTP client for disaggregated engine servers (stdlib only, no new dependency).

Requests run in a private thread pool so that many episodes can await one server concurrently.
A server that cannot be reached raises ``EngineConnectionError`` (a ``ConnectionError``); the
engine pool treats that as a dead replica, while an HTTP error status stays an ordinary error.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class EngineConnectionError(ConnectionError):
    """The engine server is unreachable (refused, reset, timed out)."""


class EngineHTTPError(RuntimeError):
    """The engine server answered with an error status."""


class JSONClient:
    def __init__(self, base_url: str, *, timeout_s: float = 600.0, max_concurrency: int = 256) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="engine-http")

    def request(
        self, method: str, path: str, payload: Any = None, *, query: dict | None = None, timeout_s: float | None = None
    ) -> Any:
        url = self.base_url + path
        if query:
            url += "?" + urllib.parse.urlencode(query, doseq=True)
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise EngineHTTPError(f"{method} {url} -> HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            raise EngineConnectionError(f"{method} {url} failed: {exc}") from exc
        if not body:
            return None
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    def post(self, path: str, payload: Any = None, **kwargs) -> Any:
        return self.request("POST", path, {} if payload is None else payload, **kwargs)

    def get(self, path: str, **kwargs) -> Any:
        return self.request("GET", path, **kwargs)

    async def apost(self, path: str, payload: Any = None, **kwargs) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: self.post(path, payload, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False)  # queued requests still run and fail as connection errors
