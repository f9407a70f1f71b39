"""scripts/bench_trl.py hands TRL what megamarl's solver gets: the prompts megamarl's rollout sends to
its engine for the same tasks (in its step order), token for token as TRL encodes them, and a reward
equal to megamarl's on the same replies. Runs without trl; only the GRPOConfig check needs it."""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from script_loader import load_script
from scripted import ScriptedEngine, smollm2_tokenizer  # tests/ helper

from megamarl.cli.configure import load_config
from megamarl.driver.rollout_driver import RolloutDriver
from megamarl.orchestration import EnvMaker, build_agents, build_orchestra, run_episodes
from megamarl.rl.rewards import mix_rewards

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_trl

worker = load_script("scripts/trl_grpo_worker.py")

# reply -> how it reads: right, wrong, right inside words, thousands separator, no number, negative
REPLIES = (
    "{a} + 0 = {t}",
    "{w}",
    "The answer is {t}.",
    "So {t:,}",
    "I am not sure.",
    "-{t} then {t}",
    "{t}.0",
    "{t} or {w}",
)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    raw = bench_trl.solver_config(steps=2, num_tasks=4, group_size=8, eval_tasks=16)
    path = tmp_path_factory.mktemp("cfg") / "solver.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


def test_config_is_the_quickstart_solver_alone(cfg):
    quickstart = load_config(ROOT / "configs" / "quickstart_cpu.yaml")
    assert list(cfg.agents) == ["solver"] and cfg.algorithm.estimator == "grpo"
    assert cfg.agents["solver"].sampling == quickstart.agents["solver"].sampling
    assert cfg.env.kwargs == {**quickstart.env.kwargs, "with_verifier": False}
    qs, ours = quickstart.policies["shared"], cfg.policies["shared"]
    assert (ours.model, ours.lr, ours.pack, ours.prefix_tree) == (qs.model, qs.lr, qs.pack, qs.prefix_tree)
    assert (cfg.rollout.num_tasks, cfg.rollout.group_size) == (4, 8)
    assert ours.kl_coef == 0.0  # what TRL's beta=0 stands for


def test_prompts_and_rewards_are_megamarls(cfg):
    tok = smollm2_tokenizer()
    rows = bench_trl.training_prompts(cfg)
    assert [r["step"] for r in rows] == [0] * 4 + [1] * 4
    by_ids = {tuple(r["prompt_ids"]): r for r in rows}
    for row in rows:  # what TRL does with a plain-text prompt: the tokenizer's call
        assert tok(text=[row["prompt"]])["input_ids"][0] == row["prompt_ids"]

    calls = itertools.count()

    def reply(request):
        truth = int(by_ids[tuple(request.prompt_ids)]["answer"])
        template = REPLIES[next(calls) % len(REPLIES)]
        return template.format(a=truth, t=truth, w=truth + 1)

    maker = EnvMaker(cfg.env.name, **cfg.env.kwargs)
    agents = build_agents(cfg.agents, tok, default_kinds=maker.default_agents)
    source = SimpleNamespace(cfg=cfg, env=maker)
    for step in range(cfg.trainer.total_steps):
        tasks, seed = RolloutDriver.task_chunk(source, step)
        engine = ScriptedEngine(tok, reply)
        result = asyncio.run(
            run_episodes(
                build_orchestra(cfg.orchestra.name, **cfg.orchestra.kwargs),
                maker,
                tasks,
                agents=agents,
                engines={"shared": engine},
                group_size=len(REPLIES),
                seed=seed,
            )
        )
        sent = {tuple(ids) for ids, _, _ in engine.requests}
        assert sent == {tuple(r["prompt_ids"]) for r in rows if r["step"] == step}
        assert len(result.samples) == len(tasks) * len(REPLIES)
        seen = set()
        for sample in result.samples:
            row = by_ids[tuple(sample.prompt_ids)]
            team, local = torch.tensor([sample.team_reward]), torch.tensor([sample.local_reward])
            ours = float(mix_rewards(team, local, alpha=cfg.algorithm.team_alpha))
            completion = tok.decode(sample.response_ids, skip_special_tokens=True)  # TRL's decode
            alpha = cfg.algorithm.team_alpha
            assert worker.solver_reward(completion, row["answer"], team_alpha=alpha) == ours
            seen.add(ours)
        assert seen == {0.0, 2.0}  # right and wrong replies both occur


def test_grpo_config_is_megamarls_budget(tmp_path):
    pytest.importorskip("trl", reason="trl is not a megamarl dependency; bench_trl.py runs it in its own env")
    settings = {
        "steps": 12,
        "num_tasks": 4,
        "group_size": 8,
        "micro_batch_size": 16,
        "temperature": 0.7,
        "max_tokens": 24,
        "lr": 3e-5,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "kl_coef": 0.0,
        "clip_low": 0.2,
        "clip_high": 0.28,
        "ppo_epochs": 1,
        "team_alpha": 1.0,
        "bf16": False,
        "seed": 0,
    }
    config = worker.grpo_config(settings, tmp_path)
    assert config.generation_batch_size == 32 and config.num_generations == 8
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == 32
    assert (config.beta, config.epsilon, config.epsilon_high, config.loss_type) == (0.0, 0.2, 0.28, "dapo")
    assert not config.shuffle_dataset and not config.use_vllm
