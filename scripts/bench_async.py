r"""Trainer modes side by side on a multi-agent workload whose environment has real latency.

The workload (configs/bench_async.yaml): two tiny policies, a caller and an answerer, play a
signalling game through slow tools (megamarl.orchestration.envs.latency): after every caller turn a
tool call waits (a remote API) or runs a python program in a subprocess; episodes take 1 to 10
rounds (long tail). Each ``trainer.mode`` trains the same config for ``--steps`` steps in a fresh
process, one run after the other (never concurrently: they would share the CPU), ``--repeats``
rounds with the modes interleaved so that a shared machine's load drifts over all of them alike.
Prints the median steps/hour and samples/hour per mode, the speed-up over sync, idle ratios, the
weight-sync bubble, staleness and drops, and writes docs/bench/async.json (every run, the machine).

    python scripts/bench_async.py [--steps 10] [--repeats 3] \
        [--modes sync one_step_off fully_async] [key=value ...]

Throughput is measured between the log lines of the first and the last step (steady state: the
first step pays for warm-up in every mode). A *step* is one update of every policy: with per-policy
progress a fully_async iteration may update only the policies whose batch was ready, so steps/hour
is policy updates per hour divided by the number of policies (raw iterations/hour are kept too).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_rollout import machine_info  # scripts/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
MODES = ("sync", "one_step_off", "fully_async")


def run_mode(
    mode: str, *, config: Path, steps: int, overrides: list[str], out_dir: Path, threads: int
) -> dict:
    command = [
        sys.executable,
        str(ROOT / "scripts" / "train.py"),
        "--config",
        str(config),
        f"trainer.mode={mode}",
        f"trainer.total_steps={steps}",
        f"output_dir={out_dir}",
        f"name={mode}",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"mode {mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    lines = [json.loads(x) for x in (out_dir / mode / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return summarise(mode, lines, wall_s=wall, load=(load_before, os.getloadavg()[0]))


def summarise(mode: str, lines: list[dict], *, wall_s: float, load: tuple[float, float]) -> dict:
    steady = lines[1:]
    span = lines[-1]["time"] - lines[0]["time"]  # from the end of step 1 to the end of the last step

    def mean(key: str) -> float:
        values = [m[key] for m in steady if key in m]
        return sum(values) / max(len(values), 1)

    samples = sum(m["rollout/num_samples"] for m in steady)
    updated = [
        k.split("/")[1] for m in steady for k in m if k.startswith("policy/") and k.endswith("/grad_norm")
    ]
    num_policies = len(set(updated))
    return {
        "mode": mode,
        "iterations": len(lines),
        "steady_seconds": span,
        "num_policies": num_policies,
        "steps_per_hour": len(updated) / num_policies / span * 3600,
        "samples_per_hour": samples / span * 3600,
        "iterations_per_hour": len(steady) / span * 3600,
        "policy_updates_per_iteration": len(updated) / len(steady),
        "samples_per_iteration": samples / len(steady),
        "step_s": mean("timing_s/step"),
        "rollout_wait_s": mean("timing_s/rollout"),
        "update_s": mean("timing_s/update"),
        "weight_sync_s": mean("timing_s/weight_sync"),
        "rollout_idle_ratio": mean("async/rollout_idle_ratio"),
        "trainer_idle_ratio": mean("async/trainer_idle_ratio"),
        "weight_sync_bubble_s": mean("async/weight_sync_bubble_s"),
        "staleness_mean": mean("async/staleness_mean"),
        "staleness_max": max(m["async/staleness_max"] for m in lines),
        "dropped_stale_groups": lines[-1]["rollout/total_dropped_stale_groups"],
        "dropped_stale_samples": lines[-1]["rollout/total_dropped_stale_samples"],
        "success_rate": mean("rollout/success_rate"),
        "process_wall_s": wall_s,
        "load_avg_1m": list(load),
    }


def median_by_mode(runs: list[dict]) -> list[dict]:
    """One row per mode: the median of every numeric field over its runs (drops: the sum)."""
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        row: dict = {"mode": mode, "num_runs": len(mine)}
        for key, value in mine[0].items():
            if isinstance(value, (int, float)) and key not in row:
                values = [r[key] for r in mine]
                row[key] = sum(values) if key.startswith("dropped") else statistics.median(values)
        row["steps_per_hour_runs"] = [round(r["steps_per_hour"]) for r in mine]
        rows.append(row)
    base = next((r for r in rows if r["mode"] == "sync"), None)
    for row in rows:
        row["speedup_vs_sync"] = row["steps_per_hour"] / base["steps_per_hour"] if base else None
        row["samples_speedup_vs_sync"] = row["samples_per_hour"] / base["samples_per_hour"] if base else None
    return rows


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="trainer modes on the tool-latency workload (medians over runs; steady state, steps 2..N)"
    )
    columns = (
        "mode",
        "steps/h",
        "x sync",
        "samples/h",
        "x sync",
        "samples/iter",
        "updates/iter",
        "iter s",
        "update s",
        "rollout idle",
        "trainer idle",
        "bubble s",
        "staleness",
        "dropped groups",
    )
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["mode"],
            f"{r['steps_per_hour']:.0f}",
            f"{r['speedup_vs_sync'] or 0:.2f}",
            f"{r['samples_per_hour']:.0f}",
            f"{r['samples_speedup_vs_sync'] or 0:.2f}",
            f"{r['samples_per_iteration']:.0f}",
            f"{r['policy_updates_per_iteration']:.2f}",
            f"{r['step_s']:.2f}",
            f"{r['update_s']:.2f}",
            f"{r['rollout_idle_ratio']:.2f}",
            f"{r['trainer_idle_ratio']:.2f}",
            f"{r['weight_sync_bubble_s']:.3f}",
            f"{r['staleness_mean']:.2f} (max {r['staleness_max']:.0f})",
            f"{r['dropped_stale_groups']:.0f}",
        )
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench_async.yaml"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the modes, interleaved")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS of every run (same for all modes)"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench" / "async.json"))
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for every mode")
    args = parser.parse_args()

    runs = []
    for repeat in range(args.repeats):
        for mode in args.modes:
            with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
                run = run_mode(
                    mode,
                    config=Path(args.config),
                    steps=args.steps,
                    overrides=args.overrides,
                    out_dir=Path(tmp),
                    threads=args.threads,
                )
            run["repeat"] = repeat
            runs.append(run)
            print(
                f"[bench_async] round {repeat + 1}/{args.repeats} {mode}: {run['steps_per_hour']:.0f} "
                "steps/h, "
                f"{run['samples_per_hour']:.0f} samples/h (load {run['load_avg_1m'][0]:.1f})",
                flush=True,
            )
    rows = median_by_mode(runs)
    print_table(rows)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": os.path.relpath(args.config, ROOT),
        "overrides": args.overrides,
        "steps": args.steps,
        "repeats": args.repeats,
        "omp_num_threads": args.threads,
        "notes": "modes run one after another in fresh processes on the same machine, interleaved over the "
        "repeats; steady state = from the end of step 1 to the end of the last step; per-mode figures are "
        "medians over runs (dropped groups: sums); idle ratios and bubble are per-step means of the async/* "
        "metrics; load_avg_1m before/after each run (other jobs on a shared machine skew the figures).",
        "results": rows,
        "runs": runs,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
