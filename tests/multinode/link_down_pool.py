"""Both ends of tests/multinode/test_link_down.py, run inside the nodes.

``serve ADDR PORT``: a fake vLLM server (tests/fake_servers.py: a tiny HF model behind vLLM's HTTP
protocol) bound to the node's address. ``drive URL0 URL1 DIR``: the driver's ``EnginePool`` over both
servers, rebuilt replicas made as ``PolicyReplicas.connect`` makes them (wait until the server answers,
then a client at weight version -1). The test moves it through phases with marker files in ``DIR``;
each phase's result is one JSON line of ``DIR/events.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: fake_servers

PROMPT = [1, 9690, 198]
PATIENCE_S = 5.0  # the probe's patience (BUSY_PATIENCE_S, 60 s in a run), shortened for the test
STALL_S = 2.0


def serve(addr: str, port: int) -> None:
    from fake_servers import FakeVLLMServer

    from megamarl.models.tiny import tiny_model
    from megamarl.rollout.engines.hf import HFEngine

    server = FakeVLLMServer(HFEngine(tiny_model("llama", seed=0), max_wait_ms=1), host=addr, port=port)
    print("ready", server.url, flush=True)
    server.serve_forever()


def drive(urls: list[str], where: Path) -> None:
    from megamarl.rollout.engines.base import SamplingParams
    from megamarl.rollout.engines.vllm_server import VLLMServerClient
    from megamarl.rollout.replicas.policy import UNSYNCED, _await_health
    from megamarl.rollout.replicas.pool import EnginePool

    class Client(VLLMServerClient):
        def health(self) -> bool:
            return self.http.answers("/health", probe_s=1.0, patience_s=PATIENCE_S)

    def replica(index: int, *, restarted: bool = False) -> Client:
        if restarted:
            _await_health(urls[index], timeout_s=600)
        client = Client(urls[index], model="default", timeout_s=600)
        client.weight_version = UNSYNCED if restarted else 0
        return client

    pool = EnginePool(lambda i: replica(i), 2, stall_s=STALL_S)
    pool.factory = lambda i: replica(i, restarted=True)
    sampling = SamplingParams(temperature=1.0, max_tokens=4, seed=0)

    def phase(name: str, num_requests: int) -> None:
        async def main():
            return await asyncio.gather(*(pool.generate(PROMPT, sampling) for _ in range(num_requests)),
                                        return_exceptions=True)

        start = time.monotonic()
        results = asyncio.run(main())
        event = {"phase": name, "seconds": round(time.monotonic() - start, 2), "requests": num_requests,
                 "failed": sum(isinstance(r, BaseException) for r in results), "served": list(pool.served),
                 "live": list(pool.live), "failovers": pool.failovers, "stale": pool.stale_replicas()}
        with open(where / "events.jsonl", "a") as out:
            out.write(json.dumps(event) + "\n")

    def marker(name: str) -> None:
        while not (where / name).exists():
            time.sleep(0.1)

    phase("both", 8)
    marker("down")
    phase("down", 8)  # replica 1 unreachable: its requests stall, it is declared dead, they go to replica 0
    phase("down_again", 8)  # the run goes on with replica 0
    marker("up")
    pool.wait_restarts(timeout_s=120)  # the rebuild waited for the server to answer again: it rejoined
    phase("rejoined", 8)  # stale (weight version -1): it takes no traffic yet
    with pool.external_update(pool.weight_version, only=pool.stale_replicas()):
        pass  # the training ranks' push into the restarted replica (a version stamp for these fake weights)
    phase("resynced", 16)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        drive(sys.argv[2:4], Path(sys.argv[4]))
