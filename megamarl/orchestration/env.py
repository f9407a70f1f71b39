"""The environment contract: task state, observations per agent, transitions, rewards, done.

An ``Env`` instance is one episode of one ``Task``. Orchestras read ``observe(agent)`` and call
``step(agent, action)`` through the episode context; the driver reads ``team_reward()`` and
``agent_reward(agent)`` when the episode ends. Compared with a gym/PettingZoo env there is no
``reset``: tasks are values (``generate_tasks`` is seeded and deterministic), so GRPO groups are
several fresh ``Env(task)`` instances of the same task, and an env can be pickled to a worker
process, stepped there (``remote_step``) and sent back.

Register an env class with ``@ENVS.register("name")``; its typed ``Config`` dataclass validates
itself; ``default_agents`` maps each role to a registered agent kind.
"""

from __future__ import annotations

import abc
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from megamarl.registry import Registry

if TYPE_CHECKING:
    from megamarl.orchestration.action import Action


@dataclass(frozen=True)
class Task:
    """One task instance; ``payload`` is the env's own typed problem record."""

    task_id: str
    payload: Any


@dataclass
class StepResult:
    """What one agent's action did. ``local_reward`` (when not None) becomes that sample's local
    reward; ``feedback`` is free text for logs; ``invalid``: the env rejected the action (an
    illegal move, a reply naming no action), so its sample counts as invalid like a parse failure."""

    local_reward: float | None = None
    feedback: str = ""
    invalid: bool = False


@dataclass
class EnvConfig:
    """Base config; envs subclass it with their own validated fields."""


ConfigT = TypeVar("ConfigT", bound=EnvConfig)


class Env(abc.ABC, Generic[ConfigT]):
    """One episode. Subclasses set ``agents``, ``default_agents``, ``Config`` and implement the
    abstract methods; the rest have sensible defaults. ``Env[MyConfig]`` types ``self.config`` and
    the classmethods' ``config`` as the env's own ``Config``."""

    Config: ClassVar[type[EnvConfig]] = EnvConfig
    agents: tuple[str, ...] = ()
    default_agents: ClassVar[dict[str, str]] = {}  # role -> AGENTS kind
    remote_step: ClassVar[bool] = False  # step in an env worker (slow or untrusted work)

    def __init__(self, task: Task, config: ConfigT) -> None:
        self.task = task
        self.config = config
        self.done = False

    @classmethod
    def acting_roles(cls, config: ConfigT) -> tuple[str, ...]:
        """The roles that act under ``config`` (each needs an ``agents.<role>`` entry); a subset of
        ``agents`` when a setting turns a role off (math's ``with_verifier: false``)."""
        return tuple(cls.agents)

    @classmethod
    def max_step_s(cls, config: ConfigT) -> float | None:
        """The longest one ``step`` or ``score`` call can take under ``config`` (an env whose steps
        have a time budget, the code judge's); None: no bound is declared. Load time rejects a
        bound that is not below ``rollout.env_timeout_s``."""
        return None

    @classmethod
    @abc.abstractmethod
    def generate_tasks(cls, config: ConfigT, *, num_tasks: int, seed: int) -> list[Task]:
        """Deterministic for (config, num_tasks, seed)."""

    @abc.abstractmethod
    def observe(self, agent: str) -> str:
        """The observation text ``agent`` acts on now."""

    @abc.abstractmethod
    def step(self, agent: str, action: Action) -> StepResult:
        """Apply ``agent``'s parsed action (``action.value``/``action.valid``/``action.text``)."""

    @abc.abstractmethod
    def team_reward(self) -> float:
        """The shared reward of the episode so far (read once at the end)."""

    def active_agents(self) -> list[str]:
        """Agents allowed to act now, in order; empty once done (the active mask)."""
        return [] if self.done else list(self.agents)

    def success(self) -> bool:
        return self.team_reward() >= 1.0

    def agent_success(self, agent: str) -> bool | None:
        """``agent``'s own success (a win in a competitive game); None: the team's ``success()``."""
        return None

    def agent_reward(self, agent: str) -> float | None:
        """Episode-level local reward of ``agent`` for samples whose step gave none."""
        return None

    def metrics(self) -> dict[str, float]:
        """Figures of this episode (e.g. the code judge's ``judge_errors``), averaged over a step's
        finished episodes and logged as ``env/<key>`` (a count becomes a count per episode)."""
        return {}

    def close(self) -> None:
        """Release what the episode holds (a wrapped env, a process, a connection). Called once when the
        episode ends, however it ended: done, cut by the orchestra's ``max_steps``, failed, timed out."""

    def score(self, agent: str, action: Action) -> float | None:
        """Check fn for tree sampling: how good ``action`` would be now, without changing state.
        None: this env has no check for ``agent``."""
        return None


