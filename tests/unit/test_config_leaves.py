"""Property-style check: every leaf of two valid configs, mutated into a wrong type and into an
out-of-range value, is rejected by ``scripts/train.py`` at load time with exit code 2 and one line
``config error: ...`` that names the leaf's full key path (with the real policy/agent name), before
any model or process group exists. Leaves where the mutation is a legitimate value are listed in
``FREE`` with the reason."""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path

import pytest

from megamarl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from train import main  # noqa: E402

CONFIGS = {"signalling_tiny.yaml": 1, "quickstart_cpu.yaml": 2}  # config -> world size it is planned for

# (leaf pattern, mutation kind): why the mutated value is a valid setting
FREE = {
    (r"name|output_dir|logger\.wandb\.(entity|project)", "out of range"): "free text (a run name, a path to create)",
    (r"agents\.\w+\.system_prompt", "out of range"): "free text (a prompt)",
    (r"agents\.\w+\.choices", "out of range"): "free text (the choices an agent may name)",
    (r"algorithm\.invalid_penalty", "out of range"): "-1e9 is a (large) penalty; > 0 is rejected (test below)",
    (r"agents\.\w+\.sampling\.allowed_tokens", "out of range"):
        "checked against the tokenizer (one token each) when the driver starts, not at load time",
}
DICT_LEAVES = ("env.kwargs", "orchestra.kwargs", "algorithm.estimator_kwargs")  # validated by their component


def leaves(obj, prefix=""):
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp, path = getattr(obj, f.name), hints[f.name], f"{prefix}{f.name}"
        if typing.get_origin(tp) is typing.Union:  # Optional[X]
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
            if dataclasses.is_dataclass(tp) and value is None:
                continue
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            yield from leaves(value, path + ".")
        elif origin is dict and dataclasses.is_dataclass(args[1]):
            for key, entry in value.items():
                yield from leaves(entry, f"{path}.{key}.")
        else:
            yield path, tp


def mutations(tp) -> list[tuple[str, str]]:
    if tp is bool:
        return [("wrong type", "maybe")]
    if tp in (int, float):
        return [("wrong type", "abc"), ("out of range", "-1000000" if tp is int else "-1e9")]
    if tp is str:
        return [("wrong type", "{a: 1}"), ("out of range", "bogus_value")]
    if typing.get_origin(tp) is list:
        bad = "[-5]" if typing.get_args(tp)[0] is int else "[bogus_value]"
        return [("wrong type", "{a: 1}"), ("out of range", bad)]
    return []


def cases():
    for config in CONFIGS:
        for path, tp in leaves(load_config(ROOT / "configs" / config)):
            if path in DICT_LEAVES:
                continue
            for kind, text in mutations(tp):
                yield pytest.param(config, path, kind, text, id=f"{config.split('.')[0]}:{path}:{kind}")


def _free(path: str, kind: str) -> bool:
    return any(kind == k and re.fullmatch(pattern, path) for pattern, k in FREE)


def test_there_are_many_leaves():
    assert len(list(cases())) > 150


@pytest.mark.parametrize("config, path, kind, text", list(cases()))
def test_every_leaf_mutation_is_named_at_load_time(config, path, kind, text, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(CONFIGS[config]))
    override = f"{path}={text}"
    if _free(path, kind):
        load_config(ROOT / "configs" / config, [override]).placement(CONFIGS[config])  # accepted, as documented
        return
    code = main(["--config", str(ROOT / "configs" / config), override])
    err = capsys.readouterr().err
    assert code == 2, (override, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: ") and "Traceback" not in err, err
    assert re.search(r"(^|[\s'\"(])" + re.escape(path) + r"($|[^\w.])", lines[0]), (override, lines[0])


@pytest.mark.parametrize("override, message", [
    ("algorithm.group_by=[task,agentt]", "algorithm.group_by has unknown keys ['agentt']"),
    ("algorithm.loss_agg=foo", "algorithm.loss_agg='foo'"),
    ("algorithm.kl_type=k9", "algorithm.kl_type='k9'"),
    ("rollout.group_size=0", "rollout.group_size must be an integer >= 1, got 0"),
    ("rollout.num_tasks=-5", "rollout.num_tasks must be an integer >= 1, got -5"),
    ("agents.sender.sampling.temperature=-1", "agents.sender.sampling.temperature must be >= 0, got -1.0"),
    ("agents.receiver.sampling.top_p=5", "agents.receiver.sampling.top_p must be in (0, 1], got 5.0"),
    ("algorithm.invalid_penalty=0.5", "algorithm.invalid_penalty must be <= 0, got 0.5"),
    ("policies.shared.model=Qwen/Qwen2.5-0.5B-Instruct", "policies.shared.model='Qwen/Qwen2.5-0.5B-Instruct' looks like a model hub id"),
    ("policies.shared.lr=-1", "policies.shared.lr must be > 0, got -1.0"),  # was printed as policies.<p>.lr
    ("policies.shared.lr=nan", "policies.shared.lr must be a finite number, got nan"),
    ("policies.shared.engine.tp=0", "policies.shared.engine.tp must be >= 1, got 0"),
])
def test_issue_cases(override, message, capsys):
    assert main(["--config", str(ROOT / "configs/signalling_tiny.yaml"), "--dry-run", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and message in err and len(err.strip().splitlines()) == 1, err
