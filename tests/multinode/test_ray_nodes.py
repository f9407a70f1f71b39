"""Ray across nodes (issue 41, item 3): ``ray start --head`` on node n0, ``ray start --address`` on n1, and
a run of ``scripts/train.py`` on n0 with ``rollout.env_workers.backend=ray`` at the head's address.

n1 declares a custom resource (``--resources '{"env_node": 2}'``) and the run asks each actor for one
(``rollout.env_workers.resources={env_node: 1}``), so the env workers must run on n1; the judge of the
test env (tests/multinode/plugins/where_judge.py) writes its hostname and pid into the shared directory
for every judged step, which proves it: every judged step ran in one of the two workers, on n1. The run
trains its step. One run, checked several ways; about a minute and a half on the idle 2-core machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from nodes import SUBNET, cluster, nodes_permitted  # tests/ helper

pytestmark = [pytest.mark.multinode, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
RAY = ROOT / ".venv" / "bin" / "ray"
PY = ROOT / ".venv" / "bin" / "python"
PLUGINS = Path(__file__).resolve().parent / "plugins"
NUM_TASKS, GROUP_SIZE, NUM_WORKERS = 2, 2, 2
PORT = 6390


# Ray 2.60 refuses a node or driver that joins a head bound to a non-loopback address without the
# cluster's token (InvalidAuthToken, even with RAY_AUTH_MODE unset): every node and the driver share one.
TOKEN = os.urandom(16).hex()


def _env() -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONWARNINGS": "ignore",
        "WANDB_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": TOKEN,
    }
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    if reason := nodes_permitted():
        pytest.skip(reason)
    if not RAY.exists():
        pytest.skip("ray is not installed in .venv (pip install 'megamarl[ray]')")
    shared = tmp_path_factory.mktemp("shared")
    where = shared / "where"
    where.mkdir()
    with cluster(2, shared) as (n0, n1):
        head = n0.run(
            [
                str(RAY),
                "start",
                "--head",
                f"--node-ip-address={n0.addr}",
                f"--port={PORT}",
                "--num-cpus=1",
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
            env=_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert head.returncode == 0, head.stdout[-2000:] + head.stderr[-2000:]
        joined = n1.run(
            [
                str(RAY),
                "start",
                f"--address={n0.addr}:{PORT}",
                f"--node-ip-address={n1.addr}",
                "--num-cpus=1",
                '--resources={"env_node": 2}',
                "--disable-usage-stats",
            ],
            env=_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert joined.returncode == 0, joined.stdout[-2000:] + joined.stderr[-2000:]
        out = shared / "runs"
        run = n0.run(
            [
                str(PY),
                "scripts/train.py",
                "--config",
                "configs/slow_judge.yaml",
                "trainer.total_steps=1",
                f"rollout.num_tasks={NUM_TASKS}",
                f"rollout.group_size={GROUP_SIZE}",
                "rollout.env_workers.backend=ray",
                f"rollout.env_workers.address={n0.addr}:{PORT}",
                f"rollout.env_workers.num_workers={NUM_WORKERS}",
                "rollout.env_workers.resources={env_node: 1}",
                "env.name=where_judge",
                "env.kwargs.judge_s=[0.01]",
                f"+env.kwargs.where_dir={where}",
                "plugins=[megamarl.orchestration.envs.latency,where_judge]",
                f"plugin_paths=[{PLUGINS}]",
                f"output_dir={out}",
                "logger.plots=false",
            ],
            env=_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        listing = {node.name: node.ps() for node in (n0, n1)}
        for node in (n1, n0):
            node.run([str(RAY), "stop", "--force"], env=_env(), cwd=ROOT, capture_output=True, timeout=120)
    metrics = (
        [json.loads(line) for line in (out / "slow_judge" / "metrics.jsonl").read_text().splitlines()]
        if (out / "slow_judge" / "metrics.jsonl").is_file()
        else []
    )
    judged = {path.name: path.read_text().split() for path in where.iterdir()}
    print("ray env workers (hostname-pid: judged steps):", {k: len(v) for k, v in judged.items()})
    return run, metrics, judged, listing


def test_the_run_trains_with_env_workers_of_the_other_node(ray_run):
    run, metrics, _, _ = ray_run
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert (
        f"env steps of where_judge: in {NUM_WORKERS} ray workers at {SUBNET}.1:{PORT} (rollout.env_workers)"
        in output
    )
    assert len(metrics) == 1 and metrics[0]["policy/shared/optimizer_steps"] >= 1
    assert (
        metrics[0]["env_workers/calls"] == 2 * NUM_TASKS * GROUP_SIZE
        and metrics[0]["rollout/num_failed"] == 0
    )


def test_every_judged_step_ran_on_n1(ray_run):
    _, metrics, judged, listing = ray_run
    hosts = {name.rsplit("-", 1)[0] for name in judged}
    assert hosts == {"n1"}, judged
    assert 1 <= len(judged) <= NUM_WORKERS  # the run's actors, no more
    assert sum(map(len, judged.values())) == metrics[0]["env_workers/calls"]
    assert "raylet" in listing["n1"] and "gcs_server" in listing["n0"]
