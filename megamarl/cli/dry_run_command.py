"""The dry-run command: ``python -m megamarl.cli.dry_run_command CONFIG [key=value ...]`` and
``scripts/train.py --dry-run``: ``planning.dryrun.dry_run`` on a loaded config, with the schedule's
traits the planner takes as parameters (docs/cluster.md, "Dry run").
"""

from __future__ import annotations

import argparse
import sys

from megamarl.cli.configure import load_config
from megamarl.config import RunConfig
from megamarl.driver.schedules import overlaps_training
from megamarl.errors import EXIT_CONFIG_ERROR
from megamarl.planning.dryrun import dry_run


def main_dry_run(cfg: RunConfig, *, console=None) -> int:
    """``scripts/train.py --dry-run``: run ``dry_run``; a failed check prints its reason, returns 1."""
    try:
        dry_run(cfg, overlaps_training=overlaps_training(cfg.trainer), console=console)
    except ValueError as exc:
        print(f"dry-run failed: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    """``python -m megamarl.cli.dry_run_command CONFIG [key=value ...]``: the same check as
    ``train.py --dry-run``."""
    parser = argparse.ArgumentParser(description="Check a run's placement and per-GPU memory without GPUs.")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    raise SystemExit(main_dry_run(cfg))


if __name__ == "__main__":
    main()
