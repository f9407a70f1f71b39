"""Relay, a two-role team game written as an OpenEnv environment (``openenv-core``'s ``Environment``,
``Action``, ``Observation`` and ``State``, the way ``openenv init`` lays one out), for the ``openenv``
env (configs/presets/openenv.yaml, docs/openenv.md).

A speaker sees a secret digit, drawn from the reset seed, and says one digit; a listener sees only
what the speaker said and names the secret. The listener's step is rewarded 1.0 when it names the
secret (0.0 otherwise) and ends the episode; the speaker's step is rewarded 0.0. Each observation
names the role that acts next (``next_role``) and each action carries the role that sends it. This
module imports nothing from megamarl: served with OpenEnv's ``create_app(RelayEnvironment,
RelayAction, RelayObservation)`` it is an ordinary OpenEnv server.
"""

from __future__ import annotations

import random
from typing import Any
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class RelayAction(Action):
    role: str = Field(..., description="who sends the message: speaker or listener")
    message: str = Field(..., description="the speaker's hint or the listener's guess")


class RelayObservation(Observation):
    prompt: str = Field(default="", description="what the role that acts next sees")
    next_role: str = Field(default="", description="the role that acts next ('' once done)")


class RelayState(State):
    secret: int = 0
    hint: str = ""


class RelayEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True  # no state outside the instance

    def __init__(self, num_symbols: int = 10) -> None:
        super().__init__()
        self.num_symbols = num_symbols
        self._state = RelayState(episode_id=str(uuid4()), step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> RelayObservation:
        secret = random.Random(seed).randrange(self.num_symbols)
        self._state = RelayState(episode_id=episode_id or str(uuid4()), step_count=0, secret=secret)
        return RelayObservation(
            prompt=f"You are the speaker. The secret digit is {secret}. Say one digit to your partner, "
            "who must name the secret from your message alone.",
            next_role="speaker",
            done=False,
            reward=0.0,
        )

    def step(self, action: RelayAction, timeout_s: float | None = None, **kwargs: Any) -> RelayObservation:  # type: ignore[override]
        self._state.step_count += 1
        if self._state.step_count == 1:
            if action.role != "speaker":
                raise ValueError(f"the speaker acts first, not {action.role!r}")
            self._state.hint = action.message.strip()
            return RelayObservation(
                prompt=f"You are the listener. Your partner, who knows a secret digit, said: "
                f"{self._state.hint!r}. Name the secret digit.",
                next_role="listener",
                done=False,
                reward=0.0,
            )
        if action.role != "listener" or self._state.step_count > 2:
            raise ValueError(f"step {self._state.step_count} of a finished relay by {action.role!r}")
        correct = action.message.strip() == str(self._state.secret)
        return RelayObservation(
            prompt=f"The secret was {self._state.secret}.",
            next_role="",
            done=True,
            reward=1.0 if correct else 0.0,
            metadata={"secret": self._state.secret, "hint": self._state.hint},
        )

    @property
    def state(self) -> RelayState:
        return self._state
