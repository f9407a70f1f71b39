"""Per-step statistics of the agent-tagged batch and the finished episodes (pure functions, no I/O).

* ``agent_batch_metrics``: per agent, the shaped reward's mean/std/min/max, the advantage's
  mean/std (over response tokens when advantages are per token; absent for critic estimators, whose
  advantages are computed on the workers), response length, the response-length clip ratio (share
  of replies cut by ``max_tokens``), invalid rate and sample count;
* ``success_metrics``: per agent its *own* success (``Env.agent_success``: a win in a competitive
  game; the team's success where the env defines none), and per policy the mean own success over
  the seats it played (with ``rollout.policy_mapping``: a self-play policy's win rate).

docs/metrics.md is the table of every key; the time and memory statistics are
``megamarl.runtime.step_metrics``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megamarl.rl.batch import SampleBatch


def agent_batch_metrics(batch: SampleBatch) -> dict[str, float]:
    out: dict[str, float] = {}
    names = batch.names("agent")
    response_len = batch.response_mask.sum(1).float()  # [B]
    for agent in sorted(set(names)):
        rows = torch.tensor([n == agent for n in names])
        rewards = batch.rewards[rows].float()
        prefix = f"agent/{agent}"
        out[f"{prefix}/reward_mean"] = float(rewards.mean())
        out[f"{prefix}/reward_std"] = float(rewards.std(unbiased=False))
        out[f"{prefix}/reward_min"] = float(rewards.min())
        out[f"{prefix}/reward_max"] = float(rewards.max())
        if batch.advantages is not None:
            adv = batch.advantages[rows]
            if adv.dim() == 2:  # per token: the response tokens only
                adv = adv[batch.response_mask[rows]]
            out[f"{prefix}/advantage_mean"] = float(adv.float().mean())
            out[f"{prefix}/advantage_std"] = float(adv.float().std(unbiased=False))
        out[f"{prefix}/response_len"] = float(response_len[rows].mean())
        out[f"{prefix}/response_clip_ratio"] = float(batch.truncated[rows].float().mean())
        out[f"{prefix}/invalid_rate"] = float((~batch.valid[rows]).float().mean())
        out[f"{prefix}/num_samples"] = float(rows.sum())
    return out


def success_metrics(episodes: Iterable) -> dict[str, float]:
    """``agent/<a>/success`` and ``policy/<p>/success`` over finished episodes (``EpisodeStats``
    with ``agent_success`` and ``policies`` filled for every agent)."""
    by_agent: dict[str, list[bool]] = {}
    by_policy: dict[str, list[bool]] = {}
    for episode in episodes:
        for agent, success in episode.agent_success.items():
            by_agent.setdefault(agent, []).append(success)
            by_policy.setdefault(episode.policies[agent], []).append(success)
    out = {f"agent/{a}/success": sum(v) / len(v) for a, v in sorted(by_agent.items())}
    out.update({f"policy/{p}/success": sum(v) / len(v) for p, v in sorted(by_policy.items())})
    return out
