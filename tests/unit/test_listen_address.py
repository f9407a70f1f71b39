"""The one bind/advertise rule for listeners other nodes may reach (``parallel.network.listen_address``)
and the recording endpoint of the ``external`` orchestra following it: one node stays on loopback; a
multi-node run (torchrun's WORLD_SIZE > LOCAL_WORLD_SIZE) binds every interface and advertises this
node's host address, never 0.0.0.0 or loopback."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from megamarl.orchestration import build_orchestra
from megamarl.parallel.network import HOST_ADDR_ENV, is_multi_node, listen_address

ONE_NODE = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
TWO_NODES = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", HOST_ADDR_ENV: "127.0.0.2"}


def test_multi_node_is_torchruns_view():
    assert not is_multi_node({})  # plain python: one rank
    assert not is_multi_node(ONE_NODE)
    assert is_multi_node(TWO_NODES)


@pytest.mark.parametrize(
    ("host", "environ", "expected"),
    [
        ("", ONE_NODE, ("127.0.0.1", "127.0.0.1")),  # auto, one node: loopback only
        ("", TWO_NODES, ("0.0.0.0", "127.0.0.2")),  # auto, several: every interface, this node's address
        ("0.0.0.0", ONE_NODE, ("0.0.0.0", "127.0.0.1")),  # explicit wildcard: advertise the rule's answer
        ("0.0.0.0", TWO_NODES, ("0.0.0.0", "127.0.0.2")),
        ("10.1.2.3", TWO_NODES, ("10.1.2.3", "10.1.2.3")),  # an explicit address is both
    ],
)
def test_listen_address(host, environ, expected):
    assert listen_address(host, environ=environ) == expected


def _models(base: str, token: str) -> dict:
    request = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


class _Episode:  # what the endpoint reads of a running episode to answer /v1/models
    episode_id, agents = "math-0/0", {"solver": None}


@pytest.mark.parametrize(
    ("environ", "host", "advertised"),
    [
        (ONE_NODE, None, "127.0.0.1"),
        (TWO_NODES, None, "127.0.0.2"),  # was 127.0.0.1: no other node could reach it
        (ONE_NODE, "0.0.0.0", "127.0.0.1"),  # was http://0.0.0.0:port, an address no peer can dial
    ],
)
def test_external_orchestra_endpoint_binds_and_advertises_by_the_rule(monkeypatch, environ, host, advertised):
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    if HOST_ADDR_ENV not in environ:
        monkeypatch.delenv(HOST_ADDR_ENV, raising=False)
    orchestra = build_orchestra("external", command=["true"], **({"host": host} if host else {}))

    async def go() -> str:
        base = await orchestra.endpoint.start()
        token = orchestra.endpoint.open(_Episode()).token  # type: ignore[arg-type]  # a stand-in
        try:  # reachable at the advertised address (127.0.0.2 is this machine's loopback too)
            assert (await asyncio.to_thread(_models, base, token))["object"] == "list"
        finally:
            await orchestra.endpoint.stop()
        return base

    base = asyncio.run(go())
    assert base.startswith(f"http://{advertised}:")
