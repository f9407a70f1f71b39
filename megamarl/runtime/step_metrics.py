"""Per-step statistics from the agent-tagged batch and the episodes (pure functions, no I/O).

The trainer logs what these return (docs/metrics.md is the table of every key):

* ``agent_batch_metrics``: per agent, the shaped reward's mean/std/min/max, the advantage's
  mean/std (over response tokens when advantages are per token; absent for critic estimators, whose
  advantages are computed on the workers), response length, the response-length clip ratio (share
  of replies cut by ``max_tokens``), invalid rate and sample count;
* ``success_metrics``: per agent its *own* success (``Env.agent_success``: a win in a competitive
  game; the team's success where the env defines none), and per policy the mean own success over
  the seats it played (with ``rollout.policy_mapping``: a self-play policy's win rate);
* ``throughput_metrics``: ``perf/train_tokens_per_s`` and ``perf/samples_per_s``;
  ``idle_seconds``: the part of ``timing_s/step`` outside its sections;
* ``peak_memory_gib``: this process's peak memory (CUDA allocator peak, else peak RSS).
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Mapping

import torch

from megamarl.rl.batch import SampleBatch

TOP_LEVEL_SECTIONS = ("rollout", "update", "weight_sync")  # timing_s/<section> that add up to a step


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


def throughput_metrics(*, num_train_tokens: int, update_s: float, num_samples: int, step_s: float) -> dict[str, float]:
    """``perf/train_tokens_per_s``: tokens the update processed per second of ``timing_s/update``;
    ``perf/samples_per_s``: the step's samples per second of ``timing_s/step`` (end to end)."""
    return {
        "perf/train_tokens_per_s": num_train_tokens / update_s if update_s > 0 else 0.0,
        "perf/samples_per_s": num_samples / step_s if step_s > 0 else 0.0,
    }


def idle_seconds(metrics: Mapping[str, float]) -> float:
    """``timing_s/step`` minus the top-level sections (rollout, update, weight_sync): time no
    section accounts for (planning and sending the batch, logging)."""
    sections = sum(metrics.get(f"timing_s/{name}", 0.0) for name in TOP_LEVEL_SECTIONS)
    return max(0.0, metrics["timing_s/step"] - sections)


def peak_memory_gib() -> float:
    """Peak memory of this process: ``torch.cuda.max_memory_allocated`` when it uses CUDA, else the
    peak resident set size (on CPU every worker group of the rank, and rank 0's engines, share it)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


def merge_rank_metrics(per_rank: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """One dict from every rank's metrics: peak and offloaded memory keys take the max over ranks (a
    worker group's peak is its fullest rank's); for other keys the last rank's value is kept."""
    merged: dict[str, float] = {}
    for metrics in per_rank:
        for key, value in metrics.items():
            if key.startswith(("perf/max_memory_gib/", "perf/offloaded_gib/")) and key in merged:
                value = max(value, merged[key])
            merged[key] = value
    return merged
