"""Kill a training run mid-step and resume it (``scripts/train.py`` on local ranks, ``train_runs.start``;
tiny signalling).

* Same layout: the resumed run's per-step metrics (rewards, per-agent sample statistics, losses,
  grad norms) and its final weights and optimizer state equal the uninterrupted run's exactly, and
  metrics.jsonl holds each step once.
* Other layout (the 1-rank checkpoint resumed at TP=2 on 2 ranks): step 3's rollout, sampled by the
  engine from the checkpoint's weights, is identical; its losses agree to float rounding.

The reference run and the run that gets killed start together (one core each). The premise,
seeded sampling that does not depend on how the engine batched the requests, is checked first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from train_runs import Ranks, start, varies_between_runs  # tests/ helper

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RUN = "signalling_tiny"  # the config's name: runs land in <output_dir>/signalling_tiny
RUN_TIMEOUT_S = 600  # a hang guard, sized for a busy machine (the suite runs on two xdist workers)
OVERRIDES = (
    "trainer.total_steps=4",
    "trainer.save_every=1",
    "rollout.num_tasks=4",
    "eval.num_tasks=0",
    "logger.progress=false",
)


def _start(
    output_dir: Path, *extra: str, num_ranks: int = 1, gate: tuple[str, int, Path] | None = None
) -> Ranks:
    """``scripts/train.py`` (``gate``: tests/gated_train.py, which stops there for a kill)."""
    env = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    argv = ["--config", "configs/signalling_tiny.yaml", *OVERRIDES, f"output_dir={output_dir}", *extra]
    log = output_dir.parent / f"{output_dir.name}.log"
    if gate is None:
        return start(argv, nproc=num_ranks, log=log, env=env)
    name, step, marker = gate
    argv = [name, str(step), str(marker), *argv, "logger.plots=false"]
    return start(argv, nproc=num_ranks, log=log, env=env, script=ROOT / "tests" / "gated_train.py")


def _kill(proc: Ranks, output_dir: Path) -> None:
    """SIGKILL the whole run at once, like a node loss: every rank's process group."""
    proc.kill()


def _wait(proc: Ranks, output_dir: Path, timeout_s: float = RUN_TIMEOUT_S) -> None:
    code = proc.wait(timeout=timeout_s)
    log = (output_dir.parent / f"{output_dir.name}.log").read_text()
    assert code == 0, log[-3000:]


def _metrics(output_dir: Path) -> list[dict]:
    lines = (output_dir / RUN / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not varies_between_runs(k)}


