"""A node dies in the middle of a 2-node ``torchrun`` run of ``scripts/train.py`` (issue 41, item 5).

Two nodes of tests/nodes.py, one ``torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d
--rdzv-endpoint n0:PORT`` each (ranks 0-1 on n0, 2-3 on n1), the tiny signalling run at DP=4 with a
checkpoint every step. Once step 2's checkpoint is complete (step 3 is under way) every process of n1 is
SIGKILLed. Then, from ONE run checked several ways:

* node 0's torchrun exits non-zero within ``LOST_BOUND_S`` of the kill (``trainer.peer_timeout_s``, the
  documented bound; here the dead ranks' sockets close, so the next collective fails and the silent
  ranks are named after a few heartbeats: megamarl.parallel.peers);
* its output has exactly one ``lost ranks`` line naming n1 and its ranks 2 and 3;
* the same command relaunched on both nodes resumes from step 2's checkpoint and trains step 3, the
  last, once: metrics.jsonl holds steps 1-3 exactly once, the first run's rows unchanged. (That a
  resumed step equals the uninterrupted run's is shown across nodes by tests/slurm/test_slurm_nodes.py
  and on one node by test_preemption: the same checkpoint path; no third run here.)

The timeline (kill, detection, exit code, resume step) is written to ``<shared>/timeline.json`` and
printed. About 3 minutes on the idle 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from nodes import cluster, nodes_permitted  # tests/ helper
from train_runs import varies_between_runs  # tests/ helper

pytestmark = [pytest.mark.multinode, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = ROOT / ".venv" / "bin" / "torchrun"
RUN = "signalling_tiny"
TOTAL_STEPS = 3
KILL_AFTER = 2  # step whose checkpoint is complete when n1 dies
PEER_TIMEOUT_S = 20  # trainer.peer_timeout_s for this run (default 60)
LOST_BOUND_S = PEER_TIMEOUT_S + 20  # kill -> node 0's torchrun exit: the bound plus torchrun's own teardown
OVERRIDES = (
    "policies.shared.ranks=[0,1,2,3]",
    f"trainer.total_steps={TOTAL_STEPS}",
    "trainer.save_every=1",
    "rollout.num_tasks=4",
    "eval.num_tasks=0",
    "logger.progress=false",
    "logger.plots=false",
    "trainer.resume=auto",
    f"trainer.peer_timeout_s={PEER_TIMEOUT_S}",
)
PORT = 29411


def _command(out: Path) -> list[str]:
    return [
        str(TORCHRUN),
        "--nnodes",
        "2",
        "--nproc_per_node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"n0:{PORT}",
        "--rdzv-id",
        "lost",
        "--max-restarts",
        "0",
        "scripts/train.py",
        "--config",
        f"configs/{RUN}.yaml",
        *OVERRIDES,
        f"output_dir={out}",
    ]


def _env() -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "WANDB_MODE": "disabled",
        "PYTHONPATH": str(ROOT),
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    env.pop("OMP_NUM_THREADS", None)
    return env


def _launch(nodes, out: Path, tag: str) -> list:
    procs = []
    for node in nodes:
        log = open(out / f"{tag}-{node.name}.log", "wb")  # noqa: SIM115 - closed with the test's tmp dir
        procs.append(node.popen(_command(out), env=_env(), cwd=ROOT, stdout=log, stderr=log))
    return procs


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )


def _stable(record: dict) -> dict:
    """Without the timings (test_preemption's rule): what the seeded run computes."""
    return {k: v for k, v in record.items() if not varies_between_runs(k)}


@pytest.fixture(scope="module")
def lost_run(tmp_path_factory):
    if reason := nodes_permitted():
        pytest.skip(reason)
    shared = tmp_path_factory.mktemp("shared")
    out = shared / "runs"
    out.mkdir()
    timeline: dict = {}
    with cluster(2, shared) as nodes:
        t0 = time.time()
        procs = _launch(nodes, out, "first")
        complete = out / RUN / "checkpoints" / f"step_{KILL_AFTER:06d}" / "COMPLETE"
        deadline = time.monotonic() + 600
        while not complete.exists():
            assert procs[0].poll() is None, (out / "first-n0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "step 2's checkpoint never completed"
            time.sleep(0.1)
        listing = {node.name: node.ps() for node in nodes}
        timeline["kill"] = time.time()
        killed = nodes[1].kill_all()
        code = procs[0].wait(timeout=LOST_BOUND_S + 600)  # measured below against the bound
        timeline["exit"] = time.time()
        timeline["exit_code"] = code
        timeline["killed_pids"] = len(killed)
        first_log = (out / "first-n0.log").read_text(errors="replace")
        lines_done = len(_metrics(out / RUN))
        timeline["steps_logged_before_kill"] = lines_done
        first_rows = _metrics(out / RUN)
        timeline["relaunch"] = time.time()
        procs = _launch(nodes, out, "second")
        codes = [p.wait(timeout=600) for p in procs]
        timeline["relaunch_exit_codes"] = codes
        timeline["end"] = time.time()
        second_log = (out / "second-n0.log").read_text(errors="replace")
        found = re.search(r"resumed from \S+step_(\d+) at step (\d+)", second_log)
        timeline["resume_step"] = int(found.group(2)) if found else None
        timeline["detection_s"] = round(timeline["exit"] - timeline["kill"], 1)
        timeline["wall_s"] = round(timeline["end"] - t0, 1)
    (shared / "timeline.json").write_text(json.dumps(timeline, indent=1))
    print("lost-node timeline:", json.dumps(timeline), file=sys.stderr)
    for name, ps in listing.items():  # the per-node process listing at the kill
        print(f"--- processes of {name} before the kill\n{ps}", file=sys.stderr)
    yield SimpleRun(timeline, first_log, second_log, _metrics(out / RUN), first_rows, listing, out)


class SimpleRun:
    def __init__(self, timeline, first_log, second_log, metrics, first_rows, listing, out):
        self.timeline, self.first_log, self.second_log = timeline, first_log, second_log
        self.metrics, self.first_rows, self.listing, self.out = metrics, first_rows, listing, out


def test_the_surviving_node_stops_within_the_bound_with_a_non_zero_code(lost_run):
    t = lost_run.timeline
    assert t["exit_code"] != 0, lost_run.first_log[-3000:]
    assert t["exit"] - t["kill"] < LOST_BOUND_S, (t, lost_run.first_log[-3000:])
    assert (
        "train.py" in lost_run.listing["n1"] and "train.py" in lost_run.listing["n0"]
    )  # both nodes had ranks


def test_one_line_names_the_lost_node_and_its_ranks(lost_run):
    lines = [line for line in lost_run.first_log.splitlines() if "lost ranks" in line]
    assert len(lines) == 1, lost_run.first_log[-4000:]
    assert re.search(r"lost ranks \[2, 3\] \(node n1, 10\.77\.0\.2\)", lines[0]), lines[0]
    assert f"step_{KILL_AFTER:06d}" in lines[0] and "trainer.resume=auto" in lines[0], lines[0]


def test_the_relaunch_resumes_and_no_step_is_lost_or_trained_twice(lost_run):
    t = lost_run.timeline
    assert t["relaunch_exit_codes"] == [0, 0], lost_run.second_log[-3000:]
    assert t["resume_step"] == KILL_AFTER, lost_run.second_log[-3000:]
    assert [m["step"] for m in lost_run.metrics] == list(range(1, TOTAL_STEPS + 1))
    assert [m["step"] for m in lost_run.first_rows] == list(range(1, KILL_AFTER + 1))  # before the relaunch
    assert [_stable(m) for m in lost_run.metrics[:KILL_AFTER]] == [_stable(m) for m in lost_run.first_rows]
