"""Train a team of LLM agents.

    torchrun --nproc_per_node 2 scripts/train.py --config configs/quickstart_cpu.yaml [key=value ...]
    python scripts/train.py --config configs/70b_hetero.yaml --dry-run

The loop (megamarl.trainer.Trainer.fit): rollout -> advantages -> update each policy -> sync weights
-> log / eval / checkpoint.
"""

import argparse
import os
import sys

from megamarl.config import load_config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML run config (see configs/)")
    parser.add_argument("--dry-run", action="store_true", help="validate placement and memory for the declared cluster")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=5")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if not args.dry_run:  # the dry run checks its declared cluster instead
            cfg.placement(int(os.environ.get("WORLD_SIZE", "1")))
    except (ValueError, ImportError) as exc:  # ImportError: a plugin module that does not load
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        from megamarl.planning.dryrun import main_dry_run

        return main_dry_run(cfg)
    from megamarl.orchestration.driver import RolloutFailureError
    from megamarl.rl.worker import NumericalFaultError
    from megamarl.runtime.checkpoint import CheckpointWriteError
    from megamarl.trainer import Trainer

    # Errors every rank raises together, with exit codes documented in docs/reliability.md
    try:
        Trainer(cfg).fit()
    except NumericalFaultError as exc:
        print(f"training stopped: {exc}", file=sys.stderr)
        return 3
    except CheckpointWriteError as exc:
        print(f"training stopped: {exc}", file=sys.stderr)
        return 4
    except RolloutFailureError as exc:
        print(f"training stopped: {exc}", file=sys.stderr)
        return 5
    return 0


if __name__ == "__main__":
    sys.exit(main())
