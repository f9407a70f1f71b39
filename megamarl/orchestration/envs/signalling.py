"""Signalling (Lewis) game: a sender sees a secret digit and sends one symbol; a receiver sees only
the symbol and must name the digit. Both get team reward 1 on success.

Action spaces, chosen to be one token each in common BPE vocabularies (SmolLM2/Llama/Qwen encode
each of these as a single token at the start of an assistant turn):
* sender: one of the first ``num_symbols`` capital letters (default 10: ``A``..``J``; ``SYMBOLS``). Its reply
  is parsed by taking the first non-whitespace character; anything else is invalid (the receiver then sees
  ``?``). Sample the sender with ``max_tokens=1`` to make "one token" literal.
* receiver: a digit ``0``..``9``, parsed as the first non-whitespace character.

The mapping symbol -> digit is not given to anyone, so a team only succeeds above chance (10%)
by learning a shared code; that makes it a clean multi-agent learning test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from megamarl.orchestration.agents import AGENTS, Agent
from megamarl.orchestration.env import ENVS, Env, EnvConfig, StepResult, Task

SYMBOLS = tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")  # the sender may use the first ``num_symbols``
DIGITS = tuple("0123456789")


def _first_char_in(text: str, allowed: tuple[str, ...]) -> tuple[str | None, bool]:
    stripped = text.strip()
    return (stripped[0], True) if stripped and stripped[0] in allowed else (None, False)


@AGENTS.register("signal_sender")
class SignalSender(Agent):
    system_prompt = "You are the sender in a signalling game."

    def parse(self, text: str):
        return _first_char_in(text, SYMBOLS)


@AGENTS.register("signal_receiver")
class SignalReceiver(Agent):
    system_prompt = "You are the receiver in a signalling game."

    def parse(self, text: str):
        return _first_char_in(text, DIGITS)


@dataclass
class SignallingConfig(EnvConfig):
    num_digits: int = 10  # secrets are 0..num_digits-1
    # Observations are only the digit / the letter (no instructions): for tiny models trained from
    # scratch, whose near-uniform attention dilutes one informative token among many.
    terse: bool = False
    num_symbols: int = 10  # letters the sender is told it may use (sample it with the same allowed_tokens)

    def __post_init__(self) -> None:
        if not 2 <= self.num_digits <= 10:
            raise ValueError(f"env.num_digits must be in [2, 10], got {self.num_digits}")
        if not 2 <= self.num_symbols <= len(SYMBOLS):
            raise ValueError(f"env.num_symbols must be in [2, {len(SYMBOLS)}], got {self.num_symbols}")


SignallingConfigT = TypeVar("SignallingConfigT", bound=SignallingConfig)


@ENVS.register("signalling")
class SignallingEnv(Env[SignallingConfigT]):
    Config = SignallingConfig
    agents = ("sender", "receiver")
    default_agents: ClassVar[dict[str, str]] = {"sender": "signal_sender", "receiver": "signal_receiver"}

    def __init__(self, task: Task, config: SignallingConfigT) -> None:
        super().__init__(task, config)
        self.secret: int = task.payload
        self.symbol: str | None = None
        self.guess: int | None = None

    @classmethod
    def generate_tasks(cls, config: SignallingConfigT, *, num_tasks: int, seed: int) -> list[Task]:
        rng = random.Random(seed)
        digits = [i % config.num_digits for i in range(num_tasks)]  # balanced secrets
        rng.shuffle(digits)
        return [Task(f"signal-{seed}-{i}", d) for i, d in enumerate(digits)]

    def active_agents(self) -> list[str]:
        if self.done:
            return []
        return ["sender"] if self.symbol is None else ["receiver"]

    def observe(self, agent: str) -> str:
        if self.config.terse:
            return str(self.secret) if agent == "sender" else str(self.symbol)
        if agent == "sender":
            return (
                f"The secret digit is {self.secret}. Send exactly one letter from "
                f"{' '.join(SYMBOLS[: self.config.num_symbols])} so your partner can guess the digit."
            )
        return (
            f"Your partner sent the letter: {self.symbol}\n"
            "Which digit (0-9) is the secret? Reply with one digit."
        )

    def step(self, agent: str, action) -> StepResult:
        if agent == "sender":
            self.symbol = action.value if action.valid else "?"
            return StepResult()
        self.guess = int(action.value) if action.valid else None
        self.done = True
        return StepResult()

    def team_reward(self) -> float:
        return float(self.guess == self.secret)

    def score(self, agent: str, action) -> float | None:
        """Check fn for the receiver's tree-sampled guesses (AT-GRPO): 1 if the guess is the secret.
        The sender's letter has no check of its own (its worth depends on the receiver)."""
        if agent != "receiver":
            return None
        return float(bool(action.valid) and int(action.value) == self.secret)
