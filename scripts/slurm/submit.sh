#!/bin/bash
# Dry-run a config on this (login) node, then submit it with the node/GPU counts it was planned for.
#
#   scripts/slurm/submit.sh configs/70b_hetero.yaml [key=value ...] [-- extra sbatch args]
#
# The dry-run builds every worker group's process groups for the whole cluster in one CPU process
# and checks per-GPU memory (megamarl.planning.dryrun); a config that fails it is not submitted.
set -euo pipefail

CONFIG=${1:?usage: scripts/slurm/submit.sh CONFIG [key=value ...] [-- sbatch args]}
shift
OVERRIDES=()
while (($#)) && [[ $1 != "--" ]]; do OVERRIDES+=("$1"); shift; done
[[ ${1:-} == "--" ]] && shift
SBATCH_ARGS=("$@")

cd "$(dirname "$0")/../.."
python -m megamarl.planning.dryrun "$CONFIG" "${OVERRIDES[@]}"

read -r NODES GPUS NAME < <(python - "$CONFIG" "${OVERRIDES[@]}" <<'PY'
import sys
from megamarl.config import load_config
cfg = load_config(sys.argv[1], sys.argv[2:])
print(cfg.cluster.num_nodes, cfg.cluster.gpus_per_node, cfg.name)
PY
)
mkdir -p logs
sbatch --nodes "$NODES" --gpus-per-node "$GPUS" --job-name "$NAME" "${SBATCH_ARGS[@]}" \
    scripts/slurm/train.sbatch "$CONFIG" "${OVERRIDES[@]}"
