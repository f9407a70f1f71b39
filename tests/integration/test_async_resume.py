"""Kill or preempt a run in an async mode and resume it (``scripts/train.py``, tiny signalling, 1 rank):
the resumed run trains the same samples as the uninterrupted one, so every step's rollout statistics,
staleness histogram, losses and grad norms are equal (float-exact), as sync mode's are
(tests/integration/test_resume.py, test_preemption.py).

* one_step_off, SIGKILL after step 2 is logged, ``save_every=1``: the checkpoint holds the finished
  prefetch of the next step (generated on the weights before the last update, which no checkpoint
  holds), and the resumed step trains it.
* fully_async, SIGTERM (preemption) after step 1, ``save_every=0`` (the reference never saves mid-run):
  the save drains in-flight groups into the buffer and stores buffer + task cursor. Exactness needs a
  fully_async run that is itself deterministic: a buffer of one batch (``max_staleness=1``,
  ``sync_every=1``) and drained pushes; with larger buffers or partial rollout, which group joins which
  batch depends on finishing times, and the checked bound is "nothing lost or trained twice"
  (tests/unit/test_async_schedules.py).
* fully_async with two policies (L3: sender_policy, receiver_policy), ``save_every=1``, SIGKILLed at
  three points inside a step (tests/gated_train.py: mid-episode, between the policies' updates, between
  their weight pushes), sharing one uninterrupted reference run: every (task, agent, turn) group of the
  data stream is trained once, in the step the reference trains it (``trained_groups.jsonl``).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml
from train_runs import Ranks, start, varies_between_runs  # tests/ helper

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RUN = "signalling_tiny"
RUN_TIMEOUT_S = 600  # a hang guard, sized for a busy machine (the suite runs on two xdist workers)
OVERRIDES = (
    "trainer.total_steps=4",
    "rollout.num_tasks=4",
    "eval.num_tasks=0",
    "logger.progress=false",
    "trainer.max_staleness=1",
)
CASES = {  # mode -> (signal, save_every, logged step after which it is sent)
    "one_step_off": (signal.SIGKILL, 1, 2),
    "fully_async": (signal.SIGTERM, 0, 1),
}


def _start(
    output_dir: Path,
    mode: str,
    save_every: int,
    *extra: str,
    config: Path = ROOT / "configs" / "signalling_tiny.yaml",
    gate: tuple[str, int, Path] | None = None,
) -> Ranks:
    """``scripts/train.py`` on one rank (``gate``: tests/gated_train.py, which stops there for a kill)."""
    env = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    argv = [
        "--config",
        str(config),
        *OVERRIDES,
        f"trainer.mode={mode}",
        f"trainer.save_every={save_every}",
        f"output_dir={output_dir}",
        *extra,
    ]
    log = output_dir.parent / f"{output_dir.name}-{len(extra)}.log"
    if gate is None:
        return start(argv, nproc=1, log=log, env=env)
    name, step, marker = gate
    argv = [name, str(step), str(marker), *argv, "logger.plots=false"]
    return start(argv, nproc=1, log=log, env=env, script=ROOT / "tests" / "gated_train.py")


def _log(output_dir: Path, num_extra: int) -> str:
    return (output_dir.parent / f"{output_dir.name}-{num_extra}.log").read_text()


def _metrics(output_dir: Path, run: str = RUN) -> list[dict]:
    lines = (output_dir / run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not varies_between_runs(k)} for line in lines]


@pytest.mark.parametrize("mode", list(CASES))
def test_async_run_killed_and_resumed_trains_the_same_samples(tmp_path, mode):
    sig, save_every, after_step = CASES[mode]
    reference, victim_dir = tmp_path / "reference", tmp_path / "victim"
    reference.mkdir(), victim_dir.mkdir()
    ref_proc = _start(reference, mode, save_every)
    victim = _start(victim_dir, mode, save_every)
    metrics = victim_dir / RUN / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (metrics.is_file() and f'"step": {after_step},' in metrics.read_text()):
        assert victim.poll() is None, _log(victim_dir, 0)[-3000:]
        assert time.monotonic() < deadline, f"the run never reached step {after_step}"
        time.sleep(0.02)
    victim.send_signal(sig)
    code = victim.wait(timeout=RUN_TIMEOUT_S)
    assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0), _log(victim_dir, 0)[-3000:]
    complete = sorted((victim_dir / RUN / "checkpoints").glob("step_*/COMPLETE"))
    assert complete, _log(victim_dir, 0)[-3000:]
    checkpoint = complete[-1].parent
    saved_step = int(checkpoint.name.removeprefix("step_"))
    assert 1 <= saved_step <= 3, checkpoint

    # what the checkpoint holds of the rollout side
    rollout = torch.load(checkpoint / "trainer.pt", weights_only=False)["driver"]["rollout_state"]
    assert rollout["mode"] == mode
    if mode == "one_step_off":
        prefetched = rollout["prefetched"]
        assert prefetched["chunk"] == saved_step  # the next step's tasks...
        # ...sampled on the weights of version saved_step, one push before those in the checkpoint
        assert {s.weight_version for s in prefetched["result"].samples} == {saved_step}
    else:
        queued = [part for parts in rollout["buffer"]["queues"].values() for part in parts]
        assert len(queued) == 4 and {p.task_id.rsplit("@", 1)[1] for p in queued} == {str(saved_step)}
        assert rollout["producer"]["next_chunk"] == saved_step + 1 and not rollout["producer"]["pending"]

    resumed = _start(victim_dir, mode, save_every, "trainer.resume=auto")
    assert resumed.wait(timeout=RUN_TIMEOUT_S) == 0, _log(victim_dir, 1)[-3000:]
    assert ref_proc.wait(timeout=RUN_TIMEOUT_S) == 0, _log(reference, 0)[-3000:]
    assert f"resumed from {checkpoint} at step {saved_step}" in _log(victim_dir, 1)
    ref_metrics, res_metrics = _metrics(reference), _metrics(victim_dir)
    assert [r["step"] for r in res_metrics] == [1, 2, 3, 4]
    for ref, res in zip(ref_metrics, res_metrics, strict=True):
        assert res == ref, f"step {ref['step']}"
    assert all(
        r["async/staleness/1"] == r["rollout/num_samples"] for r in ref_metrics[1:]
    )  # really off-policy
    assert any(r["policy/shared/grad_norm"] > 0 for r in ref_metrics)


# -- L3: two policies, killed mid-step --------------------------------------------------------------

L3_RUN = "signalling_l3"
L3_POLICIES = {"sender": "sender_policy", "receiver": "receiver_policy"}
L3_OVERRIDES = ("trainer.total_steps=3", "trainer.sync_every=1", "trainer.partial_rollout=false")
L3_KILLS = {"rollout": 2, "update": 2, "push": 3, "save": 2}  # gate (tests/gated_train.py) -> its step
GROUP_SIZE = 8  # configs/signalling_tiny.yaml's rollout.group_size


def _l3_config(root: Path) -> Path:
    """configs/signalling_tiny.yaml with its one policy split in two (L3): sender_policy, receiver_policy."""
    cfg = yaml.safe_load((ROOT / "configs" / "signalling_tiny.yaml").read_text())
    shared = cfg["policies"].pop("shared")
    cfg["policies"] = {policy: dict(shared) for policy in L3_POLICIES.values()}
    for agent, policy in L3_POLICIES.items():
        cfg["agents"][agent]["policy"] = policy
    path = root / f"{L3_RUN}.yaml"
    path.write_text(yaml.safe_dump({**cfg, "name": L3_RUN}))
    return path


def _saved_step(gate: str, step: int) -> int:
    """The last checkpoint of a run killed at ``gate`` of ``step``: the step's own past its save."""
    return step if gate == "save" else step - 1


