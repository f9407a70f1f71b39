"""The episode context: what an orchestra's async code talks to.

``await ctx.act(agent, observation)`` builds the agent's prompt (token-exact, see ``chat.py``),
calls the engine of the agent's policy, parses the reply and records one tagged ``Sample`` per
sampled candidate; ``await ctx.complete(agent, prompt_ids)`` does the same for a prompt rendered
elsewhere (the OpenAI endpoint); ``await ctx.step(agent, action)`` applies an action to the env (in
an env worker for ``remote_step`` envs); ``ctx.turn(agent)`` is observe + act + step. Once the env
is done ``act`` raises ``EpisodeDone``. Per agent: ``memory_tokens`` prefixes earlier turns (oldest
whole turns dropped), ``tree_k > 1`` samples K candidates and continues from the best, ``tools``
answers tool calls and samples again. ``report_rewards`` sets the rewards ``finalize`` writes;
``policies`` maps agents to policies for the episode; ``seed`` makes each engine call's sampling a
function of (run seed, step, task, episode, agent, turn), so a resumed run samples what the
uninterrupted one did. Details: docs/design-notes.md, "megamarl/orchestration/context.py".
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from megamarl.orchestration.action import Action
from megamarl.orchestration.chat import ChatTranscript
from megamarl.orchestration.env import Env, StepResult, Task
from megamarl.orchestration.tools import ForcedCall, call_tool, parse_tool_calls
from megamarl.rl.sample import Sample
from megamarl.rollout.engines.base import Engine, SamplingParams

if TYPE_CHECKING:
    from megamarl.orchestration.agents import Agent
    from megamarl.orchestration.workers import EnvWorkers


def derive_seed(base: int, *parts: object) -> int:
    """A 62-bit seed from ``base`` and ``parts`` (stable across processes, unlike ``hash``); 62 bits
    leave room for the engines' ``seed + sample_index`` per candidate."""
    digest = hashlib.blake2b(repr((int(base), *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class ConfigError(ValueError):
    """A configuration mistake (unknown agent, missing engine or scorer): raised, never counted as
    an episode failure, so a misconfigured run stops at once."""


class EpisodeDone(Exception):
    """Raised by ``act`` on a finished episode (the active mask)."""


class EpisodeDropped(Exception):
    """The episode cannot continue for a budget reason (e.g. prompt too long); ``reason`` is counted."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class MemoryEntry:
    agent: str
    text: str
    num_tokens: int


class EpisodeContext:
    """State of one running episode; created by the driver, handed to ``orchestra.run``."""

    def __init__(
        self,
        *,
        task: Task,
        episode_id: str,
        env: Env,
        agents: Mapping[str, Agent],
        engines: Mapping[str, Engine],
        workers: EnvWorkers | None = None,
        step_timeout_s: float = 60.0,
        seed: int | None = None,
        policies: Mapping[str, str] | None = None,
    ) -> None:
        self.task = task
        self.policies = dict(policies or {})  # agent -> policy for this episode (rollout.policy_mapping)
        self.seed = seed  # None: engine calls carry the agent's own sampling seed (usually none)
        self.episode_id = episode_id
        self.env = env
        self.agents = agents
        self.engines = engines
        self.workers = workers
        self.step_timeout_s = step_timeout_s
        self.samples: list[Sample] = []
        self.actions: list[Action] = []
        self.num_steps = 0  # global step counter over all agents
        self.turns: dict[str, int] = {}  # per-agent invocation counter
        self.transcripts: dict[str, ChatTranscript] = {}
        self.memory: list[MemoryEntry] = []
        self._step_rewards: dict[int, float] = {}  # id(sample) -> local reward from env/agent
        self._scored: set[int] = set()  # id(sample) of tree candidates (local reward = score)
        self._env_lock = asyncio.Lock()  # remote env calls of this episode, one at a time
        self.reported: tuple[float, dict[str, float]] | None = None  # report_rewards: (team, agent -> local)
        # agent -> tool calls run / of them answered with ``error: ...`` (agents with ``tools`` only)
        self.tool_calls: dict[str, int] = {
            name: 0 for name, agent in agents.items() if getattr(agent, "tools", None)
        }
        self.tool_errors: dict[str, int] = dict.fromkeys(self.tool_calls, 0)

    @property
    def done(self) -> bool:
        return self.env.done

    def policy_of(self, agent_name: str) -> str:
        """The policy ``agent_name`` samples from (and trains) in this episode."""
        return self.policies.get(agent_name) or self._agent(agent_name).policy

    # -- acting --------------------------------------------------------------------------------

    def _agent(self, name: str) -> Agent:
        if name not in self.agents:
            raise ConfigError(
                f"orchestra asked agent '{name}' to act; configured agents: {sorted(self.agents)}"
            )
        return self.agents[name]

    def _memory_text(self, agent: Agent) -> str:
        budget = agent.config.memory_tokens
        entries = [e for e in self.memory if agent.config.memory_scope == "team" or e.agent == agent.role]
        kept: list[MemoryEntry] = []
        for entry in reversed(entries):  # newest first; stop before the budget is exceeded
            if entry.num_tokens > budget:
                break
            kept.append(entry)
            budget -= entry.num_tokens
        return "".join(f"[{e.agent}] {e.text}\n" for e in reversed(kept))

    def _prompt(self, agent: Agent, observation: str) -> ChatTranscript:
        text = observation
        if agent.config.memory_tokens > 0:
            memory = self._memory_text(agent)
            text = f"Earlier turns:\n{memory}\n{observation}" if memory else observation
        transcript = self.transcripts.get(agent.role) if agent.config.multi_turn else None
        if transcript is None:
            transcript = ChatTranscript(
                agent.tokenizer, agent.system, tools=[t.schema() for t in agent.tools.values()]
            )
        transcript.add_user(agent.user_message(text))
        if len(transcript.ids) > agent.config.max_prompt_tokens:
            raise EpisodeDropped("prompt_too_long")
        return transcript

    def _engine(self, agent_name: str) -> tuple[str, Engine]:
        policy = self.policy_of(agent_name)
        engine = self.engines.get(policy)
        if engine is None:
            source = (
                "rollout.policy_mapping" if agent_name in self.policies else f"agents.{agent_name}.policy"
            )
            raise ConfigError(
                f"{source} gave '{agent_name}' policy '{policy}', which has no engine; have "
                f"{sorted(self.engines)}"
            )
        return policy, engine

    async def _sample(
        self,
        agent: Agent,
        prompt_ids: list[int],
        *,
        anchor: str,
        sampling: SamplingParams,
        num_candidates: int = 1,
        forced: ForcedCall | None = None,
    ) -> list[tuple[Sample, object]]:
        """One engine call for ``agent`` on ``prompt_ids`` (``num_candidates`` replies; the candidates
        share the list); the tagged Samples (not yet recorded), each with the agent's parsed value of
        its reply. The one path by which every agent call (``act``, ``complete``) reaches an engine.
        ``forced``: a forced tool call, its opening already encoded at the end of ``prompt_ids``: the
        agent parses the whole turn; a Sample's ``response_text`` is its reply alone, as its ids."""
        agent_name = agent.role
        policy, engine = self._engine(agent_name)
        # Counters are taken before the engine call so concurrent agents get them in call order.
        turn, step = self.turns.get(agent_name, 0), self.num_steps
        self.turns[agent_name] = turn + 1
        self.num_steps += 1
        if self.seed is not None:
            sampling = dataclasses.replace(sampling, seed=derive_seed(self.seed, agent_name, turn))
        if num_candidates > 1:
            sampling = dataclasses.replace(sampling, n=num_candidates)
        generations = await engine.generate(prompt_ids, sampling, lora=agent.lora)
        if len(generations) != num_candidates:
            raise RuntimeError(f"engine of policy '{policy}' returned {len(generations)} of {num_candidates}")
        samples = []
        for branch, gen in enumerate(generations):
            text = agent.response_text(
                gen.token_ids, sampling.stop
            )  # the call's stops: a request's, a forced call's
            value, valid = agent.parse(forced.turn_text(text) if forced is not None else text)
            samples.append(
                (
                    Sample(
                        task_id=self.task.task_id,
                        episode_id=self.episode_id,
                        agent=agent_name,
                        policy=policy,
                        turn=turn,
                        branch=branch,
                        weight_version=gen.weight_version,
                        valid=bool(valid),
                        step=step,
                        prompt_ids=prompt_ids,
                        response_ids=list(gen.token_ids),
                        rollout_logprobs=list(gen.logprobs),
                        anchor=anchor,
                        truncated=gen.finish_reason == "length",
                        response_text=text,
                        allowed_token_ids=tuple(sampling.allowed_token_ids)
                        if sampling.allowed_token_ids
                        else None,
                        temperature=sampling.temperature if sampling.temperature > 0 else 1.0,
                    ),
                    value,
                )
            )
        return samples

    async def complete(
        self,
        agent_name: str,
        prompt_ids: list[int],
        *,
        max_tokens: int | None = None,
        stop: tuple[str, ...] = (),
        anchor: str = "",
    ) -> Sample:
        """Sample ``agent_name``'s reply to a prompt rendered elsewhere (the OpenAI endpoint renders
        the program's messages) and record it: same engine, sampling, tags and token-exactness as
        ``act``, but no parsing into an env action and no env step. ``max_tokens`` can only lower the
        agent's ``sampling.max_tokens``; ``stop`` strings are added to the agent's."""
        if self.env.done:
            raise EpisodeDone(self.episode_id)
        agent = self._agent(agent_name)
        if len(prompt_ids) > agent.config.max_prompt_tokens:
            raise EpisodeDropped("prompt_too_long")
        sampling = agent.sampling
        if max_tokens is not None:
            sampling = dataclasses.replace(sampling, max_tokens=max(1, min(max_tokens, sampling.max_tokens)))
        if stop:
            sampling = dataclasses.replace(sampling, stop=tuple(dict.fromkeys((*sampling.stop, *stop))))
        [(sample, _)] = await self._sample(agent, prompt_ids, anchor=anchor, sampling=sampling)
        self.samples.append(sample)
        return sample

    def report_rewards(self, team: float, agents: Mapping[str, float] | None = None) -> None:
        """Rewards the episode's program computed itself (the external orchestra): ``finalize`` uses
        them instead of the env's. An agent missing from ``agents`` has no local reward (0.0, as an
        agent of a built-in or plugin env without one): the team's would count twice in its shaped
        reward (team + team_alpha x local = 2.0 for a team reward of 1 at alpha 1)."""
        unknown = sorted(set(agents or {}) - set(self.agents))
        if unknown:
            raise ValueError(f"rewards for unknown agents {unknown}; agents: {sorted(self.agents)}")
        self.reported = (float(team), {name: float(r) for name, r in (agents or {}).items()})

    def success(self) -> bool:
        """The team's success: a reported team reward >= 1, else the env's ``success()``."""
        return self.reported[0] >= 1.0 if self.reported is not None else bool(self.env.success())

    def agent_success(self, agent: str) -> bool:
        """``agent``'s own success: its reported local reward >= 1 when reported, else the env's."""
        if self.reported is not None:
            return self.reported[1].get(agent, self.reported[0]) >= 1.0
        own = self.env.agent_success(agent)
        return self.success() if own is None else bool(own)

    async def act(self, agent_name: str, observation: str) -> Action:
        """Sample ``agent_name``'s reply to ``observation``; record Samples; return the chosen Action."""
        if self.env.done:
            raise EpisodeDone(self.episode_id)
        agent = self._agent(agent_name)
        self._engine(agent_name)  # a config error before the prompt is built
        transcript = self._prompt(agent, observation)
        prompt_ids = list(transcript.ids)
        sampling, forced = (
            agent.sampling,
            agent.forced_call,
        )  # tool_choice naming a tool: the reply opens with its call
        if forced is not None:
            prompt_ids += agent.tokenizer.encode(forced.opening, add_special_tokens=False)
            sampling = dataclasses.replace(sampling, stop=(*sampling.stop, *forced.stop))
        num_candidates = agent.config.tree_k
        sampled = await self._sample(
            agent,
            prompt_ids,
            anchor=observation,
            sampling=sampling,
            num_candidates=num_candidates,
            forced=forced,
        )
        tool_samples: list[Sample] = []
        if agent.tools:  # tree_k is 1 (AgentConfig): a reply that calls tools is answered, then resampled
            tool_samples, sampled = await self._tool_rounds(
                agent, transcript, sampled, anchor=observation, forced=forced
            )
        # the assistant turn's text (a forced call's, when its reply called nothing: prompt ids past the
        # transcript)
        forced_reply = forced is not None and len(sampled[0][0].prompt_ids) > len(transcript.ids)
        candidates = [
            Action(
                agent_name,
                cast(ForcedCall, forced).turn_text(sample.response_text)
                if forced_reply
                else sample.response_text,
                value,
                sample.valid,
                sample.turn,
                sample.step,
                sample.branch,
                [sample],
            )
            for sample, value in sampled
        ]
        samples = [c.samples[0] for c in candidates]
        best = candidates[0]
        scores = None
        if num_candidates > 1:
            scores = [await self._score(agent, c) for c in candidates]
            best = candidates[max(range(num_candidates), key=lambda i: (scores[i], -i))]
            for sample, score in zip(samples, scores, strict=True):
                sample.local_reward = score
                self._scored.add(id(sample))
        best_sample = samples[best.branch]
        # the tool rounds' samples share the action's reward (``step``) and end with it
        samples = tool_samples + samples
        action = dataclasses.replace(best, samples=samples, scores=scores)
        if agent.config.multi_turn:
            transcript.add_response(
                best_sample.prompt_ids[len(transcript.ids) :] + best_sample.response_ids, best.text
            )
            self.transcripts[agent_name] = transcript
        self.samples.extend(samples)
        self.actions.append(action)
        if agent.config.memory_tokens > 0 or any(a.config.memory_tokens > 0 for a in self.agents.values()):
            entry_text = best.text.strip()
            self.memory.append(MemoryEntry(agent_name, entry_text, len(agent.tokenizer.encode(entry_text))))
        return action

    async def _tool_rounds(
        self,
        agent: Agent,
        transcript: ChatTranscript,
        sampled: list[tuple[Sample, object]],
        *,
        anchor: str,
        forced: ForcedCall | None = None,
    ) -> tuple[list[Sample], list[tuple[Sample, object]]]:
        """While the reply calls tools (at most ``max_tool_calls`` rounds): run them, append the reply
        and each result (a ``tool`` turn) to the transcript, sample again. Returns the tool-calling
        samples (valid: a call is a well-formed move) and the final reply. ``forced``: the first reply
        was made to call a tool (``agents.<a>.tool_choice``; its opening ends that reply's prompt ids)."""
        tool_samples = []
        for _ in range(agent.config.max_tool_calls):
            sample = sampled[0][0]
            text = forced.turn_text(sample.response_text) if forced is not None else sample.response_text
            calls = forced.calls(sample.response_text) if forced is not None else parse_tool_calls(text)[1]
            if not calls:
                break
            sample.valid = True
            tool_samples.append(sample)
            transcript.add_response(sample.prompt_ids[len(transcript.ids) :] + sample.response_ids, text)
            forced = None
            results = [call_tool(call, agent.tools) for call in calls]
            self.tool_calls[agent.role] = self.tool_calls.get(agent.role, 0) + len(results)
            errors = sum(result.startswith("error:") for result in results)
            self.tool_errors[agent.role] = self.tool_errors.get(agent.role, 0) + errors
            transcript.add_messages([{"role": "tool", "content": result} for result in results])
            if len(transcript.ids) > agent.config.max_prompt_tokens:
                raise EpisodeDropped("prompt_too_long")
            sampled = await self._sample(agent, list(transcript.ids), anchor=anchor, sampling=agent.sampling)
        return tool_samples, sampled

    async def _score(self, agent: Agent, candidate: Action) -> float:
        score = agent.local_reward(candidate, self.env)
        if score is None:
            score = await self._in_env(_score_env, candidate.agent, candidate.stripped(), mutates=False)
        if score is None:
            raise ConfigError(
                f"agents.{agent.role}.tree_k>1 needs a scorer: the agent's local_reward or the env's score() "
                f"for '{agent.role}' ({type(self.env).__name__} has none)"
            )
        return float(score)

    # -- env -------------------------------------------------------------------------------------

    async def _in_env(self, fn, agent: str, action: Action, *, mutates: bool):
        if not (self.env.remote_step and self.workers is not None):
            env, result = fn(self.env, agent, action)
        else:
            # A remote step returns a stepped *copy* of the env: two calls of one episode in flight at
            # once (agents acting concurrently) would each start from the same state and the later
            # would undo the earlier; the lock keeps them in call order, as inline calls are.
            async with self._env_lock:
                env, result = await self.workers.call(
                    fn, self.env, agent, action, timeout_s=self.step_timeout_s
                )
        if mutates:
            self.env = env
        return result

    async def step(self, agent_name: str, action: Action) -> StepResult:
        """Apply ``action`` to the env and record local rewards for its (non-tree) sample."""
        result = await self._in_env(_step_env, agent_name, action.stripped(), mutates=True)
        if result.invalid:  # the env rejected the move (illegal, masked out): same as a parse failure
            action.valid = False
            for sample in action.samples:
                if id(sample) not in self._scored:
                    sample.valid = False
        reward = self._agent(agent_name).local_reward(action, self.env)
        if reward is None:
            reward = result.local_reward
        if reward is not None:
            for sample in action.samples:
                if id(sample) not in self._scored:
                    self._step_rewards[id(sample)] = float(reward)
        return result

    async def turn(self, agent_name: str, observation: str | None = None) -> Action:
        """Observe (unless ``observation`` is given), act and step: one agent turn."""
        obs = self.env.observe(agent_name) if observation is None else observation
        action = await self.act(agent_name, obs)
        await self.step(agent_name, action)
        return action

    # -- end -------------------------------------------------------------------------------------

    def finalize(self) -> float:
        """Fill team and local rewards on every Sample; return the team reward."""
        if self.reported is not None:
            team, by_agent = self.reported
            for sample in self.samples:
                sample.team_reward, sample.local_reward = team, by_agent.get(sample.agent, 0.0)
            return team
        team = float(self.env.team_reward())
        for sample in self.samples:
            sample.team_reward = team
            if id(sample) in self._scored:
                continue
            local = self._step_rewards.get(id(sample))
            if local is None:
                local = self.env.agent_reward(sample.agent)
            sample.local_reward = float(local) if local is not None else 0.0
        return team


def _step_env(env: Env, agent: str, action: Action) -> tuple[Env, StepResult]:
    """Top-level (picklable) so env workers can run it; returns the stepped env."""
    return env, env.step(agent, action)


def _score_env(env: Env, agent: str, action: Action) -> tuple[Env, float | None]:
    return env, env.score(agent, action)
