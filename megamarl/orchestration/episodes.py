"""Episodes: run many episodes concurrently and hand back agent-tagged Samples plus stats.

``run_episodes`` creates ``group_size`` episodes per task (GRPO groups share the task id), runs up to
``max_concurrency`` at once on one asyncio loop and fills ``team_reward``/``local_reward`` at each
episode's end. An episode ends ``ok`` (the orchestra returned; ``env_done`` tells why), ``dropped``
(``EpisodeDropped``, e.g. ``prompt_too_long``) or ``failed`` (env crash, hang, exception, timeout),
all counted in ``RolloutResult``; samples of dropped and failed episodes are discarded. The run goes on
while the failed fraction stays within ``rollout.max_failed_fraction`` (``check_failures``).
Configuration errors (an agent with no engine) raise at once.
Details: docs/design-notes.md, "megamarl/orchestration/episodes.py".
"""

from __future__ import annotations

import asyncio
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from megamarl.errors import RolloutFailureError, RunStoppedError
from megamarl.orchestration.agents import Agent
from megamarl.orchestration.chat import TemplateDeltaError
from megamarl.orchestration.context import (
    ConfigError,
    EpisodeContext,
    EpisodeDone,
    EpisodeDropped,
    derive_seed,
)
from megamarl.orchestration.env import Env, Task
from megamarl.orchestration.orchestras import Orchestra
from megamarl.orchestration.workers import EnvWorkerError, EnvWorkers
from megamarl.rl.sample import Sample
from megamarl.rollout.engines.base import Engine


@dataclass
class EpisodeStats:
    task_id: str
    episode_id: str
    status: str  # ok | dropped | failed
    reason: str = ""
    team_reward: float = 0.0
    success: bool = False
    env_done: bool = False
    num_samples: int = 0
    num_calls: dict[str, int] = field(default_factory=dict)  # agent -> number of act() calls
    num_invalid: int = 0
    agent_success: dict[str, bool] = field(default_factory=dict)  # agent -> own success (ok episodes)
    policies: dict[str, str] = field(default_factory=dict)  # agent -> the policy it used
    error: str = ""  # failed episodes: the last lines of the traceback
    env_metrics: dict[str, float] = field(default_factory=dict)  # Env.metrics() (ok episodes)
    tool_calls: dict[str, int] = field(default_factory=dict)  # agent -> tool calls run (agents with tools)
    tool_errors: dict[str, int] = field(default_factory=dict)  # agent -> of them answered "error: ..."


@dataclass
class RolloutResult:
    samples: list[Sample]
    episodes: list[EpisodeStats]

    @property
    def num_failed(self) -> int:
        return sum(e.status == "failed" for e in self.episodes)

    @property
    def num_dropped(self) -> int:
        return sum(e.status == "dropped" for e in self.episodes)

    def reasons(self) -> Counter:
        """Failure/drop reasons, e.g. ``{"env_worker:timeout": 2, "prompt_too_long": 1}``."""
        return Counter(e.reason for e in self.episodes if e.status != "ok")

    @property
    def failed_fraction(self) -> float:
        return self.num_failed / len(self.episodes) if self.episodes else 0.0

    def first_error(self) -> str:
        """The first failed episode's id, reason and traceback tail ('' when none failed)."""
        for e in self.episodes:
            if e.status == "failed":
                return f"episode {e.episode_id} ({e.reason}):\n{e.error}".rstrip()
        return ""

    def failure_report(self, what: str) -> str:
        return (
            f"{what}: {self.num_failed}/{len(self.episodes)} episodes failed {dict(self.reasons())}; "
            f"first: {self.first_error()}"
        )

    def summary(self) -> dict[str, float]:
        ok = [e for e in self.episodes if e.status == "ok"]
        out = {
            "rollout/num_episodes": float(len(self.episodes)),
            "rollout/num_failed": float(self.num_failed),
            "rollout/num_dropped": float(self.num_dropped),
            "rollout/num_samples": float(len(self.samples)),
        }
        if ok:  # no finished episode (a fully_async step fed only from the buffer): no score, not 0.000
            out["rollout/team_reward_mean"] = sum(e.team_reward for e in ok) / len(ok)
            out["rollout/success_rate"] = sum(e.success for e in ok) / len(ok)
        calls: Counter[str] = Counter()
        for e in ok:
            calls.update(e.num_calls)
        for agent, num in sorted(calls.items()):
            out[f"agent/{agent}/num_calls"] = float(num)
        for key in ("tool_calls", "tool_errors"):  # getattr: episodes pickled before the fields existed
            totals: Counter[str] = Counter()
            for e in ok:
                totals.update(getattr(e, key, {}))
            for agent, num in sorted(totals.items()):  # zeros kept: an agent with tools that called none
                out[f"agent/{agent}/{key}"] = float(num)
        env_totals: Counter[str] = Counter()
        for e in ok:  # getattr: episodes pickled in a checkpoint written before Env.metrics existed
            env_totals.update(getattr(e, "env_metrics", {}))
        # a mean per finished episode, as every other rollout/ figure: comparable across batch sizes
        out.update({f"env/{key}": value / len(ok) for key, value in sorted(env_totals.items())})
        return out


