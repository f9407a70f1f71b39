"""An SGLang engine replica as a server started by its owning rank, through ``scripts/train.py``
(issue #14): ``engine.backend: sglang, launch: server``, against two servers (issue #29): the real
SGLang 0.5.23 on CPU where ``scripts/setup.sh --extras sglang-cpu`` built ``.venv-sglang`` (named by
``engine.server_python``; skipped otherwise), and always ``tests/fake_sglang`` (put first on
``PYTHONPATH``): ``python -m sglang.launch_server`` that parses the real SGLang flags megamarl emits and
serves SGLang's HTTP protocol from transformers (``tests/fake_servers.py: FakeSGLangServer``), joining
the update group over a real gloo rendezvous. Everything on megamarl's side is the production path:
rank 1 owns the server, rank 0 trains (TP=1) and pushes every step's weights straight into it
(``/init_weights_update_group`` once, then per bucket ``/update_weights_from_distributed`` + a
broadcast), the driver's pool routes requests to it, and ``engine.verify_sync`` compares its greedy
``/generate`` tokens with transformers on the pushed tensors after every push.

A second run places the policy on ranks 0-1 (DP=2) with two *colocated* replicas, one per rank, each
fed by its own rank over a gloo group of that rank and its server (the CPU path for colocated SGLang
replicas) and asleep (``/release_memory_occupation``) while the policy trains.

The order of the calls a server received comes from its log: the fake logs each call with its body,
the real server logs each request's path (uvicorn's access log); bodies are checked on the fake only.
The real server decodes in fp32 (``engine.dtype``), so that ``verify_sync``'s exact comparison with
transformers in fp32 holds; the fake receives bf16.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from train_runs import train  # tests/ helper

from megamarl.rollout.servers.server_launch import sglang_venv_python

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS, EPISODES = 3, 4 * 4  # rollout.num_tasks x group_size

CONFIG = """
name: sglang_servers
policies:
  shared:
    model: tiny-plain-llama
    ranks: {policy_ranks}
    lr: 1.0e-3
    seq_len: 256
    dtype: fp32
    engine: {{backend: sglang, launch: server, tp: 1, {placement} dtype: {dtype}, {python}
             max_num_seqs: 32, num_threads: 1, bucket_mb: 1, verify_sync: true}}
agents:
  sender:
    policy: shared
    sampling: {{temperature: 1.0, max_tokens: 2}}
  receiver:
    policy: shared
    sampling: {{temperature: 1.0, max_tokens: 2}}
env: {{name: signalling, kwargs: {{terse: true, num_symbols: 10}}}}
orchestra: {{name: sequential}}
rollout: {{num_tasks: 4, group_size: 4, max_concurrency: 16}}
algorithm: {{estimator: at_grpo, group_by: [task, agent, turn], normalize_std: false}}
eval: {{num_tasks: 0}}
trainer: {{total_steps: {steps}, seed: 0, resume: none}}
logger: {{wandb: {{mode: disabled}}, progress: false}}
"""


PLACEMENTS = {
    "disaggregated": ("[0]", "num_replicas: 1, ranks: [1],"),
    "colocated": ("[0, 1]", "num_replicas: 2,"),
}


REAL = os.access(sglang_venv_python(), os.X_OK)
# a real SGLang server starts in ~80 s on 2 idle cores, minutes beside a loaded machine's other work
KINDS = [
    "fake",
    pytest.param(
        "real",
        marks=[
            pytest.mark.timeout(1200),
            pytest.mark.skipif(
                not REAL,
                reason=f"no real SGLang: {sglang_venv_python()} missing (bash scripts/setup.sh --extras "
                "sglang-cpu)",
            ),
        ],
    ),
]
_ACCESS = re.compile(r'"(?:GET|POST) (/[\w/]*) HTTP')


def _calls(text: str, kind: str) -> list[dict]:
    """The calls a server received, in order: the fake's records (path and body), or the real
    server's access log (path only)."""
    if kind == "fake":
        return [
            json.loads(line.split("[fake-sglang] ", 1)[1])
            for line in text.splitlines()
            if line.startswith("[fake-sglang] {")
        ]
    return [
        {"path": m.group(1)} for m in map(_ACCESS.search, text.splitlines()) if m and m.group(1) != "/health"
    ]


