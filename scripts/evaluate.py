"""Evaluate a run, a checkpoint or an exported model on the configured eval sets, without training.

    torchrun --nproc_per_node 2 scripts/evaluate.py --run-dir runs/quickstart_cpu  # latest checkpoint, config
    torchrun --nproc_per_node 2 scripts/evaluate.py --checkpoint runs/quickstart_cpu/checkpoints/step_000010
    torchrun --nproc_per_node 2 scripts/evaluate.py --config configs/quickstart_cpu.yaml --hf exported/
    python scripts/evaluate.py --config configs/quickstart_cpu.yaml "policies.shared.ranks=[0]"  # 1 rank

It runs on the ranks the config places its policies on (the quickstart's ``ranks: [0, 1]`` needs two;
``policies.<p>.ranks=[0]`` moves a policy to one rank, and checkpoints reshard to it).

The evaluation is the one a training run makes at its eval steps (``eval.env`` / ``eval.sets``,
``eval.num_tasks``, ``eval.k``, ``eval.temperature``; the held-out seed): the same ``Trainer`` is built,
loads the weights and pushes them into its engines, then evaluates once (``Trainer.evaluate_only``).
So a checkpoint evaluated here scores exactly what its run logged at that step. Sources:

* ``--run-dir DIR``: the run's latest complete checkpoint; ``--checkpoint DIR``: that checkpoint
  (``<run>/checkpoints/step_N``). Both set ``trainer.resume``; ``--config`` defaults to the run's
  ``config.yaml``. The entry's step is the checkpoint's.
* ``--hf DIR``: ``megamarl-convert --to hf`` output (``DIR/<policy>/``: each policy found there is
  loaded from it, the others keep their configured model) or one model directory for a one-policy
  config. The entry's step is the export's (``megamarl_export.json``), else 0. L2 (LoRA) policies
  are refused: their adapters are not loaded from an export (evaluate their checkpoint instead).
* none: the configured models, as a run's step-0 evaluation.

A checkpoint holds policies by name; which agent a policy serves is the config's (``agents.<a>.policy``,
``agents.<a>.lora``), so overrides may remap them: ``agents.solver.policy=verifier_policy
agents.verifier.policy=solver_policy`` evaluates an L3 run with the roles' trained policies swapped
(scripts/bench_learning.py's ablation). What must match is each trained policy's name and model.

Output goes to ``--out`` (default ``<output_dir>/<name>-eval``; never the evaluated run's own
directory): ``eval.json`` gets one entry per evaluation, ``config.yaml`` the evaluation's config. The
table of results is printed at the end. Exit codes: 0 done, 2 config error (one line naming the flag
or key, before any model loads), 5 evaluation failed (as scripts/train.py, docs/reliability.md).
"""

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from megamarl.cli.configure import load_config
from megamarl.cli.front_door import launch_world, preflight, report_config_error
from megamarl.config import RunConfig
from megamarl.errors import EXIT_OK, RolloutFailureError


