"""``PeerWatch``: which ranks are still alive, so that a lost node stops the run in bounded time.

Every rank bumps a counter of its own in the rendezvous store every ``interval_s`` (from a thread with
its own store connection) and reads the others'; a rank whose counter has not moved for ``timeout_s``
(``trainer.peer_timeout_s``) is lost. A rank that ends marks itself exited first (``stop``, ``atexit``),
so only a SIGKILLed or unreachable rank goes silent. A collective that fails early (``suspect``)
shortens the wait to ``SUSPECT_INTERVALS``. The first rank to conclude publishes the verdict, every rank
adopts it within an interval, and ``on_lost(lost)`` runs once per rank.
Why not the collectives' own errors: docs/design-notes.md, "megamarl/parallel/peers.py".
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

SUSPECT_INTERVALS = 3  # after a failed collective, heartbeats a silent rank may miss before it is named
VERDICT = "lost"


@dataclass(frozen=True)
class RankHome:
    """Where a rank runs: its node's hostname and the address its peers reach it at."""

    hostname: str
    address: str


def heartbeat_interval(timeout_s: float) -> float:
    """A tenth of the timeout, between 0.5 and 5 s."""
    return min(5.0, max(0.5, timeout_s / 10))


def describe_lost(lost: list[int], homes: list[RankHome]) -> str:
    """``lost ranks [2, 3] (node n1, 10.77.0.2)``; several nodes are listed one after the other."""
    nodes: dict[RankHome, list[int]] = {}
    for rank in lost:
        nodes.setdefault(homes[rank], []).append(rank)
    where = "; ".join(f"node {home.hostname}, {home.address}" for home in nodes)
    return f"lost ranks {sorted(lost)} ({where})"


class PeerWatch:
    def __init__(
        self,
        *,
        rank: int,
        homes: list[RankHome],
        timeout_s: float,
        on_lost: Callable[[list[int], str], None],
        prefix: str = "megamarl/peers",
        store_addr: tuple[str, int] | None = None,
    ) -> None:
        """``homes``: every rank's ``RankHome`` (``gather_homes``); ``on_lost(lost, why)`` runs in the
        watch's thread once a verdict is reached (it is expected to end the process)."""
        self.rank, self.homes, self.world_size = rank, homes, len(homes)
        self.timeout_s, self.interval_s = timeout_s, heartbeat_interval(timeout_s)
        self.on_lost = on_lost
        self.prefix = f"{prefix}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        host, port = store_addr or (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self.store_rank = 0  # the store lives with the agent of rank 0's node (torchrun's group rank 0)
        self._seen = [0] * self.world_size
        self._changed = [time.monotonic()] * self.world_size
        self._suspect_since: float | None = None
        self._someone_exited = False  # a store that fails after a rank exited is the normal end
        self._stop = threading.Event()
        self._verdict = threading.Event()
        self.lost: list[int] = []
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    # -- what the main thread calls ----------------------------------------------------------------

    def suspect(self, *, wait_s: float | None = None) -> list[int]:
        """A collective failed: name the ranks silent for ``SUSPECT_INTERVALS`` heartbeats (waits at
        most ``wait_s``, default that many intervals plus one). [] when every rank still beats or
        exited on its own: the failure was not a lost rank."""
        self._suspect_since = self._suspect_since or time.monotonic()
        wait_s = (SUSPECT_INTERVALS + 1) * self.interval_s if wait_s is None else wait_s
        self._verdict.wait(wait_s)
        return list(self.lost)

    def stop(self) -> None:
        """This rank ends (normally or by an exception): mark it exited, stop beating."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(Exception):
            self.store.set(f"{self.prefix}/exited/{self.rank}", "1")

    # -- the thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        failing_since: float | None = None
        while not self._stop.is_set():
            try:
                self._beat()
                failing_since = None
            except Exception as exc:  # noqa: BLE001 - the store's host is gone or unreachable
                if self._stop.is_set() or self._someone_exited:
                    return
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since >= self._patience():  # not one hiccup: the store is gone
                    lost = [r for r, home in enumerate(self.homes) if home == self.homes[self.store_rank]]
                    self._conclude(
                        lost,
                        f"the rendezvous store on rank {self.store_rank}'s node stopped answering "
                        f"({type(exc).__name__})",
                        publish=False,
                    )
                    return
            if self._verdict.is_set():
                return
            self._stop.wait(self.interval_s)

    def _beat(self) -> None:
        self.store.add(f"{self.prefix}/beat/{self.rank}", 1)
        now = time.monotonic()
        if self.store.check([f"{self.prefix}/{VERDICT}"]):
            published = self.store.get(f"{self.prefix}/{VERDICT}").decode()
            lost, _, why = published.partition(":")
            self._conclude([int(r) for r in lost.split(",")], why, publish=False)
            return
        exited = [self.store.check([f"{self.prefix}/exited/{r}"]) for r in range(self.world_size)]
        self._someone_exited = any(exited)
        silent: list[int] = []
        for r in range(self.world_size):
            if r == self.rank or exited[r]:
                continue
            count = self.store.add(f"{self.prefix}/beat/{r}", 0)
            if count != self._seen[r]:
                self._seen[r], self._changed[r] = count, now
            if now - self._changed[r] > self._patience():
                silent.append(r)
        if silent:  # a node fails as a unit: its other ranks, silent for two heartbeats, go with it
            homes = [self.homes[r] for r in silent]
            silent += [
                r
                for r in range(self.world_size)
                if r != self.rank
                and r not in silent
                and not exited[r]
                and self.homes[r] in homes
                and now - self._changed[r] > 2 * self.interval_s
            ]
            quiet = max(now - self._changed[r] for r in silent)
            self._conclude(silent, f"no heartbeat for {quiet:.0f} s", publish=True)

    def _patience(self) -> float:
        """How long a rank may stay silent: the timeout, or a few heartbeats once a collective failed."""
        return self.timeout_s if self._suspect_since is None else SUSPECT_INTERVALS * self.interval_s

    def _conclude(self, lost: list[int], why: str, *, publish: bool) -> None:
        if self._verdict.is_set():
            return
        self.lost = sorted(lost)
        if publish:
            with contextlib.suppress(Exception):
                self.store.set(f"{self.prefix}/{VERDICT}", f"{','.join(map(str, self.lost))}:{why}")
        self.on_lost(self.lost, why)  # ends the process, normally: suspect() then never returns
        self._verdict.set()

    def reporter(self) -> bool:
        """Whether this rank reports the loss: the lowest rank not lost (one line for the whole job)."""
        return self.rank == min(r for r in range(self.world_size) if r not in self.lost)


def gather_homes(*, address: str, group=None) -> list[RankHome]:
    """Every rank's ``RankHome``, gathered once at start-up over ``group`` (a collective)."""
    homes: list = [None] * dist.get_world_size()
    dist.all_gather_object(homes, RankHome(socket.gethostname(), address), group=group)
    return homes
