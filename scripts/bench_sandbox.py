"""Code-judge throughput: candidates/s through the isolated sandbox vs the old audit-hook path.

    python scripts/bench_sandbox.py               # docs/bench/sandbox.json + a table (~30-50 s)
    python scripts/bench_sandbox.py --num 10      # quicker
    python scripts/bench_sandbox.py --preset-steps 3   # also the code preset's step time, both paths (~4 min)

Both paths judge the same candidates in one run, one judge process, sequentially (as one env
worker does): a function-call problem (three cases, one sandboxed process per candidate) and a
stdin/stdout problem (three cases, one process per case). Half the candidates are correct, half
wrong, so both verdicts are exercised; the paths alternate in 5 rounds so that load drift on a
shared machine hits both. CPU ms are the sandboxed processes' user + system time (bwrap, setpriv,
unshare and python for the isolated path), less sensitive to other load than wall time. ``isolated`` is the
default path (bubblewrap, own uid and namespaces); ``unsafe_inprocess`` is the old one (rlimits + audit hook,
same uid as the judge), kept only as the explicit opt-in ``env.kwargs.unsafe_inprocess: true``.
``isolated_rlimits_only`` is the isolated path without its per-run cgroup (tree-wide memory, pids and CPU
limits), to show what the cgroup costs; the row is left out where no cgroup hierarchy is writable.

``--preset-steps N`` also trains ``configs/presets/code.yaml`` (the code env's judge in 2 process env
workers) for N steps on each path (``env.kwargs.unsafe_inprocess`` true, then false, then both again:
alternating runs), through ``torchrun --nproc_per_node 1 scripts/train.py``, and reports the steps'
``timing_s/step`` and ``timing_s/rollout`` (means over the runs' steps), the per-step coder reward,
the coder answers that reached the judge per step (those that parsed), the judge's error and
failed-episode counts: that the preset trains the same on both paths.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from megamarl.orchestration import sandbox
from megamarl.orchestration.judge import StdioCase, judge_calls, judge_stdio, parse_assert_tests
from megamarl.orchestration.sandbox import SandboxConfig, isolation_error, tree_limits

ROOT = Path(__file__).resolve().parent.parent
SETUP, CASES = parse_assert_tests("assert scale(2) == 6\nassert scale(-1) == -3\nassert scale(5) == 15\n")
CALLS = ["def scale(x):\n    return x * 3\n", "def scale(x):\n    return x + 3\n"]
STDIO_CASES = [StdioCase("1 2\n", "3\n"), StdioCase("10 -4\n", "6\n"), StdioCase("0 0\n", "0\n")]
STDIO = [
    "a, b = map(int, input().split())\nprint(a + b)\n",
    "a, b = map(int, input().split())\nprint(a - b)\n",
]


PATHS = ("unsafe_inprocess", "isolated_rlimits_only", "isolated")


@contextmanager
def without_cgroups(active: bool):
    found = sandbox._hierarchies
    if active:
        sandbox._hierarchies = lambda: ()
    try:
        yield
    finally:
        sandbox._hierarchies = found


def judge_some(
    kind: str, path: str, num: int, config: SandboxConfig, offset: int
) -> tuple[float, float, int]:
    """(wall s, CPU s of the sandboxed processes, candidates that passed) for ``num`` candidates."""
    isolated = path != "unsafe_inprocess"
    with without_cgroups(path == "isolated_rlimits_only"):
        return _judge_some(kind, isolated, num, config, offset)


def _judge_some(
    kind: str, isolated: bool, num: int, config: SandboxConfig, offset: int
) -> tuple[float, float, int]:
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    passed = 0
    for i in range(offset, offset + num):
        if kind == "function-call":
            verdict = judge_calls(CALLS[i % 2], CASES, config, setup=SETUP, isolated=isolated)
        else:
            verdict = judge_stdio(STDIO[i % 2], STDIO_CASES, config, isolated=isolated)
        passed += verdict.all_passed
    wall = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    return wall, cpu, passed


def bench(
    kind: str, num: int, config: SandboxConfig, paths: tuple[str, ...], *, num_rounds: int = 5
) -> list[dict]:
    """The paths in alternating rounds (load drift on a shared machine hits all alike)."""
    totals = {path: [0.0, 0.0, 0, 0] for path in paths}  # wall, cpu, passed, candidates
    per_round = max(2, num // num_rounds)
    for round_ in range(num_rounds):
        for path in paths:
            wall, cpu, passed = judge_some(kind, path, per_round, config, round_ * per_round)
            t = totals[path]
            t[0], t[1], t[2], t[3] = t[0] + wall, t[1] + cpu, t[2] + passed, t[3] + per_round
    rows = []
    for path, (wall, cpu, passed, count) in totals.items():
        assert passed == count // 2, f"{kind} {path}: {passed} of {count} passed"
        processes = count * (1 if kind == "function-call" else len(STDIO_CASES))
        rows.append(
            {
                "problem": kind,
                "path": path,
                "candidates": count,
                "sandboxed_processes": processes,
                "seconds": round(wall, 3),
                "candidates_per_s": round(count / wall, 2),
                "ms_per_process": round(1000 * wall / processes, 1),
                "cpu_ms_per_process": round(1000 * cpu / processes, 1),
            }
        )
    return rows


def train_preset(steps: int, *, unsafe: bool, out: str) -> list[dict]:
    """One code-preset run on one path: its per-step metrics (metrics.jsonl)."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    name = f"code_{'unsafe' if unsafe else 'isolated'}"
    command = [
        torchrun,
        "--nproc_per_node",
        "1",
        str(ROOT / "scripts/train.py"),
        "--config",
        str(ROOT / "configs/presets/code.yaml"),
        f"trainer.total_steps={steps}",
        f"output_dir={out}",
        f"name={name}",
        f"env.kwargs.unsafe_inprocess={str(unsafe).lower()}",
        "trainer.save_every=0",
        "logger.plots=false",
        "logger.progress=false",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(
            f"bench_sandbox: {' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}"
        )
    lines = [json.loads(line) for line in (Path(out) / name / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "timing_s/step" in m]


def bench_preset(steps: int, *, num_rounds: int = 2) -> list[dict]:
    """The code preset on both paths, alternating runs; means over every run's steps."""
    runs = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as out:
        for round_ in range(num_rounds):
            for unsafe in (True, False):
                print(
                    f"code preset, {'unsafe_inprocess' if unsafe else 'isolated'}, run "
                    f"{round_ + 1}/{num_rounds}",
                    flush=True,
                )
                runs[unsafe].append(train_preset(steps, unsafe=unsafe, out=f"{out}/{round_}"))
    rows = []
    for unsafe, per_run in runs.items():
        steps_ = [m for run in per_run for m in run]
        rows.append(
            {
                "path": "unsafe_inprocess" if unsafe else "isolated",
                "runs": len(per_run),
                "steps_per_run": steps,
                "step_s": round(statistics.mean(m["timing_s/step"] for m in steps_), 2),
                "rollout_s": round(statistics.mean(m["timing_s/rollout"] for m in steps_), 2),
                "coder_reward_mean_per_step": [
                    [round(m.get("agent/coder/reward_mean", float("nan")), 4) for m in run] for run in per_run
                ],
                # coder answers that parsed, so went through the judge (an invalid one is never judged)
                "coder_judged_per_step": [
                    [round((1 - m["agent/coder/invalid_rate"]) * m["agent/coder/num_samples"]) for m in run]
                    for run in per_run
                ],
                "judge_errors": sum(m.get("env/judge_errors", 0) for m in steps_),
                "failed_episodes": sum(m.get("rollout/num_failed", 0) for m in steps_),
            }
        )
    return rows


def machine() -> dict:
    cpu = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    bwrap = subprocess.run(["bwrap", "--version"], check=False, capture_output=True, text=True).stdout.strip()
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "bwrap": bwrap,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=20, help="candidates per problem kind and path")
    parser.add_argument("--out", default=str(ROOT / "docs/bench/sandbox.json"))
    parser.add_argument(
        "--preset-steps",
        type=int,
        default=0,
        help="also train configs/presets/code.yaml this many steps on each path (0: skip)",
    )
    args = parser.parse_args()
    reason = isolation_error()
    if reason is not None:
        print(f"bench_sandbox: isolation unavailable here: {reason}", file=sys.stderr)
        return 2
    config = SandboxConfig()
    limits = tree_limits()
    paths = PATHS if limits != "rlimits" else ("unsafe_inprocess", "isolated")
    load_before = os.getloadavg()[0]
    rows = []
    for kind in ("function-call", "stdin/stdout"):
        for path in paths:  # warm the page cache for every path
            judge_some(kind, path, 2, config, 0)
        rows += bench(kind, args.num, config, paths)
    preset = bench_preset(args.preset_steps) if args.preset_steps > 0 else []
    load_after = os.getloadavg()[0]
    for r in rows:
        old = next(o for o in rows if o["problem"] == r["problem"] and o["path"] == "unsafe_inprocess")
        r["vs_unsafe_inprocess"] = round(r["candidates_per_s"] / old["candidates_per_s"], 2)
    print(
        "| problem | path | candidates/s | wall ms per sandboxed process | CPU ms per sandboxed process "
        "| candidates/s vs unsafe_inprocess |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['problem']} | {r['path']} | {r['candidates_per_s']:.2f} | {r['ms_per_process']:.1f} | "
            f"{r['cpu_ms_per_process']:.1f} | {r.get('vs_unsafe_inprocess', 1.0):.2f}x |"
        )
    if preset:
        print(
            "\n| code preset | step s | rollout s | coder reward per step (runs) | coder answers judged per "
            "step "
            "| judge errors | failed episodes |\n|---|---|---|---|---|---|---|"
        )
        for r in preset:
            print(
                f"| {r['path']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | "
                f"{r['coder_reward_mean_per_step']} | "
                f"{r['coder_judged_per_step']} | {r['judge_errors']:g} | {r['failed_episodes']:g} |"
            )
    result = {
        "machine": machine(),
        "tree_limits": limits,
        "code_preset": preset,
        "load_avg_1m": {"before": load_before, "after": load_after},
        "sandbox": {k: v for k, v in vars(config).items()},
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"wrote {args.out}; load average {load_before:.2f} -> {load_after:.2f} on "
        f"{result['machine']['cores']} cores"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
