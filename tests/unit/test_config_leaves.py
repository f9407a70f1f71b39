"""Property-style check: every leaf of the config schema (found in two valid configs), mutated into a wrong
type, into an out-of-range value and (text leaves) into a 5000-character value, is rejected by
``scripts/train.py --check`` (every start-up check of a training launch, nothing built) with exit code 2 and
one line ``config error: ...`` of at most ~600 characters (an over-long value's echo is cut) that names the
leaf's full key path (with the real policy/agent name), before any model or process group exists. Leaves where
the mutation is a legitimate value are listed in ``FREE`` with the reason. Then the front door's other inputs
that an override can give (run name, seed, ranks, roles, tokens)."""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from pathlib import Path

import pytest

from megamarl.cli.configure import load_config
from megamarl.config import MAX_ERROR_CHARS
from megamarl.parallel.placement import placement_of

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from train import main

CONFIGS = {"signalling_tiny.yaml": 1, "quickstart_cpu.yaml": 2}  # config -> world size it is planned for

# (leaf pattern, mutation kind): why the mutated value is a valid setting
FREE = {
    (
        r"name|output_dir|logger\.wandb\.(entity|project)",
        "out of range",
    ): "free text (a run name, a path to create)",
    (r"agents\.\w+\.system_prompt", "out of range"): "free text (a prompt)",
    (r"agents\.\w+\.choices", "out of range"): "free text (the choices an agent may name)",
    (
        r"rollout\.opponent_pool\.alias",
        "out of range",
    ): "free text (the name a policy mapping returns for the pool)",
    (
        r"rollout\.opponent_pool\.alias",
        "over-long",
    ): "free text (the name a policy mapping returns for the pool)",
    (r"agents\.\w+\.sampling\.stop", "out of range"): "free text (any non-empty string may end a reply)",
    (
        r"algorithm\.invalid_penalty",
        "out of range",
    ): "-1e9 is a (large) penalty; > 0 is rejected (test below)",
    (r"agents\.\w+\.system_prompt|logger\.wandb\.(entity|project)", "over-long"): "free text of any length",
}
DICT_LEAVES = ("env.kwargs", "orchestra.kwargs", "algorithm.estimator_kwargs")  # validated by their component


def leaves(obj, prefix=""):
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp, path = getattr(obj, f.name), hints[f.name], f"{prefix}{f.name}"
        if typing.get_origin(tp) in (typing.Union, types.UnionType):  # Optional[X], X | None
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
        return [("wrong type", "{a: 1}"), ("out of range", "bogus_value"), ("over-long", "x" * 5000)]
    if typing.get_origin(tp) is list:
        bad = "[-5]" if typing.get_args(tp)[0] is int else "[bogus_value]"
        return [("wrong type", "{a: 1}"), ("out of range", bad)]
    return []


# Each leaf of the schema is mutated once: the same leaf under another policy or agent name, or in the
# other config, goes through the same check and the same placeholder fill-in (620 cases -> 258). The
# per-policy and per-agent sections come from quickstart_cpu (2 ranks; agents solver and verifier), the
# rest from signalling_tiny, so both configs and both worlds are still exercised.
SECTION_CONFIG = {"policies": "quickstart_cpu.yaml", "agents": "quickstart_cpu.yaml"}
DEFAULT_CONFIG = "signalling_tiny.yaml"


def _schema_leaf(path: str) -> str:
    parts = path.split(".")
    if parts[0] in ("policies", "agents") and len(parts) > 2:
        parts[1] = "<name>"
    return ".".join(parts)


