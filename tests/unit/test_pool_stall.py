"""``EnginePool``'s stall watch: a replica that answers nothing (its node unreachable: no request ever
fails, so the pool never saw a ``ConnectionError``) is probed after ``stall_s``, declared dead when the
probe fails, and the requests waiting on it are retried on the other replica; a replica that is only
slow answers the probe and keeps its requests; the dead one is rebuilt by the factory (it rejoins) and
takes traffic once it carries the pool's weights. A few seconds."""

from __future__ import annotations

import asyncio
import threading
import time

from megamarl.rollout.engines.base import Engine, Generation, SamplingParams
from megamarl.rollout.replicas.pool import EnginePool

SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)


class Replica(Engine):
    """A replica whose answers take ``delay_s``; ``unreachable`` makes requests hang and probes fail
    (after ``probe_s``, as ``JSONClient.answers`` gives up on a silent server)."""

    def __init__(
        self, name: str, *, delay_s: float = 0.0, unreachable: bool = False, probe_s: float = 0.2
    ) -> None:
        self.name, self.delay_s, self.unreachable, self.probe_s = name, delay_s, unreachable, probe_s
        self.weight_version = 0
        self.probes = 0
        self.answered = 0

    async def generate(self, prompt_ids, sampling, *, lora=None) -> list[Generation]:
        if self.unreachable:
            await asyncio.Event().wait()  # a request into a dropped link: no answer, no error
        await asyncio.sleep(self.delay_s)
        self.answered += 1
        return [
            Generation(
                token_ids=[1],
                logprobs=[0.0],
                finish_reason="length",
                weight_version=self.weight_version,
                meta={"replica": self.name},
            )
        ]

    def health(self) -> bool:
        self.probes += 1
        if self.unreachable:
            time.sleep(self.probe_s)
            return False
        return True

    def update_weights(self, weights, *, version: int, lora=None) -> None:
        self.weight_version = version


def _generate(pool: EnginePool, n: int) -> list[str]:
    async def main():
        return await asyncio.gather(*(pool.generate([1, 2], SAMPLING) for _ in range(n)))

    return [g[0].meta["replica"] for g in asyncio.run(main())]


def test_an_unreachable_replica_is_declared_dead_and_its_requests_served_by_the_other():
    built: list[Replica] = []
    link = threading.Event()  # set: the link is back

    def factory(index: int) -> Replica:
        rebuild = index == 1 and any(r.name == "r1" for r in built)
        if rebuild:  # waits until the replica answers again, as PolicyReplicas.connect's factory does
            link.wait(10)
        replica = Replica(f"r{index}", unreachable=index == 1 and not rebuild)
        if rebuild:
            replica.weight_version = -1  # a rebuilt server carries its checkpoint, not the pool's weights
        built.append(replica)
        return replica

    pool = EnginePool(factory, 2, stall_s=1.0, weights_provider=None)
    start = time.monotonic()
    texts = _generate(pool, 4)
    took = time.monotonic() - start
    assert texts == ["r0"] * 4  # the two requests routed to r1 were abandoned and retried on r0
    assert pool.live[1] is False and pool.failovers == 2
    assert 1.0 <= took < 5.0  # after stall_s (+ the probe), not after the client's request timeout
    assert built[1].probes == 1  # one probe for all the requests waiting on it
    assert _generate(pool, 2) == ["r0", "r0"]  # the run goes on with the other replica
    link.set()
    pool.wait_restarts(timeout_s=10)
    assert pool.live[1] and pool.stale_replicas() == [1]  # rejoined, not serving until re-synced
    assert _generate(pool, 2) == ["r0", "r0"]
    with pool.external_update(pool.weight_version, only=pool.stale_replicas()) as targets:  # the re-sync push
        assert targets == [(1, 1)]
    assert sorted(_generate(pool, 4)) == ["r0", "r0", "r1", "r1"]


def test_a_slow_replica_answers_the_probe_and_keeps_its_requests():
    pool = EnginePool(lambda i: Replica(f"r{i}", delay_s=2.5 if i == 1 else 0.0), 2, stall_s=0.5)
    texts = _generate(pool, 2)
    assert sorted(texts) == ["r0", "r1"]
    assert pool.live == [True, True] and pool.failovers == 0
    assert pool.replicas[1].probes >= 1  # it was probed (silent past stall_s) and answered
