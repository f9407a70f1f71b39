"""Env work off the driver's event loop: episodes/s of N concurrent episodes whose env steps block,
with the steps inline (on the event loop) vs in process workers vs in Ray actors (``rollout.env_workers``).

    python scripts/bench_env_workers.py                 # docs/bench/env_workers.json + a table (~2 min)
    python scripts/bench_env_workers.py --episodes 8 --rounds 1    # quicker

Two workloads, each ``--episodes`` episodes run at once by ``run_episodes`` (the driver's rollout):

* ``slow_judge`` (megamarl.orchestration.envs.latency): the signalling game, every step (sender,
  receiver) blocks on a judge for ``--judge-s`` seconds (``time.sleep``: a judge waiting on its
  sandboxed process). Inline the judges of all episodes run one after the other.
* ``code``: the code env (``solve_verify``, one loop): the coder's function is judged on the hidden
  tests, the tester's asserts on the code and on the reference, each a real sandboxed process
  (bubblewrap); this judge is CPU work, so workers help up to the free cores.

The agents' replies come from a scripted engine (fixed replies, no model), so the time measured is
the env work and how it overlaps, not generation. Backends: ``inline``; ``process`` and ``ray`` with
2 workers; ``process`` with ``--many`` workers. All worker sets are started first (start-up timed
apart), then the backends alternate in ``--rounds`` rounds so that load drift on a shared machine hits
all alike; every run must produce the same rewards as inline. The load average is recorded: on a
machine busy with other work the figures are lower bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import megamarl.orchestration.envs.latency  # noqa: F401 - registers slow_judge
from megamarl.orchestration import (
    AgentConfig,
    EnvMaker,
    build_agents,
    build_orchestra,
    make_workers,
    run_episodes,
)
from megamarl.orchestration.sandbox import isolation_error
from megamarl.orchestration.workers import EnvWorkers, WorkersConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's model-free engine: this bench times env work only
from scripted import ScriptedEngine, smollm2_tokenizer

CODE_REPLIES = {
    "scale": "def scale(x):\n    return x * 3\n",
    "clip": "def clip(x):\n    return max(0, min(9, x))\n",
}
NOTE = (
    "1, 5, 15 min load averages. Other work on the machine lowers every figure and favours backends that run "
    "more processes at once (they get a larger share of the contended cores): on a loaded machine, gains "
    "beyond "
    "the core count are partly that share"
)
CODE_TESTS = {"scale": "assert scale(1) == 3\n", "clip": "assert clip(20) == 9\n"}


def _code_reply(request) -> str:
    kind = "scale" if "scale(" in request.last_user else "clip"
    return f"```python\n{(CODE_TESTS if 'Write tests' in request.last_user else CODE_REPLIES)[kind]}```"


def _signal_reply(request) -> str:
    return "A" if "secret digit" in request.last_user else "3"


class Workload:
    """One env, its tasks (one episode each) and the scripted agents that play it."""

    def __init__(self, name: str, *, num_episodes: int, judge_s: float) -> None:
        tok = smollm2_tokenizer()
        if name == "slow_judge":
            self.maker = EnvMaker("slow_judge", judge_s=[judge_s])
            self.orchestra = build_orchestra("sequential")
            reply = _signal_reply
        else:
            self.maker = EnvMaker("code", kinds=("scale", "clip"))
            self.orchestra = build_orchestra("solve_verify", solver="coder", verifier="tester", max_loops=1)
            reply = _code_reply
        self.name = name
        self.tasks = self.maker.tasks(num_episodes, seed=0)
        roles = self.maker.env_cls.acting_roles(self.maker.config)
        self.agents = build_agents(
            {r: AgentConfig(policy="default") for r in roles}, tok, default_kinds=self.maker.default_agents
        )
        self.engines = {"default": ScriptedEngine(tok, reply)}

    def run(self, workers: EnvWorkers) -> tuple[float, list]:
        """(seconds, outcome) of every episode at once; outcome: the rewards, to compare backends."""
        start = time.perf_counter()
        result = asyncio.run(
            run_episodes(
                self.orchestra,
                self.maker,
                self.tasks,
                agents=self.agents,
                engines=self.engines,
                max_concurrency=len(self.tasks),
                workers=workers,
                step_timeout_s=120.0,
            )
        )
        seconds = time.perf_counter() - start
        assert result.num_failed == 0, result.failure_report(self.name)
        return seconds, [(s.episode_id, s.agent, s.local_reward, s.team_reward) for s in result.samples]


def machine() -> dict:
    cpu = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    try:
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = None
    bwrap = subprocess.run(["bwrap", "--version"], check=False, capture_output=True, text=True).stdout.strip()
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "ray": ray_version,
        "bwrap": bwrap,
    }


def start_backends(num_many: int, *, with_ray: bool) -> dict[str, tuple[EnvWorkers, float]]:
    """label -> (workers, start-up seconds)."""
    configs = {
        "inline": WorkersConfig(backend="inline"),
        "process (2)": WorkersConfig(backend="process", num_workers=2),
    }
    if with_ray:
        configs["ray (2)"] = WorkersConfig(backend="ray", num_workers=2)
    configs[f"process ({num_many})"] = WorkersConfig(backend="process", num_workers=num_many)
    started = {}
    for label, config in configs.items():
        start = time.perf_counter()
        started[label] = (make_workers(config), time.perf_counter() - start)
    return started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16, help="concurrent episodes per workload")
    parser.add_argument(
        "--judge-s", type=float, default=0.2, help="slow_judge: seconds each step's judge blocks"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds in which the backends alternate")
    parser.add_argument("--many", type=int, default=8, help="workers of the larger process pool")
    parser.add_argument(
        "--workloads", nargs="+", default=["slow_judge", "code"], choices=["slow_judge", "code"]
    )
    parser.add_argument("--out", default=str(ROOT / "docs/bench/env_workers.json"))
    args = parser.parse_args()
    workloads = list(args.workloads)
    if "code" in workloads and isolation_error() is not None:
        print(
            f"bench_env_workers: no sandbox isolation here ({isolation_error()}): code workload skipped",
            file=sys.stderr,
        )
        workloads.remove("code")
    try:
        import ray  # noqa: F401

        with_ray = True
    except ImportError:
        print("bench_env_workers: ray is not installed: no ray row", file=sys.stderr)
        with_ray = False
    load_before = os.getloadavg()
    benches = {name: Workload(name, num_episodes=args.episodes, judge_s=args.judge_s) for name in workloads}
    backends = start_backends(args.many, with_ray=with_ray)
    totals = {(w, b): 0.0 for w in benches for b in backends}
    try:
        # warm-up (imports, page cache, the sandbox) and the reference outcome
        reference = {name: bench.run(backends["inline"][0])[1] for name, bench in benches.items()}
        for _ in range(args.rounds):
            for name, bench in benches.items():
                for label, (workers, _) in backends.items():
                    seconds, outcome = bench.run(workers)
                    assert outcome == reference[name], f"{name}: {label} changed the episodes' rewards"
                    totals[name, label] += seconds
    finally:
        for workers, _ in backends.values():
            workers.close()
    load_after = os.getloadavg()
    rows = []
    for name in benches:
        inline_rate = args.episodes * args.rounds / totals[name, "inline"]
        for label, (_workers, startup_s) in backends.items():
            seconds = totals[name, label]
            rate = args.episodes * args.rounds / seconds
            rows.append(
                {
                    "workload": name,
                    "backend": label,
                    "episodes": args.episodes * args.rounds,
                    "seconds": round(seconds, 3),
                    "episodes_per_s": round(rate, 2),
                    "vs_inline": round(rate / inline_rate, 2),
                    "startup_s": round(startup_s, 2),
                }
            )
    print(
        f"{args.episodes} concurrent episodes per rollout, {args.rounds} rounds; slow_judge: {args.judge_s} "
        "s per step\n"
    )
    print("| workload | backend | episodes/s | vs inline | worker start-up s |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['backend']} | {r['episodes_per_s']:.2f} | {r['vs_inline']:.2f}x | "
            f"{r['startup_s']:.2f} |"
        )
    result = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "machine": machine(),
        "load_avg": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in load_after],
            "note": NOTE,
        },
        "settings": {
            "episodes": args.episodes,
            "rounds": args.rounds,
            "judge_s": args.judge_s,
            "many": args.many,
        },
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"\nwrote {args.out}; load average (1 min) {load_before[0]:.2f} -> {load_after[0]:.2f} "
        f"on {result['machine']['cores']} cores"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
