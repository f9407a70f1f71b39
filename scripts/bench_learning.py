"""The specialisation table: does a team with agent-aware credit beat one agent, and does giving each
role its own weights (a LoRA adapter, or a whole policy) pay at this model size?

    python scripts/bench_learning.py                     # the committed table (docs/bench/learning.json)
    python scripts/bench_learning.py --quick             # a 1-step, 1-seed smoke run of every cell
    python scripts/bench_learning.py --families math --seeds 0 1
    python scripts/bench_learning.py --work DIR --stop-at 2026-12-02T09:10+00:00  # partial; DIR continues it

For each task family and seed, four variants train the packaged SmolLM2-135M-Instruct on CPU with
``scripts/train.py`` (torchrun, 2 ranks; prefix-tree micro-batches, exact to the unshared update), with
the same steps, tasks per step, group size, sampling and held-out eval:

  (a) single  one agent (the family's acting role alone), one policy, GRPO grouped by task
  (b) L1      the team on one shared policy, AT-GRPO grouped by (task, agent, turn)
  (c) L2      the team on one frozen base with a LoRA adapter per role, AT-GRPO
  (d) L3      the team with one policy per role (two full models), AT-GRPO

Held-out team accuracy (greedy, ``eval.num_tasks`` tasks drawn with a seed the training stream never
uses) is measured at step 0 and every ``--eval-every`` steps. Prints a table (mean +- std over seeds of
the accuracy before and after, the gain, rollout and train tokens, wall time), draws accuracy vs step
with one band (min..max over seeds) per variant and family (``docs/bench/learning.png``) and writes
``docs/bench/learning.json`` with the machine, its load while the table ran, and every run's curve.

The role swap (PettingLLMs' specialisation ablation): each L3 cell's final checkpoint is evaluated
again with ``scripts/evaluate.py``, as trained and with the two roles' policies swapped
(``agents.<a>.policy=<b>_policy agents.<b>.policy=<a>_policy``); the re-evaluation must equal the run's
own last eval, and the drop is as trained minus swapped. Both policies start from the same base
model, so at step 0 a swap changes nothing: a drop can only come from what training made different.

Families:
  math    solver + verifier on arithmetic and word problems (the quickstart's task); single = the
          solver alone (``env.kwargs.with_verifier: false``)
  search  searcher + answerer on fictional-country QA over a BM25 index (answers cannot come from
          pretraining); single = the answerer alone, which sees no evidence
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_quickstart import LoadSampler, _cpu_model

from megamarl.parallel.hardware import cpu_flags, native_bf16, node_cores
from megamarl.runtime.checkpoint import checkpoint_step, list_checkpoints
from megamarl.runtime.metrics import read_eval, read_metrics

VARIANTS = ("single", "L1", "L2", "L3")
LABELS = {
    "single": "(a) single agent, GRPO",
    "L1": "(b) team, L1 shared policy, AT-GRPO",
    "L2": "(c) team, L2 LoRA per role, AT-GRPO",
    "L3": "(d) team, L3 policy per role, AT-GRPO",
}
MODEL = "smollm2-135m-instruct"
LR = 3.0e-5  # full-weight policies (the quickstart's)
LORA_LR = 3.0e-4  # adapters: 10x, the usual ratio for LoRA (rank 8, alpha 16)

FAMILIES = {
    "math": {
        "roles": ("solver", "verifier"),
        "single_role": "solver",
        "agents": {
            "solver": {"sampling": {"temperature": 0.7, "max_tokens": 24}},
            "verifier": {"sampling": {"temperature": 0.7, "max_tokens": 8}},
        },
        "env": {"name": "math", "kwargs": {"kinds": ["add1", "add2", "word"]}},
        "single_env_kwargs": {"with_verifier": False},
        "orchestra": {"name": "solve_verify", "kwargs": {"max_loops": 1}},
    },
    "search": {
        "roles": ("searcher", "answerer"),
        "single_role": "answerer",
        "agents": {
            "searcher": {"sampling": {"temperature": 0.7, "max_tokens": 8}},
            "answerer": {"sampling": {"temperature": 0.7, "max_tokens": 8}},
        },
        "env": {"name": "search_qa", "kwargs": {"num_countries": 20, "top_k": 2}},
        "single_env_kwargs": {},
        "orchestra": {"name": "sequential", "kwargs": {"order": ["searcher", "answerer"], "max_steps": 2}},
    },
}


def variant_config(
    family: str,
    variant: str,
    *,
    seed: int,
    steps: int,
    num_tasks: int,
    group_size: int,
    eval_tasks: int,
    eval_every: int,
) -> dict:
    """The full run config of one cell (a plain dict, written as the run's YAML)."""
    fam = FAMILIES[family]
    engine = {"backend": "vllm", "kv_cache_gib": 0.5}
    # prefix-tree micro-batches (docs/rl.md, "Shared prefixes computed once"): a group's samples share
    # their prompt, forwarded once; exact to the unshared update, so the saving buys more steps
    policy = {
        "model": MODEL,
        "ranks": [0, 1],
        "lr": LR,
        "micro_batch_size": 16,
        "pack": True,
        "prefix_tree": True,
        "engine": engine,
    }
    agents = copy.deepcopy(fam["agents"])
    env = copy.deepcopy(fam["env"])
    orchestra = copy.deepcopy(fam["orchestra"])
    algorithm = {"estimator": "at_grpo", "group_by": ["task", "agent", "turn"]}
    if variant == "single":
        role = fam["single_role"]
        agents = {role: agents[role]}
        env["kwargs"].update(fam["single_env_kwargs"])
        orchestra = {"name": "sequential", "kwargs": {"order": [role], "max_steps": 1}}
        algorithm = {"estimator": "grpo", "group_by": ["task"]}
    if variant == "L3":
        policies = {f"{role}_policy": copy.deepcopy(policy) for role in fam["roles"]}
        for role in fam["roles"]:
            agents[role]["policy"] = f"{role}_policy"
    else:
        policies = {"shared": policy}
        for agent in agents.values():
            agent["policy"] = "shared"
    if variant == "L2":
        policy.update(lr=LORA_LR, lora={"rank": 8, "alpha": 16.0})
        for role, agent in agents.items():
            agent["lora"] = role
    return {
        "name": f"{family}_{variant}_s{seed}",
        "policies": policies,
        "agents": agents,
        "env": env,
        "orchestra": orchestra,
        "rollout": {"num_tasks": num_tasks, "group_size": group_size},
        "algorithm": algorithm,
        "eval": {"every": eval_every, "num_tasks": eval_tasks, "k": 1, "temperature": 0.0},
        "trainer": {"total_steps": steps, "seed": seed},
        "logger": {"wandb": {"mode": "disabled"}, "episodes_per_step": 1, "plots": False},
    }


def _torchrun(script: str, *args: str) -> list[str]:
    return [
        str(ROOT / ".venv" / "bin" / "torchrun"),
        "--nproc_per_node",
        "2",
        str(ROOT / "scripts" / script),
        *args,
    ]


def _launch(command: list[str], *, log: Path, env: dict, what: str, clean: Path) -> tuple[float, float, int]:
    """Run ``command`` (output to ``log``) until it succeeds; a rank killed from outside (the OOM
    killer on a shared node) tries again, up to 4 times, ``clean`` removed before each attempt.
    Returns (wall s, CPU s, attempts)."""
    attempts = 4
    for attempt in range(1, attempts + 1):
        shutil.rmtree(clean, ignore_errors=True)
        start, cpu_start = time.perf_counter(), _children_cpu_s()
        with open(log, "w") as f:
            code = subprocess.call(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        wall_s, cpu_s = time.perf_counter() - start, _children_cpu_s() - cpu_start
        if code == 0:
            return wall_s, cpu_s, attempt
        killed = "exitcode: -9" in log.read_text()
        if attempt == attempts or not killed:
            raise SystemExit(f"{what} failed (exit {code}); log: {log}")
        print(f"{what}: a rank was killed (SIGKILL; out of memory?); running it again in 30 s", flush=True)
        time.sleep(30)
    raise AssertionError("unreachable")


def run_cell(cfg: dict, work: Path, env: dict) -> dict:
    """Train one cell with ``scripts/train.py`` on 2 ranks; its curve, tokens and time. The run's
    checkpoints are kept (``role_swap`` evaluates the last one; ``drop_checkpoints`` removes them)."""
    config_path = work / f"{cfg['name']}.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_dir, done = work / "runs" / cfg["name"], work / f"{cfg['name']}.json"
    if done.exists():  # finished by an earlier invocation with --work (a crash or a kill loses no cell)
        return {**json.loads(done.read_text()), "cached": True}
    command = _torchrun("train.py", "--config", str(config_path), f"output_dir={work / 'runs'}")
    wall_s, cpu_s, attempt = _launch(
        command, log=work / f"{cfg['name']}.log", env=env, what=cfg["name"], clean=run_dir
    )
    metrics, evals = read_metrics(run_dir), read_eval(run_dir)
    cell = {
        "curve": [[e["step"], e["results"]["team_accuracy"]] for e in evals],
        "rollout_success": [m.get("rollout/success_rate", 0.0) for m in metrics],
        "rollout_tokens": round(
            sum(m.get("perf/rollout_tokens_per_s", 0) * m.get("timing_s/rollout", 0) for m in metrics)
        ),
        "train_tokens": round(
            sum(m.get("perf/train_tokens_per_s", 0) * m.get("timing_s/update", 0) for m in metrics)
        ),
        "samples": int(sum(m.get("rollout/num_samples", 0) for m in metrics)),
        "steps": len(metrics),
        "wall_s": round(wall_s, 1),
        "attempts": attempt,
        "cpu_s": round(cpu_s, 1),
    }
    done.write_text(json.dumps(cell))
    return cell


def swap_overrides(family: str) -> list[str]:
    """The L3 cell's two agents each served by the other role's policy."""
    first, second = FAMILIES[family]["roles"]
    return [f"agents.{first}.policy={second}_policy", f"agents.{second}.policy={first}_policy"]


def role_swap(cfg: dict, family: str, work: Path, env: dict) -> dict | None:
    """PettingLLMs' specialisation ablation on a trained L3 cell: its final checkpoint evaluated with
    ``scripts/evaluate.py`` (2 ranks, the run's own eval set) as trained, and with the roles' policies
    swapped. ``as_trained`` must equal the run's own last eval (``reproduces``): the check that the
    swapped number is comparable. None when the checkpoint is gone (a cell kept from an older table)."""
    found = list_checkpoints(work / "runs" / cfg["name"])
    if not found:
        return None
    checkpoint, swap, results = found[-1], {"wall_s": 0.0}, {}
    for kind, overrides in (("as_trained", []), ("swapped", swap_overrides(family))):
        out = work / "evals" / f"{cfg['name']}-{kind}"
        command = _torchrun("evaluate.py", "--checkpoint", str(checkpoint), "--out", str(out), *overrides)
        wall_s, _, _ = _launch(
            command, log=work / f"{cfg['name']}-{kind}.log", env=env, what=f"{cfg['name']} {kind}", clean=out
        )
        [entry] = json.loads((out / "eval.json").read_text())
        results[kind] = entry["results"]
        swap[kind] = entry["results"]["team_accuracy"]
        swap["wall_s"] = round(swap["wall_s"] + wall_s, 1)
    swap["drop"] = swap["as_trained"] - swap["swapped"]
    swap["step"] = checkpoint_step(checkpoint)
    # which policy served which agent, as each evaluation counted it (agent/<a>/success is the agent's
    # own success; policy/<p>/success the same episodes counted by the policy that served the agent)
    swap["results"] = results
    return swap


def drop_checkpoints(cfg: dict, work: Path) -> None:
    shutil.rmtree(work / "runs" / cfg["name"] / "checkpoints", ignore_errors=True)  # ~1 GB a cell


def _children_cpu_s() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


def summarise(cells: list[dict]) -> dict:
    def stats(values: list[float]) -> dict:
        return {
            "mean": round(statistics.fmean(values), 4),
            "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
            "min": round(min(values), 4),
            "max": round(max(values), 4),
        }

    before = [c["curve"][0][1] for c in cells]
    after = [c["curve"][-1][1] for c in cells]
    return {
        "before": stats(before),
        "after": stats(after),
        "gain": stats([a - b for a, b in zip(after, before)]),
        "rollout_success": stats([statistics.fmean(c["rollout_success"]) for c in cells]),
        "rollout_tokens": stats([c["rollout_tokens"] for c in cells]),
        "train_tokens": stats([c["train_tokens"] for c in cells]),
        "samples": stats([c["samples"] for c in cells]),
        "wall_s": stats([c["wall_s"] for c in cells]),
        "cpu_s": stats(cpu) if (cpu := [c["cpu_s"] for c in cells if c.get("cpu_s") is not None]) else None,
        "swap": {  # L3 only: the role-swap evaluation of the seeds that have one
            key: stats([c["swap"][key] for c in swapped]) for key in ("as_trained", "swapped", "drop")
        }
        | {
            "seeds": len(swapped),
            "reproduced": sum(c["swap"]["as_trained"] == c["curve"][-1][1] for c in swapped),
        }
        if (swapped := [c for c in cells if "swap" in c])
        else None,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(result["families"])
    fig, axes = plt.subplots(1, len(families), figsize=(max(7.5, 6.2 * len(families)), 4.6), squeeze=False)
    colors = dict(zip(VARIANTS, ("tab:gray", "tab:blue", "tab:green", "tab:red")))
    for ax, family in zip(axes[0], families):
        for variant, block in result["families"][family].items():
            curves = [cell["curve"] for cell in block["runs"].values()]
            steps = [s for s, _ in curves[0]]
            rows = [[acc for _, acc in curve] for curve in curves]
            mean = [statistics.fmean(col) for col in zip(*rows)]
            ax.plot(
                steps, mean, marker="o", color=colors[variant], label=f"{LABELS[variant]} (n={len(rows)})"
            )
            ax.fill_between(
                steps,
                [min(c) for c in zip(*rows)],
                [max(c) for c in zip(*rows)],
                color=colors[variant],
                alpha=0.15,
            )
        l3 = result["families"][family].get("L3")
        swaps = [
            (c["swap"]["step"], c["swap"]["swapped"])
            for c in (l3 or {}).get("runs", {}).values()
            if "swap" in c
        ]
        if swaps:
            values = [acc for _, acc in swaps]
            step = swaps[0][0] + 0.25  # beside the last step's points
            ax.errorbar(
                [step],
                [statistics.fmean(values)],
                yerr=[[statistics.fmean(values) - min(values)], [max(values) - statistics.fmean(values)]],
                fmt="X",
                markersize=9,
                color=colors["L3"],
                markeredgecolor="black",
                capsize=4,
                label=f"(d) L3, the roles' policies swapped, step {swaps[0][0]} "
                f"(n={len(values)}; bar: min..max)",
            )
            ax.scatter([step] * len(values), values, s=10, color="black", zorder=3)
        ax.set_title(f"{family}: held-out team accuracy ({result['budget']['eval_tasks']} tasks, greedy)")
        ax.set_xlabel("training step")
        ax.set_ylabel("team accuracy (mean; band: min..max over seeds)")
        ax.set_ylim(-0.02, 1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(
        f"{MODEL} on CPU, {result['budget']['steps']} steps x {result['budget']['num_tasks']} tasks "
        f"x {result['budget']['group_size']} samples; scripts/bench_learning.py"
        + (f"; PARTIAL: {len(result['unfinished'])} cells not run" if result.get("unfinished") else ""),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--num-tasks", type=int, default=4, help="tasks per step (rollout.num_tasks)")
    parser.add_argument("--group-size", type=int, default=4, help="samples per task (rollout.group_size)")
    parser.add_argument("--eval-tasks", type=int, default=48)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument(
        "--stop-at",
        type=lambda t: datetime.fromisoformat(t).astimezone(timezone.utc),
        help="start no cell after this time (ISO 8601, e.g. 2026-12-02T09:10+00:00); the outputs are "
        "then partial ('unfinished' lists what is left) and --work continues them",
    )
    parser.add_argument(
        "--no-swap", action="store_true", help="skip the L3 cells' role-swap evaluation (role_swap)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 step, 1 seed, 8 eval tasks: a smoke run of every cell"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument(
        "--work", type=Path, help="working directory; an earlier invocation's: its finished cells are kept"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seeds, args.eval_tasks, args.eval_every, args.group_size = 1, args.seeds[:1], 8, 1, 2

    work = args.work or Path(tempfile.mkdtemp(prefix="megamarl-bench-learning-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"working directory {work} (--work {work} continues this table after a crash)", flush=True)
    # this checkout's package first (a worktree may borrow another checkout's .venv)
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    env.setdefault("MEGAMARL_CACHE", str(work / "cache"))
    budget = {
        "steps": args.steps,
        "num_tasks": args.num_tasks,
        "group_size": args.group_size,
        "eval_tasks": args.eval_tasks,
        "eval_every": args.eval_every,
        "seeds": args.seeds,
        "lr": LR,
        "lora_lr": LORA_LR,
        "ranks": 2,
        "model": MODEL,
    }
    result = {
        "command": "python scripts/" + " ".join([Path(__file__).name, *sys.argv[1:]]),
        "budget": budget,
        "machine": {
            "cpu": _cpu_model(),
            "cores": node_cores(),
            "native_bf16": native_bf16(),
            "avx512_bf16": "avx512_bf16" in cpu_flags(),
            "python": platform.python_version(),
        },
        "families": {},
        "unfinished": [],  # cells --stop-at left for a later invocation with the same --work
    }
    cells = [(f, v, s) for f in args.families for v in args.variants for s in args.seeds]
    load_before, sampler, start = os.getloadavg()[0], LoadSampler(), time.perf_counter()
    sampler.start()
    for i, (family, variant, seed) in enumerate(cells, 1):
        cfg = variant_config(
            family,
            variant,
            seed=seed,
            steps=args.steps,
            num_tasks=args.num_tasks,
            group_size=args.group_size,
            eval_tasks=args.eval_tasks,
            eval_every=args.eval_every,
        )
        late = args.stop_at is not None and datetime.now(timezone.utc) >= args.stop_at
        if late and not (work / f"{cfg['name']}.json").exists():  # a finished cell is still collected
            result["unfinished"].append(cfg["name"])
            continue
        cell = run_cell(cfg, work, env)
        if variant == "L3" and not args.no_swap and "swap" not in cell:
            swap = role_swap(cfg, family, work, env)
            if swap is not None:
                cell["swap"] = swap
                done = work / f"{cfg['name']}.json"
                done.write_text(json.dumps({k: v for k, v in cell.items() if k != "cached"}))
        drop_checkpoints(cfg, work)  # the curve (and the swap) is all a cell keeps
        block = result["families"].setdefault(family, {}).setdefault(variant, {"config": cfg, "runs": {}})
        block["runs"][str(seed)] = cell
        elapsed = time.perf_counter() - start
        print(
            f"[{i}/{len(cells)}] {family} {variant} seed {seed}: accuracy {cell['curve'][0][1]:.3f} -> "
            f"{cell['curve'][-1][1]:.3f} in {cell['wall_s']:.0f} s | elapsed {elapsed / 60:.1f} min, "
            f"ETA {elapsed / i * (len(cells) - i) / 60:.1f} min",
            flush=True,
        )
    result["total_s"] = round(time.perf_counter() - start, 1)  # this invocation
    result["cells_wall_s"] = round(
        sum(c["wall_s"] for f in result["families"].values() for b in f.values() for c in b["runs"].values()),
        1,
    )  # the whole table, across invocations
    load = sampler.stop()
    ran_here = any(
        not c.get("cached")
        for f in result["families"].values()
        for b in f.values()
        for c in b["runs"].values()
    )
    # cells kept from an earlier invocation (--work) ran under that invocation's load, not this one's
    result["load_avg_1min"] = {"before": round(load_before, 2), **load} if ran_here else None
    for family, variants in result["families"].items():
        # the table's order, whatever order --variants ran them in
        result["families"][family] = variants = {v: variants[v] for v in VARIANTS if v in variants}
        for block in variants.values():
            block["summary"] = summarise(list(block["runs"].values()))

    header = (
        "family",
        "variant",
        "accuracy before",
        "after",
        "gain",
        "rollout success",
        "rollout tok",
        "train tok",
        "wall s",
    )
    rows = []
    for family, variants in result["families"].items():
        for variant, block in variants.items():
            s = block["summary"]
            pm = lambda d, f="{:.1%}": f"{f.format(d['mean'])} +- {f.format(d['std'])}"
            rows.append(
                (
                    family,
                    LABELS[variant],
                    pm(s["before"]),
                    pm(s["after"]),
                    pm(s["gain"], "{:+.1%}"),
                    pm(s["rollout_success"]),
                    f"{s['rollout_tokens']['mean']:.0f}",
                    f"{s['train_tokens']['mean']:.0f}",
                    f"{s['wall_s']['mean']:.0f}",
                )
            )
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for family, variants in result["families"].items():
        swap = variants.get("L3", {}).get("summary", {}).get("swap")
        if swap is None:
            continue
        print(f"\n{family}, L3 roles' policies swapped at the last step ({swap['seeds']} seeds):")
        print("| seed | logged after | as trained (re-evaluated) | swapped | drop |\n|---|---|---|---|---|")
        for seed, cell in variants["L3"]["runs"].items():
            if "swap" in cell:
                w = cell["swap"]
                print(
                    f"| {seed} | {cell['curve'][-1][1]:.1%} | {w['as_trained']:.1%} | {w['swapped']:.1%} | "
                    f"{w['drop']:+.1%} |"
                )
        pm = lambda d, f="{:.1%}": f"{f.format(d['mean'])} +- {f.format(d['std'])}"
        print(
            f"| mean +- std | | {pm(swap['as_trained'])} | {pm(swap['swapped'])} | "
            f"{pm(swap['drop'], '{:+.1%}')} |"
            f"\n(re-evaluation equal to the run's own last eval in {swap['reproduced']} of {swap['seeds']})"
        )
    print(
        f"table {result['cells_wall_s'] / 60:.1f} min (this invocation {result['total_s'] / 60:.1f}); load "
        "avg (1 min) "
        + (
            f"before {load_before:.1f}, mean {load['mean']:.1f}, max {load['max']:.1f}"
            if ran_here
            else "not measured: every cell came from --work"
        )
    )
    if result["unfinished"]:
        print(f"PARTIAL: --stop-at left {len(result['unfinished'])} cells: {', '.join(result['unfinished'])}")
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    (args.out / f"learning{suffix}.json").write_text(json.dumps(result, indent=1) + "\n")
    if result["families"]:
        plot(result, args.out / f"learning{suffix}.png")
    print(f"wrote {args.out / f'learning{suffix}.json'} and {args.out / f'learning{suffix}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
