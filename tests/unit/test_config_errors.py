"""Bad configs fail at load (or placement) time with a ValueError that names the offending key, and
``scripts/train.py`` turns them into one line on stderr and a nonzero exit."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamarl.cli.configure import load_config
from megamarl.parallel.placement import placement_of
from megamarl.rl.policy_setup import critic_config, loss_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "signalling_tiny.yaml"


def _error(overrides, *, world_size: int | None = None, path=CONFIG) -> str:
    with pytest.raises(ValueError) as info:
        cfg = load_config(path, overrides)
        if world_size is not None:
            placement_of(cfg, world_size)
    return str(info.value)


def test_the_base_config_loads():
    cfg = load_config(CONFIG, ["trainer.keep_last=2"])
    assert cfg.trainer.keep_last == 2
    placement_of(cfg, 1)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["trainer.total_step=3"], "trainer.total_step"),  # unknown key
        (["policies.shared.tpp=2"], "policies.shared.tpp"),
        (["agents.sender.temperature=0.5"], "agents.sender.temperature"),  # belongs under sampling
        (["trainer.total_steps=abc"], "trainer.total_steps"),  # wrong type
        (["policies.shared.lr=fast"], "policies.shared.lr"),
        (["policies.shared.ranks=0"], "policies.shared.ranks"),
        (["trainer.mode=async"], "trainer.mode"),  # not an allowed value
        (["trainer.keep_last=-1"], "trainer.keep_last"),
        (["trainer.save_every=-2"], "trainer.save_every"),
        (["algorithm.estimator=ppo2"], "algorithm.estimator"),  # unknown registry names
        (["env.name=chess"], "env.name"),
        (["orchestra.name=debate"], "orchestra.name"),
        (["agents.sender.kind=oracle"], "agents.sender.kind"),
        (["env.kwargs.board=8"], "env.kwargs"),  # a keyword the env's config does not take
        (["orchestra.kwargs.rounds=3"], "orchestra.kwargs"),
        (["agents.receiver.policy=critic"], "agents.receiver.policy"),  # a policy that is not defined
        (["algorithm.std_ddof=2"], "algorithm.std_ddof"),
        (["algorithm.max_refill_rounds=2"], "algorithm.max_refill_rounds"),  # without dynamic_sampling
        (
            ["algorithm.dynamic_sampling=true", "algorithm.max_refill_rounds=2", "trainer.mode=fully_async"],
            "algorithm.max_refill_rounds",
        ),
        (["eval.env.name=chess"], "eval.env.name"),
        (["eval.sets.b.kwargs.board=8"], "eval.sets.b.kwargs"),
        (
            ["eval.sets.b.name=math", "eval.sets.b.kwargs.dataset_path=/nonexistent.jsonl"],
            "eval.sets.b.kwargs",
        ),
        (["+eval.env.kwargs.terse=true", "eval.sets.b.name=signalling"], "eval.env and eval.sets"),
    ],
)
def test_error_names_the_key(overrides, key):
    assert key in _error(overrides)


def test_eval_sets_resolve_against_the_training_env():
    cfg = load_config(CONFIG, [])
    assert cfg.eval.resolved_sets(cfg.env) == {"": cfg.env}  # default: the training env, unnamed
    cfg = load_config(CONFIG, ["+eval.env.kwargs.num_symbols=10"])
    only = cfg.eval.resolved_sets(cfg.env)[""]
    assert (only.name, only.kwargs) == ("signalling", {"num_symbols": 10})
    cfg = load_config(CONFIG, ["eval.sets.same.name=signalling", "eval.sets.other.kwargs.terse=false"])
    sets = cfg.eval.resolved_sets(cfg.env)
    assert sets["same"].kwargs == cfg.env.kwargs  # the training env's name: its kwargs too
    assert (sets["other"].name, sets["other"].kwargs) == ("signalling", {"terse": False})


@pytest.mark.parametrize(
    "overrides, world_size, keys",
    [
        (["policies.shared.ranks=[0,1,2]"], 2, ["policies.shared.ranks", "world size 2"]),
        (["policies.shared.tp=2"], 3, ["policies.shared", "tp*pp"]),  # 3 ranks, TP=2
        (
            [
                "placement_mode=disaggregated",
                "policies.shared.ranks=[0,1]",
                "policies.other.model=tiny-random-llama",
                "policies.other.ranks=[1]",
            ],
            2,
            ["policies.other.ranks", "policies.shared.ranks", "rank 1"],
        ),
    ],
)
def test_impossible_placement_names_the_key(overrides, world_size, keys):
    message = _error(overrides, world_size=world_size)
    assert all(k in message for k in keys), message


@pytest.mark.parametrize("override", ["policies.shared.tp=3", "policies.shared.pp=3"])
def test_layout_that_does_not_fit_the_model_names_the_key(override):
    """tiny-random-llama has 4 heads, 2 KV heads, 4 layers: TP=3 or PP=3 cannot shard it (checked by
    the dry run and again when the trainer builds the model)."""
    from rich.console import Console

    from megamarl.driver.schedules import overlaps_training
    from megamarl.planning.dryrun import dry_run

    cfg = load_config(CONFIG, [override])
    with pytest.raises(ValueError, match=override.replace(".", r"\.")):
        dry_run(
            cfg,
            overlaps_training=overlaps_training(cfg.trainer),
            world_size=3,
            console=Console(file=io.StringIO()),
        )


def test_missing_config_file_names_the_flag(tmp_path):
    assert "--config" in _error([], path=tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "overrides, env, key",
    [
        (["trainer.total_step=3"], {}, "trainer.total_step"),
        (["policies.shared.ranks=[0,1,2]"], {"WORLD_SIZE": "2"}, "policies.shared.ranks"),  # under torchrun
    ],
)
def test_train_script_prints_one_line(overrides, env, key):
    result = subprocess.run(
        [sys.executable, "scripts/train.py", "--config", str(CONFIG), *overrides],
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error:") and key in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["policies.shared.algorithm.estimator=ppo"],
            "unknown advantage estimator policies.shared.algorithm.estimator='ppo'",
        ),
        (
            ["policies.shared.algorithm.group_by=[task,agnt]"],
            "policies.shared.algorithm.group_by has unknown keys ['agnt']",
        ),
        (["policies.shared.algorithm.std_ddof=2"], "policies.shared.algorithm.std_ddof must be 0"),
        (["policies.shared.algorithm.loss_agg=foo"], "policies.shared.algorithm.loss_agg='foo'"),
        (
            ["policies.shared.algorithm.estimator_kwargs={lamda: 0.9}"],
            "policies.shared.algorithm.estimator_kwargs:",
        ),
        (
            ["policies.shared.algorithm.estimator=gae", "algorithm.dynamic_sampling=true"],
            "policies.shared.algorithm sets ['estimator'], but algorithm.dynamic_sampling",
        ),
    ],
)
def test_per_policy_algorithm_errors_name_the_policy_key(overrides, message):
    assert message in _error(overrides)


def test_per_policy_algorithm_merges_over_the_run_algorithm():
    cfg = load_config(
        CONFIG,
        [
            "policies.shared.algorithm.estimator=gae",
            "policies.shared.algorithm.estimator_kwargs={gamma: 1.0, lam: 0.9}",
        ],
    )
    own = cfg.policy_algorithm("shared")
    assert (own.estimator, own.estimator_kwargs, own.group_by, cfg.algorithm.estimator) == (
        "gae",
        {"gamma": 1.0, "lam": 0.9},
        cfg.algorithm.group_by,
        "at_grpo",
    )
    plain = load_config(CONFIG)
    assert plain.policy_algorithm("shared") is plain.algorithm  # nothing set: the run's own settings object


def test_per_policy_loss_aggregations_reach_the_policys_loss_and_critic():
    """policies.<p>.algorithm.loss_agg / value_loss_agg: what the policy's worker is built with."""
    cfg = load_config(
        CONFIG,
        [
            "policies.shared.algorithm.estimator=gae",
            "policies.shared.algorithm.loss_agg=seq-mean-token-sum",
            "policies.shared.algorithm.value_loss_agg=seq-mean-token-mean",
        ],
    )
    algos = cfg.policy_algorithms()
    policy = cfg.policies["shared"]
    assert loss_config(policy, algos["shared"]).agg_mode == "seq-mean-token-sum"
    critic = critic_config(policy, algos["shared"])
    assert (critic.loss_agg, critic.advantage.estimator) == ("seq-mean-token-mean", "gae")
    assert critic_config(policy, cfg.algorithm) is None  # the run's at_grpo has no critic


