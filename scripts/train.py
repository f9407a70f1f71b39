"""Train a team of LLM agents.

    torchrun --nproc_per_node 2 scripts/train.py --config configs/quickstart_cpu.yaml [key=value ...]
    python scripts/train.py --config configs/70b_hetero.yaml --dry-run [policies.planner.tp=4,8 ...]
    python scripts/train.py --config configs/70b_hetero.yaml --show-placement  # which rank starts each engine

Overrides use Hydra's grammar (key=value, +key=value, ++key=value, ~key, group=option; see
docs/configs.md). A sweep (key=a,b) is planned combination by combination with --dry-run; a
training launch takes one value per key.

The loop (megamarl.trainer.Trainer.fit): rollout -> advantages -> update each policy -> sync weights
-> log / eval / checkpoint.
"""

import argparse
import signal
import sys

from megamarl.cli.configure import load_config
from megamarl.cli.front_door import launch_world, preflight, report_config_error
from megamarl.config_loader import expand_sweeps
from megamarl.errors import EXIT_CONFIG_ERROR, EXIT_OK, RunStoppedError
from megamarl.runtime.preemption import PreemptionFlag


def build_parser() -> argparse.ArgumentParser:
    """The command line; no flag may abbreviate one of torchrun's own
    (tests/unit/test_torchrun_command_lines.py)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="YAML run config (see configs/)")
    parser.add_argument(
        "--dry-run", action="store_true", help="validate placement and memory for the declared cluster"
    )
    parser.add_argument(
        "--show-placement",
        action="store_true",
        help="print which rank holds which WG shard and starts which engine replica, computed "
        "as every rank of the declared cluster does at start-up (fake process groups)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="run every start-up check of a training launch (config, datasets, placement, run "
        "directory, resume checkpoint, tokens) and exit: 0 ok, 2 config error; outside "
        "torchrun, placement is checked on the world the config declares",
    )
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. trainer.total_steps=5 +env.kwargs.size=6"
    )
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        return _dry_run(args.config, args.overrides)
    if args.show_placement:
        return _show_placement(args.config, args.overrides)
    # Before anything slow (config, tokenizers, models, engines): a SIGUSR1 (Slurm's warning) from here
    # on is held and the loop stops at the end of its first step (megamarl.runtime.preemption), instead
    # of being lost or killing the rank (the default action). SIGTERM keeps its default until the loop:
    # torchrun stops the other ranks with it when one fails at start-up (a config error is reported
    # once, by the first rank), and the loop's flag holds it from then on.
    if not args.check:
        PreemptionFlag(
            (signal.SIGUSR1,)
        )  # kept alive by the handler it installs; Trainer.fit's flag takes over
    try:
        cfg = load_config(args.config, args.overrides)
        plan = preflight(cfg, world_size=launch_world(cfg, check=args.check))  # the run's engine plan, once
    except (ValueError, ImportError) as exc:  # ImportError: a plugin module that does not load
        return report_config_error(exc)
    if args.check:
        print(f"config ok: {args.config}")
        return EXIT_OK
    from megamarl.trainer import Trainer

    try:
        Trainer(cfg, plan=plan).fit()
    except (
        RunStoppedError
    ) as exc:  # every rank raises it together; its code: megamarl.errors, docs/reliability.md
        print(f"training stopped: {exc}", file=sys.stderr)
        return exc.exit_code
    return EXIT_OK


def _dry_run(config: str, overrides: list[str]) -> int:
    """Plan every sweep combination against the declared cluster (not WORLD_SIZE); worst exit code."""
    from megamarl.cli.dry_run_command import main_dry_run

    try:
        combos = expand_sweeps(overrides)
        configs = [(combo, load_config(config, combo)) for combo in combos]
    except (ValueError, ImportError) as exc:
        return report_config_error(exc)
    status = EXIT_OK
    for combo, cfg in configs:
        if len(configs) > 1:
            print(f"== dry run: {' '.join(combo)}")
        status = max(
            status, EXIT_CONFIG_ERROR if main_dry_run(cfg) else EXIT_OK
        )  # a plan that does not fit: a config error too
    return status


def _show_placement(config: str, overrides: list[str]) -> int:
    from megamarl.planning.placement_view import main_show_placement

    try:
        cfg = load_config(config, overrides)
    except (ValueError, ImportError) as exc:
        return report_config_error(exc)
    return (
        EXIT_CONFIG_ERROR if main_show_placement(cfg) else EXIT_OK
    )  # a placement that cannot be built: a config error too


if __name__ == "__main__":
    sys.exit(main())
