"""``megamarl.parallel.peers.PeerWatch`` over a real TCPStore: three watches in one process stand for three
ranks on two nodes. A rank that stops beating without exiting is named after the timeout (or after a
few heartbeats once a collective failed), with its node; a rank that exits is never named; the verdict
is published so that every rank reaches the same one; a store that goes away takes its node's ranks.
About 10 s."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megamarl.parallel.network import free_port
from megamarl.parallel.peers import SUSPECT_INTERVALS, PeerWatch, RankHome, describe_lost, heartbeat_interval

HOMES = [RankHome("n0", "10.77.0.1"), RankHome("n0", "10.77.0.1"), RankHome("n1", "10.77.0.2")]


class Ranks:
    """Three watches on one store; ``verdicts[rank]`` is what ``on_lost`` received."""

    def __init__(self, timeout_s: float, prefix: str) -> None:
        self.port = free_port()
        self.server = dist.TCPStore("127.0.0.1", self.port, is_master=True, timeout=timedelta(seconds=30))
        self.verdicts: dict[int, tuple[list[int], str]] = {}
        self.done = threading.Event()
        self.watches = [
            PeerWatch(
                rank=r,
                homes=HOMES,
                timeout_s=timeout_s,
                on_lost=self._on_lost(r),
                prefix=prefix,
                store_addr=("127.0.0.1", self.port),
            )
            for r in range(3)
        ]

    def _on_lost(self, rank: int):
        def on_lost(lost: list[int], why: str) -> None:
            self.verdicts[rank] = (lost, why)

        return on_lost

    def freeze(self, rank: int) -> None:
        """The rank's node dies: its heartbeats stop, and it never marks itself exited."""
        self.watches[rank]._verdict.set()  # its thread leaves at the next beat

    def wait(self, ranks: list[int], within_s: float) -> float:
        start = time.monotonic()
        while not all(r in self.verdicts for r in ranks):
            assert time.monotonic() - start < within_s, self.verdicts
            time.sleep(0.05)
        return time.monotonic() - start

    def close(self) -> None:
        for watch in self.watches:
            watch.stop()


def test_a_silent_rank_is_named_with_its_node_after_the_timeout_and_exited_ranks_never():
    ranks = Ranks(timeout_s=3.0, prefix="t1")
    try:
        ranks.watches[1].stop()  # exits normally: never lost
        time.sleep(0.2)
        ranks.freeze(2)
        took = ranks.wait([0], within_s=3.0 + 3 * heartbeat_interval(3.0))
        assert took > 2.0  # not before the timeout
        lost, why = ranks.verdicts[0]
        assert lost == [2] and "no heartbeat" in why
        assert ranks.watches[0].reporter()
        assert describe_lost(lost, HOMES) == "lost ranks [2] (node n1, 10.77.0.2)"
        assert 1 not in ranks.verdicts  # it stopped watching when it exited
    finally:
        ranks.close()


def test_a_failed_collective_names_the_silent_rank_within_a_few_heartbeats_and_everyone_adopts_it():
    timeout_s = 10.0  # beyond the assertion below: only suspicion names the rank in time
    ranks = Ranks(timeout_s=timeout_s, prefix="t2")
    try:
        time.sleep(heartbeat_interval(timeout_s) + 0.5)  # everyone beat at least once
        ranks.freeze(2)
        start = time.monotonic()
        assert ranks.watches[0].suspect(wait_s=30) == [2]
        assert time.monotonic() - start < (SUSPECT_INTERVALS + 2) * heartbeat_interval(timeout_s) < timeout_s
        ranks.wait([1], within_s=2 * heartbeat_interval(timeout_s))  # rank 1 adopts the published verdict
        assert ranks.verdicts[1][0] == [2] and not ranks.watches[1].reporter()
    finally:
        ranks.close()


def test_no_silent_rank_means_the_failure_was_something_else():
    ranks = Ranks(timeout_s=60.0, prefix="t3")
    try:
        assert ranks.watches[0].suspect(wait_s=1.0) == []
        assert not ranks.verdicts
    finally:
        ranks.close()


def test_the_store_going_away_loses_the_node_that_hosted_it():
    ranks = Ranks(timeout_s=2.0, prefix="t4")
    try:
        time.sleep(0.6)
        ranks.freeze(0)
        ranks.freeze(1)
        del ranks.server  # rank 0's node (the agent hosting the store) is gone
        ranks.wait([2], within_s=10)
        lost, why = ranks.verdicts[2]
        assert lost == [0, 1] and "rendezvous store" in why
    finally:
        ranks.close()


@pytest.mark.parametrize(("timeout_s", "interval_s"), [(1.0, 0.5), (30.0, 3.0), (600.0, 5.0)])
def test_heartbeat_interval(timeout_s, interval_s):
    assert heartbeat_interval(timeout_s) == interval_s
