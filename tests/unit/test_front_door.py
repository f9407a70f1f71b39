"""The front door (issue #28 item 4): every bad input a user can hand ``scripts/train.py`` through a
file fails before any model or engine is built, with exit code 2, one line ``config error: ...``
naming the key, the file and (where there is one) the line, and nothing in an existing run directory
changed. Inputs an override alone can give are in ``test_config_leaves.py``; torchrun in
``tests/integration/test_front_door_torchrun.py``. docs/reliability.md, "The front door", lists them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megamarl.runtime import checkpoint

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from train import main

SIGNALLING = ROOT / "configs" / "signalling_tiny.yaml"
MATH = ROOT / "configs" / "presets" / "math.yaml"
CODE = ROOT / "configs" / "presets" / "code.yaml"


def _refused(capsys, config: Path, *overrides: str, check: bool = True) -> str:
    """``train.py`` exits 2 with one ``config error:`` line and no traceback; returns the line."""
    code = main(["--config", str(config), *(["--check"] if check else []), *overrides])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("config error: "), err[:3000]
    assert "Traceback" not in err
    return lines[0]


# ---- env datasets: validated when the config loads, not at the first rollout ------------------------

_ROW = {
    "math": {"question": "What is 2 + 3?", "answer": 5},
    "code": {"spec": "Write add(a, b).", "fn_name": "add", "tests": [{"input": [1, 2], "output": 3}]},
}
_BAD_FILES = {  # name -> (file bytes or None for a directory / nothing, message after "<key> <file>")
    "missing": (None, " does not exist"),
    "a directory": (None, " is a directory, not a JSONL file"),
    "empty": (b"\n  \n", " is empty (no JSON lines)"),
    "malformed JSON on line 2": (
        '{row}\n{{"question": 1,\n',
        ":2: not valid JSON at column 16: Expecting property name",
    ),
    "not UTF-8": (b"\xff\xfe{}\n", ":1: not UTF-8 text (byte 0: b'\\xff')"),
    "a list, not an object": ("{row}\n[1, 2]\n", ":2: each line must be a JSON object, got list"),
    "wrong fields": ('{row}\n{{"q": 1}}\n', ":2: "),
}


@pytest.mark.parametrize("env", ["math", "code"])
@pytest.mark.parametrize("case", list(_BAD_FILES))
def test_bad_dataset_files_are_named_with_file_and_line(env, case, tmp_path, capsys):
    content, message = _BAD_FILES[case]
    path = tmp_path / "data.jsonl"
    if case == "a directory":
        path.mkdir()
    elif content is not None:
        path.write_bytes(
            content if isinstance(content, bytes) else content.format(row=json.dumps(_ROW[env])).encode()
        )
    key = "env.dataset_path" if env == "math" else "env.dataset"
    field = key.removeprefix("env.")
    line = _refused(
        capsys, MATH if env == "math" else CODE, f"++env.kwargs.{field}={path}", f"output_dir={tmp_path}"
    )
    sep = ": " if case in ("missing", "a directory", "empty") else " "
    assert f"{key}{sep}{path}{message}" in line, line
    if case == "wrong fields":
        assert (
            "each line needs 'question' and 'answer'" if env == "math" else "missing field 'tests'"
        ) in line


def test_an_eval_set_dataset_is_named_by_its_set(tmp_path, capsys):
    path = tmp_path / "heldout.jsonl"
    path.write_text('{"question": "q"}\n')
    line = _refused(capsys, MATH, f"++eval.sets.heldout.kwargs.dataset_path={path}", f"output_dir={tmp_path}")
    assert (
        f"eval.sets.heldout.kwargs: env.dataset_path {path}:1: each line needs 'question' and 'answer'"
        in line
    )


# ---- YAML ---------------------------------------------------------------------------------------


def test_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("name: x\npolicies:\n  shared: {model: tiny-random-llama\nagents: {}\n")
    line = _refused(capsys, config)
    assert f"--config {config}:4:7: YAML syntax error: expected ',' or '}}', but got ':'" in line, line


def test_yaml_syntax_error_in_a_defaults_file_names_that_file(tmp_path, capsys):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "broken.yaml").write_text("trainer:\n  total_steps: [1, 2\n")
    config = tmp_path / "run.yaml"
    config.write_text(
        SIGNALLING.read_text().replace(
            "name: signalling_tiny", "defaults:\n  - base: broken\n  - _self_\nname: x"
        )
    )
    line = _refused(capsys, config)
    assert (
        f"{tmp_path / 'base' / 'broken.yaml'} (in --config {config}'s defaults):3:1: YAML syntax error: "
        "expected ',' or ']', but got '<stream end>'" in line
    ), line


@pytest.mark.parametrize(
    "text, message",
    [
        ("- name: x\n- policies: {}\n", "the top level is a list; a config is a mapping of keys"),
        ("just a string\n", "the top level is a single value ('just a string')"),
    ],
)
def test_a_config_that_is_not_a_mapping(tmp_path, capsys, text, message):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    assert f"--config {config}: {message}" in _refused(capsys, config)


def test_a_config_that_is_not_utf8(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_bytes(b"name: caf\xe9\n")
    assert f"--config {config}: not UTF-8 text (byte 9)" in _refused(capsys, config)


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("name: signalling_tiny", "nämé: x\nname: signalling_tiny", "config key 'nämé': unknown key"),
        ("  sender:\n", "  sënder:\n", "agents.sënder: 'sënder' is not a role of env 'signalling'"),
    ],
)
def test_unicode_keys_are_named(tmp_path, capsys, old, new, message):
    config = tmp_path / "run.yaml"
    config.write_text(SIGNALLING.read_text().replace(old, new, 1), encoding="utf-8")
    assert message in _refused(capsys, config, f"output_dir={tmp_path}")


# ---- run directory --------------------------------------------------------------------------------


def test_output_dir_that_cannot_hold_a_run_directory(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    line = _refused(capsys, SIGNALLING, f"output_dir={blocker}")
    assert (
        f"output_dir: cannot create the run directory {blocker}/signalling_tiny: {blocker} is a file" in line
    )
    line = _refused(capsys, SIGNALLING, "output_dir=/proc/megamarl-runs")  # not writable, even for root
    assert (
        "output_dir: cannot create the run directory /proc/megamarl-runs/signalling_tiny: /proc is not "
        "writable" in line
    )
    (tmp_path / "signalling_tiny").write_text("")
    line = _refused(capsys, SIGNALLING, f"output_dir={tmp_path}")
    assert f"the run directory {tmp_path}/signalling_tiny exists and is not a directory" in line


def _run_dir_snapshot(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and mtime, and every directory's mtime (an entry created and removed)."""
    return {
        str(p.relative_to(run_dir)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mtime_ns)
        for p in [run_dir, *sorted(run_dir.rglob("*"))]
    }


