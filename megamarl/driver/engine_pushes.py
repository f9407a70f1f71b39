"""The trained weights into the engines: the due pushes, the opponent pool's snapshots, the re-sync of
restarted servers. Collective (every rank calls each, in the same order); each push or snapshot is a
new weight version (``rollout.weight_versions``), stamped on everything the engines generate afterwards.
While weights move, the driver's rollout is drained or paused (``RolloutDriver.weight_update``).
"""

from __future__ import annotations

import time
from collections.abc import Set as AbstractSet
from contextlib import nullcontext
from typing import Any

import torch.distributed as dist

from megamarl.config import PolicyConfig
from megamarl.config_sections import OpponentPoolConfig
from megamarl.driver.opponent_pool import snapshot_slot
from megamarl.parallel.distributed import control_group
from megamarl.rollout.replicas.policy import stale_replicas
from megamarl.rollout.weight_versions import WeightVersions
from megamarl.runtime.progress import RunProgress

DRIVER = 0


class EnginePushes:
    def __init__(
        self,
        policies: dict[str, PolicyConfig],
        pool: OpponentPoolConfig,
        *,
        replicas: dict[str, Any],
        versions: WeightVersions,
        driver: Any,
        progress: RunProgress,
    ) -> None:
        """``driver``: the rollout driver on rank 0, None elsewhere."""
        self.policies, self.pool, self.replicas, self.versions = policies, pool, replicas, versions
        self.driver, self.progress = driver, progress

    def _rollout_paused(self):
        return self.driver.weight_update() if self.driver is not None else nullcontext()

    def push(self, policies: list[str], *, start_up: bool = False) -> dict[str, float]:
        """Push ``policies`` into their engines. Frozen policies get the version but no push (their
        engines already serve the checkpoint). ``start_up``: the push before the step-0 evaluation,
        which belongs to no step (its progress line says so instead of "step 1/N")."""
        if not policies:
            return {}
        start, metrics = time.perf_counter(), {}
        with self._rollout_paused():
            for name in policies:
                adapters = None if start_up else self.versions.to_push(name)  # L2: those that stepped
                version = self.versions.pushed(name, adapters)
                if not self.policies[name].frozen:
                    label = f"weight sync {name}" + (" (start-up)" if start_up else "")
                    with self.progress.phase(label, unit="", in_step=not start_up):
                        metrics.update(self.replicas[name].push(version, adapters=adapters))
        dist.barrier(group=control_group())
        metrics["timing_s/weight_sync"] = time.perf_counter() - start
        return metrics

    def snapshot(self, step: int) -> dict[str, float]:
        """``rollout.opponent_pool``: after every ``every``-th step, the learner's weights go into the next
        snapshot slot (a frozen policy's engines), a new version of that policy."""
        pool = self.pool
        slot = snapshot_slot(step, every=pool.every, num_slots=len(pool.snapshots)) if pool.enabled else None
        if slot is None:
            return {}
        name = pool.snapshots[slot]
        version = self.versions.bump(name)
        with self._rollout_paused(), self.progress.phase(f"snapshot {pool.learner} -> {name}", unit=""):
            metrics = self.replicas[name].snapshot_from(self.replicas[pool.learner], version)
        if self.driver is not None:
            self.driver.opponent_pool.record(slot, step)
        dist.barrier(group=control_group())
        return metrics

    def resync_restarted(self, *, skip: AbstractSet[str] = frozenset()) -> dict[str, float]:
        """Engine servers restarted since the last push get the current weights now instead of idling
        until the next push (nothing when none restarted); not those of the ``skip`` policies."""
        metrics = {}
        for name, indices in stale_replicas(
            self.replicas, driver_rank=DRIVER, control_group=control_group()
        ).items():
            if name not in skip:
                with self.progress.phase(f"re-sync {name} replicas {indices}", unit=""):
                    metrics.update(self.replicas[name].resync(self.versions.current[name], indices))
        return metrics
