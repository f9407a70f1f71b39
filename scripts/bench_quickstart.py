"""Time the README's main command as a new user runs it, and record what the run learned.

    python scripts/bench_quickstart.py                 # fresh clone of HEAD, empty model cache
    python scripts/bench_quickstart.py --in-place      # this checkout (its .venv), empty model cache
    python scripts/bench_quickstart.py --tag avx512    # writes docs/bench/quickstart_avx512.json and so on

Runs the quickstart's first command exactly as README.md prints it (``bash scripts/setup.sh ... &&
.venv/bin/torchrun ... configs/quickstart_cpu.yaml``) in a clean environment with ``MEGAMARL_CACHE``
pointing at a new directory, timing its two halves (install, train) separately, and sampling the
machine's load average every 5 s (a figure taken on a busy machine says so). Prints a table and
writes ``docs/bench/quickstart.json``; the run's ``eval.json``, ``metrics.jsonl``, config and PNGs
are copied to ``docs/quickstart/`` (the committed run the README quotes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megamarl.parallel.hardware import cpu_flags, native_bf16, node_cores


def readme_main_command() -> str:
    block = re.search(
        r"## Quickstart.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL
    ).group(1)
    return next(line for line in block.splitlines() if line.strip() and not line.startswith("#"))


class LoadSampler(threading.Thread):
    def __init__(self, every_s: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.every_s, self.samples, self._stop = every_s, [], threading.Event()

    def run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict:
        self._stop.set()
        samples = self.samples or [os.getloadavg()[0]]
        return {"mean": round(sum(samples) / len(samples), 2), "max": round(max(samples), 2)}


def run_timed(command: str, cwd: Path, env: dict, log: Path) -> tuple[float, int]:
    start = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.call(["bash", "-c", command], cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    return time.perf_counter() - start, code


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--in-place", action="store_true", help="run in this checkout instead of a fresh clone"
    )
    parser.add_argument(
        "--tag",
        default="",
        help="suffix of what is written (one committed run per machine "
        "kind): docs/bench/quickstart_TAG.json and docs/quickstart_TAG/",
    )
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides appended to the command")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="megamarl-bench-qs-"))
    repo = ROOT if args.in_place else work / "megamarl"
    if not args.in_place:
        subprocess.check_call(["git", "clone", "-q", str(ROOT), str(repo)])
    command = readme_main_command()
    setup, train = command.split(" && ", 1)
    train = " ".join([train, *args.overrides, f"output_dir={work / 'runs'}"])
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TERM") if k in os.environ}
    env.update(MEGAMARL_CACHE=str(work / "cache"), PYTHONUNBUFFERED="1")
    load_before = os.getloadavg()[0]
    sampler = LoadSampler()
    sampler.start()
    setup_s, code = run_timed(setup, repo, env, work / "setup.log")
    if code != 0:
        print(f"setup failed ({code}); log: {work / 'setup.log'}")
        return code
    train_s, code = run_timed(train, repo, env, work / "train.log")
    load = sampler.stop()
    if code != 0:
        print(f"train failed ({code}); log: {work / 'train.log'}")
        return code

    run = work / "runs" / "quickstart_cpu"
    evals = json.loads((run / "eval.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    result = {
        "command": command,
        "overrides": args.overrides,
        "fresh_clone": not args.in_place,
        "machine": {
            "cpu": _cpu_model(),
            "cores": node_cores(),
            "native_bf16": native_bf16(),
            "avx512_bf16": "avx512_bf16" in cpu_flags(),
            "python": platform.python_version(),
        },
        "load_avg_1min": {"before": round(load_before, 2), **load},
        "setup_s": round(setup_s, 1),
        "train_s": round(train_s, 1),
        "total_s": round(setup_s + train_s, 1),
        "steps": len(metrics),
        "step_s_mean": round(sum(m["timing_s/step"] for m in metrics) / max(len(metrics), 1), 2),
        "rollout_tokens_per_s_mean": round(
            sum(m.get("perf/rollout_tokens_per_s", 0) for m in metrics) / max(len(metrics), 1), 1
        ),
        "eval": [
            {
                "step": e["step"],
                "team_accuracy": e["results"]["team_accuracy"],
                "num_tasks": e["results"]["num_tasks"],
            }
            for e in evals
        ],
    }
    base, final = evals[0]["results"]["team_accuracy"], evals[-1]["results"]["team_accuracy"]
    result["team_accuracy_base_to_final"] = [base, final]

    suffix = f"_{args.tag}" if args.tag else ""
    out = ROOT / "docs" / "bench" / f"quickstart{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    committed = ROOT / "docs" / f"quickstart{suffix}"
    shutil.rmtree(committed, ignore_errors=True)
    committed.mkdir(parents=True)
    for name in ("eval.json", "metrics.jsonl", "config.yaml"):
        shutil.copy(run / name, committed / name)
    for png in (run / "plots").glob("*.png"):
        shutil.copy(png, committed / png.name)
    shutil.copy(work / "train.log", committed / "train.log")

    rows = [
        ("install (setup.sh)", f"{setup_s / 60:.1f} min"),
        ("train (torchrun, 2 ranks)", f"{train_s / 60:.1f} min"),
        ("steps x mean step", f"{len(metrics)} x {result['step_s_mean']:.1f} s"),
        ("rollout tokens/s (mean)", f"{result['rollout_tokens_per_s_mean']:.0f}"),
        ("held-out team accuracy", f"{base:.1%} -> {final:.1%} ({(final - base) * 100:+.1f} points)"),
        ("load avg (before / mean / max)", f"{load_before:.1f} / {load['mean']:.1f} / {load['max']:.1f}"),
        ("CPU", f"{result['machine']['cpu']}, {node_cores()} cores, native bf16: {native_bf16()}"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(f"wrote {out} and {committed}/")
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
