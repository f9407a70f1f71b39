"""Configs compose through Hydra: the override grammar, ``defaults:`` composition of the presets, sweeps,
and that loading a config leaves the process alone (no chdir, no outputs/, no logging set-up)."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megamarl.cli.configure import load_config
from megamarl.config import RunConfig, to_yaml
from megamarl.config_loader import expand_sweeps

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "configs" / "presets"
CONFIG = PRESETS / "signalling.yaml"  # env.kwargs empty, trainer.total_steps 2
# OmegaConf.to_yaml(load_config(preset)) of every preset, written by the loader before Hydra (when
# each preset was a full copy). Merged onto today's schema so that keys added since get their default.
RESOLVED = Path(__file__).resolve().parent / "data" / "presets_resolved"


def _error(overrides, path=CONFIG) -> str:
    with pytest.raises(ValueError) as info:
        load_config(path, overrides)
    return str(info.value)


# ---- the override grammar -------------------------------------------------------------------------


def test_plus_adds_a_map_entry_and_a_kwarg():
    cfg = load_config(
        CONFIG,
        ["+policies.critic.model=tiny-random-qwen2", "+policies.critic.tp=2", "+env.kwargs.num_symbols=5"],
    )
    assert list(cfg.policies) == ["shared", "critic"]
    assert (cfg.policies["critic"].model, cfg.policies["critic"].tp, cfg.policies["critic"].lr) == (
        "tiny-random-qwen2",
        2,
        1e-6,
    )
    assert cfg.env.kwargs == {"num_symbols": 5}


def test_plain_override_still_adds_map_entries():
    """Maps (policies, agents, *.kwargs) are open, as they were before Hydra: no '+' needed there."""
    cfg = load_config(CONFIG, ["policies.other.model=tiny-random-llama", "env.kwargs.num_symbols=5"])
    assert cfg.policies["other"].model == "tiny-random-llama" and cfg.env.kwargs == {"num_symbols": 5}


@pytest.mark.parametrize(
    "override, message",
    [
        ("+trainer.foo=1", "config key 'trainer.foo': unknown key"),  # '+' cannot add to a schema section
        ("trainer.total_step=3", "did you mean trainer.total_steps?"),
        (
            "+policies.critic.tpp=2",
            "config key 'policies.critic.tpp': unknown key; did you mean policies.critic.tp?",
        ),
        ("+trainer.total_steps=5", "config key 'trainer.total_steps'"),  # '+' on a key that exists
        ("~trainer.nope", "trainer.nope"),
    ],
)
def test_grammar_errors_name_the_key(override, message):
    assert message in _error([override])


def test_tilde_deletes_map_entries_and_resets_fields_to_their_default():
    assert load_config(CONFIG).trainer.total_steps == 2
    cfg = load_config(CONFIG, ["~trainer.total_steps", "~policies.shared.lr"])
    assert (cfg.trainer.total_steps, cfg.policies["shared"].lr) == (10, 1e-6)  # RunConfig's defaults
    hybrid = load_config(
        PRESETS / "hybrid_colocated.yaml", ["~policies.answerer_policy", "agents.answerer.policy=team"]
    )
    assert list(hybrid.policies) == ["team"]
    search = load_config(PRESETS / "search_qa.yaml", ["~env.kwargs.top_k"])
    assert search.env.kwargs == {"num_countries": 20}


def test_double_plus_sets_or_adds():
    cfg = load_config(CONFIG, ["++trainer.total_steps=7", "++policies.extra.model=tiny-random-llama"])
    assert cfg.trainer.total_steps == 7 and cfg.policies["extra"].model == "tiny-random-llama"


def test_list_values():
    cfg = load_config(
        CONFIG,
        [
            "algorithm.group_by=[task,agent]",
            "policies.shared.ranks=[0,1]",
            "agents.sender.sampling.allowed_tokens=[A,B]",
        ],
    )
    assert cfg.algorithm.group_by == ["task", "agent"] and cfg.policies["shared"].ranks == [0, 1]
    assert cfg.agents["sender"].sampling.allowed_tokens == ["A", "B"]


def test_group_options_are_overridable_from_the_command_line():
    cfg = load_config(PRESETS / "signalling.yaml", ["policy@policies.shared=tiny_qwen2", "base=smoke"])
    assert cfg.policies["shared"].model == "tiny-random-qwen2"
    assert cfg.policies["shared"].lr == 3e-3  # the preset's own body still wins over its defaults
    assert "Could not find 'task/chess'" in _error(["task=chess"], path=PRESETS / "signalling.yaml")


# ---- defaults composition -------------------------------------------------------------------------


def _preset_param(stem: str):
    """A preset whose env is an optional extra's loads only with the extra installed."""
    package = {"reasoning_gym": "reasoning_gym"}.get(stem)
    missing = package is not None and importlib.util.find_spec(package) is None
    return pytest.param(stem, marks=pytest.mark.skipif(missing, reason=f"needs the {package} extra"))


