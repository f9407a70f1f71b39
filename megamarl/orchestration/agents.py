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

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from megamarl.config_sections import AgentConfig, SamplingConfig
from megamarl.orchestration.tools import TOOLS, forced_call
from megamarl.registry import Registry
from megamarl.rollout.engines.base import SamplingParams

if TYPE_CHECKING:
    from megamarl.orchestration.action import Action
    from megamarl.orchestration.env import Env


def sampling_params(sampling: SamplingConfig, tokenizer: Any = None) -> SamplingParams:
    """An agent's engine request parameters (``agents.<a>.sampling``); ``allowed_tokens`` become token
    ids with ``tokenizer``, the tokenizer of the agent's policy (needed only when some are set)."""
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=sampling.max_tokens,
        allowed_token_ids=_single_token_ids(sampling.allowed_tokens, tokenizer),
        stop=tuple(sampling.stop),
    )


def _single_token_ids(texts: list[str], tokenizer: Any) -> tuple[int, ...]:
    if not texts:
        return ()
    if tokenizer is None:
        raise ValueError(
            "agents.<a>.sampling.allowed_tokens needs the policy's tokenizer to become token ids"
        )
    ids = []
    for text in texts:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"agents.<a>.sampling.allowed_tokens: {text!r} is {len(encoded)} tokens, not one"
            )
        ids.append(encoded[0])
    return tuple(ids)


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
        sampling = sampling_params(config.sampling, tokenizer)
        stops = tuple(sampling.stop_token_ids)
        if eos is not None and eos not in stops:
            stops += (eos,)
        self.sampling = replace(sampling, stop_token_ids=stops)
        self.stop_token_ids = frozenset(stops)
        self.tools = {
            name: TOOLS.get(name, key=f"agents.{role}.tools") for name in config.tools
        }  # name -> Tool
        # agents.<a>.tool_choice naming a tool: each call's first reply is made to call it (tools.ForcedCall)
        forced = self.tools[config.tool_choice] if config.tool_choice != "auto" else None
        self.forced_call = forced_call(forced.name, forced.parameters) if forced is not None else None

    def user_message(self, observation: str) -> str:
        """The user-turn text for an observation (the role's prompt template applied)."""
        return self.template.format(observation=observation)

    def response_text(self, response_ids: list[int], stop: tuple[str, ...] | None = None) -> str:
        """Reply content: the decoded ids without a trailing stop token, cut before the first stop
        string (``stop``, those the call sampled with; default ``sampling.stop``; as vLLM's text
        without ``include_stop_str_in_output``)."""
        ids = response_ids[:-1] if response_ids and response_ids[-1] in self.stop_token_ids else response_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        cuts = [i for i in (text.find(s) for s in (self.sampling.stop if stop is None else stop)) if i >= 0]
        return text[: min(cuts)] if cuts else text

    def parse(self, text: str) -> tuple[Any, bool]:
        """``(action value, valid)``; the base kind accepts any non-empty reply as text."""
        stripped = text.strip()
        return stripped, bool(stripped)

    def local_reward(self, action: Action, env: Env) -> float | None:
        """Optional per-agent reward, read after the env stepped; overrides the env's local reward."""
        return None


AGENTS: Registry[type[Agent]] = Registry(
    "agent",
    signature="class(Agent); cls(role, config: AgentConfig, tokenizer); parse(text) -> (action, valid)",
    keys=("agents.<name>.kind",),
)
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
                raise ValueError(
                    f"{str(exc).replace('agents.<a>', f'agents.{role}')} (policies.{config.policy}'s "
                    "tokenizer)"
                ) from None


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


def first_choice(text: str, choices: Sequence[str]) -> tuple[str | None, bool]:
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
