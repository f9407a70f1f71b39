#!/bin/bash
# One node of a megamarl Slurm job: train.sbatch's srun starts this once per node, with torchrun's
# command line as arguments. It runs torchrun and holds the preemption signal for the ranks:
#
# * torchrun runs with USR1 ignored (a disposition that survives exec), so the USR1 meant for the
#   ranks does not kill it, and each rank inherits "ignored" until scripts/train.py installs its
#   handler (megamarl.runtime.preemption) at the start of its main();
# * a USR1 that reaches this script (train.sbatch forwards the batch shell's warning to every process
#   of the job step) is held: every second, each rank (a child of torchrun) whose handler is now
#   installed (the USR1 bit of SigCgt in /proc/PID/status) gets USR1 once. A warning that came while
#   torchrun was still starting, or while a rank was importing, therefore reaches every rank as soon
#   as it can act on it, instead of being lost.
#
# Exit status: torchrun's.
set -uo pipefail

HELD=0
trap 'HELD=1' USR1
# The trap is set: train.sbatch may forward a warning to this node now (it waits for every node's mark).
if [[ -n ${MEGAMARL_SLURM_READY_DIR:-} ]]; then touch "$MEGAMARL_SLURM_READY_DIR/${SLURMD_NODENAME:-$(hostname)}"; fi

(trap '' USR1; exec "$@") &
TORCHRUN=$!

declare -A DELIVERED=()
deliver_held() {  # USR1 to each rank that has its handler and has not had it from us yet
    local pid mask
    for pid in $(pgrep -P "$TORCHRUN" 2>/dev/null); do
        [[ -n ${DELIVERED[$pid]:-} ]] && continue
        mask=$(awk '/^SigCgt:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || continue
        if [[ -n $mask ]] && (( 16#$mask & (1 << (10 - 1)) )); then  # SIGUSR1 is signal 10 on Linux
            kill -USR1 "$pid" 2>/dev/null && DELIVERED[$pid]=1
        fi
    done
}

# `wait` returns early whenever the trap runs; while a signal is held, poll once a second instead.
while :; do
    if [[ $HELD == 1 ]]; then
        deliver_held
        sleep 1 &
        wait $! 2>/dev/null
        kill -0 "$TORCHRUN" 2>/dev/null || break
    else
        wait "$TORCHRUN"
        STATUS=$?
        kill -0 "$TORCHRUN" 2>/dev/null || exit "$STATUS"   # torchrun ended (not the trap)
    fi
done
wait "$TORCHRUN"
