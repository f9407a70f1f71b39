"""Agents: a role with a prompt template, a policy to sample from, an output parser, an optional
local reward and its own sampling parameters. ``AgentConfig`` (with ``SamplingConfig``) is both the
``agents.<role>`` section of the run config and what an agent is built from.

An agent *kind* is a class registered in ``AGENTS`` (``@AGENTS.register("math_solver")``); an
agent *instance* is that class built from an ``AgentConfig`` (which role it plays, which policy and
LoRA adapter it samples from, sampling, prompt overrides, memory budget, tree width). Agents hold
no per-episode state: conversations live in the episode context, so one agent object serves every
concurrent episode. User agents live in plugin modules imported with
``megamarl.registry.import_plugins`` (a failing import stops the run).

Parsers return ``(value, valid)``: ``valid=False`` marks the sample for the invalid-action penalty
and tells the env to treat the action as a no-op. ``last_number`` takes the LAST number of the
reply, because models write "3 + 2 = 5".
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

from omegaconf import MISSING

from megamarl.registry import Registry
from megamarl.rollout.engines.base import SamplingParams

if TYPE_CHECKING:
    from megamarl.orchestration.context import Action
    from megamarl.orchestration.env import Env

MEMORY_SCOPES = ("team", "self")


def _check_number(key: str, value: float, *, low: float, high: float | None = None, low_open: bool = False) -> None:
    """``key`` (an ``agents.<a>...`` key; ``megamarl.config.load_config`` puts the agent's name in)
    must be a finite number in [low, high], low excluded when ``low_open``. Worded as config.py's checks."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value}")
    if (value <= low if low_open else value < low) or (high is not None and value > high):
        opening = "(" if low_open else "["
        bound = f"{'>' if low_open else '>='} {low}" if high is None else f"in {opening}{low}, {high}]"
        raise ValueError(f"{key} must be {bound}, got {value}")


@dataclass
class SamplingConfig:
    """``agents.<a>.sampling``: what the agent's engine requests look like. ``sampling_params``
    turns it into the engine's per-request ``SamplingParams`` (token ids need the tokenizer)."""

    temperature: float = 1.0  # sampling temperature (also applied to the trainer's logprobs)
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    # Constrained decoding: sample only these strings' tokens (each must be one token), e.g. the
    # ten symbols of the signalling game. Empty: unconstrained.
    allowed_tokens: list[str] = field(default_factory=list)
    # Stop strings (vLLM's / OpenAI's ``stop``): the reply ends at the first one. Its tokens stay in the
    # trained response (they were sampled); the text the parser reads is cut before it. Empty: none.
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_number("agents.<a>.sampling.temperature", self.temperature, low=0)
        _check_number("agents.<a>.sampling.top_p", self.top_p, low=0, high=1, low_open=True)
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"agents.<a>.sampling.top_k must be -1 (off) or >= 1, got {self.top_k}")
        _check_number("agents.<a>.sampling.max_tokens", self.max_tokens, low=1)
        self.allowed_tokens = list(self.allowed_tokens)
        self.stop = list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"agents.<a>.sampling.stop must list non-empty strings, got {self.stop}")

    def sampling_params(self, tokenizer: Any = None) -> SamplingParams:
        """The engine's request parameters; ``allowed_tokens`` become token ids with ``tokenizer``
        (needed only when some are set)."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_tokens,
            allowed_token_ids=_single_token_ids(self.allowed_tokens, tokenizer), stop=tuple(self.stop),
        )


def _single_token_ids(texts: list[str], tokenizer: Any) -> tuple[int, ...]:
    if not texts:
        return ()
    if tokenizer is None:
        raise ValueError("agents.<a>.sampling.allowed_tokens needs the policy's tokenizer to become token ids")
    ids = []
    for text in texts:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"agents.<a>.sampling.allowed_tokens: {text!r} is {len(encoded)} tokens, not one")
        ids.append(encoded[0])
    return tuple(ids)


@dataclass
class AgentConfig:
    """``agents.<role>`` of the run config, and what an agent is built from. ``kind`` defaults to
    the env's default kind for the role. Typed for OmegaConf (``Optional``, ``list``): the same
    class is the structured-config schema (``megamarl.config.RunConfig.agents``)."""

    policy: str = MISSING  # the policy this agent samples from and trains (a key of `policies`)
    kind: str = ""  # registered agent kind; empty: the env's default kind for this role
    lora: str | None = None  # L2: adapter name on the policy's shared base
    system_prompt: str | None = None  # system turn; null: the agent kind's default
    prompt_template: str | None = None  # user turn, `{observation}` is replaced; null: the kind's default
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    multi_turn: bool = False  # keep the agent's own chat transcript across its turns (token-exact)
    memory_tokens: int = 0  # budget of earlier turns shown in the prompt (oldest dropped); 0: none
    memory_scope: str = "team"  # team: every agent's earlier turns; self: its own only
    tree_k: int = 1  # >1: tree sampling (AT-GRPO), K candidates per call, continue from the best
    max_prompt_tokens: int = 4096  # longer prompts drop the episode (counted, reason prompt_too_long)
    choices: list[str] = field(default_factory=list)  # names a router agent may pick
    # Per-agent training hyperparameters; None inherits the policy's value. ``lr`` needs the agent's
    # own parameters (an L2 LoRA adapter or an L3 policy of its own): agents sharing weights share one
    # optimizer step. ``frozen``: the agent acts but its samples never train the policy.
    lr: float | None = None
    clip_low: float | None = None
    clip_high: float | None = None
    kl_coef: float | None = None
    entropy_coef: float | None = None
    micro_batch_size: int | None = None
    mini_batch_size: int | None = None  # samples per optimizer step for this agent's rows
    frozen: bool = False

    def __post_init__(self) -> None:
        if self.policy == MISSING:
            raise ValueError("agents.<a>.policy must be set (a key of `policies`)")
        if isinstance(self.sampling, Mapping):
            self.sampling = SamplingConfig(**self.sampling)
        if self.prompt_template is not None and "{observation}" not in self.prompt_template:
            raise ValueError("agents.<a>.prompt_template must contain '{observation}'")
        if self.memory_scope not in MEMORY_SCOPES:
            raise ValueError(f"agents.<a>.memory_scope='{self.memory_scope}' unknown; allowed: {list(MEMORY_SCOPES)}")
        for key in ("tree_k", "max_prompt_tokens"):
            _check_number(f"agents.<a>.{key}", getattr(self, key), low=1)
        _check_number("agents.<a>.memory_tokens", self.memory_tokens, low=0)
        if self.lr is not None:
            _check_number("agents.<a>.lr", self.lr, low=0, low_open=True)
        if self.clip_low is not None:
            _check_number("agents.<a>.clip_low", self.clip_low, low=0, high=1)
        self.choices = list(self.choices)

    def sampling_params(self, tokenizer: Any = None) -> SamplingParams:
        """This agent's engine request parameters (``sampling``; ``allowed_tokens`` resolved with
        ``tokenizer``, the tokenizer of the agent's policy)."""
        return self.sampling.sampling_params(tokenizer)

    def train_overrides(self) -> dict[str, float]:
        """The per-agent hyperparameters this agent sets (None values omitted)."""
        keys = ("lr", "clip_low", "clip_high", "kl_coef", "entropy_coef", "micro_batch_size", "mini_batch_size")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


