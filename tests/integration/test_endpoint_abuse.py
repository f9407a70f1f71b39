"""The recording endpoint and the ``external`` orchestra under abuse by a local process or a bad program:
every route needs the episode's own token (401 otherwise; another episode's token touches nothing); one
finite, bounded reward per episode (400 naming the value, then 409); bodies past ``max_body_bytes`` are a
413 without being read; slow, idle and half-sent connections are closed and capped, and a normal request
still succeeds during a flood; a program's stderr is read with a byte cap; what a program leaves running
is killed on every exit path; the program sees an allow-listed environment, not the driver's."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import pytest
from external_runs import run_one_episode, survivors
from scripted import smollm2_tokenizer

from megamarl.orchestration.context import EpisodeContext
from megamarl.orchestration.openai_endpoint import EndpointLimits, RecordingEndpoint

pytestmark = [pytest.mark.integration]


class FakeContext:
    """What the endpoint reads of an episode; ``complete`` is never reached by a refused request."""

    def __init__(self, episode_id: str) -> None:
        self.episode_id, self.agents, self.reported, self.completions = episode_id, {"solver": None}, None, 0

    report_rewards = EpisodeContext.report_rewards

    async def complete(self, *args, **kwargs):
        self.completions += 1
        raise AssertionError("a refused request reached the engine")


def serve(coro_fn, **limits):
    """Run ``coro_fn(endpoint, [handle0, handle1])`` against a served endpoint with two open episodes."""

    async def go():
        endpoint = RecordingEndpoint(limits=EndpointLimits(**limits))
        await endpoint.start()
        handles = [endpoint.open(FakeContext(f"math-{i}/0")) for i in range(2)]
        try:
            return await coro_fn(endpoint, handles)
        finally:
            await endpoint.stop()

    return asyncio.run(go())


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_every_route_needs_the_episodes_own_token():
    async def go(endpoint, handles):
        mine, other = handles
        reward = endpoint.episode_url("math-0/0") + "/reward"
        chat = endpoint.episode_url("math-0/0") + "/chat/completions"
        body = {"model": "solver", "messages": [{"role": "user", "content": "hi"}]}
        assert mine.token != other.token and len(mine.token) >= 32
        async with aiohttp.ClientSession() as session:
            for headers in ({}, bearer(other.token), bearer("megamarl"), {"Authorization": mine.token}):
                async with session.post(reward, json={"team": 9.0}, headers=headers) as r:
                    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
                async with session.post(chat, json=body, headers=headers) as r:
                    assert r.status == 401
                # routed by header or body instead of the URL: the same check
                async with session.post(
                    endpoint.base_url + "/v1/chat/completions",
                    json={**body, "user": "math-0/0"},
                    headers=headers,
                ) as r:
                    assert r.status == 401
            async with session.get(endpoint.base_url + "/v1/models") as r:
                assert r.status == 401
            async with session.get(endpoint.base_url + "/v1/models", headers=bearer(other.token)) as r:
                assert r.status == 200
            async with session.post(reward, json={"team": 0.5}, headers=bearer(mine.token)) as r:
                assert r.status == 200
            # one reward per episode: a second post (an overwrite) is refused
            async with session.post(reward, json={"team": 1.0}, headers=bearer(mine.token)) as r:
                assert r.status == 409 and (await r.json())["error"]["code"] == "reward_already_posted"
        assert mine.ctx.reported == (0.5, {}) and other.ctx.reported is None
        assert mine.ctx.completions == other.ctx.completions == 0

    serve(go)


@pytest.mark.parametrize(
    "raw, shown",
    [
        ('{"team": NaN}', "nan"),
        ('{"team": Infinity}', "inf"),
        ('{"team": -Infinity}', "-inf"),
        ('{"team": 1e308}', "1e+308"),
        ('{"team": 1, "agents": {"solver": NaN}}', "nan"),
        ('{"team": 10001}', "10001"),
    ],
)
def test_a_reward_must_be_finite_and_bounded(raw, shown):
    async def go(endpoint, handles):
        url = endpoint.episode_url("math-0/0") + "/reward"
        headers = {**bearer(handles[0].token), "Content-Type": "application/json"}
        async with aiohttp.ClientSession() as session:
            async with session.post(url, data=raw, headers=headers) as r:
                error = (await r.json())["error"]
                assert r.status == 400 and error["code"] == "invalid_reward", error
                assert shown in error["message"] and "max_abs_reward" in error["message"]
            assert handles[0].ctx.reported is None
            async with session.post(url, json={"team": 1.0}, headers=headers) as r:  # still one to give
                assert r.status == 200

    serve(go)


def _raw(base_url: str, data: bytes, *, timeout: float = 10.0) -> tuple[socket.socket, bytes]:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.sendall(data)
    return sock, b""


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_60_mb_body_is_413_without_being_read():
    async def go(endpoint, handles):
        path = "/episodes/math-0/0/v1/reward"
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {handles[0].token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {60 * 1024 * 1024}\r\n\r\n"
        ).encode()

        def declared():  # only 1 MB of the declared 60 MB is ever sent: an answer proves it was not awaited
            sock, _ = _raw(endpoint.base_url, head + b" " * (1 << 20))
            with sock:
                return sock.recv(4096)

        def chunked():  # no Content-Length: refused once the limit is passed
            sock, _ = _raw(
                endpoint.base_url,
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {handles[0].token}\r\n"
                "Transfer-Encoding: chunked\r\n\r\n".encode(),
            )
            with sock:
                chunk = b"%x\r\n" % 65536 + b" " * 65536 + b"\r\n"
                try:
                    for _ in range(64):  # 4 MB
                        sock.sendall(chunk)
                except OSError:
                    pass  # the server answered and closed
                return sock.recv(4096)

        for send in (declared, chunked):
            answer = await asyncio.to_thread(send)
            assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
            assert b"max_body_bytes" in answer
        assert handles[0].ctx.reported is None

    serve(go, max_body_bytes=1 << 20)


def test_idle_and_half_sent_connections_are_closed():
    async def go(endpoint, handles):
        def idle():  # connects and sends nothing
            sock, _ = _raw(endpoint.base_url, b"")
            with sock:
                start = time.monotonic()
                assert _read_all(sock) == b""
                return time.monotonic() - start

        def half_body():  # complete headers, then 10 of 100 body bytes
            sock, _ = _raw(
                endpoint.base_url,
                f"POST /episodes/math-0/0/v1/reward HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {handles[0].token}\r\n"
                "Content-Length: 100\r\n\r\n{}        ".encode(),
            )
            with sock:
                start = time.monotonic()
                answer = _read_all(sock)
                return time.monotonic() - start, answer

        def kept_alive():  # one request answered, then the connection idles
            sock, _ = _raw(
                endpoint.base_url,
                f"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {handles[0].token}\r\n\r\n".encode(),
            )
            with sock:
                start = time.monotonic()
                answer = _read_all(sock)
                return time.monotonic() - start, answer

        waited = await asyncio.to_thread(idle)
        assert waited < 4, waited
        waited, answer = await asyncio.to_thread(half_body)
        assert waited < 4 and (answer == b"" or answer.startswith(b"HTTP/1.1 408")), (waited, answer[:200])
        waited, answer = await asyncio.to_thread(kept_alive)
        assert waited < 4 and answer.startswith(b"HTTP/1.1 200"), (waited, answer[:200])

    serve(go, idle_timeout_s=1.5, read_timeout_s=1.5)


SLOW_SERVER = """
import asyncio, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))  # as a driver with few descriptors left
from megamarl.orchestration.context import EpisodeContext
from megamarl.orchestration.openai_endpoint import EndpointLimits, RecordingEndpoint