# not one episode's failure: the run stops (a config error; a crash-looping program: RunStoppedError)
_CONFIG_ERRORS = (ConfigError, TemplateDeltaError, RunStoppedError)


async def run_episode(
    orchestra: Orchestra,
    env: Env,
    task: Task,
    *,
    episode_id: str,
    agents: Mapping[str, Agent],
    engines: Mapping[str, Engine],
    workers: EnvWorkers | None = None,
    step_timeout_s: float = 60.0,
    episode_timeout_s: float | None = None,
    seed: int | None = None,
    policies: Mapping[str, str] | None = None,
) -> tuple[list[Sample], EpisodeStats]:
    """One episode; returns (samples, stats). Samples are empty unless the status is ok.
    ``seed``: this episode's sampling seed; ``policies``: agent -> policy for this episode (see
    ``EpisodeContext``)."""
    ctx = EpisodeContext(
        task=task,
        episode_id=episode_id,
        env=env,
        agents=agents,
        engines=engines,
        workers=workers,
        step_timeout_s=step_timeout_s,
        seed=seed,
        policies=policies,
    )
    stats = EpisodeStats(task.task_id, episode_id, "ok")
    try:
        await asyncio.wait_for(_run_to_end(orchestra, ctx), episode_timeout_s)
    except EpisodeDropped as exc:
        stats.status, stats.reason = "dropped", exc.reason
    except EnvWorkerError as exc:
        stats.status, stats.reason = "failed", f"env_worker:{exc.reason.split(':')[0]}"
        stats.error = _traceback_tail(exc)
    except asyncio.TimeoutError:
        stats.status, stats.reason = "failed", "episode_timeout"
        stats.error = f"the episode ran longer than {episode_timeout_s} s"
    except _CONFIG_ERRORS:
        raise
    except Exception as exc:  # noqa: BLE001 - an env/engine failure fails this episode only
        stats.status, stats.reason = "failed", f"error:{type(exc).__name__}"
        stats.error = _traceback_tail(exc)
    stats.num_calls = dict(Counter(s.agent for s in ctx.samples if s.branch == 0))
    if stats.status != "ok":
        stats.num_samples = 0
        return [], stats
    stats.team_reward = ctx.finalize()
    stats.success = ctx.success()
    stats.env_done = bool(ctx.env.done)
    stats.num_samples = len(ctx.samples)
    stats.num_invalid = sum(not s.valid for s in ctx.samples)
    stats.env_metrics = dict(ctx.env.metrics())
    stats.tool_calls, stats.tool_errors = dict(ctx.tool_calls), dict(ctx.tool_errors)
    for agent in ctx.agents:  # every seat, also one that never acted (its opponent forfeited first)
        stats.agent_success[agent] = ctx.agent_success(agent)
        stats.policies[agent] = ctx.policy_of(agent)
    return ctx.samples, stats