@pytest.mark.parametrize(
    "python, message",
    [
        ("/nonexistent/bin/python", "does not exist"),
        (str(ROOT / "README.md"), "is not executable"),
        (sys.executable, "cannot import 'sglang'"),  # megamarl's env has no sglang (it lives in .venv-sglang)
    ],
)
def test_engine_server_python_is_checked_at_load(python, message):
    base = ["policies.shared.engine.backend=sglang", "policies.shared.engine.launch=server"]
    if message == "cannot import 'sglang'" and __import__("importlib").util.find_spec("sglang") is not None:
        pytest.skip("this environment has sglang")
    error = _error([*base, f"policies.shared.engine.server_python={python}"])
    assert error.startswith(f"policies.shared.engine.server_python='{python}'") and message in error
    assert "server_python" in _error(
        ["policies.shared.engine.backend=hf", f"policies.shared.engine.server_python={python}"]
    )


def test_engine_server_python_runs_the_server_and_defaults_to_the_sglang_env(monkeypatch, tmp_path):
    from megamarl.rollout.servers import server_launch
    from megamarl.rollout.servers.server_launch import ServerSpec, server_command, server_python

    cfg = load_config(
        CONFIG,
        [
            "policies.shared.engine.backend=vllm",
            "policies.shared.engine.launch=server",
            f"policies.shared.engine.server_python={sys.executable}",
        ],
    )
    assert cfg.policies["shared"].engine.server_python == sys.executable  # finds vllm: accepted
    spec = ServerSpec(
        policy="p", replica=0, rank=0, backend="sglang", model_path=str(tmp_path), python="/opt/x/python"
    )
    assert server_command(spec)[:3] == ["/opt/x/python", "-m", "sglang.launch_server"]
    assert server_python("vllm") == sys.executable
    venv = tmp_path / "sgl"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.setenv(server_launch.SGLANG_VENV_ENV, str(venv))
    monkeypatch.setattr(server_launch.importlib.util, "find_spec", lambda name: None)
    assert server_python("sglang") == str(venv / "bin" / "python")  # this env lacks sglang: setup.sh's env
    assert server_python("sglang", "/custom/python") == "/custom/python"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU nodes")
def test_sglang_lora_on_cpu_is_refused_before_anything_loads(tmp_path):
    """L2 adapters on SGLang: its LoRA kernels are CUDA/Triton, so a CPU launch is refused in the
    preflight (no model, engine or server started), naming the policy's lora key."""
    from megamarl.cli.front_door import preflight

    cfg = load_config(
        ROOT / "configs" / "presets" / "l2_colocated.yaml",
        [
            "policies.base.engine.backend=sglang",
            "policies.base.engine.launch=server",
            f"output_dir={tmp_path}",
        ],
    )
    with pytest.raises(ValueError, match=r"policies\.base\.lora with engine\.backend=sglang on CPU"):
        preflight(cfg, world_size=2)
    assert not any(tmp_path.iterdir())  # the run directory was never created