def _trained_groups(output_dir: Path) -> list[dict]:
    lines = (output_dir / L3_RUN / "trained_groups.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_two_policy_fully_async_run_killed_mid_step_trains_every_group_once(tmp_path):
    """L3 fully_async, a one-batch buffer and drained pushes (deterministic), ``save_every=1``; three
    runs SIGKILLed at a gate (tests/gated_train.py): mid-episode in the rollout of step 2's overlap,
    between the two policies' updates of step 2, between their weight pushes of step 3, after step 2's
    checkpoint before its metrics line. Each resumes from the checkpoint before the step it died in,
    which that step had already taken its batch from (the last: from step 2's, logging its line).
    Resumed = uninterrupted: every trained (task, agent, turn) group of every step (trained_groups.jsonl)
    and every metrics value except wall-clock ones (``varies_between_runs``)."""
    config = _l3_config(tmp_path)
    reference = tmp_path / "reference"
    victims = {gate: tmp_path / gate for gate in L3_KILLS}
    for path in (reference, *victims.values()):
        path.mkdir()
    runs = {"reference": _start(reference, "fully_async", 1, *L3_OVERRIDES, config=config)}
    for gate, step in L3_KILLS.items():
        gated = (gate, step, tmp_path / f"{gate}.marker")
        runs[gate] = _start(victims[gate], "fully_async", 1, *L3_OVERRIDES, config=config, gate=gated)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for gate, step in L3_KILLS.items():
            marker = tmp_path / f"{gate}.marker"
            while not marker.is_file():
                assert runs[gate].poll() is None, _log(victims[gate], 3)[-3000:]
                assert time.monotonic() < deadline, f"the {gate} gate of step {step} was never reached"
                time.sleep(0.02)
            assert marker.read_text() == f"{gate} {step}"
            runs[gate].kill()
            assert runs[gate].poll() == -signal.SIGKILL
            # the step it died in had taken its batch (logged), and was never saved
            assert [g["step"] for g in _trained_groups(victims[gate])] == list(range(1, step + 1))
            saved = sorted(p.parent.name for p in (victims[gate] / L3_RUN / "checkpoints").glob("*/COMPLETE"))
            assert saved[-1] == f"step_{_saved_step(gate, step):06d}", saved
            assert [r["step"] for r in _metrics(victims[gate], L3_RUN)] == list(range(1, step))
        for gate in L3_KILLS:
            resume = (*L3_OVERRIDES, "trainer.resume=auto")
            runs[gate] = _start(victims[gate], "fully_async", 1, *resume, config=config)
        for name, run in runs.items():
            out = reference if name == "reference" else victims[name]
            assert run.wait(timeout=RUN_TIMEOUT_S) == 0, _log(out, 3 if name == "reference" else 4)[-3000:]
    finally:
        for run in runs.values():
            run.kill()

    # the reference trains every group of chunks 0, 1, 2 once: per policy, its agent's (task, agent,
    # turn) groups of one chunk per step, rollout.num_tasks of them, each of group_size samples
    ref_groups = _trained_groups(reference)
    for row in ref_groups:
        assert set(row["policies"]) == set(L3_POLICIES.values())
        for agent, policy in L3_POLICIES.items():
            part = row["policies"][policy]
            assert part["key"] == ["task", "agent", "turn"]
            chunk = row["step"] - 1
            assert len(part["groups"]) == 4 and len({task for task, _, _, _ in part["groups"]}) == 4
            assert {(task.rsplit("@", 1)[1], a, turn, n) for task, a, turn, n in part["groups"]} == {
                (str(chunk), agent, 0, GROUP_SIZE)
            }
    ref_metrics = _metrics(reference, L3_RUN)
    assert [r["step"] for r in ref_metrics] == [1, 2, 3]
    assert all(r["async/staleness/1"] == r["rollout/num_samples"] for r in ref_metrics[1:])  # off-policy
    for gate, step in L3_KILLS.items():
        log = _log(victims[gate], 4)
        assert f"at step {_saved_step(gate, step)}" in log and "resumed from" in log, log[-3000:]
        assert _trained_groups(victims[gate]) == ref_groups, gate
        for ref, res in zip(ref_metrics, _metrics(victims[gate], L3_RUN), strict=True):
            assert res == ref, f"{gate}: step {ref['step']}"
