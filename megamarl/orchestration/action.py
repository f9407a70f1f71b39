"""``Action``: one agent decision, what an orchestra hands the env and the env's step reads.

Its own module so that agents, envs and the episode context can all name it without importing each
other (the env is below the context, which drives it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megamarl.rl.sample import Sample


@dataclass
class Action:
    """One agent decision: the chosen candidate's text and parsed value, plus every candidate's Sample."""

    agent: str
    text: str
    value: Any
    valid: bool
    turn: int
    step: int
    branch: int = 0  # the candidate continued from
    samples: list[Sample] = field(
        default_factory=list, repr=False
    )  # tool rounds (agents.<a>.tools), then the candidates
    scores: list[float] | None = None  # tree sampling: one per candidate

    def stripped(self) -> Action:
        """A copy without token-heavy samples, for sending to env workers."""
        return dataclasses.replace(self, samples=[])
