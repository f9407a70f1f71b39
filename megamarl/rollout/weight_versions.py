"""Weight versions and the push cadence: one object per run, the same on every rank.

A policy's version counts the pushes of its weights into its engines; everything the engines generate
afterwards carries it. ``trainer.sync_every = N``: a policy is due for a push after N updates since
its last push (``due``). A snapshot of the opponent pool is a new version of the frozen policy it
overwrites, with no update behind it (``bump``). Saved with the checkpoint (``state_dict``).
L2: a push carries only the adapters that stepped since the policy's last push (``to_push``), and
each adapter has its own version: the policy version of its last push, which its samples carry
(``serving``: an L2 agent's samples are as stale as its adapter's weights, not as the policy's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class WeightVersions:
    def __init__(
        self, policies: list[str], *, sync_every: int, adapters: Mapping[str, tuple[str, str]] | None = None
    ) -> None:
        """``adapters``: each L2 agent -> (its policy, its adapter)."""
        self.current = {name: 0 for name in policies}  # pushes into the engines so far
        self.agent_adapters = dict(adapters or {})
        self.adapter_current: dict[str, dict[str, int]] = {}  # L2 policy -> adapter -> its version
        for policy, adapter in self.agent_adapters.values():
            self.adapter_current.setdefault(policy, {})[adapter] = 0
        self.updates_since_push = {name: 0 for name in policies}
        self.sync_every = sync_every
        self.stepped: dict[str, set[str]] = {}  # L2 policy -> adapters stepped since its last push

    def trained(self, policies: Iterable[str], adapters: Mapping[str, Iterable[str]] | None = None) -> None:
        """These policies had one update each (every rank counts every policy's); ``adapters``: of the
        L2 ones among them, the adapters that stepped (``BatchSummary.stepped_adapters``)."""
        for name in policies:
            self.updates_since_push[name] += 1
        for name, stepped in (adapters or {}).items():
            self.stepped.setdefault(name, set()).update(stepped)

    def to_push(self, name: str) -> list[str] | None:
        """L2 policy ``name``'s adapters that stepped since its last push (sorted); None: every part of
        the policy (a full-weight policy, or an L2 one before its first recorded update)."""
        return sorted(self.stepped[name]) if name in self.stepped else None

    def due(self) -> list[str]:
        """Policies with ``sync_every`` updates since their last push."""
        return [name for name, num in self.updates_since_push.items() if num >= self.sync_every]

    def pushed(self, name: str, adapters: list[str] | None = None) -> int:
        """A push of ``name`` (L2: of ``adapters``, default all): its new version (the updates since the
        push start again)."""
        self.updates_since_push[name] = 0
        if name in self.stepped:
            self.stepped[name] = set()
        version = self.bump(name)
        own = self.adapter_current.get(name, {})
        for adapter in own if adapters is None else adapters:
            own[adapter] = version
        return version

    def serving(self) -> dict[str, int]:
        """What the engines serve: each policy's version, and for each L2 agent (``<policy>/<agent>``)
        its adapter's (the driver's staleness reads the agent's key first, ``driver.streaming``)."""
        return {
            **self.current,
            **{f"{p}/{agent}": self.adapter_current[p][a] for agent, (p, a) in self.agent_adapters.items()},
        }

    def bump(self, name: str) -> int:
        self.current[name] += 1
        return self.current[name]

    def state_dict(self) -> dict[str, int]:
        return dict(self.current)

    def load_state_dict(self, saved: dict[str, int]) -> None:
        """Resume at the saved versions: the start-up push stamps version + 1, so start one below
        (a policy the checkpoint lacks starts at 0)."""
        self.current = {name: saved.get(name, 1) - 1 for name in self.current}
        # every adapter is pushed by the start-up push, which sets its version
