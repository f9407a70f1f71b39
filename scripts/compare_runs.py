"""Check that a refactor keeps a seeded run's losses bit-identical (docs/style.md "Refactors keep seeded runs
bit-identical").

    python scripts/compare_runs.py --base 60ff66b            # base revision vs the working tree
    python scripts/compare_runs.py --base HEAD --head HEAD   # determinism: one revision twice
    # a 2-rank preset; two finished runs
    python scripts/compare_runs.py --base main --config configs/presets/l2_colocated.yaml --nproc 2
    python scripts/compare_runs.py --metrics runs/one_node/metrics.jsonl runs/two_nodes/metrics.jsonl
    python scripts/compare_runs.py --base HEAD --head HEAD --rtol 1e-4 --atol 1e-6 policies.shared.pack=true \
        --head-override policies.shared.prefix_tree=true   # a feature on vs off, one revision

Runs a seeded ``trainer.total_steps``-step ``configs/signalling_tiny.yaml`` run (torchrun, one rank)
once at each side, each from its own source tree: a revision is checked out into a temporary
``git worktree`` and put first on PYTHONPATH; ``--head`` defaults to the working tree. Then every
key of every ``metrics.jsonl`` line is compared exactly (float equality of the JSON values), except
wall-clock keys (``time``, ``timing/``, ``perf/``, ``memory/``, ``*_s``, ``*_per_s``, ``gbps``, async time
ratios: ``megamarl.runtime.metrics.MEASURED``), which differ run to run by nature. Losses (``policy/*``)
must match; any other difference also fails, since rewards and sample counts come from the same seeded
rollout. Exit status 0 when identical.

``--rtol R`` compares across a numerical change instead (for example a different optimizer
implementation): numbers match when ``|a - b| <= R * max(|a|, |b|)``, keys only one side logs are
listed but do not fail, and the largest relative difference of each loss key is printed.

``--metrics BASE HEAD`` compares two runs already made (their ``metrics.jsonl``, e.g. the same config and
seed on one node and on two) by the same rules, starting nothing; ``--ignore REGEX`` leaves out more keys
(values that may differ by design, said why where it is used).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: this tree's megamarl
from megamarl.runtime.metrics import MEASURED

WALL_CLOCK = MEASURED  # time stamp, durations, throughputs, async time ratios, resident memory


def run_at(
    source: Path, out_dir: Path, *, config: str, steps: int, extra: list[str], nproc: int = 1
) -> list[dict]:
    """One seeded run with ``source`` first on PYTHONPATH; returns its metrics.jsonl records."""
    env = dict(os.environ, PYTHONPATH=str(source), OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(29500 + os.getpid() % 1000),
        str(source / "scripts" / "train.py"),
        "--config",
        str(source / config),
        f"trainer.total_steps={steps}",
        f"output_dir={out_dir}",
        "name=compare",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=source, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(
            f"run at {source} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    lines = (out_dir / "compare" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _close(a, b, rtol: float, atol: float = 0.0) -> bool:
    if a == b:
        return True
    if rtol <= 0 or isinstance(a, bool) or isinstance(b, bool):
        return False
    if not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return False
    return abs(a - b) <= max(rtol * max(abs(a), abs(b)), atol)


def compare(
    base: list[dict], head: list[dict], rtol: float = 0.0, ignore: re.Pattern | None = None, atol: float = 0.0
) -> tuple[list[str], int]:
    """Differences between two runs' records (empty: identical) and the number of values compared.
    ``rtol > 0``: numbers within that relative tolerance match and one-sided keys are not differences;
    ``ignore``: keys left out besides the wall-clock ones."""
    diffs, num_compared = [], 0
    if len(base) != len(head):
        diffs.append(f"{len(base)} records vs {len(head)}")

    def kept(key: str) -> bool:
        return not WALL_CLOCK.search(key) and not (ignore and ignore.search(key))

    for i, (a, b) in enumerate(zip(base, head)):
        keys_a = {k for k in a if kept(k)}
        keys_b = {k for k in b if kept(k)}
        for key in sorted(keys_a ^ keys_b) if rtol <= 0 else ():
            diffs.append(f"record {i}: key {key} only in {'base' if key in keys_a else 'head'}")
        for key in sorted(keys_a & keys_b):
            num_compared += 1
            if not _close(a[key], b[key], rtol, atol):
                diffs.append(f"record {i} (step {a.get('step')}): {key} base={a[key]!r} head={b[key]!r}")
    return diffs, num_compared


def checkout(rev: str, into: Path) -> Path:
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(into), rev],
        check=True,
        capture_output=True,
    )
    return into


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", help="git revision of the reference run")
    parser.add_argument(
        "--metrics",
        nargs=2,
        metavar=("BASE", "HEAD"),
        type=Path,
        help="compare two finished runs' metrics.jsonl instead of running anything",
    )
    parser.add_argument("--ignore", default="", help="regex of further keys not compared (--metrics)")
    parser.add_argument("--head", default=None, help="git revision to compare (default: the working tree)")
    parser.add_argument("--config", default="configs/signalling_tiny.yaml")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run (a 2-rank preset: 2)")
    parser.add_argument(
        "--rtol", type=float, default=0.0, help="relative tolerance for numbers (default 0: bit-identical)"
    )
    parser.add_argument(
        "--atol",
        type=float,
        default=0.0,
        help="with --rtol: numbers this close also match (values near 0, e.g. a pg_loss of ~1e-8)",
    )
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs")
    parser.add_argument(
        "--head-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for the head run only: a feature on vs off on one revision "
        "(e.g. --base HEAD --head HEAD --head-override policies.shared.prefix_tree=true)",
    )
    args = parser.parse_args(argv)
    if args.metrics:
        return report(
            *(_records(path) for path in args.metrics),
            names=tuple(map(str, args.metrics)),
            rtol=args.rtol,
            atol=args.atol,
            ignore=re.compile(args.ignore) if args.ignore else None,
        )
    if not args.base:
        parser.error("give --base REV (or --metrics BASE HEAD)")
    tmp = Path(tempfile.mkdtemp(prefix="megamarl_compare_"))
    worktrees = []
    try:
        sides = {}
        for side, rev in (("base", args.base), ("head", args.head)):
            if rev is None:
                source = REPO
            else:
                source = checkout(rev, tmp / f"src_{side}")
                worktrees.append(source)
            sides[side] = run_at(
                source,
                tmp / f"out_{side}",
                config=args.config,
                steps=args.steps,
                extra=[*args.overrides, *(args.head_override if side == "head" else [])],
                nproc=args.nproc,
            )
    finally:
        for tree in worktrees:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                capture_output=True,
                check=False,
            )
        shutil.rmtree(tmp, ignore_errors=True)
    head = (args.head or "working tree") + (
        f" with {' '.join(args.head_override)}" if args.head_override else ""
    )
    return report(sides["base"], sides["head"], names=(args.base, head), rtol=args.rtol, atol=args.atol)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(
    base: list[dict],
    head: list[dict],
    *,
    names: tuple[str, str],
    rtol: float = 0.0,
    atol: float = 0.0,
    ignore: re.Pattern | None = None,
) -> int:
    """Print the comparison of two runs' records; 0 when they match."""
    diffs, num_compared = compare(base, head, rtol, ignore, atol)
    losses = sorted(
        {k for record in base for k in record if k.startswith("policy/") and not WALL_CLOCK.search(k)}
    )
    print(
        f"base={names[0]} head={names[1]}: {len(base)} records, "
        f"{num_compared} values compared, loss keys: {losses}"
    )
    for record in base:
        print(
            f"  step {record.get('step')}: " + ", ".join(f"{k}={record[k]!r}" for k in losses if k in record)
        )
    if rtol > 0:
        only = sorted(
            {
                k
                for side, other in ((base, head), (head, base))
                for r in side[:1]
                for k in r
                if not WALL_CLOCK.search(k) and k not in other[0]
            }
        )
        print(f"keys logged by one side only (not compared): {only}")
        for key in losses:
            rel = [
                abs(a[key] - b[key]) / max(abs(a[key]), abs(b[key]), 1e-30)
                for a, b in zip(base, head)
                if key in a
                and key in b
                and isinstance(a[key], (int, float))
                and isinstance(b[key], (int, float))
            ]
            print(f"  {key}: max relative difference {max(rel, default=0.0):.3g} over {len(rel)} steps")
    if diffs:
        print("DIFFERENT:\n  " + "\n  ".join(diffs[:50]))
        return 1
    print(
        "IDENTICAL (bit-for-bit, wall-clock keys excluded)"
        if rtol <= 0
        else f"MATCH within rtol={rtol:g}, atol={atol:g} (wall-clock keys excluded)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