def _existing_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "signalling_tiny"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: signalling_tiny  # the earlier run's\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "team/reward_mean": 0.5}\n{"step": 2}\n')
    (run_dir / "eval.json").write_text('[{"step": 2}]')
    return run_dir


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.total_step=3"],
        ["trainer.seed=99999999999999999999"],
        ["~agents.receiver"],
        ["agents.sender.sampling.allowed_tokens=[A,hello_world]"],
        ["trainer.resume=auto"],  # the existing run's checkpoint is corrupt (made below)
    ],
)
def test_a_refused_launch_leaves_an_existing_run_directory_alone(tmp_path, capsys, overrides):
    """A real training launch (no --check): refused before the trainer, the driver (which writes
    config.yaml) or the metrics logger exist."""
    run_dir = _existing_run(tmp_path)
    _save_checkpoint(run_dir, step=2)
    (checkpoint.checkpoint_path(run_dir, 2) / checkpoint.TRAINER_STATE).write_bytes(b"not a pickle")
    before = _run_dir_snapshot(run_dir)
    _refused(capsys, SIGNALLING, f"output_dir={tmp_path}", *overrides, check=False)
    assert _run_dir_snapshot(run_dir) == before


# ---- trainer.resume: a corrupt checkpoint is refused before the run directory is touched ---------


def _save_checkpoint(run_dir: Path, *, step: int) -> Path:
    """A checkpoint in the trainer's layout: a dist checkpoint of policy 'shared' (the format and
    reader megatron-core's torch_dist uses), rng, trainer.pt, committed (marker + manifest) by
    ``checkpoint.commit`` as ``Trainer.save`` does."""
    final = checkpoint.checkpoint_path(run_dir, step)
    staging = checkpoint.staging_path(final)
    dcp.save(
        {"weight": torch.arange(1000.0), "bias": torch.ones(10)},
        checkpoint_id=str(staging / checkpoint.POLICIES / "shared"),
        no_dist=True,
    )
    checkpoint.save_rng(staging, 0)
    checkpoint.commit(
        staging, final, {"step": step, "versions": {"shared": 3}, "num_updates": {"shared": step}}
    )
    return final


def _shard(path: Path) -> Path:
    return path / checkpoint.POLICIES / "shared" / "__0_0.distcp"


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:100])


def _drop_manifest(path: Path) -> None:
    (path / checkpoint.COMPLETE).write_text(
        json.dumps({"step": 2}) + "\n"
    )  # a checkpoint saved before the manifest


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda p: _shard(p).write_bytes(b"garbage"),
            "policies/shared/__0_0.distcp has 7 bytes, the save wrote ",
        ),
        (lambda p: _truncate(_shard(p)), "policies/shared/__0_0.distcp has 100 bytes, the save wrote "),
        (
            lambda p: (_drop_manifest(p), _shard(p).write_bytes(b"garbage")),
            "policies/shared/__0_0.distcp holds 7 bytes, its metadata needs ",
        ),
        (
            lambda p: (_drop_manifest(p), (p / checkpoint.TRAINER_STATE).write_bytes(b"\x80garbage")),
            "trainer.pt does not load (",
        ),
        (
            lambda p: (
                _drop_manifest(p),
                (p / checkpoint.POLICIES / "shared" / ".metadata").write_bytes(b"junk"),
            ),
            "policies/shared/.metadata does not load",
        ),
        (lambda p: (p / checkpoint.COMPLETE).write_text("{not json"), "COMPLETE does not parse"),
        (lambda p: _shard(p).unlink(), "policies/shared/__0_0.distcp is missing"),
    ],
)
def test_a_corrupt_checkpoint_is_refused_naming_the_file(tmp_path, capsys, damage, message):
    run_dir = _existing_run(tmp_path)
    path = _save_checkpoint(run_dir, step=2)
    damage(path)
    before = _run_dir_snapshot(run_dir)
    line = _refused(capsys, SIGNALLING, f"output_dir={tmp_path}", f"trainer.resume={path}", check=False)
    assert f"trainer.resume: checkpoint {path} is corrupt: {message}" in line, line
    assert _run_dir_snapshot(run_dir) == before


