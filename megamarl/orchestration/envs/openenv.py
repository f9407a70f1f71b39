"""OpenEnv adapter: an OpenEnv ``Environment`` (PyPI ``openenv-core``) as a megamarl env a team plays.

``openenv`` (registered env) builds the user's ``Environment`` subclass (``env.kwargs.environment``,
``"module:Class"``) once per episode, in this process, and drives it through OpenEnv's own API:
``reset(seed=<episode seed>, episode_id=<task id>)`` (each only where ``reset`` takes it),
``step(action)`` and the observations' ``done`` / ``reward``. OpenEnv has one acting party per step;
here each step is one agent's: the roles (``env.kwargs.roles``) act in turn, or the one the last
observation names (``turn_field``), so the ``sequential`` orchestra plays the env in its own order.
A reply becomes the env's ``Action`` model: into its ``text_field`` (by default its one required text
field), or parsed as the action's JSON object when it has several; the acting role goes into
``role_field``. A reply that does not validate is an invalid sample and the env is not stepped (the
same role acts again, within the orchestra's ``max_steps``). An observation's ``reward`` is the acting
agent's local reward; the team reward is the episode's return (their sum); success: a return of at
least ``success_reward``. The env is closed once, at done or when the episode ends without it (the
orchestra's ``max_steps``). ``openenv`` is imported only when the config names an environment.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from megamarl.orchestration.action import Action
from megamarl.orchestration.env import ENVS, Env, EnvConfig, StepResult, Task
from megamarl.registry import resolve_callable

EXTRA_HINT = "pip install 'megamarl[openenv]' (or bash scripts/setup.sh --extras openenv)"
_OBSERVATION_BASE_FIELDS = ("done", "reward", "metadata")  # OpenEnv's Observation: not shown as text


@dataclass
class OpenEnvConfig(EnvConfig):
    environment: str = ""  # "module:Class", an openenv Environment subclass
    init_kwargs: dict[str, Any] = field(default_factory=dict)  # Class(**init_kwargs), once per episode
    reset_kwargs: dict[str, Any] = field(default_factory=dict)  # reset(seed=..., episode_id=..., **these)
    action: str = ""  # "module:Class" of its Action; empty: the annotation of the action in step()
    roles: list[str] = field(default_factory=lambda: ["agent"])  # one agent per role
    turn_field: str = ""  # observation field (or metadata key) naming the next role; empty: roles in turn
    role_field: str = ""  # Action field that receives the acting role; empty: none
    text_field: str = ""  # Action field that receives the reply; empty: its one required str field, else JSON
    observation_field: str = ""  # observation field shown to the agent; empty: its own fields as JSON
    success_reward: float = 1.0  # success: the episode's return reaches it

    def __post_init__(self) -> None:
        if not self.environment:
            raise ValueError(
                "env.kwargs.environment must name an OpenEnv Environment subclass, 'module:Class'"
            )
        if importlib.util.find_spec("openenv") is None:
            raise ValueError(
                f"env 'openenv' (env.kwargs.environment={self.environment}) needs the 'openenv-core' "
                f"package, which is not importable here: {EXTRA_HINT}"
            )
        self.roles = [str(r) for r in self.roles]
        if not self.roles or len(set(self.roles)) != len(self.roles):
            raise ValueError(f"env.kwargs.roles must name one or more distinct roles, got {self.roles}")
        self.init_kwargs, self.reset_kwargs = dict(self.init_kwargs), dict(self.reset_kwargs)
        env_cls = self.environment_class()
        base = importlib.import_module("openenv.core.env_server.interfaces").Environment
        if not (isinstance(env_cls, type) and issubclass(env_cls, base)):
            raise ValueError(  # noqa: TRY004 - a config error: ValueError naming the key
                f"env.kwargs.environment={self.environment!r} is not a subclass of OpenEnv's "
                "openenv.core.env_server.interfaces.Environment"
            )
        action_cls = self.action_class()
        fields = action_cls.model_fields
        for key in ("role_field", "text_field"):
            name = getattr(self, key)
            if name and name not in fields:
                raise ValueError(
                    f"env.kwargs.{key}={name!r} is not a field of {action_cls.__name__} (its fields: "
                    f"{sorted(fields)})"
                )

    def environment_class(self) -> Any:
        return resolve_callable(self.environment, key="env.kwargs.environment")

    def action_class(self) -> Any:
        """The env's Action model: ``action`` when given, else what ``step`` annotates its action as."""
        if self.action:
            return resolve_callable(self.action, key="env.kwargs.action")
        step = self.environment_class().step
        try:
            hint = typing.get_type_hints(step).get("action")
        except (NameError, TypeError):  # an annotation that does not resolve (a TYPE_CHECKING-only import)
            hint = None
        base = importlib.import_module("openenv.core.env_server.types").Action
        if not (isinstance(hint, type) and issubclass(hint, base) and hint is not base):
            raise ValueError(
                f"env.kwargs.action is empty and {self.environment}'s step() does not annotate its action "
                "with an Action subclass; set env.kwargs.action to 'module:Class'"
            )
        return hint


