"""``torchrun --nnodes 2`` across two network-namespace nodes (tests/nodes.py) running scripts/train.py,
exactly as on a cluster: ``torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint
<n0>:<port>`` in each node, the run directory on the shared directory, each node with its own address,
/dev/shm and /tmp (docs/cluster.md, "Several nodes").

One run, checked many ways (a module-scoped fixture), and one reference:

* two policies (tiny Llama, tiny Qwen2), ``placement_mode: disaggregated``, policy ``pa`` training on
  rank 0 (n0) with its engine server on rank 3 (n1, ``engine.ranks``), ``pb`` training on rank 2 (n1)
  with its server on rank 1 (n0): the driver (rank 0, n0) samples from pa's server on n1 over the
  namespace network, and every weight push crosses the node boundary (a gloo group on the sending
  node's address). The episodes come from the ``external`` orchestra: the agent program runs on n1
  (``remote_exec.py``, the tests' ``srun -w n1``), its ``OPENAI_BASE_URL`` pointing at the recording
  endpoint on n0's address.
* the one-node reference: the same config on 4 local ranks with the program run locally; the two-node
  run gives the same metrics (``scripts/compare_runs.py --metrics``), wall-clock keys excepted.

Engine servers are ``tests/fake_sglang`` (the real SGLang command line and HTTP protocol, transformers
behind it, a real gloo receiver; tests/fake_servers.py): what is under test is megamarl's side, the
addresses, groups and launches, not an engine's speed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nodes import cluster, nodes_permitted  # tests/ helper
from train_runs import ROOT, train  # tests/ helper

pytestmark = [pytest.mark.multinode, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]

PY = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
FAKE_SGLANG = str(ROOT / "tests" / "fake_sglang")
PROGRAM = "tests/multinode/signal_program.py"
RELAY = "tests/multinode/remote_exec.py"
RDZV_PORT, RELAY_PORT = 29400, 29500
RUN_TIMEOUT_S = 900
STEPS = 2

POLICY = """
    model: {model}
    ranks: {ranks}
    lr: 1.0e-3
    seq_len: 128
    dtype: fp32
    engine: {{backend: sglang, launch: server, tp: 1, num_replicas: 1, {engine_ranks} dtype: fp32,
             max_num_seqs: 16, num_threads: 1, bucket_mb: 1}}"""
CONFIG = """
name: {name}
placement_mode: disaggregated
policies:
  pa:{pa}
  pb:{pb}
agents:
  sender:
    policy: pa
    sampling: {{temperature: 1.0, max_tokens: 1}}
  receiver:
    policy: pb
    sampling: {{temperature: 1.0, max_tokens: 1}}
