"""Opponent pool for self-play (``rollout.opponent_pool``): a learner plays against frozen snapshots
of its own past versions, as in AlphaStar's / OpenAI Five's past-self opponents and RLlib's
``policy_mapping_fn`` over frozen policy copies.

A snapshot is a frozen policy of the run (``policies.<s>.frozen: true``): its engine serves rollouts,
its samples train nobody. Every ``every`` steps the trainer copies the learner's weights into the next
slot (round-robin) through the ordinary push (``PolicyReplicas.snapshot_from``); before the first copy
every slot holds the step-0 weights. ``rollout.policy_mapping`` returns the pool's ``alias`` (default
``opponent``) for the seat the pool fills; the driver replaces it per episode by the slot ``pick``
chooses (registry: ``latest``, ``uniform``), seeded by the episode seed. This module is pure
bookkeeping; pushes happen in the trainer. Details: docs/design-notes.md, "megamarl/driver/opponent_pool.py".
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from megamarl.config_sections import OpponentPoolConfig
from megamarl.registry import Registry

Pick = Callable[[Sequence[int], random.Random], int]  # slots' snapshot steps, rng -> slot index

OPPONENT_PICKS: Registry[Pick] = Registry(
    "opponent pick",
    signature="pick(snapshot_steps: Sequence[int] (one per slot), rng: random.Random) -> slot index",
    keys=("rollout.opponent_pool.pick",),
)


@OPPONENT_PICKS.register("latest")
def pick_latest(snapshot_steps: Sequence[int], rng: random.Random) -> int:
    """The slot holding the most recent snapshot (the first of equals)."""
    return max(range(len(snapshot_steps)), key=lambda i: (snapshot_steps[i], -i))


@OPPONENT_PICKS.register("uniform")
def pick_uniform(snapshot_steps: Sequence[int], rng: random.Random) -> int:
    """Any slot, with equal probability."""
    return rng.randrange(len(snapshot_steps))


def snapshot_slot(step: int, *, every: int, num_slots: int) -> int | None:
    """The slot that takes the learner's weights after trainer step ``step`` (1-based), or None:
    snapshots at steps every, 2 every, ... go to slots 0, 1, ..., num_slots - 1, 0, ..."""
    if step < 1 or step % every:
        return None
    return (step // every - 1) % num_slots


class OpponentPool:
    """The driver's view of the pool: each slot's snapshot step, and the episode mapping over it."""

    def __init__(self, cfg: OpponentPoolConfig) -> None:
        self.cfg = cfg
        self.snapshot_steps = [0] * len(cfg.snapshots)  # the learner's step each slot holds (0: initial)
        self.num_snapshots = 0

    def record(self, slot: int, step: int) -> None:
        """Slot ``slot`` now holds the learner's weights after trainer step ``step``."""
        self.snapshot_steps[slot] = step
        self.num_snapshots += 1

    def pick(self, episode_seed: int) -> str:
        """The snapshot policy an episode's opponent seat gets (deterministic in ``episode_seed``)."""
        index = OPPONENT_PICKS.get(self.cfg.pick)(self.snapshot_steps, random.Random(episode_seed))
        return self.cfg.snapshots[index]

    def mapping(self, base: Callable[[str, int], str]) -> Callable[[str, int], str]:
        """``base`` (``rollout.policy_mapping``) with the pool's alias resolved per episode."""

        def mapped(agent_id: str, episode_seed: int) -> str:
            policy = base(agent_id, episode_seed)
            return self.pick(episode_seed) if policy == self.cfg.alias else policy

        return mapped

    def metrics(self) -> dict[str, float]:
        out = {"opponent_pool/num_snapshots": float(self.num_snapshots)}
        out.update(
            {
                f"opponent_pool/{name}/snapshot_step": float(step)
                for name, step in zip(self.cfg.snapshots, self.snapshot_steps, strict=True)
            }
        )
        return out
