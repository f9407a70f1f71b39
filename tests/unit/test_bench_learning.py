"""scripts/bench_learning.py's cells: every (family, variant) config passes every load-time check and
is the variant it claims (one agent / one shared policy / a LoRA adapter per role / a policy per role),
with the same rollout budget and eval set across variants; the L3 cells' role swap loads and gives each
role the other's policy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from megamarl.cli.configure import load_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_learning

BUDGET = {"seed": 1, "steps": 5, "num_tasks": 4, "group_size": 4, "eval_tasks": 48, "eval_every": 2}


@pytest.mark.parametrize("family", sorted(bench_learning.FAMILIES))
@pytest.mark.parametrize("variant", bench_learning.VARIANTS)
def test_cell_config_loads_and_is_its_variant(family, variant, tmp_path):
    raw = bench_learning.variant_config(family, variant, **BUDGET)
    path = tmp_path / "cell.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    roles = bench_learning.FAMILIES[family]["roles"]
    single = bench_learning.FAMILIES[family]["single_role"]
    assert (cfg.rollout.num_tasks, cfg.rollout.group_size, cfg.trainer.total_steps, cfg.trainer.seed) == (
        4,
        4,
        5,
        1,
    )
    assert (cfg.eval.num_tasks, cfg.eval.every, cfg.eval.temperature) == (48, 2, 0.0)
    assert all(p.pack and p.prefix_tree for p in cfg.policies.values())  # the shared prompts once
    if variant == "single":
        assert list(cfg.agents) == [single] and list(cfg.policies) == ["shared"]
        assert cfg.algorithm.estimator == "grpo"
        return
    assert sorted(cfg.agents) == sorted(roles) and cfg.algorithm.estimator == "at_grpo"
    if variant == "L1":
        assert list(cfg.policies) == ["shared"] and cfg.policies["shared"].lora is None
    elif variant == "L2":
        assert cfg.policies["shared"].lora.rank == 8
        assert {a: cfg.agents[a].lora for a in roles} == {a: a for a in roles}
        assert cfg.policies["shared"].lr == bench_learning.LORA_LR
    else:
        assert sorted(cfg.policies) == sorted(f"{a}_policy" for a in roles)
        assert {cfg.agents[a].policy for a in roles} == set(cfg.policies)


@pytest.mark.parametrize("family", sorted(bench_learning.FAMILIES))
def test_role_swap_gives_each_role_the_other_policy(family, tmp_path):
    path = tmp_path / "cell.yaml"
    path.write_text(yaml.safe_dump(bench_learning.variant_config(family, "L3", **BUDGET)))
    cfg = load_config(path, bench_learning.swap_overrides(family))
    first, second = bench_learning.FAMILIES[family]["roles"]
    assert (cfg.agents[first].policy, cfg.agents[second].policy) == (f"{second}_policy", f"{first}_policy")
