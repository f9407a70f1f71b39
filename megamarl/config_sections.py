"""Component sections of the run config: agents, env, orchestra, env workers, LoRA, MoE, opponent pool,
learning-rate and team-alpha schedules, rollout/training mismatch correction, logger.

They sit at the ground with ``megamarl.config`` (which composes them into ``RunConfig``) so that the
config imports nothing above it; the modules that act on a section import it from here. Each
``__post_init__`` checks what the section can check alone (ranges, fixed choices); checks that need
a registry (a registered env, worker backend, schedule shape, opponent pick) run at load time in the
module that owns the registry, called by ``megamarl.cli.configure.load_config``. A key inside a
named entry is written with a placeholder (``agents.<a>.lr``) that ``load_config`` fills in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


def check_range(key: str, value, *, low=None, high=None, low_open: bool = False) -> None:
    """``key`` (a full key path, or one with a ``<p>``/``<a>`` placeholder that ``load_config`` fills
    in) must be a finite number in [low, high] (low excluded when ``low_open``)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value}")
    if low is not None and (value <= low if low_open else value < low) or high is not None and value > high:
        bound = (
            f"{'>' if low_open else '>='} {low}"
            if high is None
            else (f"<= {high}" if low is None else f"in {'(' if low_open else '['}{low}, {high}]")
        )
        raise ValueError(f"{key} must be {bound}, got {value}")


MEMORY_SCOPES = ("team", "self")


@dataclass
class SamplingConfig:
    """``agents.<a>.sampling``: what the agent's engine requests look like. ``sampling_params``
    turns it into the engine's per-request ``SamplingParams`` (``megamarl.orchestration.agents``;
    token ids need the tokenizer)."""

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
        check_range("agents.<a>.sampling.temperature", self.temperature, low=0)
        check_range("agents.<a>.sampling.top_p", self.top_p, low=0, high=1, low_open=True)
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"agents.<a>.sampling.top_k must be -1 (off) or >= 1, got {self.top_k}")
        check_range("agents.<a>.sampling.max_tokens", self.max_tokens, low=1)
        self.allowed_tokens = list(self.allowed_tokens)
        self.stop = list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"agents.<a>.sampling.stop must list non-empty strings, got {self.stop}")


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
    # Registered tools (calculator, ...) the agent may call: their schemas go into its prompt, a reply
    # holding tool calls (Hermes/Qwen <tool_call> blocks or Llama JSON) is answered with the tools'
    # results as the next turn, up to max_tool_calls rounds; the reply after that is the action.
    tools: list[str] = field(default_factory=list)
    max_tool_calls: int = 2  # tool rounds per agent call
    # OpenAI's ``tool_choice``: ``auto`` (the model decides) or a tool's name: the agent's first reply
    # of each call is made to call that tool (its opening ``<tool_call>{"name": <tool>, "arguments": ``
    # is written into the assistant turn, prompt tokens, and the model writes the arguments); the
    # replies after the tool's result are free. For models that never call tools unprompted.
    tool_choice: str = "auto"
    # Per-agent training hyperparameters; None inherits the policy's value. ``lr`` needs the agent's
    # own parameters (an L2 LoRA adapter or an L3 policy of its own): agents sharing weights share one
    # optimizer step. ``frozen``: the agent acts but its samples never train the policy (L2: its
    # adapter serves but never steps, and is pushed only at start-up).
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
            raise ValueError(
                f"agents.<a>.memory_scope='{self.memory_scope}' unknown; allowed: {list(MEMORY_SCOPES)}"
            )
        for key in ("tree_k", "max_prompt_tokens", "max_tool_calls"):
            check_range(f"agents.<a>.{key}", getattr(self, key), low=1)
        self.tools = list(self.tools)
        if self.tool_choice != "auto" and self.tool_choice not in self.tools:
            raise ValueError(
                f"agents.<a>.tool_choice='{self.tool_choice}' must be auto or one of agents.<a>.tools "
                f"{self.tools}"
            )
        if self.tools and self.tree_k > 1:
            raise ValueError(
                "agents.<a>.tools cannot be combined with agents.<a>.tree_k > 1 (tool rounds follow one "
                "reply)"
            )
        check_range("agents.<a>.memory_tokens", self.memory_tokens, low=0)
        if self.lr is not None:
            check_range("agents.<a>.lr", self.lr, low=0, low_open=True)
        if self.clip_low is not None:
            check_range("agents.<a>.clip_low", self.clip_low, low=0, high=1)
        self.choices = list(self.choices)

    def train_overrides(self) -> dict[str, float]:
        """The per-agent hyperparameters this agent sets (None values omitted)."""
        keys = (
            "lr",
            "clip_low",
            "clip_high",
            "kl_coef",
            "entropy_coef",
            "micro_batch_size",
            "mini_batch_size",
        )
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