def build_parser() -> argparse.ArgumentParser:
    """The command line. No flag may be a prefix of one of torchrun's own (``--run`` is one of
    ``--run-path``: torchrun refuses it as ambiguous before starting a rank), so the source flag is
    ``--run-dir``; tests/unit/test_torchrun_command_lines.py parses every flag through torchrun's parser."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", help="YAML run config (default with --run-dir/--checkpoint: the run's config.yaml)"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--run-dir", dest="run", help="a run directory: its latest complete checkpoint")
    source.add_argument("--checkpoint", help="a checkpoint directory, <run>/checkpoints/step_N")
    source.add_argument(
        "--hf", help="exported HF models (megamarl-convert output, DIR/<policy>/) or one model directory"
    )
    parser.add_argument("--out", help="where eval.json goes (default: <output_dir>/<name>-eval)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="run the start-up checks (config, sources, placement, output directory) and exit",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. eval.num_tasks=200 eval.k=4")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg, step, notes = eval_config(args)
        plan = preflight(cfg, world_size=launch_world(cfg, check=args.check))  # the run's engine plan, once
    except (ValueError, ImportError) as exc:  # ImportError: a plugin module that does not load
        return report_config_error(exc)
    out = Path(cfg.output_dir) / cfg.name
    if args.check:
        print(f"config ok: evaluation of {_describe(args)} into {out}")
        return EXIT_OK
    from megamarl.trainer import Trainer

    is_driver = int(os.environ.get("RANK", "0")) == 0
    for note in notes if is_driver else ():
        print(note)
    try:
        trainer = Trainer(cfg, eval_only=True, plan=plan)
        results = trainer.evaluate_only(step=step)
    except RolloutFailureError as exc:
        print(f"evaluation failed: {exc}", file=sys.stderr)
        return exc.exit_code
    if is_driver:
        step = trainer.step if step is None else step
        print_table(
            results, title=f"{_describe(args)}, step {step} ({out / 'eval.json'})", sets=list(cfg.eval.sets)
        )
    return EXIT_OK


def eval_config(args) -> tuple[RunConfig, int | None, list[str]]:
    """The evaluation's config: ``--config`` (or the run's) with the overrides, the source's weights
    (``trainer.resume``, or ``policies.<p>.model`` for ``--hf``) and the output directory as its run
    directory. Also the step to label the entry with (None: the checkpoint's) and notes to print."""
    bad = [o for o in args.overrides if o.lstrip("+~").split("=", 1)[0] == "trainer.resume"]
    if bad:
        raise ValueError(
            f"{bad[0]}: the evaluated checkpoint is given with --run-dir or --checkpoint, not trainer.resume"
        )
    checkpoint = _checkpoint_dir(args)
    config = args.config
    if config is None:  # the run's own resolved config
        if checkpoint is None:
            raise ValueError("--config is required with --hf or without a source (--run-dir / --checkpoint)")
        config = checkpoint.parent.parent / "config.yaml"
        if not config.is_file():
            raise ValueError(f"--config is required: the run has no {config}")
    cfg = load_config(config, args.overrides)
    if cfg.eval.num_tasks <= 0:
        raise ValueError(
            "eval.num_tasks is 0: nothing to evaluate; set eval.num_tasks=N (tasks per eval set)"
        )
    step, notes, policies = None, [], cfg.policies
    if args.hf is not None:
        policies, step, notes = _hf_policies(cfg, Path(args.hf))
    out = Path(os.path.abspath(args.out or Path(cfg.output_dir) / f"{cfg.name}-eval"))
    _check_out(out, checkpoint)
    # the output directory is the Trainer's run directory (config.yaml, eval.json, engine logs, plots)
    trainer = replace(cfg.trainer, resume=str(checkpoint) if checkpoint is not None else "none")
    return (
        replace(cfg, output_dir=str(out.parent), name=out.name, trainer=trainer, policies=policies),
        step,
        notes,
    )


def _checkpoint_dir(args) -> Path | None:
    """``--run-dir`` / ``--checkpoint`` -> the complete checkpoint directory (ValueError naming the flag)."""
    from megamarl.runtime import checkpoint

    if args.checkpoint is not None:
        path = Path(args.checkpoint)
        if not (path / checkpoint.COMPLETE).is_file():
            why = (
                "does not exist"
                if not path.exists()
                else f"is not a complete checkpoint (no {checkpoint.COMPLETE} marker)"
            )
            raise ValueError(
                f"--checkpoint {path} {why}; give <run>/{checkpoint.CHECKPOINTS}/step_N, or a run "
                "directory with --run-dir"
            )
        return path
    if args.run is not None:
        path = Path(args.run)
        found = checkpoint.list_checkpoints(path)
        if not found:
            why = (
                "does not exist"
                if not path.exists()
                else f"holds no complete checkpoint under {checkpoint.CHECKPOINTS}/"
            )
            raise ValueError(
                f"--run-dir {path} {why}; give a run directory (or one checkpoint with --checkpoint)"
            )
        return found[-1]
    return None


def _hf_policies(cfg: RunConfig, path: Path) -> tuple[dict, int, list[str]]:
    """``--hf``: each policy's model from the export; the export's step; a note per policy kept."""
    from megamarl.cli.export import MANIFEST

    if not path.is_dir():
        raise ValueError(
            f"--hf {path} does not exist; give megamarl-convert's output directory or one model directory"
        )
    if (path / "config.json").is_file():  # one model directory
        if len(cfg.policies) != 1:
            raise ValueError(
                f"--hf {path} is one model directory but the config has policies {sorted(cfg.policies)}; "
                "give the export directory holding one <policy>/ directory each"
            )
        found, manifest = {next(iter(cfg.policies)): path}, path.parent / MANIFEST
    else:
        found = {name: path / name for name in cfg.policies if (path / name / "config.json").is_file()}
        manifest = path / MANIFEST
        if not found:
            raise ValueError(
                f"--hf {path} has no model directory for any policy of the config "
                f"({', '.join(f'{name}/' for name in sorted(cfg.policies))})"
            )
    lora = sorted(name for name in found if cfg.policies[name].lora is not None)
    if lora:
        raise ValueError(
            f"--hf: policies {lora} are L2 (LoRA) policies, whose exported adapters the engines do not "
            "load from an export; evaluate their run with --run-dir or --checkpoint"
        )
    notes = [
        f"--hf: policy {name} is not in {path}; it keeps policies.{name}.model={p.model}"
        for name, p in cfg.policies.items()
        if name not in found
    ]
    policies = {
        name: replace(p, model=str(found[name])) if name in found else p for name, p in cfg.policies.items()
    }
    try:
        step = int(json.loads(manifest.read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        step = 0  # not megamarl's export: labelled like the base models
    return policies, step, notes


def _check_out(out: Path, checkpoint: Path | None) -> None:
    """The output directory is the evaluation's own: not a training run's (its eval.json and
    config.yaml would change under it)."""
    from megamarl.runtime.checkpoint import CHECKPOINTS

    if checkpoint is not None and out.resolve() == checkpoint.parent.parent.resolve():
        raise ValueError(
            f"--out {out} is the evaluated run's directory; give another (default: <output_dir>/<name>-eval)"
        )
    if (out / CHECKPOINTS).exists():
        raise ValueError(f"--out {out} holds a training run ({CHECKPOINTS}/); give another directory")


def _describe(args) -> str:
    for flag, dest in (("run-dir", "run"), ("checkpoint", "checkpoint"), ("hf", "hf")):
        if getattr(args, dest) is not None:
            return f"--{flag} {getattr(args, dest)}"
    return "the configured models"


def print_table(results: dict, *, title: str, sets: list[str]) -> None:
    """Results as a table on a terminal (rich), as aligned plain lines otherwise (logs, pipes)."""
    rows = []
    for key, value in results.items():
        name, result = key.split("/", 1) if sets and key.split("/", 1)[0] in sets else ("", key)
        text = (
            "-"
            if value is None
            else str(int(value))
            if result in ("num_tasks", "num_failed")
            else f"{value:.4f}"
        )
        rows.append((name, result, text))
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"eval of {title}")
        for column in ("set", "result", "value")[0 if sets else 1 :]:
            table.add_column(column, justify="right" if column == "value" else "left")
        for row in rows:
            table.add_row(*row[0 if sets else 1 :])
        Console().print(table)
        return
    print(f"eval of {title}")
    width = max((len(f"{name}/{result}" if name else result) for name, result, _ in rows), default=0)
    for name, result, text in rows:
        print(f"  {f'{name}/{result}' if name else result:<{width}}  {text:>8}")


if __name__ == "__main__":
    sys.exit(main())