def cases():
    found: dict[tuple[str, str], list] = {}
    for config in CONFIGS:
        for path, tp in leaves(load_config(ROOT / "configs" / config)):
            if path in DICT_LEAVES:
                continue
            for kind, text in mutations(tp):
                found.setdefault((_schema_leaf(path), kind), []).append((config, path, text))
    for (leaf, kind), where in found.items():
        owner = SECTION_CONFIG.get(leaf.split(".")[0], DEFAULT_CONFIG)
        config, path, text = next((w for w in where if w[0] == owner), where[0])
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
        placement_of(
            load_config(ROOT / "configs" / config, [override]), CONFIGS[config]
        )  # accepted, as documented
        return
    code = main(["--config", str(ROOT / "configs" / config), "--check", override])
    err = capsys.readouterr().err
    assert code == 2, (override[:200], err[:1000])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: ") and "Traceback" not in err, err[:1000]
    assert len(lines[0]) <= len("config error: ") + MAX_ERROR_CHARS + 40, len(lines[0])  # the echo is cut
    assert re.search(r"(^|[\s'\"(])" + re.escape(path) + r"($|[^\w.])", lines[0]), (override[:200], lines[0])


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.group_by=[task,agentt]", "algorithm.group_by has unknown keys ['agentt']"),
        ("algorithm.loss_agg=foo", "algorithm.loss_agg='foo'"),
        ("algorithm.kl_type=k9", "algorithm.kl_type='k9'"),
        ("rollout.group_size=0", "rollout.group_size must be an integer >= 1, got 0"),
        ("rollout.num_tasks=-5", "rollout.num_tasks must be an integer >= 1, got -5"),
        (
            "agents.sender.sampling.temperature=-1",
            "agents.sender.sampling.temperature must be >= 0, got -1.0",
        ),
        ("agents.receiver.sampling.top_p=5", "agents.receiver.sampling.top_p must be in (0, 1], got 5.0"),
        ("algorithm.invalid_penalty=0.5", "algorithm.invalid_penalty must be <= 0, got 0.5"),
        (
            "policies.shared.model=Qwen/Qwen2.5-0.5B-Instruct",
            "policies.shared.model='Qwen/Qwen2.5-0.5B-Instruct' looks like a model hub id",
        ),
        (
            "policies.shared.lr=-1",
            "policies.shared.lr must be > 0, got -1.0",
        ),  # was printed as policies.<p>.lr
        ("policies.shared.lr=nan", "policies.shared.lr must be a finite number, got nan"),
        ("policies.shared.engine.tp=0", "policies.shared.engine.tp must be >= 1, got 0"),
    ],
)
def test_issue_cases(override, message, capsys):
    assert main(["--config", str(ROOT / "configs/signalling_tiny.yaml"), "--dry-run", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and message in err and len(err.strip().splitlines()) == 1, err


# The front door (issue #28 item 4): inputs an override can give. Each is refused by `train.py --check`
# (so also by a training launch, which runs the same checks first) with exit 2 and one line holding
# the message. docs/reliability.md, "The front door", lists them.
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["name=../../elsewhere"], "name='../../elsewhere' escapes output_dir"),
        (["name=/abs/run"], "name='/abs/run' escapes output_dir"),
        (["name=" + "n" * 300], "name is too long: 300 bytes in one path component"),
        (["output_dir=" + "o" * 300], "output_dir is too long: 300 bytes"),
        (
            ["trainer.seed=99999999999999999999"],
            "trainer.seed must be in [0, 4294967295], got 99999999999999999999",
        ),
        (["trainer.seed=4294967296"], "trainer.seed must be in [0, 4294967295], got 4294967296"),
        (["policies.shared.ranks=[]"], "policies.shared.ranks=[] lists no rank"),
        (
            [
                "policies.shared.ranks=[0]",
                "policies.shared.engine.backend=vllm",
                "policies.shared.engine.ranks=[5]",
                "placement_mode=disaggregated",
            ],
            "policies.shared.engine.ranks",
        ),
        (
            ["~agents.receiver"],
            (
                "agents.receiver is not defined, but orchestra 'sequential' calls role 'receiver' in "
                "env 'signalling'"
            ),
        ),
        (
            ["~agents.receiver", "+agents.recever.policy=shared"],
            "agents.recever: 'recever' is not a role of env 'signalling' (its roles: ['sender', 'receiver'])",
        ),
        (
            ["orchestra.kwargs.order=[sender,receivr]"],
            ("agents.receivr is not defined, but orchestra 'sequential' calls role 'receivr'"),
        ),
        (
            ["orchestra.name=solve_verify"],
            "agents.solver is not defined, but orchestra 'solve_verify' calls role 'solver'",
        ),
        (
            ["agents.sender.sampling.allowed_tokens=[A,hello_world]"],
            (
                "agents.sender.sampling.allowed_tokens: 'hello_world' is 3 tokens, not one "
                "(policies.shared's tokenizer)"
            ),
        ),
        (["trainer.mode=" + "m" * 100_000], "chars cut"),
        (["+é=3"], "config override '+é=3': LexerNoViableAltException"),  # Hydra's grammar: ASCII keys
    ],
)
def test_front_door_overrides(overrides, message, capsys, tmp_path, monkeypatch):
    # as ``torchrun --nproc_per_node 1`` launches it (outside torchrun --check places on the world the
    # config declares, which grows with engine.ranks)
    monkeypatch.setenv("WORLD_SIZE", "1")
    code = main(
        [
            "--config",
            str(ROOT / "configs/signalling_tiny.yaml"),
            "--check",
            f"output_dir={tmp_path}",
            *overrides,
        ]
    )
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("config error: ") and message in lines[0], (
        err[:2000]
    )
    assert len(lines[0]) < 700 and not list(tmp_path.iterdir())  # cut echo; nothing created under output_dir


def test_front_door_accepts_the_config(capsys, tmp_path):
    assert (
        main(["--config", str(ROOT / "configs/signalling_tiny.yaml"), "--check", f"output_dir={tmp_path}"])
        == 0
    )
    assert capsys.readouterr().out.startswith("config ok: ") and not list(tmp_path.iterdir())
