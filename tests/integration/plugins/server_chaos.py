"""A signalling env that kills an engine server in the middle of a rollout (test harness for
tests/integration/test_train_with_servers.py): episode ``kill_at`` sends SIGKILL to the server of
``policy`` replica ``replica`` (its process group, led by the pid in ``<run_dir>/engine_servers.json``);
episode ``wait_at`` (counted over training and evaluation episodes) blocks until the owning rank has restarted
it and the driver's pool has rebuilt its client, so the trainer finds it restarted and unsynced at the next
step boundary."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from megamarl.orchestration.env import ENVS
from megamarl.orchestration.envs.signalling import SignallingConfig, SignallingEnv


@dataclass
class ChaosConfig(SignallingConfig):
    servers_file: str = ""
    policy: str = ""
    replica: int = 1
    kill_at: int = 10
    wait_at: int = 33


@ENVS.register("signalling_chaos")
class ChaosSignalling(SignallingEnv):
    Config = ChaosConfig
    episodes = 0

    def __init__(self, task, config: ChaosConfig) -> None:
        super().__init__(task, config)
        type(self).episodes += 1
        if type(self).episodes == config.kill_at:
            os.killpg(self._server(config)["pid"], signal.SIGKILL)  # the server's whole process group
        if type(self).episodes == config.wait_at:
            url = self._server(config)["url"]
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                try:
                    urllib.request.urlopen(url + "/health", timeout=5).read()
                    break
                except OSError:
                    time.sleep(1)
            time.sleep(5)  # the pool polls health once a second before it rebuilds the client

    @staticmethod
    def _server(config: ChaosConfig) -> dict:
        rows = json.loads(Path(config.servers_file).read_text())
        return next(r for r in rows if r["policy"] == config.policy and r["replica"] == config.replica)