def test_an_intact_checkpoint_passes_and_every_resume_form_is_checked(tmp_path, capsys):
    run_dir = _existing_run(tmp_path)
    path = _save_checkpoint(run_dir, step=2)
    no_tokens = [
        "agents.sender.sampling.allowed_tokens=[]",
        "agents.receiver.sampling.allowed_tokens=[]",
    ]  # no tokenizer
    for resume in (str(path), "auto", str(run_dir)):  # the checkpoint, the latest of this run, of a run dir
        assert (
            main(
                [
                    "--config",
                    str(SIGNALLING),
                    "--check",
                    f"output_dir={tmp_path}",
                    f"trainer.resume={resume}",
                    *no_tokens,
                ]
            )
            == 0
        )
    capsys.readouterr()
    _truncate(_shard(path))
    for resume in (str(path), "auto", str(run_dir)):
        line = _refused(capsys, SIGNALLING, f"output_dir={tmp_path}", f"trainer.resume={resume}")
        assert (
            f"trainer.resume: checkpoint {path} is corrupt: policies/shared/__0_0.distcp has 100 bytes"
            in line
        )


def test_a_checkpoint_without_the_policy_is_refused(tmp_path, capsys):
    path = _save_checkpoint(_existing_run(tmp_path), step=2)
    line = _refused(
        capsys,
        SIGNALLING,
        f"output_dir={tmp_path}",
        f"trainer.resume={path}",
        "policies.other.model=tiny-random-llama",
        "agents.receiver.policy=other",
    )
    assert f"trainer.resume: checkpoint {path} has no policies ['other']; it has ['shared']" in line


def test_the_manifest_lists_every_file_with_its_size(tmp_path):
    path = _save_checkpoint(tmp_path / "run", step=7)
    marker = json.loads((path / checkpoint.COMPLETE).read_text())
    files = {
        str(p.relative_to(path)): p.stat().st_size
        for p in path.rglob("*")
        if p.is_file() and p.name != "COMPLETE"
    }
    assert marker == {"step": 7, "files": files}
    assert set(files) == {
        "policies/shared/.metadata",
        "policies/shared/__0_0.distcp",
        "rng/rank_00000.pt",
        "trainer.pt",
    }


# ---- planner errors -------------------------------------------------------------------------------


def test_dry_run_planner_errors_exit_2(capsys):
    """A plan that does not fit (the model's 4 heads cannot take TP=3) is a config error too."""
    code = main(["--config", str(SIGNALLING), "--dry-run", "policies.shared.tp=3", "cluster.num_nodes=3"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("dry-run failed: ") and "policies.shared.tp=3" in err, err
    assert len(err.strip().splitlines()) == 1


# ---- roles the env turns off by config --------------------------------------------------------------


def test_a_role_the_env_turns_off_needs_no_agent(tmp_path, capsys):
    """math without the verifier (``Env.acting_roles``): solve_verify never reaches the verifier, so
    no agents.verifier is needed; with the verifier on, its absence is named at load time."""
    line = _refused(capsys, MATH, "~agents.verifier", f"output_dir={tmp_path}")
    assert (
        "agents.verifier is not defined, but orchestra 'solve_verify' calls role 'verifier' in env 'math'"
        in line
    )
    no_tokens = "agents.solver.sampling.allowed_tokens=[]"
    assert (
        main(
            [
                "--config",
                str(MATH),
                "--check",
                "~agents.verifier",
                "++env.kwargs.with_verifier=false",
                no_tokens,
                f"output_dir={tmp_path}",
            ]
        )
        == 0
    )


def test_check_outside_torchrun_places_on_the_declared_world(tmp_path, capsys, monkeypatch):
    """``--check`` before torchrun: a 2-rank config is checked on the 2 ranks it declares (not on the
    1 of a plain process); under torchrun, on torchrun's WORLD_SIZE."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    quickstart = ROOT / "configs" / "quickstart_cpu.yaml"
    assert main(["--config", str(quickstart), "--check", f"output_dir={tmp_path}"]) == 0
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--config", str(quickstart), "--check", f"output_dir={tmp_path}"]) == 2
    assert "policies.shared.ranks [1] out of range for world size 1" in capsys.readouterr().err
