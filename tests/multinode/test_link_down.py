"""One engine server's node unreachable (issue 41, item 5): two fake vLLM servers (a tiny HF model behind
vLLM's HTTP protocol), one on n0 and one on n1, behind the driver's ``EnginePool`` on n0
(tests/multinode/link_down_pool.py). n1's link is taken down between requests and brought back later:

* with the link down, the requests routed to n1's replica get no answer (packets are dropped, nothing
  fails); the pool's stall watch probes it, declares it dead, and every request is served by n0's
  replica; the next batch goes to n0 alone;
* with the link back, the replica is rebuilt once it answers (it rejoins) and takes no traffic while its
  weights are stale; after the re-sync push it serves again.

The probe's patience is shortened to 5 s (60 s in a run: ``BUSY_PATIENCE_S``). About 40 s.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from nodes import cluster, nodes_permitted  # tests/ helper

pytestmark = [pytest.mark.multinode, pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "link_down_pool.py"
PORT = 18080


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    if reason := nodes_permitted():
        pytest.skip(reason)
    shared = tmp_path_factory.mktemp("shared")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    with cluster(2, shared) as nodes:
        servers = [node.popen([sys.executable, str(SCRIPT), "serve", node.addr, str(PORT)], env=env, cwd=ROOT,
                              stdout=-1, text=True) for node in nodes]
        for server in servers:
            assert server.stdout.readline().startswith("ready")
        urls = [f"http://{node.addr}:{PORT}" for node in nodes]
        log = open(shared / "driver.log", "w")  # noqa: SIM115
        driver = nodes[0].popen([sys.executable, str(SCRIPT), "drive", *urls, str(shared)], env=env, cwd=ROOT,
                                stdout=log, stderr=log)
        path = shared / "events.jsonl"

        def wait_phase(n: int) -> None:
            deadline = time.monotonic() + 300
            while not path.exists() or len(path.read_text().splitlines()) < n:
                assert driver.poll() is None, (shared / "driver.log").read_text()[-3000:]
                assert time.monotonic() < deadline, (shared / "driver.log").read_text()[-3000:]
                time.sleep(0.1)

        wait_phase(1)
        nodes[1].link_down()
        (shared / "down").touch()
        wait_phase(3)
        nodes[1].link_up()
        (shared / "up").touch()
        assert driver.wait(timeout=300) == 0, (shared / "driver.log").read_text()[-3000:]
    return {e["phase"]: e for e in map(json.loads, path.read_text().splitlines())}


def test_both_replicas_serve_while_the_link_is_up(events):
    both = events["both"]
    assert both["failed"] == 0 and all(n > 0 for n in both["served"])


def test_the_unreachable_replica_is_declared_dead_and_the_run_goes_on(events):
    both, down, again = events["both"], events["down"], events["down_again"]
    assert down["failed"] == 0 and down["live"] == [True, False]
    assert down["failovers"] >= 1  # the requests routed to it were retried on n0's replica
    assert down["served"][1] == both["served"][1]  # n1 answered none of them
    assert down["seconds"] < 60  # stall (2 s) + the probe's patience (5 s), not the 600 s request timeout
    assert again["failed"] == 0 and again["served"][0] - down["served"][0] == 8


def test_it_rejoins_and_serves_after_the_resync(events):
    rejoined, resynced = events["rejoined"], events["resynced"]
    assert rejoined["live"] == [True, True] and rejoined["stale"] == [1]
    assert rejoined["served"][1] == events["down_again"]["served"][1]  # stale: no traffic yet
    assert resynced["failed"] == 0 and resynced["stale"] == []
    assert resynced["served"][1] > rejoined["served"][1]