def _train(out: Path, placement: str, kind: str):
    policy_ranks, engine = PLACEMENTS[placement]
    config = out / "sglang_servers.yaml"
    python = f"server_python: {sglang_venv_python()}," if kind == "real" else ""
    config.write_text(
        CONFIG.format(
            steps=STEPS,
            policy_ranks=policy_ranks,
            placement=engine,
            python=python,
            dtype="fp32" if kind == "real" else "bf16",
        )
    )
    env = {}
    if kind == "fake":  # `python -m sglang.launch_server` finds the fake first
        fake = str(ROOT / "tests" / "fake_sglang")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (fake, str(ROOT), os.environ.get("PYTHONPATH")) if p)
    run_dir, rows, _ = train(config, out, nproc=2, timeout=900, env=env)
    texts = [
        log.read_text(errors="replace")
        for log in sorted((run_dir / "engine_logs").glob("shared-replica*.log"))
    ]
    return run_dir, rows, [_calls(text, kind) for text in texts], kind


@pytest.fixture(scope="module", params=KINDS)
def run(request, tmp_path_factory):
    run_dir, rows, (calls,), kind = _train(
        tmp_path_factory.mktemp(f"sglang_disagg_{request.param}"), "disaggregated", request.param
    )
    return run_dir, rows, calls, kind


@pytest.fixture(scope="module", params=KINDS)
def colocated(request, tmp_path_factory):
    return _train(tmp_path_factory.mktemp(f"sglang_coloc_{request.param}"), "colocated", request.param)


def test_the_replica_runs_on_rank_1_as_an_sglang_server(run):
    run_dir, _, calls, kind = run
    (server,) = json.loads((run_dir / "engine_servers.json").read_text())
    assert (server["policy"], server["replica"], server["ranks"], server["colocated"]) == (
        "shared",
        0,
        [1],
        False,
    )
    log = (run_dir / "engine_logs" / "shared-replica0.log").read_text()
    assert "-m sglang.launch_server --model-path" in log
    assert ("--dtype float32" if kind == "real" else "--dtype bfloat16") in log
    if kind == "real":  # engine.server_python ran it, on SGLang's CPU paths
        assert f"{sglang_venv_python()} -m sglang.launch_server" in log and "--device cpu" in log
        assert "The server is fired up and ready to roll" in log
    assert calls  # the server logged the calls it received


def test_every_step_pushes_over_update_weights_from_distributed_in_the_engine_dtype(run):
    _, rows, calls, kind = run
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    paths = [c["path"] for c in calls]
    assert paths.count("/init_weights_update_group") == 1
    updates = [c for c in calls if c["path"] == "/update_weights_from_distributed"]
    pushes = paths.count("/update_weight_version")
    # the initial push (version 1) before the first rollout, then one after each step but the last's
    assert pushes in (STEPS, STEPS + 1)
    buckets_per_push = len(updates) // pushes
    assert buckets_per_push > 1 and len(updates) == buckets_per_push * pushes  # bucket_mb: 1
    for row in rows:
        assert row["weight_sync/shared/bytes"] > 0
        assert row["weight_sync/shared/replicas"] == row["weight_sync/shared/verified_replicas"] == 1
    if kind == "fake":  # the bodies
        groups = [c["body"] for c in calls if c["path"] == "/init_weights_update_group"]
        assert (
            groups[0]["backend"] == "gloo" and groups[0]["world_size"] == 2 and groups[0]["rank_offset"] == 1
        )
        assert {c["group_name"] for c in updates} == {groups[0]["group_name"]}
        assert {d for c in updates for d in c["dtypes"]} == {
            "bfloat16"
        }  # engine.dtype, not the trainer's fp32
        assert {c["load_format"] for c in updates} == {"flattened_bucket"} and not any(
            c["flush_cache"] for c in updates
        )
        stamps = [c["body"]["new_version"] for c in calls if c["path"] == "/update_weight_version"]
        assert stamps == [str(v) for v in range(1, pushes + 1)]