env: {{name: signalling, kwargs: {{terse: true, num_symbols: 2, num_digits: 2}}}}
orchestra: {orchestra}
rollout: {{num_tasks: 2, group_size: 4, max_concurrency: 8}}
algorithm: {{estimator: at_grpo, group_by: [task, agent, turn], normalize_std: false}}
eval: {{num_tasks: 0}}
trainer: {{total_steps: {steps}, seed: 0, resume: none}}
logger: {{wandb: {{mode: disabled}}, progress: false, plots: false}}
"""


def external(command: list[str]) -> str:
    # SIGNAL_LOG: the driver's variable the program logs to (the program sees only allow-listed ones)
    kwargs = json.dumps(
        {"command": command, "roles": ["sender", "receiver"], "timeout_s": 120, "pass_env": ["SIGNAL_LOG"]}
    )
    return f"{{name: external, kwargs: {kwargs}}}"


def config(name: str, *, pa_ranks, pb_ranks, pa_engine=(), pb_engine=(), orchestra: str) -> str:
    def policy(model, ranks, engine):
        return POLICY.format(
            model=model, ranks=list(ranks), engine_ranks=f"ranks: {list(engine)}," if engine else ""
        )

    return CONFIG.format(
        name=name,
        pa=policy("tiny-random-llama", pa_ranks, pa_engine),
        pb=policy("tiny-random-qwen2", pb_ranks, pb_engine),
        orchestra=orchestra,
        steps=STEPS,
    )


def run_env(**extra: str) -> dict[str, str]:
    """The ranks' environment: the fake ``sglang`` package first on the path."""
    path = os.pathsep.join(p for p in (FAKE_SGLANG, str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


class NodeRun:
    """One ``torchrun --nnodes N`` of scripts/train.py, one agent per node; what the tests look at."""

    def __init__(self, nodes, shared: Path, name: str, text: str, *, env: dict[str, str]) -> None:
        self.nodes, self.name = nodes, name
        self.out = shared / name
        self.out.mkdir(parents=True)
        self.config = self.out / f"{name}.yaml"  # on the shared directory: every node reads it
        self.config.write_text(text)
        self.run_dir = self.out / name
        self.listings: dict[str, str] = {}  # node -> its busiest ``ps`` seen during the run
        self.logs = {node.name: self.out / f"torchrun-{node.name}.log" for node in nodes}
        start = time.monotonic()
        procs = []
        for node in nodes:
            with open(self.logs[node.name], "w") as log:
                procs.append(
                    node.popen(self.command(), env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
                )
        deadline = start + RUN_TIMEOUT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            self._sample()
            time.sleep(2)
        for node in nodes:  # a hang: end it here (the fixture's teardown would too)
            if any(p.poll() is None for p in procs):
                node.kill_all()
        self.returncodes = [p.wait() for p in procs]
        self.wall_s = time.monotonic() - start

    def command(self) -> list[str]:
        return [
            TORCHRUN,
            "--nnodes",
            str(len(self.nodes)),
            "--nproc_per_node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{self.nodes[0].addr}:{RDZV_PORT}",
            "--rdzv-id",
            self.name,
            "scripts/train.py",
            "--config",
            str(self.config),
            f"output_dir={self.out}",
        ]

    def _sample(self) -> None:
        for node in self.nodes:
            listing = node.ps()
            if listing.count("python") > self.listings.get(node.name, "").count("python"):
                self.listings[node.name] = listing

    def output(self) -> str:
        return "".join(f"--- {n}\n{log.read_text(errors='replace')[-6000:]}" for n, log in self.logs.items())

    def check_ok(self) -> None:
        assert self.returncodes == [0] * len(self.nodes), self.output()

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    def servers(self) -> dict[str, dict]:
        return {s["policy"]: s for s in json.loads((self.run_dir / "engine_servers.json").read_text())}

    def server_calls(self, policy: str) -> list[dict]:
        log = (self.run_dir / "engine_logs" / f"{policy}-replica0.log").read_text()
        return [
            json.loads(line.split("[fake-sglang] ", 1)[1])
            for line in log.splitlines()
            if line.startswith("[fake-sglang] {")
        ]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    if reason := nodes_permitted():
        pytest.skip(reason)
    shared = tmp_path_factory.mktemp("cluster")
    with cluster(2, shared) as nodes:
        yield nodes, shared


@pytest.fixture(scope="module")
def run(nodes):
    nodes, shared = nodes
    n1 = nodes[1]
    relay = n1.popen(
        [PY, RELAY, "serve", n1.addr, str(RELAY_PORT)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert relay.stdout.readline().startswith("serving")
    # the program runs on n1, as ``srun -w n1 python signal_program.py`` would run it on a cluster
    command = ["python", RELAY, n1.name, str(RELAY_PORT), "--", "python", PROGRAM]
    run = NodeRun(
        nodes,
        shared,
        "cross",
        cross_config(external(command)),
        env=run_env(SIGNAL_LOG=str(shared / "cross-signal.jsonl")),
    )
    run.signal_log = shared / "cross-signal.jsonl"
    relay.kill()
    relay.wait()
    return run


def cross_config(orchestra: str) -> str:
    return config("cross", pa_ranks=[0], pa_engine=[3], pb_ranks=[2], pb_engine=[1], orchestra=orchestra)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The reference: the same config and seed on 4 local ranks of this machine, the program local."""
    out = tmp_path_factory.mktemp("one_node")
    path = out / "cross.yaml"
    path.write_text(cross_config(external(["python", PROGRAM])))
    start = time.monotonic()
    run_dir, rows, _ = train(path, out, nproc=4, timeout=RUN_TIMEOUT_S, env=run_env())
    return run_dir, rows, time.monotonic() - start


def test_both_policies_train_across_two_nodes(run):
    run.check_ok()
    rows = run.metrics()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["rollout/num_episodes"] == 8 and row["rollout/num_failed"] == 0
        assert "policy/pa/loss" in row and "policy/pb/loss" in row
    print(f"\ntwo-node run: {run.wall_s:.0f} s wall")
    for node, listing in run.listings.items():
        print(f"--- ps in {node}\n{listing}")


def test_each_node_runs_its_ranks_and_the_other_policys_server(run):
    run.check_ok()
    n0, n1 = run.nodes
    servers = run.servers()
    # the servers advertise their node's address (bound to 0.0.0.0), never loopback or the wildcard
    assert re.fullmatch(rf"http://{re.escape(n1.addr)}:\d+", servers["pa"]["url"]), servers
    assert re.fullmatch(rf"http://{re.escape(n0.addr)}:\d+", servers["pb"]["url"]), servers
    assert (servers["pa"]["ranks"], servers["pb"]["ranks"]) == ([3], [1])
    for node, model, other in (
        (n0, "tiny-random-qwen2", "tiny-random-llama"),
        (n1, "tiny-random-llama", "tiny-random-qwen2"),
    ):
        listing = run.listings[node.name]  # what ``ps`` inside the node showed at its busiest
        assert listing.count("scripts/train.py") >= 3, listing  # torchrun's agent and its two ranks
        # the server of the policy trained on the other node (megamarl's server_guard and the server under it)
        servers = [line for line in listing.splitlines() if "sglang.launch_server" in line]
        assert servers and all(model in line for line in servers) and other not in listing, listing


def test_every_push_crosses_the_node_boundary(run):
    run.check_ok()
    n0, n1 = run.nodes
    for policy, trainer_node in (("pa", n0), ("pb", n1)):
        calls = run.server_calls(policy)
        [init] = [c for c in calls if c["path"] == "/init_weights_update_group"]
        body = init["body"]
        assert body["master_address"] == trainer_node.addr, body  # the sender's node, the other one
        assert body["backend"] == "gloo"
        pushes = [c for c in calls if c["path"] == "/update_weight_version"]
        assert len(pushes) >= STEPS  # the initial push and one after each step but the last


def test_the_agent_program_runs_on_n1_and_reaches_the_endpoint_on_n0(run):
    run.check_ok()
    n0, n1 = run.nodes
    episodes = [json.loads(line) for line in run.signal_log.read_text().splitlines()]
    assert len(episodes) == 8 * STEPS
    assert {e["host"] for e in episodes} == {n1.name}
    assert all(e["base"].startswith(f"http://{n0.addr}:") for e in episodes), episodes[0]


def test_gives_the_metrics_of_the_one_node_run(run, one_node):
    run.check_ok()
    run_dir, _, wall_s = one_node
    # rtol 1e-5, atol 1e-6: the sampled tokens, rewards and counts are equal, but the servers' fp32 log-probs
    # depend on how requests were batched (timing), so TIS weights and losses differ in the last bits (~1e-7
    # relative seen); a GRPO loss whose advantages cancel is ~4e-7 itself, and there its noise (6e-8) is the
    # whole value, so it is compared absolutely
    done = subprocess.run(
        [
            PY,
            "scripts/compare_runs.py",
            "--rtol",
            "1e-5",
            "--atol",
            "1e-6",
            "--metrics",
            str(run_dir / "metrics.jsonl"),
            str(run.run_dir / "metrics.jsonl"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    print(f"\none-node reference: {wall_s:.0f} s wall\n{done.stdout}")
    assert done.returncode == 0, done.stdout + done.stderr