@ENVS.register("openenv")
class OpenEnvEnv(Env[OpenEnvConfig]):
    Config = OpenEnvConfig

    def __init__(self, task: Task, config: OpenEnvConfig) -> None:
        super().__init__(task, config)
        self.agents = tuple(config.roles)
        self.action_cls = config.action_class()
        self.environment = config.environment_class()(**config.init_kwargs)
        accepted = inspect.signature(self.environment.reset).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        offered = {"seed": task.payload, "episode_id": task.task_id}
        passed = {k: v for k, v in offered.items() if takes_any or k in accepted}
        self.observation = self.environment.reset(**passed, **config.reset_kwargs)
        self.current = self.agents[0]
        self.episode_return = 0.0
        self.num_turns = 0
        self.num_invalid = 0
        self._closed = False
        self._follow(self.observation)

    @classmethod
    def generate_tasks(cls, config: OpenEnvConfig, *, num_tasks: int, seed: int) -> list[Task]:
        return [Task(f"openenv-{seed}-{i}", seed * 100_003 + i) for i in range(num_tasks)]

    def _follow(self, observation: Any) -> None:
        """Who acts next after ``observation``: the role it names, else the next role in turn."""
        self.done = bool(observation.done)
        field_name = self.config.turn_field
        if not field_name:
            return
        named = getattr(observation, field_name, None)
        if named is None:
            named = observation.metadata.get(field_name)
        if isinstance(named, int) and not isinstance(named, bool) and 0 <= named < len(self.agents):
            named = self.agents[named]
        if named not in self.agents:
            if self.done:
                return
            raise ValueError(
                f"env.kwargs.turn_field={field_name!r}: the observation names {named!r}, not one of "
                f"env.kwargs.roles {list(self.agents)} (nor a player index)"
            )
        self.current = named

    def active_agents(self) -> list[str]:
        return [] if self.done else [self.current]

    def observe(self, agent: str) -> str:
        if agent != self.current:
            raise ValueError(
                f"OpenEnv env {self.config.environment}: '{self.current}' acts now, not '{agent}'"
            )
        name = self.config.observation_field
        if name:
            return str(getattr(self.observation, name))
        return json.dumps(self.observation.model_dump(exclude=set(_OBSERVATION_BASE_FIELDS)), default=str)

    def to_action(self, agent: str, text: str) -> Any:
        """The env's Action for ``agent``'s reply; raises pydantic's ValidationError (a ValueError) or
        json's JSONDecodeError when the reply does not make one."""
        fields = self.action_cls.model_fields
        text_field = self.config.text_field or _only_text_field(fields, skip=self.config.role_field)
        values: dict[str, Any] = {text_field: text} if text_field else _json_object(text)
        if self.config.role_field:
            values[self.config.role_field] = agent
        return self.action_cls.model_validate(values)

    def step(self, agent: str, action: Action) -> StepResult:
        if self.done or agent != self.current:
            raise ValueError(
                f"OpenEnv env {self.config.environment}: '{agent}' cannot act now "
                f"({'the episode is over' if self.done else repr(self.current) + ' acts now'})"
            )
        self.num_turns += 1
        try:
            env_action = self.to_action(agent, action.text)
        except ValueError:  # pydantic's ValidationError and json's JSONDecodeError are ValueErrors
            self.num_invalid += 1
            return StepResult(invalid=True)
        self.observation = self.environment.step(env_action)
        reward = None if self.observation.reward is None else float(self.observation.reward)
        self.episode_return += reward or 0.0
        if not self.config.turn_field:
            self.current = self.agents[(self.agents.index(agent) + 1) % len(self.agents)]
        self._follow(self.observation)
        if self.done:
            self.close()
        return StepResult(local_reward=reward, invalid=not action.valid)

    def close(self) -> None:
        """The OpenEnv env's ``close()``, once: at done, or when the episode ends without it (cut by
        the orchestra's ``max_steps``, failed, timed out)."""
        if not self._closed:
            self._closed = True
            self.environment.close()

    def team_reward(self) -> float:
        return self.episode_return

    def success(self) -> bool:
        return self.episode_return >= self.config.success_reward

    def metrics(self) -> dict[str, float]:
        return {
            "turns": float(self.num_turns),
            "invalid_actions": float(self.num_invalid),
            "unfinished": 0.0 if self.done else 1.0,  # cut by the orchestra's max_steps before done
        }


def _only_text_field(fields: dict[str, Any], *, skip: str) -> str:
    """The Action's one required ``str`` field (``skip``: the role field); '' when it has none or several."""
    required = [n for n, f in fields.items() if f.is_required() and n != skip]
    return required[0] if len(required) == 1 and fields[required[0]].annotation is str else ""


def _json_object(text: str) -> dict[str, Any]:
    """The first JSON object in ``text`` (a reply may wrap it in prose or a code fence)."""
    start = text.find("{")
    if start < 0:
        raise ValueError("the reply holds no JSON object")
    value, _ = json.JSONDecoder().raw_decode(text[start:])
    if not isinstance(value, dict):
        raise ValueError("the reply's JSON is not an object")  # noqa: TRY004 - a bad reply: ValueError
    return value