@pytest.mark.parametrize("preset", [_preset_param(p.stem) for p in sorted(PRESETS.glob("*.yaml"))])
def test_every_preset_composes_to_the_config_it_resolved_to_before(preset):
    """Same values, same map order (agents/policies iterate in this order at run time)."""
    extra = {"textarena": "textarena", "openenv": "openenv"}.get(preset)
    if extra:  # its env checks at load that its optional extra is there
        pytest.importorskip(extra)
    before = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(RESOLVED / f"{preset}.yaml"))
    assert to_yaml(load_config(PRESETS / f"{preset}.yaml")) == OmegaConf.to_yaml(before)


def test_presets_are_compositions_not_copies():
    for path in PRESETS.glob("*.yaml"):
        raw = OmegaConf.load(path)
        assert "defaults" in raw and "env" not in raw and "logger" not in raw, path.name
    assert sorted(p.stem for p in RESOLVED.glob("*.yaml")) == sorted(p.stem for p in PRESETS.glob("*.yaml"))


def test_a_config_anywhere_composes_groups_from_its_own_directory(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "small.yaml").write_text("model: tiny-random-llama\nlr: 2.0e-3\n")
    (tmp_path / "run.yaml").write_text(
        "defaults:\n  - model@policies.p: small\n  - _self_\n"
        "agents: {sender: {policy: p}, receiver: {policy: p}}\nenv: {name: signalling}\n"
        "orchestra: {name: sequential}\n"
    )
    cfg = load_config(tmp_path / "run.yaml", ["policies.p.tp=2"])
    assert (cfg.policies["p"].model, cfg.policies["p"].lr, cfg.policies["p"].tp) == (
        "tiny-random-llama",
        2e-3,
        2,
    )


def test_config_file_must_be_yaml(tmp_path):
    path = tmp_path / "run.yml"
    path.write_text(CONFIG.read_text())
    assert "--config" in _error([], path=path)


# ---- sweeps ---------------------------------------------------------------------------------------


def test_expand_sweeps_is_the_cartesian_product():
    assert expand_sweeps(["trainer.seed=1,2", "name=x", "policies.shared.tp=1,2"]) == [
        ["trainer.seed=1", "name=x", "policies.shared.tp=1"],
        ["trainer.seed=1", "name=x", "policies.shared.tp=2"],
        ["trainer.seed=2", "name=x", "policies.shared.tp=1"],
        ["trainer.seed=2", "name=x", "policies.shared.tp=2"],
    ]
    assert expand_sweeps(["trainer.seed=range(3)"]) == [
        ["trainer.seed=0"],
        ["trainer.seed=1"],
        ["trainer.seed=2"],
    ]
    assert expand_sweeps(["a=[1,2]"]) == [["a=[1,2]"]]  # a list is one value


def test_a_training_load_rejects_a_sweep_naming_it():
    assert "trainer.seed=1,2 is a sweep" in _error(["trainer.seed=1,2"])
    assert "'x=['" in _error(["x=["])


# ---- Hydra leaves the process alone ---------------------------------------------------------------


def test_loading_does_not_chdir_write_outputs_or_configure_logging(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    before = (list(root.handlers), root.level, sorted(logging.root.manager.loggerDict))
    cfg = load_config(PRESETS / "l3_colocated.yaml", ["trainer.seed=3"])
    assert cfg.trainer.seed == 3
    assert Path.cwd() == tmp_path and os.listdir(tmp_path) == []
    assert (list(root.handlers), root.level) == before[:2]
    assert not [
        n
        for n in logging.root.manager.loggerDict
        if n.startswith("hydra") and n not in before[2] and logging.getLogger(n).handlers
    ]