def _traceback_tail(exc: BaseException, num_lines: int = 12) -> str:
    lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    if len(lines) > num_lines + 1:  # keep the header, so the text reads as a traceback
        lines = [lines[0], "  ...", *lines[-num_lines:]]
    return "\n".join(lines)


def check_failures(result: RolloutResult, *, max_failed_fraction: float, what: str) -> None:
    """Raise ``RolloutFailureError`` (with the first traceback) when the failed fraction of
    ``result``'s episodes is above ``max_failed_fraction`` (``rollout.max_failed_fraction``)."""
    if result.episodes and result.failed_fraction > max_failed_fraction:
        raise RolloutFailureError(
            result.failure_report(what) + f"\n(failed fraction {result.failed_fraction:.3f} > "
            f"rollout.max_failed_fraction={max_failed_fraction})"
        )


async def _run_to_end(orchestra: Orchestra, ctx: EpisodeContext) -> None:
    try:
        await orchestra.run(ctx)
    except EpisodeDone:
        pass
    finally:  # done, cut by the orchestra's max_steps, failed or timed out (the cancellation lands here)
        ctx.env.close()


async def run_episodes(
    orchestra: Orchestra,
    make_env: Callable[[Task], Env],
    tasks: Sequence[Task],
    *,
    agents: Mapping[str, Agent],
    engines: Mapping[str, Engine],
    group_size: int = 1,
    max_concurrency: int = 64,
    workers: EnvWorkers | None = None,
    step_timeout_s: float = 60.0,
    episode_timeout_s: float | None = None,
    seed: int | None = None,
    policy_mapping: Callable[[str, int], str] | None = None,
    on_episode: Callable[[list[Sample]], None] | None = None,
) -> RolloutResult:
    """Run ``len(tasks) * group_size`` episodes, at most ``max_concurrency`` at a time.

    Episode ids are ``f"{task_id}/{g}"``; results keep task-major, group-minor order regardless
    of completion order, so a seeded run yields samples in a reproducible order. ``seed`` (the
    trainer passes one per step) seeds every engine call from (seed, episode id, agent, turn);
    None leaves sampling to the engines' own generators. ``policy_mapping(agent_id, episode_seed) ->
    policy`` (RLlib-style) binds each agent to a policy per episode (self-play: two policies swap
    seats); ``episode_seed`` is derived from (seed or 0, task id, episode index). ``on_episode``
    receives each finished episode's samples (progress display).
    """
    if group_size < 1:
        raise ValueError(f"rollout.group_size must be >= 1, got {group_size}")
    if max_concurrency < 1:
        raise ValueError(f"rollout.max_concurrency must be >= 1, got {max_concurrency}")
    semaphore = asyncio.Semaphore(max_concurrency)

    async def one(task: Task, index: int) -> tuple[list[Sample], EpisodeStats]:
        policies = None
        if policy_mapping is not None:
            episode_seed = derive_seed(seed or 0, task.task_id, index)
            policies = {agent: policy_mapping(agent, episode_seed) for agent in agents}
        async with semaphore:
            result = await run_episode(
                orchestra,
                make_env(task),
                task,
                episode_id=f"{task.task_id}/{index}",
                agents=agents,
                engines=engines,
                workers=workers,
                step_timeout_s=step_timeout_s,
                episode_timeout_s=episode_timeout_s,
                seed=None if seed is None else derive_seed(seed, task.task_id, index),
                policies=policies,
            )
        if on_episode is not None:
            on_episode(result[0])
        return result

    results = await asyncio.gather(*(one(task, g) for task in tasks for g in range(group_size)))
    samples = [s for episode_samples, _ in results for s in episode_samples]
    return RolloutResult(samples=samples, episodes=[stats for _, stats in results])