ENVS: Registry[type[Env]] = Registry(
    "env",
    signature="class(Env) with a Config(EnvConfig); generate_tasks(config, *, num_tasks, seed); cls(task, "
    "config)",
    keys=("env.name", "eval.env.name", "eval.sets.<name>.name"),
)


def draw_from_dataset(num_items: int, num_tasks: int, *, seed: int, prefix: str) -> list[tuple[int, str]]:
    """``num_tasks`` (item index, unique task id) pairs from a dataset of ``num_items`` items.

    Items are drawn without repetition: a seeded permutation of the whole dataset, then (only when
    ``num_tasks > num_items``) a fresh permutation per further pass. A repeated item gets its own
    task id (``{prefix}-{item}`` on the first pass, ``{prefix}-{item}.{pass}`` after), so its episodes
    form a group of their own instead of merging with the first copy's.
    """
    if num_items < 1:
        raise ValueError(f"{prefix}: the dataset is empty")
    rng = random.Random(seed)
    picks: list[tuple[int, str]] = []
    for pass_ in range(-(-num_tasks // num_items)):
        order = list(range(num_items))
        rng.shuffle(order)
        picks += [(j, f"{prefix}-{j}" if pass_ == 0 else f"{prefix}-{j}.{pass_}") for j in order]
    return picks[:num_tasks]


def read_jsonl(path: str | Path, *, key: str) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for each non-blank line of a JSONL dataset, ``where`` = ``"<key> <file>:<line>"``
    for the caller's own field errors. Every problem with the file itself raises a ValueError naming
    ``key`` and the file (and the line, for JSON that does not parse or is not an object): missing,
    a directory, not UTF-8, empty. Envs call it from their ``Config`` so a bad file stops the run at
    load time, not at the first rollout."""
    path = Path(path)
    try:
        path.stat()
    except FileNotFoundError:
        raise ValueError(f"{key}: {path} does not exist") from None
    except (OSError, ValueError) as exc:  # a name too long (the OS refuses it), a NUL byte, no permission
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ValueError(f"{key}: {str(path)[:200]} cannot be read ({reason})") from None
    if not path.is_file():
        raise ValueError(
            f"{key}: {path} is {'a directory' if path.is_dir() else 'not a regular file'}, not a JSONL file"
        )
    num_records = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{key} {path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{where}: not UTF-8 text (byte {exc.start}: {raw[exc.start : exc.start + 1]!r})"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))  # so the column counts within this line
            except json.JSONDecodeError as exc:  # its own "line 1" means this line: name the file's line
                raise ValueError(f"{where}: not valid JSON at column {exc.colno}: {exc.msg}") from None
            if not isinstance(record, dict):
                # a ValueError: every bad-input error of a config is one (scripts/train.py exits 2 on it)
                raise ValueError(f"{where}: each line must be a JSON object, got {type(record).__name__}")  # noqa: TRY004
            num_records += 1
            yield where, record
    if num_records == 0:
        raise ValueError(f"{key}: {path} is empty (no JSON lines)")


class EnvMaker:
    """A named, configured env: ``maker.tasks(n, seed=...)`` and ``maker(task) -> Env``."""

    def __init__(self, name: str, config: EnvConfig | None = None, **overrides: Any) -> None:
        self.name = name
        self.env_cls = ENVS.get(name, key="env.name")
        if config is None:
            config = self.env_cls.Config(**overrides)
        elif overrides:
            raise ValueError("EnvMaker takes either a config object or keyword overrides, not both")
        if not isinstance(config, self.env_cls.Config):
            expected = self.env_cls.Config.__name__
            raise ValueError(f"env '{name}' needs a {expected}, got {type(config).__name__}")  # noqa: TRY004 - a config error
        self.config = config

    def tasks(self, num_tasks: int, *, seed: int = 0) -> list[Task]:
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        return self.env_cls.generate_tasks(self.config, num_tasks=num_tasks, seed=seed)

    def __call__(self, task: Task) -> Env:
        return self.env_cls(task, self.config)

    @property
    def agents(self) -> tuple[str, ...]:
        return self.env_cls.agents

    @property
    def default_agents(self) -> dict[str, str]:
        return dict(self.env_cls.default_agents)