class Ctx:
    episode_id, agents, reported = "math-0/0", {"solver": None}, None
    report_rewards = EpisodeContext.report_rewards

async def main():
    endpoint = RecordingEndpoint(limits=EndpointLimits(max_connections=32, idle_timeout_s=30))
    await endpoint.start()
    handle = endpoint.open(Ctx())
    print(endpoint.base_url, handle.token, flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


def test_many_slow_connections_leave_room_for_a_normal_request():
    """200 connections that send a header byte at a time (slowloris) against a driver with 128 descriptors:
    the newest connection evicts the oldest one that has sent no complete request, so a normal request
    is answered at once instead of waiting out the flood."""
    server = subprocess.Popen(
        [sys.executable, "-c", SLOW_SERVER], stdout=subprocess.PIPE, text=True, env={**os.environ}
    )
    slow: list[socket.socket] = []
    try:
        base_url, token = server.stdout.readline().split()
        host, port = base_url.removeprefix("http://").rsplit(":", 1)
        for _ in range(200):
            try:
                sock = socket.create_connection((host, int(port)), timeout=5)
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
                slow.append(sock)
            except OSError:
                pass
        stop = threading.Event()

        def drip():
            while not stop.is_set():
                for sock in slow:
                    try:
                        sock.send(b"X")
                    except OSError:
                        pass
                time.sleep(0.2)

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        time.sleep(0.5)
        start = time.monotonic()
        request = (
            f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            "Connection: close\r\n\r\n"
        )
        sock = socket.create_connection((host, int(port)), timeout=5)
        with sock:
            sock.sendall(request.encode())
            answer = _read_all(sock)
        elapsed = time.monotonic() - start
        stop.set()
        dripper.join()
        assert answer.startswith(b"HTTP/1.1 200") and elapsed < 3, (elapsed, answer[:200])
    finally:
        for sock in slow:
            sock.close()
        server.kill()
        server.wait()


# -- the program's process --------------------------------------------------------------------------


POST_REWARD = """
import json, os, urllib.request
def post_reward(team):
    request = urllib.request.Request(os.environ["MEGAMARL_REWARD_URL"], data=json.dumps({"team": team}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    urllib.request.urlopen(request, timeout=30).read()
"""  # noqa: E501 - the embedded program keeps its own layout


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_200_mb_of_stderr_leaves_the_driver_bounded_and_keeps_the_tail():
    script = (
        "import sys\nline = 'x' * 1023 + '\\n'\n"
        "for _ in range(200 * 1024):\n    sys.stderr.write(line)\n"
        "sys.stderr.write('the last words\\n')\nsys.exit(3)\n"
    )
    smollm2_tokenizer()  # loaded before the baseline
    before, peak, done = _rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        episode = run_one_episode(script)
    finally:
        done.set()
        sampler.join()
    grown = peak[0] - before
    assert grown < 40 * 1024 * 1024, f"the driver grew {grown / 2**20:.0f} MiB reading the program's stderr"
    assert episode.reason == "error:ProgramExitError" and "the last words" in episode.error
    assert len(episode.error) < 20_000


@pytest.mark.parametrize("exit_code", [0, 3])
def test_what_the_program_leaves_running_is_killed(exit_code, tmp_path):
    pid_file = tmp_path / "pid"
    script = POST_REWARD + (
        "import subprocess, sys\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        f"post_reward(1.0)\nsys.exit({exit_code})\n"
    )
    episode = run_one_episode(script)
    assert episode.status == ("ok" if exit_code == 0 else "failed"), episode.error
    pid = int(pid_file.read_text())
    assert survivors([pid]) == [], f"the program's background child {pid} outlived it"


def test_the_program_sees_an_allow_listed_environment(tmp_path, monkeypatch):
    seen = tmp_path / "env.json"
    monkeypatch.setenv("MEGAMARL_TEST_DRIVER_SECRET", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter3")
    monkeypatch.setenv("TEAM_SETTING", "passed")
    script = POST_REWARD + f"json.dump(dict(os.environ), open({str(seen)!r}, 'w'))\npost_reward(1.0)\n"
    episode = run_one_episode(script, pass_env=["TEAM_SETTING"], env={"EXTRA": "1"})
    assert episode.status == "ok", episode.error
    env = json.loads(seen.read_text())
    assert "MEGAMARL_TEST_DRIVER_SECRET" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["TEAM_SETTING"] == "passed" and env["EXTRA"] == "1" and env["PATH"] == os.environ["PATH"]
    assert {"OPENAI_BASE_URL", "OPENAI_API_KEY", "MEGAMARL_REWARD_URL", "MEGAMARL_TASK"} <= set(env)
    assert env["OPENAI_API_KEY"] != "megamarl" and env["OPENAI_API_KEY"] not in os.environ.values()