def _policy_state(checkpoint: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{checkpoint.parent.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint / "policies" / "shared", out)
    return torch.load(out, weights_only=False)


def _flat(state, prefix=""):
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _flat(value, f"{prefix}{key}/")
    elif isinstance(state, torch.Tensor):
        yield prefix, state


def _assert_same_final_checkpoint(reference: Path, resumed: Path, tmp_path: Path) -> dict:
    """Step 4's checkpoints of both runs hold identical weights and optimizer state (Adam moments
    included) and an identical trainer.pt; returns the reference run's trainer.pt."""
    ref_ckpt, res_ckpt = (d / RUN / "checkpoints" / "step_000004" for d in (reference, resumed))
    ref_state = dict(_flat(_policy_state(ref_ckpt, tmp_path)))
    res_state = dict(_flat(_policy_state(res_ckpt, tmp_path)))
    assert ref_state.keys() == res_state.keys() and any("exp_avg" in k for k in ref_state)
    for key, value in ref_state.items():
        assert torch.equal(res_state[key], value), key
    ref_run, res_run = (torch.load(c / "trainer.pt", weights_only=False) for c in (ref_ckpt, res_ckpt))
    assert res_run == ref_run
    return ref_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    reference, resumed = base / "reference", base / "resumed"
    for d in (reference, resumed):
        d.mkdir()
    ref_proc = _start(reference)
    victim = _start(resumed)
    metrics = resumed / RUN / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    # Kill once step 3 is logged: its checkpoint is at best being written, step 2's is complete.
    while not (metrics.is_file() and '"step": 3,' in metrics.read_text()):
        assert victim.poll() is None, (resumed.parent / "resumed.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run never reached step 3"
        time.sleep(0.02)
    _kill(victim, resumed)
    checkpoints = resumed / RUN / "checkpoints"
    killed_state = {
        "complete": sorted(p.parent.name for p in checkpoints.glob("step_*/COMPLETE")),
        "logged_steps": [r["step"] for r in _metrics(resumed)],
    }
    _wait(_start(resumed, "trainer.resume=auto"), resumed)
    _wait(ref_proc, reference)
    return reference, resumed, killed_state


def test_killed_run_resumes_bit_identical(runs, tmp_path):
    reference, resumed, killed = runs
    assert {"step_000001", "step_000002"} <= set(killed["complete"])
    assert killed["logged_steps"] == [1, 2, 3]

    ref_metrics, res_metrics = _metrics(reference), _metrics(resumed)
    assert [r["step"] for r in res_metrics] == [1, 2, 3, 4]  # lines after the checkpoint were cut
    for ref, res in zip(ref_metrics, res_metrics, strict=True):
        assert _stable(res) == _stable(ref), f"step {ref['step']}"
    assert any(r["policy/shared/grad_norm"] > 0 for r in ref_metrics)  # the comparison is not vacuous

    ref_run = _assert_same_final_checkpoint(reference, resumed, tmp_path)
    assert ref_run["versions"] == {"shared": 5} and ref_run["num_updates"] == {"shared": 4}
    names = sorted(p.name for p in (resumed / RUN / "checkpoints").iterdir())
    assert names == [f"step_00000{i}" for i in range(1, 5)]  # the killed save's .partial was cleared


def test_run_killed_between_a_save_and_its_metrics_line(runs, tmp_path):
    """SIGKILLed right after step 2's checkpoint is complete, before the step's metrics line is logged
    (tests/gated_train.py's ``save`` gate): the resumed run logs step 2's line from the checkpoint,
    equal to the uninterrupted run's but for the wall-clock values, then steps 3 and 4."""
    reference, _, _ = runs
    victim, marker = tmp_path / "victim", tmp_path / "save.marker"
    victim.mkdir()
    proc = _start(victim, gate=("save", 2, marker))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not marker.is_file():
        assert proc.poll() is None, (tmp_path / "victim.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the save gate of step 2 was never reached"
        time.sleep(0.02)
    _kill(proc, victim)
    assert [r["step"] for r in _metrics(victim)] == [1]
    assert (victim / RUN / "checkpoints" / "step_000002" / "COMPLETE").is_file()
    _wait(_start(victim, "trainer.resume=auto"), victim)

    ref_metrics, res_metrics = _metrics(reference), _metrics(victim)
    assert [r["step"] for r in res_metrics] == [1, 2, 3, 4]
    for ref, res in zip(ref_metrics, res_metrics, strict=True):
        assert _stable(res) == _stable(ref), f"step {ref['step']}"
    assert res_metrics[1]["timing_s/step"] > 0  # the re-logged line has the step's time up to its save


def test_resume_at_another_layout(runs, tmp_path):
    reference, resumed, _ = runs
    other = tmp_path / "tp2"
    other.mkdir()
    checkpoint = resumed / RUN / "checkpoints" / "step_000002"
    overrides = (f"trainer.resume={checkpoint}", "trainer.total_steps=3", "policies.shared.tp=2")
    _wait(_start(other, *overrides, num_ranks=2), other)

    (step3,) = _metrics(other)
    ref3 = _metrics(reference)[2]
    assert step3["step"] == 3
    # the trainer's per-agent figures (agent/<a>/mismatch_*) are computed at the new layout, like the losses
    trained = {k for k in ref3 if k.startswith("agent/") and "/mismatch_" in k}
    rollout = {
        k: v for k, v in _stable(ref3).items() if k.startswith(("rollout/", "agent/")) and k not in trained
    }
    assert {k: step3[k] for k in rollout} == rollout  # same weights, same seeds: the same samples
    assert trained and all(step3[k] == pytest.approx(ref3[k], rel=1e-4, abs=1e-6) for k in trained)
    for key in ("loss", "pg_loss", "entropy", "approx_kl"):
        name = f"policy/shared/{key}"
        assert step3[name] == pytest.approx(ref3[name], rel=1e-4, abs=1e-6), key


def test_seeded_rollout_does_not_depend_on_batching(tmp_path):
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megamarl.models.packaged import save_tiny_model
    from megamarl.orchestration import (
        AgentConfig,
        EnvMaker,
        SamplingConfig,
        build_agents,
        build_orchestra,
        run_episodes,
    )
    from megamarl.rollout.engines.hf import HFEngine

    path = save_tiny_model(tmp_path, "llama", seed=0)
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    maker = EnvMaker("signalling")
    sampling = SamplingConfig(temperature=1.0, max_tokens=2)
    agents = build_agents(
        {r: AgentConfig(policy="default", sampling=sampling) for r in maker.agents},
        tokenizer,
        default_kinds=maker.default_agents,
    )

    def rollout(*, max_batch_rows, max_concurrency, engine_seed, seed=7):
        engine = HFEngine(model, max_batch_rows=max_batch_rows, seed=engine_seed)
        result = asyncio.run(
            run_episodes(
                build_orchestra("sequential"),
                maker,
                maker.tasks(4, seed=3),
                agents=agents,
                engines={"default": engine},
                group_size=4,
                max_concurrency=max_concurrency,
                seed=seed,
            )
        )
        engine.shutdown()
        return [(s.episode_id, s.agent, s.response_ids) for s in result.samples]

    one_batch = rollout(max_batch_rows=64, max_concurrency=64, engine_seed=0)
    assert one_batch == rollout(max_batch_rows=3, max_concurrency=5, engine_seed=1)
    assert len({tuple(ids) for *_, ids in one_batch}) > 1  # episodes of a group still differ
    assert one_batch != rollout(max_batch_rows=64, max_concurrency=64, engine_seed=0, seed=8)
