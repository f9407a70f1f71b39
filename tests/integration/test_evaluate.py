"""``scripts/evaluate.py``: a run, a checkpoint, an exported model or the configured models
evaluated on the configured eval sets without training (issue #27 item 5).

One training run serves every check: ``configs/presets/signalling.yaml`` on 1 rank, 2 steps, a
checkpoint and an evaluation at every step. The exact check: an evaluation of a step's weights scores
what the run itself logged at that step (the same weights pushed into the same hf engine, the held-out
seed, every engine call seeded), so eval.json's results are equal, not close:

* ``--run-dir`` (the run's own config.yaml) == the step-2 entry; the run directory is left as it was;
* ``--checkpoint .../step_000001`` on 2 ranks (the 1-rank checkpoint loaded at DP=2) == the step-1 entry;
* ``--hf`` of the run exported with ``megamarl-convert`` == the step-2 entry (the export is fp32,
  the source model's dtype; the worker reads it through the same HF <-> Megatron mapping the push
  uses, so the engine gets the checkpoint's tensors bit for bit);
* no source (the configured model) == the step-0 entry.

For the equalities to tell the steps apart the evaluation samples (``eval.temperature=1``, 16 tasks x
``eval.k=4``): greedy over the default 4 tasks scored 0.25 at steps 0, 1 and 2 alike (the tiny random
model's argmax barely moves in 2 steps), while the sampled results differ between the steps (checked
first). The entropy bonus gives the update its gradient: the rewards of a group are all equal here,
so the advantages are 0 (as in test_export.py).

A second, two-policy run (L3: sender and receiver each on its own copy of the tiny Llama, 1 step)
checks the role-swap ablation (scripts/bench_learning.py): its checkpoint evaluated with
``agents.sender.policy=receiver_policy agents.receiver.policy=sender_policy`` loads each policy's
trained weights under its own name and serves each agent from the other role's policy. A swap at
step 0 (both policies the same base model) scores exactly the run's step-0 entry; at step 1 the
unswapped evaluation scores the step-1 entry and the swapped one scores differently.

Errors (bad flags and paths, ``eval.num_tasks=0``) exit 2 before any model loads; they call the
script's ``main`` in this process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from train_runs import launch, train  # tests/ helper

from megamarl.cli.export import main as convert_main

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EVALUATE = ROOT / "scripts" / "evaluate.py"
PRESET = ROOT / "configs" / "presets" / "signalling.yaml"
EVAL = ("eval.num_tasks=16", "eval.k=4", "eval.temperature=1.0")  # the training run's, for --config PRESET
sys.path.insert(0, str(ROOT / "scripts"))
from evaluate import main as evaluate_main


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The training run: (run directory, its eval.json entries by step)."""
    run_dir, _, _ = train(
        PRESET,
        tmp_path_factory.mktemp("train"),
        nproc=1,
        timeout=600,
        env=_env(),
        overrides=(
            "name=run",
            "trainer.save_every=1",
            "eval.every=1",
            "policies.shared.entropy_coef=0.01",
            *EVAL,
        ),
    )
    entries = json.loads((run_dir / "eval.json").read_text())
    assert [e["step"] for e in entries] == [0, 1, 2]
    logged = {e["step"]: e["results"] for e in entries}
    assert not logged[0] == logged[1] == logged[2], logged  # measured: all three differ
    return run_dir, logged


TINY = {"model": "tiny-random-llama", "lr": 3.0e-3, "entropy_coef": 0.01, "engine": {"backend": "hf"}}
SWAP = ("agents.sender.policy=receiver_policy", "agents.receiver.policy=sender_policy")


@pytest.fixture(scope="module")
def l3_run(tmp_path_factory):
    """The two-policy run (module docstring): its config file, run directory and eval.json by step."""
    root = tmp_path_factory.mktemp("l3")
    signalling = yaml.safe_load((ROOT / "configs" / "presets" / "task" / "signalling.yaml").read_text())
    for role in ("sender", "receiver"):
        signalling["agents"][role]["policy"] = f"{role}_policy"
    config = root / "l3.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                **signalling,
                "name": "l3",
                "policies": {"sender_policy": dict(TINY), "receiver_policy": dict(TINY)},
                "rollout": {"num_tasks": 4, "group_size": 4},
                "eval": {"every": 1, "num_tasks": 16, "k": 4, "temperature": 1.0},
                "trainer": {"total_steps": 1},
                "logger": {"wandb": {"mode": "disabled"}, "progress": False},
            }
        )
    )
    run_dir, _, _ = train(config, root, nproc=1, timeout=600, env=_env())
    logged = {e["step"]: e["results"] for e in json.loads((run_dir / "eval.json").read_text())}
    assert list(logged) == [0, 1] and logged[0] != logged[1], logged
    return config, run_dir, logged


