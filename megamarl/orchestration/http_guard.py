"""Connection hygiene for an aiohttp server that any local process can reach (the recording endpoint).

aiohttp bounds the size of a request head (8 KiB lines, 32 headers) and, with ``keepalive_timeout``,
closes a connection that has no complete request that long after it opened or was last answered. It
has no cap on connections and no deadline for a head that arrives a byte at a time. ``ConnectionGuard``
wraps aiohttp's protocol factory (``AppRunner.server``) and adds both:

* at most ``max_connections`` open connections: a new one evicts the oldest connection that is not
  inside a request handler (a dribbling head, an idle keep-alive, a connection being drained after an
  early answer); when every connection is inside a handler the new one gets a bare 503 and is closed.
  A flood of slow connections therefore costs the newest legitimate request nothing: its head
  completes at once, it enters the handler and is no longer evictable.
* a head that started arriving must be complete within ``header_timeout_s`` (the connection is closed).

``track`` is the aiohttp middleware that tells the guard when a connection is inside a handler.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

REFUSED = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Connection(asyncio.Protocol):
    """One accepted socket: forwards every event to aiohttp's protocol and notes what the guard needs."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.inner: asyncio.Protocol | None = None  # aiohttp's, created only for an admitted connection
        self.transport: asyncio.Transport | None = None
        self.num_in_handler = 0
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP server's transports are Transports
        if not self.guard.admit(self):
            transport.write(REFUSED)  # type: ignore[attr-defined]
            transport.close()
            return
        assert self.guard.protocol_factory is not None, "set before the server accepts"
        self.inner = self.guard.protocol_factory()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self.num_in_handler == 0 and self._head_timer is None:  # the first byte of a head
            self._head_timer = asyncio.get_running_loop().call_later(self.guard.header_timeout_s, self.close)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self.guard.forget(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    # -- what the guard and the middleware call ---------------------------------------------------

    def entered_handler(self) -> None:
        self._cancel_head_timer()  # the head is complete
        self.num_in_handler += 1

    def left_handler(self) -> None:
        self.num_in_handler -= 1

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()  # aiohttp's connection_lost follows and cancels what it was doing

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


class ConnectionGuard:
    """The open connections of one server, oldest first; ``factory`` goes to ``loop.create_server``."""

    def __init__(self, *, max_connections: int, header_timeout_s: float) -> None:
        # aiohttp's (``AppRunner.server``), known once the runner that holds ``track`` is set up
        self.protocol_factory: Callable[[], asyncio.Protocol] | None = None
        self.max_connections, self.header_timeout_s = max_connections, header_timeout_s
        self.connections: dict[_Connection, None] = {}  # insertion order: oldest first
        self._by_transport: dict[asyncio.BaseTransport, _Connection] = {}
        self.num_evicted = self.num_refused = 0

    def factory(self) -> asyncio.Protocol:
        return _Connection(self)

    def admit(self, connection: _Connection) -> bool:
        if len(self.connections) >= self.max_connections:
            victim = next((c for c in self.connections if c.num_in_handler == 0), None)
            if victim is None:  # every connection is being served: refuse rather than exceed the cap
                self.num_refused += 1
                return False
            self.num_evicted += 1
            self.forget(victim)  # now: its connection_lost comes later, the cap holds meanwhile
            victim.close()
        assert connection.transport is not None
        self.connections[connection] = None
        self._by_transport[connection.transport] = connection
        return True

    def forget(self, connection: _Connection) -> None:
        self.connections.pop(connection, None)
        if connection.transport is not None:
            self._by_transport.pop(connection.transport, None)

    def connection_of(self, request: web.BaseRequest) -> _Connection | None:
        return self._by_transport.get(request.transport) if request.transport is not None else None


def track(guard: ConnectionGuard) -> Callable:
    """The middleware marking a connection as inside a handler (not evictable, its head complete)."""

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        connection = guard.connection_of(request)
        if connection is not None:
            connection.entered_handler()
        try:
            return await handler(request)
        finally:
            if connection is not None:
                connection.left_handler()

    return middleware