class Agent:
    """Base agent kind. Subclasses override the class defaults and ``parse``/``local_reward``."""

    system_prompt: ClassVar[str | None] = None  # None: the chat template's default system turn
    prompt_template: ClassVar[str] = "{observation}"

    def __init__(self, role: str, config: AgentConfig, tokenizer: Any) -> None:
        self.role = role
        self.config = config
        self.tokenizer = tokenizer
        self.policy = config.policy
        self.lora = config.lora
        self.system = config.system_prompt if config.system_prompt is not None else self.system_prompt
        self.template = config.prompt_template or self.prompt_template
        eos = getattr(tokenizer, "eos_token_id", None)
        sampling = config.sampling_params(tokenizer)
        stops = tuple(sampling.stop_token_ids)
        if eos is not None and eos not in stops:
            stops += (eos,)
        self.sampling = replace(sampling, stop_token_ids=stops)
        self.stop_token_ids = frozenset(stops)

    def user_message(self, observation: str) -> str:
        """The user-turn text for an observation (the role's prompt template applied)."""
        return self.template.format(observation=observation)

    def response_text(self, response_ids: list[int]) -> str:
        """Reply content: the decoded ids without a trailing stop token, cut before the first stop
        string (``sampling.stop``; as vLLM's text without ``include_stop_str_in_output``)."""
        ids = response_ids[:-1] if response_ids and response_ids[-1] in self.stop_token_ids else response_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        cuts = [i for i in (text.find(stop) for stop in self.sampling.stop) if i >= 0]
        return text[:min(cuts)] if cuts else text

    def parse(self, text: str) -> tuple[Any, bool]:
        """``(action value, valid)``; the base kind accepts any non-empty reply as text."""
        stripped = text.strip()
        return stripped, bool(stripped)

    def local_reward(self, action: Action, env: Env) -> float | None:
        """Optional per-agent reward, read after the env stepped; overrides the env's local reward."""
        return None


