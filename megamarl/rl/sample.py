"""The one typed hand-off from rollout to training: a ``Sample`` is one agent call.

Orchestration produces ``Sample`` records (one per agent invocation, per tree-sampled candidate);
``megamarl.rl.batch`` collates them into a padded, agent-tagged ``SampleBatch``. Index columns
say where a sample came from, so advantage estimators can group by any of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    # --- index columns -------------------------------------------------------------------
    task_id: str  # the task instance; GRPO groups share it (several episodes per task)
    episode_id: str  # one rollout of the task
    agent: str  # the role that acted
    policy: str  # the trainable model (worker group) that produced the tokens
    turn: int  # index of this agent's invocation within the episode (0, 1, ...)
    branch: int = 0  # tree sampling: candidate index among K at this (task, agent, turn)
    weight_version: int = 0  # version of the policy weights that generated the response
    valid: bool = True  # the parser accepted the action (invalid-action penalty uses it)
    step: int = 0  # global env step index within the episode (all agents), for GiGPO/discounts
    # The episode's largest ``step`` when it finished (``mark_episode_ends``); None: not recorded. Lets
    # preparation tell an episode whose last step was removed (stale) from one that ended earlier.
    episode_last_step: int | None = None
    # --- tokens ------------------------------------------------------------------------------
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)  # one per response token
    # --- rewards -----------------------------------------------------------------------------
    team_reward: float = 0.0  # shared by every agent of the episode
    local_reward: float = 0.0  # this agent's own reward (e.g. verifier correctness)
    # GiGPO: the observation this step acted on, hashed/compared to form anchor-state groups.
    anchor: str | None = None
    # The token set sampling was restricted to (``SamplingParams.allowed_token_ids``), or None. The
    # trainer renormalises over the same set, so its logprobs are those of the policy that acted.
    allowed_token_ids: tuple[int, ...] | None = None
    # Sampling temperature; the trainer scales its logits the same way (1.0: none).
    temperature: float = 1.0
    # Filled in when the sample was truncated (max_tokens) rather than ending on EOS/stop.
    truncated: bool = False
    # Free-form text for logging/debugging only; never read by training code.
    response_text: str = ""

    def __post_init__(self) -> None:
        if self.rollout_logprobs and len(self.rollout_logprobs) != len(self.response_ids):
            raise ValueError(
                f"Sample(agent={self.agent!r}, episode={self.episode_id!r}): "
                f"{len(self.rollout_logprobs)} rollout_logprobs for {len(self.response_ids)} response tokens"
            )


def mark_episode_ends(samples: list[Sample]) -> None:
    """Stamp every sample with its episode's last step (``episode_last_step``), in place; call on an
    episode's samples as it finishes, before any of them can be removed."""
    last: dict[str, int] = {}
    for s in samples:
        last[s.episode_id] = max(last.get(s.episode_id, s.step), s.step)
    for s in samples:
        s.episode_last_step = last[s.episode_id]