@dataclass
class EnvSpec:
    """``env:`` in the run config: a registered env's name and the keyword arguments of its own
    ``Config`` (which validates them)."""

    name: str = "math"
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class OrchestraSpec:
    """``orchestra:`` in the run config: a registered orchestra's name and the keyword arguments of
    its own ``Config`` (which validates them)."""

    name: str = "solve_verify"
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class WorkersConfig:
    """``rollout.env_workers``: where env steps that can block (``Env.remote_step``) run. Each step's
    timeout is ``rollout.env_timeout_s``."""

    backend: str = "inline"
    num_workers: int = 2  # process slots or Ray actors: remote env steps that run at once
    # ray: address of an existing cluster (auto, host:port, ray://host:10001); empty: the run starts a local
    # one
    address: str = ""
    # ray: what each actor asks the cluster for, which decides where it runs: {CPU: 1}, or a custom resource
    # that only some nodes declare (ray start --resources '{"env_node": 8}') with {env_node: 1}; empty:
    # nothing
    # (an actor may run on any node, the driver's first)
    resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (
            isinstance(self.num_workers, bool)
            or not isinstance(self.num_workers, int)
            or self.num_workers < 1
        ):
            raise ValueError(
                f"rollout.env_workers.num_workers must be an integer >= 1, got {self.num_workers!r}"
            )
        for name, amount in self.resources.items():
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount >= 0:
                raise ValueError(
                    f"rollout.env_workers.resources.{name} must be a number >= 0, got {amount!r}"
                )
        # the backend, its address and its package: megamarl.orchestration.workers.check_workers (load time)


# ``policies.<p>.lora.targets`` names -> megatron-core linear names
TARGET_NAMES = {"qkv": "linear_qkv", "proj": "linear_proj", "fc1": "linear_fc1", "fc2": "linear_fc2"}


