"""Weight versions and the push cadence: one object per run, the same on every rank.

A policy's version counts the pushes of its weights into its engines; everything the engines generate
afterwards carries it. ``trainer.sync_every = N``: a policy is due for a push after N updates since
its last push (``due``). A snapshot of the opponent pool is a new version of the frozen policy it
overwrites, with no update behind it (``bump``). Saved with the checkpoint (``state_dict``).
L2: a push carries only the adapters that stepped since the policy's last push (``to_push``); the
others are re-stamped with the new version, their unchanged weights left in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class WeightVersions:
    def __init__(self, policies: list[str], *, sync_every: int) -> None:
        self.current = {name: 0 for name in policies}  # pushes into the engines so far
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

    def pushed(self, name: str) -> int:
        """A push of ``name``: its new version (the updates since the push start again)."""
        self.updates_since_push[name] = 0
        if name in self.stepped:
            self.stepped[name] = set()
        return self.bump(name)

    def bump(self, name: str) -> int:
        self.current[name] += 1
        return self.current[name]

    def state_dict(self) -> dict[str, int]:
        return dict(self.current)

    def load_state_dict(self, saved: dict[str, int]) -> None:
        """Resume at the saved versions: the start-up push stamps version + 1, so start one below
        (a policy the checkpoint lacks starts at 0)."""
        self.current = {name: saved.get(name, 1) - 1 for name in self.current}