def _evaluate(out: Path, *args: str, nproc: int = 1) -> tuple[dict, str]:
    """scripts/evaluate.py on ``nproc`` local ranks (as torchrun runs it); its one eval.json entry and
    the ranks' output."""
    log = out.with_name(out.name + ".log")
    code = launch(["--out", str(out), *args], nproc=nproc, log=log, timeout=600, env=_env(), script=EVALUATE)
    output = log.read_text(errors="replace")
    assert code == 0, output[-8000:]
    [entry] = json.loads((out / "eval.json").read_text())
    return entry, output


def _refused(*args: str) -> str:
    """``main`` exits 2 with one ``config error:`` line; returns it."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = evaluate_main(list(args))
    lines = stderr.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("config error: "), stderr.getvalue()[-3000:]
    return lines[0]


def test_evaluate_a_run_scores_what_it_logged(run, tmp_path):
    run_dir, logged = run
    before = {f: (run_dir / f).read_bytes() for f in ("eval.json", "config.yaml", "metrics.jsonl")}
    entry, output = _evaluate(tmp_path / "eval", "--run-dir", str(run_dir))
    assert entry["step"] == 2 and entry["results"] == logged[2], (entry, logged)
    assert "eval of --run" in output and "team_accuracy" in output  # the table (plain lines: not a TTY)
    assert {f: (run_dir / f).read_bytes() for f in before} == before  # the run's own files untouched
    assert (tmp_path / "eval" / "config.yaml").is_file()


def test_evaluate_a_checkpoint_on_two_ranks(run, tmp_path):
    run_dir, logged = run
    entry, _ = _evaluate(
        tmp_path / "eval",
        "--config",
        str(PRESET),
        "--checkpoint",
        str(run_dir / "checkpoints" / "step_000001"),
        *EVAL,
        nproc=2,
    )
    assert entry["step"] == 1 and entry["results"] == logged[1], (entry, logged)


def test_evaluate_an_export_and_the_base_model(run, tmp_path):
    run_dir, logged = run
    with contextlib.redirect_stderr(io.StringIO()):
        convert_main(["--from", "run", "--to", "hf", str(run_dir), str(tmp_path / "hf")])
    entry, _ = _evaluate(tmp_path / "hf-eval", "--config", str(PRESET), "--hf", str(tmp_path / "hf"), *EVAL)
    assert entry["step"] == 2 and entry["results"] == logged[2], (entry, logged)
    entry, output = _evaluate(tmp_path / "base-eval", "--config", str(PRESET), *EVAL)
    assert entry["step"] == 0 and entry["results"] == logged[0], (entry, logged)
    assert "eval of the configured models" in output


def test_evaluate_errors_name_the_flag_or_key(run, tmp_path):
    run_dir, _ = run
    step = run_dir / "checkpoints" / "step_000002"
    assert "--run-dir" in _refused("--run-dir", str(tmp_path / "nope"))
    assert "--checkpoint" in _refused("--checkpoint", str(run_dir))  # a run directory, not a checkpoint
    assert "eval.num_tasks" in _refused("--checkpoint", str(step), "eval.num_tasks=0")
    assert "trainer.resume" in _refused("--run-dir", str(run_dir), "trainer.resume=none")
    assert "--out" in _refused("--run-dir", str(run_dir), "--out", str(run_dir))
    assert "--hf" in _refused("--config", str(PRESET), "--hf", str(tmp_path))  # no <policy>/ model directory
    assert "--config" in _refused("--hf", str(tmp_path))


def test_evaluate_with_the_roles_policies_swapped(l3_run, tmp_path):
    config, run_dir, logged = l3_run
    base, _ = _evaluate(tmp_path / "base-swapped", "--config", str(config), *SWAP)
    assert base["results"] == logged[0], (base, logged)  # one base model: a swap changes nothing at step 0
    step = run_dir / "checkpoints" / "step_000001"
    trained, _ = _evaluate(tmp_path / "trained", "--checkpoint", str(step))
    swapped, _ = _evaluate(tmp_path / "swapped", "--checkpoint", str(step), *SWAP)
    assert trained["results"] == logged[1], (trained, logged)
    assert swapped["step"] == 1 and swapped["results"] != trained["results"], (swapped, trained)
    evaluated = yaml.safe_load((tmp_path / "swapped" / "config.yaml").read_text())
    assert {role: a["policy"] for role, a in evaluated["agents"].items()} == {
        "sender": "receiver_policy",
        "receiver": "sender_policy",
    }
