"""Opponent pool for self-play (``rollout.opponent_pool``): a learner plays against frozen snapshots
of its own past versions, as in AlphaStar's / OpenAI Five's past-self opponents and RLlib's
``policy_mapping_fn`` over frozen policy copies.

A snapshot is a *frozen policy* of the run (``policies.<s>.frozen: true``, the learner's model): its
engine serves rollouts like any policy's, its samples train nobody. Every ``every`` trainer steps the
trainer copies the learner's current weights into the next snapshot slot (round-robin, the oldest
overwritten) through the ordinary weight push (``PolicyReplicas.snapshot_from``). Before the first copy every
slot holds the initial weights (the learner at step 0).

``rollout.policy_mapping`` stays the one place that binds seats to policies: it returns the pool's
``alias`` (default ``opponent``) for the seat the pool fills, and the driver replaces the alias,
per episode, by the slot that ``pick`` chooses from the slots' snapshot steps with a generator seeded
by the episode seed (so a seeded run picks the same opponents). Picks are a registry:

* ``latest``: the most recent snapshot (ties: the first slot), i.e. play the last saved self;
* ``uniform``: any slot with equal probability (fictitious-self-play style over the pool).

Everything here is pure bookkeeping (which slot to write at a step, which slot an episode faces);
the pushes happen in the trainer, the engines in the driver.
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
