"""Per-step statistics of the run's time and memory (pure functions, no I/O); those of the batch and
the episodes are ``megamarl.rl.batch_metrics``. The trainer logs what these return (docs/metrics.md
is the table of every key):

* ``throughput_metrics``: ``perf/train_tokens_per_s`` and ``perf/samples_per_s``;
  ``idle_seconds``: the part of ``timing_s/step`` outside its sections; ``step_end_metrics``: the
  step's time, its idle part and its throughput;
* ``peak_memory_gib``: this process's peak memory (CUDA allocator peak, else peak RSS);
* ``policy_update_metrics``: a worker's update metrics under its policy's keys.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Mapping

import torch

TOP_LEVEL_SECTIONS = ("rollout", "update", "weight_sync")  # timing_s/<section> that add up to a step


def throughput_metrics(
    *, num_train_tokens: int, update_s: float, num_samples: int, step_s: float
) -> dict[str, float]:
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


def step_end_metrics(metrics: Mapping[str, float], *, step_s: float, summary) -> dict[str, float]:
    """What a step's ``metrics`` gain at its end: ``timing_s/step``, ``timing_s/idle``, the throughputs
    (``summary``: the batch's, ``rl.dispatch.BatchSummary``)."""
    ended = {"timing_s/step": step_s}
    ended["timing_s/idle"] = idle_seconds({**metrics, **ended})
    update_s = metrics["timing_s/update"]
    ended.update(
        throughput_metrics(
            num_train_tokens=summary.num_train_tokens,
            update_s=update_s,
            num_samples=summary.num_samples,
            step_s=step_s,
        )
    )
    return ended


def peak_memory_gib() -> float:
    """Peak memory of this process: ``torch.cuda.max_memory_allocated`` when it uses CUDA, else the
    peak resident set size (on CPU every worker group of the rank, and rank 0's engines, share it)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


def policy_update_metrics(policy: str, values: Mapping[str, float]) -> dict[str, float]:
    """A worker's ``train_share`` metrics named for its policy: ``timing_s/<section>`` becomes
    ``timing_s/<policy>/<section>``, the throughput figures ``perf/<key>/<policy>``, the per-agent ones
    (``agent/<a>/...``) stay as they are, the rest ``policy/<policy>/<key>``."""
    metrics = {}
    for key, value in values.items():
        section = key.removeprefix("timing_s/")
        if key.startswith("agent/"):
            metrics[key] = value
        elif key in ("padding_fraction", "forwarded_tokens"):
            metrics[f"perf/{key}/{policy}"] = value
        else:
            metrics[f"timing_s/{policy}/{section}" if section != key else f"policy/{policy}/{key}"] = value
    return metrics


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