@dataclass
class LoraConfig:
    """``policies.<p>.lora``: L2 adapters on the policy's frozen base, one per agent that names one
    (``agents.<a>.lora``). ``targets`` are short names of the adapted linears (``TARGET_NAMES``)."""

    rank: int = 8
    alpha: float = 16.0
    targets: list[str] = field(default_factory=lambda: list(TARGET_NAMES))
    seed: int = 0  # adapter initialisation (A; B starts at zero)
    # An adapter steps in an update only when its agents' rows in the policy batch number at least
    # this; the rows of one below it are dropped and counted (rl.adapters). 0: every adapter steps.
    min_samples: int = 0

    def __post_init__(self) -> None:
        if self.min_samples < 0:
            raise ValueError(f"policies.<p>.lora.min_samples must be >= 0, got {self.min_samples}")
        bad = [t for t in self.targets if t not in TARGET_NAMES]
        if bad or not self.targets:
            raise ValueError(f"policies.<p>.lora.targets={list(self.targets)}: allowed {list(TARGET_NAMES)}")
        if self.rank < 1:
            raise ValueError(f"policies.<p>.lora.rank must be >= 1, got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"policies.<p>.lora.alpha must be > 0, got {self.alpha}")

    @property
    def modules(self) -> tuple[str, ...]:
        """The megatron-core linear names of ``targets``."""
        return tuple(TARGET_NAMES[t] for t in self.targets)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass
class MoeConfig:
    """``policies.<p>.moe``: how a mixture-of-experts policy routes tokens (a dense model rejects it at
    load, ``planning.expert_plan.check_expert_parallel``). ``capacity_factor``: each expert takes at most
    ``ceil(capacity_factor * routed tokens / num_experts)`` tokens per micro-batch and rank, the rest
    dropped and the buffers padded to it (megatron-core's ``moe_expert_capacity_factor``); null:
    dropless, buffers as large as the routing makes them (the plan prices balanced routing)."""

    # MoE: each expert takes at most ceil(capacity_factor x its balanced share) tokens, padded to it;
    # null: dropless
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        if self.capacity_factor is not None:
            check_range("policies.<p>.moe.capacity_factor", self.capacity_factor, low=0, low_open=True)


@dataclass
class OpponentPoolConfig:
    """``rollout.opponent_pool``: ``learner``'s past versions in the frozen policies ``snapshots``."""

    learner: str = ""  # the trained policy whose snapshots fill the pool; empty: no pool
    snapshots: list[str] = field(default_factory=list)  # frozen policies (the learner's model) holding them
    every: int = 1  # trainer steps between snapshots (the learner's weights after step every, 2 every, ...)
    pick: str = "latest"  # latest | uniform (OPPONENT_PICKS): the slot an episode's opponent seat gets
    alias: str = "opponent"  # what rollout.policy_mapping returns for the seat the pool fills

    def __post_init__(self) -> None:
        self.snapshots = list(self.snapshots)
        if self.every < 1:
            raise ValueError(f"rollout.opponent_pool.every must be >= 1, got {self.every}")
        if not self.alias:
            raise ValueError(
                "rollout.opponent_pool.alias is empty; name what rollout.policy_mapping returns "
                "for the pool's seat"
            )
        if self.learner and not self.snapshots:
            raise ValueError(
                f"rollout.opponent_pool.learner={self.learner!r} needs rollout.opponent_pool.snapshots "
                "(frozen policies that hold its past versions)"
            )
        if self.snapshots and not self.learner:
            raise ValueError("rollout.opponent_pool.snapshots needs rollout.opponent_pool.learner")
        if len(set(self.snapshots)) != len(self.snapshots):
            raise ValueError(f"rollout.opponent_pool.snapshots lists a policy twice: {self.snapshots}")

    @property
    def enabled(self) -> bool:
        return bool(self.learner)


LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass
class LrScheduleConfig:
    """``policies.<p>.lr_schedule``: linear warmup from 0 to ``policies.<p>.lr`` over ``warmup_steps``
    trainer steps, then ``decay`` down to ``min_lr`` at ``decay_steps`` (default: trainer.total_steps)."""

    warmup_steps: int = 0  # trainer steps of linear warmup from 0 to policies.<p>.lr
    decay: str = "constant"  # constant | linear | cosine (megatron-core's lr_decay_style)
    min_lr: float = 0.0  # the learning rate at the end of the decay
    decay_steps: int | None = None  # None: trainer.total_steps

    def __post_init__(self) -> None:
        if self.decay not in LR_DECAY_STYLES:
            raise ValueError(
                f"policies.<p>.lr_schedule.decay='{self.decay}' unknown; allowed: {list(LR_DECAY_STYLES)}"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"policies.<p>.lr_schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.min_lr < 0:
            raise ValueError(f"policies.<p>.lr_schedule.min_lr must be >= 0, got {self.min_lr}")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"policies.<p>.lr_schedule.decay_steps must be >= 1, got {self.decay_steps}")


@dataclass
class TeamAlphaSchedule:
    """``algorithm.team_alpha_schedule``: anneals the local-reward weight ``algorithm.team_alpha`` (the
    start) to ``end`` over ``steps`` trainer steps, then holds it. ``kind: constant`` keeps team_alpha."""

    kind: str = "constant"  # constant | linear | cosine (ALPHA_SCHEDULES)
    end: float = 0.0  # the weight reached after `steps` steps (kind != constant)
    steps: int = 0  # trainer steps of the anneal; 0: trainer.total_steps

    @property
    def anneals(self) -> bool:
        """False for ``constant``: team_alpha never moves (and is not logged per step)."""
        return self.kind != "constant"

    def __post_init__(self) -> None:
        if not math.isfinite(self.end) or self.end < 0:
            raise ValueError(
                f"algorithm.team_alpha_schedule.end must be a finite number >= 0, got {self.end}"
            )
        if self.steps < 0:
            raise ValueError(
                f"algorithm.team_alpha_schedule.steps must be >= 0 (0: trainer.total_steps), got {self.steps}"
            )


MISMATCH_MODES = ("off", "truncate", "mask", "reject")  # algorithm.mismatch.<level>.mode
MISMATCH_LEVELS = ("token", "sequence", "geometric")  # algorithm.mismatch's sections


@dataclass
class MismatchLevel:
    """One level of ``algorithm.mismatch``: what happens to a token whose importance ratio (training
    over rollout probability, at this level) is outside [lower, upper] (null: unbounded on that side).
    truncate: weight ``min(ratio, upper)``; mask: weight ``ratio`` inside the bounds, 0 outside (at
    token level only the token, at sequence/geometric level the row); reject: weight 1 inside, and the
    whole row 0 when any of its ratios is outside. The bounds are read only when mode is not off."""

    mode: str = "off"  # off | truncate | mask | reject
    lower: float | None = None  # mask / reject: ratios below it are out (truncate: must be null)
    upper: float | None = None  # truncate: the cap (required); mask / reject: ratios above it are out


def _default_token_level() -> MismatchLevel:
    return MismatchLevel(mode="truncate", upper=2.0)  # token-level TIS, cap 2 (the old tis_cap default)


@dataclass
class MismatchConfig:
    """``algorithm.mismatch`` (and ``policies.<p>.algorithm.mismatch``): correction of the mismatch
    between the rollout engine's log-probs and the trainer's, at three levels whose weights multiply:
    ``token`` (ratio per token), ``sequence`` (the product over the row's tokens) and ``geometric``
    (their geometric mean, exp of the row's mean token log-ratio). docs/rl.md, "Rollout/training
    mismatch"."""

    token: MismatchLevel = field(default_factory=_default_token_level)
    sequence: MismatchLevel = field(default_factory=MismatchLevel)
    geometric: MismatchLevel = field(default_factory=MismatchLevel)

    @property
    def enabled(self) -> bool:
        """Some level corrects (else the loss needs no rollout log-probs)."""
        return any(getattr(self, level).mode != "off" for level in MISMATCH_LEVELS)

    def __post_init__(self) -> None:
        for level in MISMATCH_LEVELS:
            value = getattr(self, level)
            if isinstance(value, Mapping):
                value = MismatchLevel(**value)
                setattr(self, level, value)
            _check_mismatch_level(value, key=f"algorithm.mismatch.{level}")


def _check_mismatch_level(level: MismatchLevel, *, key: str) -> None:
    if level.mode not in MISMATCH_MODES:
        raise ValueError(f"{key}.mode={level.mode!r} unknown; allowed: {list(MISMATCH_MODES)}")
    for bound in ("lower", "upper"):
        value = getattr(level, bound)
        if value is not None:
            check_range(f"{key}.{bound}", value, low=0, low_open=True)
    if level.mode == "off":
        return
    if level.lower is not None and level.upper is not None and not level.lower < level.upper:
        raise ValueError(f"{key}.lower must be < {key}.upper, got {level.lower} and {level.upper}")
    if level.mode == "truncate" and (level.upper is None or level.lower is not None):
        raise ValueError(
            f"{key}.mode=truncate caps the weight from above: set {key}.upper and leave {key}.lower "
            f"null (got lower={level.lower}, upper={level.upper}); mask or reject drop low ratios"
        )
    if level.lower is None and level.upper is None:
        raise ValueError(f"{key}.mode={level.mode} needs {key}.lower or {key}.upper (or both)")


WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "megamarl"
    entity: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"logger.wandb.mode='{self.mode}' unknown; allowed: {list(WANDB_MODES)}")


@dataclass
class LoggerConfig:
    """``logger:``: the run's metrics sinks (JSONL always; wandb per ``wandb.mode``) and console progress."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    # A live display (rich) on a terminal; one plain line per phase otherwise (Slurm logs).
    progress: bool = True
    # full transcripts (prompts, replies, parsed actions, rewards) of this many of each step's episodes
    # go to <run>/episodes/step_<N>.jsonl (and a wandb table); scripts/show_episodes.py prints them. 0: none
    episodes_per_step: int = 2
    # PNG curves of metrics.jsonl / eval.json in <run>/plots when the run ends (megamarl-plot RUN_DIR
    # draws them any time, e.g. while it runs); false: none (a sweep of many runs watched in wandb)
    plots: bool = True
    # one line per step in <run>/trained_groups.jsonl: every group of the step's training batch, by
    # policy, under its estimator's group key (e.g. task, agent, turn), with its number of samples;
    # rewound with metrics.jsonl on resume (which tasks a step trained, in every trainer.mode)
    trained_groups: bool = True

    def __post_init__(self) -> None:
        if self.episodes_per_step < 0:
            raise ValueError(f"logger.episodes_per_step must be >= 0, got {self.episodes_per_step}")
