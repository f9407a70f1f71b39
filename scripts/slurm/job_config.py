"""What a Slurm job needs from a run config, as shell assignments for ``eval`` (submit.sh, train.sbatch).

    python scripts/slurm/job_config.py CONFIG [key=value ...]

prints (values shell-quoted)::

    JOB_NAME=...        the config's ``name``
    NUM_NODES=...       ``cluster.num_nodes``
    GPUS_PER_NODE=...   ``cluster.gpus_per_node`` (0: a CPU config)
    RANKS_PER_NODE=...  torchrun's --nproc_per_node: the GPUs of a node, or for a CPU config the
                        smallest world it runs on (planning.dryrun.declared_world_size) per node
    RESOURCES=(...)     the sbatch options that give the job those ranks (below)
    RUN_DIR=...         ``<output_dir>/<name>``: checkpoints, metrics, the PREEMPTED marker
    TOTAL_STEPS=...     ``trainer.total_steps``

The resources, and why:

* GPU config: ``--gpus-per-node G --exclusive --mem=0``: the node's GPUs, all its CPUs and memory
  (the ranks, their engine servers and data loading share them; another job on the node would
  compete for NVLink and host memory);
* CPU config: ``--cpus-per-task R`` (one core per rank) without ``--exclusive``: a small CPU run
  shares a node. More cores per rank: pass ``--cpus-per-task`` after ``--`` to submit.sh (later
  sbatch options win); the template gives every core of the allocation to the ranks.

Both: ``--nodes N --ntasks-per-node 1`` (one torchrun per node). A config error prints one line
naming the key and exits 2, before anything is submitted.
"""

from __future__ import annotations

import shlex
import sys

from megamarl.cli.configure import load_config
from megamarl.config import config_error_line
from megamarl.planning.dryrun import declared_world_size


def job_config(config: str, overrides: list[str]) -> dict[str, str | list[str]]:
    cfg = load_config(config, overrides)
    nodes, gpus = cfg.cluster.num_nodes, cfg.cluster.gpus_per_node
    if gpus > 0:
        ranks_per_node = gpus
        resources = ["--gpus-per-node", str(gpus), "--exclusive", "--mem=0"]
    else:
        world = declared_world_size(cfg)
        if world % nodes:
            raise ValueError(
                f"cluster.num_nodes={nodes} does not divide the {world} ranks this CPU config runs on; "
                "set cluster.num_nodes to a divisor (1 for a CPU run on one node)"
            )
        ranks_per_node = world // nodes
        resources = ["--cpus-per-task", str(ranks_per_node)]
    return {
        "JOB_NAME": cfg.name,
        "NUM_NODES": str(nodes),
        "GPUS_PER_NODE": str(gpus),
        "RANKS_PER_NODE": str(ranks_per_node),
        "RESOURCES": ["--nodes", str(nodes), "--ntasks-per-node", "1", *resources],
        "RUN_DIR": f"{cfg.output_dir}/{cfg.name}",  # as the trainer's (relative to the repository)
        "TOTAL_STEPS": str(cfg.trainer.total_steps),
    }


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        values = job_config(argv[0], argv[1:])
    except (ValueError, ImportError) as exc:
        print(f"config error: {config_error_line(exc)}", file=sys.stderr)
        return 2
    for key, value in values.items():
        quoted = f"({' '.join(map(shlex.quote, value))})" if isinstance(value, list) else shlex.quote(value)
        print(f"{key}={quoted}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