AGENTS: Registry[type[Agent]] = Registry(
    "agent", signature="class(Agent); cls(role, config: AgentConfig, tokenizer); parse(text) -> (action, valid)")
AGENTS.add("text", Agent)


def build_agents(
    configs: Mapping[str, AgentConfig],
    tokenizers: Mapping[str, Any] | Any,
    *,
    default_kinds: Mapping[str, str] | None = None,
) -> dict[str, Agent]:
    """Instantiate one agent per role. ``tokenizers`` is one tokenizer or a mapping policy -> tokenizer
    (heterogeneous policies may use different vocabularies)."""
    agents = {}
    for role, config in configs.items():
        kind = config.kind or (default_kinds or {}).get(role, "")
        if not kind:
            raise ValueError(f"agents.{role}.kind is empty and the env has no default kind for role '{role}'")
        cls = AGENTS.get(kind, key=f"agents.{role}.kind")
        if isinstance(tokenizers, Mapping):
            if config.policy not in tokenizers:
                raise ValueError(
                    f"agents.{role}.policy='{config.policy}' has no tokenizer; have {sorted(tokenizers)}"
                )
            tokenizer = tokenizers[config.policy]
        else:
            tokenizer = tokenizers
        try:
            agents[role] = cls(role, config, tokenizer)
        except ValueError as exc:  # the sampling config's own messages say agents.<a>: put the role in
            raise ValueError(str(exc).replace("agents.<a>", f"agents.{role}")) from exc
    return agents


def check_allowed_tokens(configs: Mapping[str, AgentConfig], tokenizers: Mapping[str, Any]) -> None:
    """Load time (``scripts/train.py``, with only the tokenizers loaded, before any model): every
    ``agents.<role>.sampling.allowed_tokens`` entry is one token of its policy's tokenizer.
    ``tokenizers``: policy -> tokenizer, for the policies of agents that set allowed_tokens."""
    for role, config in configs.items():
        if config.sampling.allowed_tokens:
            try:
                _single_token_ids(config.sampling.allowed_tokens, tokenizers[config.policy])
            except ValueError as exc:
                raise ValueError(f"{str(exc).replace('agents.<a>', f'agents.{role}')} (policies.{config.policy}'s "
                                 "tokenizer)") from None


# -- parsers ------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> tuple[float | None, bool]:
    """The last number in ``text`` ("3 + 2 = 5" -> 5.0); thousands separators are removed."""
    found = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return (float(found[-1]), True) if found else (None, False)


_VERDICT = re.compile(r"\b(yes|no|correct|incorrect|approve|reject)\b", re.IGNORECASE)
_APPROVING = {"yes", "correct", "approve"}


def verdict(text: str) -> tuple[bool | None, bool]:
    """The last yes/no-style word: True approves, False rejects, invalid when none is present."""
    found = _VERDICT.findall(text)
    return (found[-1].lower() in _APPROVING, True) if found else (None, False)


def first_choice(text: str, choices: tuple[str, ...]) -> tuple[str | None, bool]:
    """The earliest of ``choices`` (whole word, case-insensitive) mentioned in ``text``."""
    best: tuple[int, str] | None = None
    for choice in choices:
        match = re.search(rf"\b{re.escape(choice)}\b", text, re.IGNORECASE)
        if match and (best is None or match.start() < best[0]):
            best = (match.start(), choice)
    return (best[1], True) if best else (None, False)


_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def code_block(text: str) -> tuple[str | None, bool]:
    """The last fenced code block (or the whole reply when unfenced); valid if it compiles."""
    blocks = _CODE_BLOCK.findall(text)
    code = blocks[-1] if blocks else text
    try:
        compile(code, "<reply>", "exec")
    except (SyntaxError, ValueError):
        return code, False
    return code, bool(code.strip())


@AGENTS.register("router")
class RouterAgent(Agent):
    """Picks the next agent: its reply must name one of ``config.choices``."""

    system_prompt = "You coordinate a team. Decide which teammate acts next."
    prompt_template = "{observation}"

    def __init__(self, role: str, config: AgentConfig, tokenizer: Any) -> None:
        super().__init__(role, config, tokenizer)
        if not config.choices:
            raise ValueError(f"agents.{role}.choices must list the agents a router can pick")

    def parse(self, text: str) -> tuple[Any, bool]:
        return first_choice(text, self.config.choices)