def test_pushes_are_bracketed_by_pause_flush_and_continue(run):
    _, _, calls, _ = run
    lifecycle = {
        "/pause_generation",
        "/update_weight_version",
        "/flush_cache",
        "/continue_generation",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    }
    control = [c["path"] for c in calls if c["path"] in lifecycle]
    push = ["/pause_generation", "/update_weight_version", "/flush_cache", "/continue_generation"]
    assert control[:4] == push
    assert control == push * (len(control) // 4)
    assert "/release_memory_occupation" not in control  # disaggregated: the replica never sleeps


def test_samples_carry_the_pushed_version_and_the_step_completes(run):
    _, rows, calls, kind = run
    for row in rows:
        assert row["rollout/num_episodes"] == EPISODES and row["rollout/total_failed_episodes"] == 0
        assert row["async/staleness_max"] == 0
    # step k samples with push k's weights (push 1 comes before the first rollout)
    assert [r["engine/shared/replica0/weight_version"] for r in rows] == [
        float(k) for k in range(1, STEPS + 1)
    ]
    assert rows[-1]["engine/shared/replica0/requests"] > 0
    pushes = sum(1 for c in calls if c["path"] == "/update_weight_version")
    generates = [c for c in calls if c["path"] == "/generate"]
    # verify_sync's greedy probes (two prompts) after every push, then the rollout's sampled requests
    assert len(generates) > 2 * pushes
    if kind == "fake":
        greedy = [c for c in generates if c["temperatures"] == [0.0]]
        assert len(greedy) == 2 * pushes and all(c["num_inputs"] == 1 for c in greedy)
        assert sum(c["num_inputs"] for c in generates if c["temperatures"] == [1.0]) > 0


def test_colocated_replicas_are_fed_by_their_own_rank_and_sleep_while_training(colocated):
    run_dir, rows, calls, kind = colocated
    servers = json.loads((run_dir / "engine_servers.json").read_text())
    assert [(s["replica"], s["ranks"], s["colocated"]) for s in servers] == [(0, [0], True), (1, [1], True)]
    for row in rows:
        assert row["weight_sync/shared/replicas"] == row["weight_sync/shared/verified_replicas"] == 2
        assert row["rollout/num_episodes"] == EPISODES
    push = ["/pause_generation", "/update_weight_version", "/flush_cache", "/continue_generation"]
    # to sleep: /flush_cache until the scheduler is idle (SGLang asserts idleness on release), then release
    step = [
        "/flush_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        *push,
        "/resume_memory_occupation",
    ]
    lifecycle = set(step)
    for replica_calls in calls:
        assert [c["path"] for c in replica_calls].count(
            "/init_weights_update_group"
        ) == 1  # its own rank's group
        control = [c["path"] for c in replica_calls if c["path"] in lifecycle]
        assert control[:4] == push and control[4:] == step * ((len(control) - 4) // len(step))
        assert len(control) > 4
        if kind == "real":
            continue
        (group,) = [c["body"] for c in replica_calls if c["path"] == "/init_weights_update_group"]
        assert (
            group["world_size"] == 2 and group["rank_offset"] == 1 and group["backend"] == "gloo"
        )  # own rank
        tags = [c["body"]["tags"] for c in replica_calls if c["path"].endswith("_memory_occupation")]
        assert tags[:3] == [["weights", "kv_cache"], ["weights"], ["kv_cache"]]
        assert {
            d for c in replica_calls if c["path"] == "/update_weights_from_distributed" for d in c["dtypes"]
        } == {"bfloat16"}
