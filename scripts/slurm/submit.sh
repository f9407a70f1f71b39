#!/bin/bash
# Dry-run a config on this (login) node, then submit it with the resources it was planned for.
#
#   scripts/slurm/submit.sh configs/70b_hetero.yaml [key=value ...] [-- extra sbatch options]
#
# The dry-run builds every worker group's process groups for the whole cluster in one CPU process
# and checks per-GPU memory (megamarl.planning.dryrun); a config that fails it is not submitted.
# The resources come from the config (scripts/slurm/job_config.py): --nodes, one task (torchrun) per
# node, and for a GPU config --gpus-per-node, --exclusive and --mem=0, for a CPU config one core per
# rank (--cpus-per-task). Options after `--` go to sbatch after those, so they win: --time,
# --account, --partition, --cpus-per-task for more cores per CPU rank, --signal for another warning.
# Prints sbatch's answer ("Submitted batch job N"); the log is logs/<name>-<N>.out.
set -euo pipefail

CONFIG=${1:?usage: scripts/slurm/submit.sh CONFIG [key=value ...] [-- sbatch options]}
shift
OVERRIDES=()
while (($#)) && [[ $1 != "--" ]]; do OVERRIDES+=("$1"); shift; done
[[ ${1:-} == "--" ]] && shift
SBATCH_ARGS=("$@")

cd "$(dirname "$0")/../.."
python -m megamarl.cli.dry_run_command "$CONFIG" ${OVERRIDES[@]+"${OVERRIDES[@]}"}

INFO=$(python scripts/slurm/job_config.py "$CONFIG" ${OVERRIDES[@]+"${OVERRIDES[@]}"}) || exit 2
eval "$INFO"   # JOB_NAME RESOURCES ...
if [[ " ${SBATCH_ARGS[*]-} " != *" --output"* ]]; then mkdir -p logs; fi   # Slurm does not create the log folder
sbatch --job-name "$JOB_NAME" "${RESOURCES[@]}" ${SBATCH_ARGS[@]+"${SBATCH_ARGS[@]}"} \
    scripts/slurm/train.sbatch "$CONFIG" ${OVERRIDES[@]+"${OVERRIDES[@]}"}
