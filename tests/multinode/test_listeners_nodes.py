"""Listeners that other nodes must reach, across two namespace nodes without a training run (seconds):
the recording OpenAI endpoint of the ``external`` orchestra, started on n0 in a multi-node run's
environment (torchrun's WORLD_SIZE > LOCAL_WORLD_SIZE, MASTER_ADDR=n0), advertises n0's address and
answers a client on n1; ``host_address`` on each node is its own eth0 address, also when the node's
name maps to 127.0.1.1 (Debian) and there is no default route (docs/cluster.md section 9)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from nodes import cluster, nodes_permitted  # tests/ helper
from train_runs import ROOT  # tests/ helper

pytestmark = [pytest.mark.multinode]

PY = sys.executable
SERVE_ENDPOINT = """
import asyncio, sys
from megamarl.orchestration import build_orchestra

class Episode:  # a stand-in running episode: the endpoint answers only its key
    episode_id, agents = "math-0/0", {"solver": None}

async def main():
    orchestra = build_orchestra("external", command=["true"])
    base = await orchestra.endpoint.start()
    print(base, orchestra.endpoint.open(Episode()).token, flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""
GET = """
import sys, urllib.request
request = urllib.request.Request(sys.argv[1], headers={"Authorization": "Bearer " + sys.argv[2]})
print(urllib.request.urlopen(request, timeout=5).read().decode())
"""
# one rank per node: the world's gloo group through megamarl's init_distributed, then an all-reduce
WORLD = """
import os, torch, torch.distributed as dist
from megamarl.parallel.distributed import init_distributed
init_distributed(timeout_s=30)
t = torch.ones(1)
dist.all_reduce(t)
print(os.environ.get("GLOO_SOCKET_IFNAME"), t.item(), flush=True)
"""
HOST_ADDRESS = "from megamarl.parallel.network import host_address; print(host_address(multi_node=True))"


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Nodes whose /etc/hosts maps their own name to 127.0.1.1 (Debian): the case that broke gloo; the
    plain case is the one every other multinode test runs in."""
    if reason := nodes_permitted():
        pytest.skip(reason)
    with cluster(2, tmp_path_factory.mktemp("listeners"), own_name_on_loopback=True) as nodes:
        yield nodes


def multi_node_env(rank: int) -> dict[str, str]:
    return {
        **os.environ,
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "RANK": str(rank),
        "MASTER_ADDR": "n0",
        "PYTHONPATH": str(ROOT),
    }


@pytest.mark.parametrize("own_name_on_loopback", [False, True], ids=["dns", "debian-hosts"])
def test_host_address_is_each_nodes_own(own_name_on_loopback, tmp_path):
    if reason := nodes_permitted():
        pytest.skip(reason)
    with cluster(2, tmp_path, own_name_on_loopback=own_name_on_loopback) as nodes:
        for i, node in enumerate(nodes):
            done = node.run(
                [PY, "-c", HOST_ADDRESS],
                env=multi_node_env(2 * i),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert done.stdout.strip() == node.addr, done.stderr[-2000:]


def test_the_world_gloo_group_spans_the_nodes(nodes):
    """torch's gloo device takes the address the hostname resolves to: with Debian's hosts file that is
    127.0.1.1 and the first collective fails ("connectFullMesh ... remote=[127.0.1.1]"); megamarl pins
    GLOO_SOCKET_IFNAME to the host-address rule's interface (``network.pin_gloo_interface``)."""
    env = {
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "n0",
        "MASTER_PORT": "29411",
    }
    ranks = [
        node.popen(
            [PY, "-c", WORLD],
            env={**multi_node_env(i), **env, "RANK": str(i)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, node in enumerate(nodes)
    ]
    outs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], [err[-2000:] for _, err in outs]
    assert [out.split() for out, _ in outs] == [["eth0", "2.0"], ["eth0", "2.0"]]


def test_the_recording_endpoint_on_n0_answers_n1(nodes):
    n0, n1 = nodes
    server = n0.popen(
        [PY, "-c", SERVE_ENDPOINT],
        env=multi_node_env(0),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base, token = (server.stdout.readline().split() + ["", ""])[:2]
        assert base.startswith(f"http://{n0.addr}:"), (base, server.stderr.read() if not base else "")
        reply = n1.run(
            [PY, "-c", GET, f"{base}/v1/models", token],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert reply.returncode == 0, reply.stderr[-2000:]
        assert json.loads(reply.stdout)["object"] == "list"
    finally:
        server.kill()
        server.wait()
