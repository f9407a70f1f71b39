"""``where_judge``: ``slow_judge`` whose judge writes where it ran (``<where_dir>/<hostname>-<pid>``, one
line per judged step) into a directory every node sees, so a test knows which node's env workers ran
the judges. A test plugin (``plugins: [where_judge]``, ``plugin_paths: [tests/multinode/plugins]``)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from megamarl.orchestration.env import ENVS, Task
from megamarl.orchestration.envs.latency import SlowJudgeConfig, SlowJudgeEnv


@dataclass
class WhereJudgeConfig(SlowJudgeConfig):
    where_dir: str = ""  # a directory on the cluster's shared filesystem


@ENVS.register("where_judge")
class WhereJudgeEnv(SlowJudgeEnv):
    Config = WhereJudgeConfig

    def __init__(self, task: Task, config: WhereJudgeConfig) -> None:
        super().__init__(task, config)
        self.where_dir = config.where_dir

    def step(self, agent: str, action):
        with open(Path(self.where_dir) / f"{socket.gethostname()}-{os.getpid()}", "a") as out:
            out.write(f"{agent}\n")
        return super().step(agent, action)
