"""The engine-server HTTP client: pooled keep-alive connections on the generation path (one
aiohttp session per event loop, no thread per request), and its error mapping."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from aiohttp import web

from megamarl.rollout.engines._http import EngineConnectionError, EngineHTTPError, JSONClient


async def _serve(ports: list[int]):
    async def echo(request):
        ports.append(request.transport.get_extra_info("peername")[1])
        body = await request.json()
        if body.get("fail"):
            return web.json_response({"error": "boom"}, status=500)
        await asyncio.sleep(0.01)
        return web.json_response({"x": body["x"] + 1})

    app = web.Application()
    app.router.add_post("/v1/completions", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def test_connections_are_reused_and_no_threads_are_spawned():
    ports: list[int] = []

    async def main():
        runner, port = await _serve(ports)
        client = JSONClient(f"http://127.0.0.1:{port}", max_concurrency=8)
        threads = threading.active_count()
        for i in range(20):  # sequential: one keep-alive connection
            assert (await client.apost("/v1/completions", {"x": i})) == {"x": i + 1}
        sequential = set(ports)
        replies = await asyncio.gather(*(client.apost("/v1/completions", {"x": i}) for i in range(64)))
        assert [r["x"] for r in replies] == list(range(1, 65))
        assert threading.active_count() == threads
        with pytest.raises(EngineHTTPError, match="HTTP 500"):
            await client.apost("/v1/completions", {"fail": True})
        client.close()
        await asyncio.sleep(0)
        await runner.cleanup()
        return sequential

    sequential = asyncio.run(main())
    assert len(sequential) == 1
    assert len(set(ports)) <= 8  # 64 concurrent requests over at most max_concurrency connections


def test_unreachable_server_is_a_connection_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = JSONClient(f"http://127.0.0.1:{port}")
    with pytest.raises(EngineConnectionError):
        asyncio.run(client.apost("/v1/completions", {}))
    with pytest.raises(EngineConnectionError):
        client.post("/pause")
    client.close()


def test_session_closes_with_its_event_loop():
    """``asyncio.run`` per rollout: each loop's session is closed by the loop's own shutdown, and
    the next loop gets a new one (no unclosed-session leaks, no cross-loop connections)."""
    ports: list[int] = []
    client = JSONClient("http://unused")

    async def main():
        runner, port = await _serve(ports)
        client.base_url = f"http://127.0.0.1:{port}"
        assert (await client.apost("/v1/completions", {"x": 1})) == {"x": 2}
        session = await client._session()
        await runner.cleanup()
        return session

    first = asyncio.run(main())
    assert first.closed
    second = asyncio.run(main())
    assert second.closed and second is not first
    assert len(client._sessions) <= 1
