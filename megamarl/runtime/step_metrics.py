"""Per-step statistics of the run's time and memory (pure functions but for reading this process's
memory from ``/proc``); those of the batch and
the episodes are ``megamarl.rl.batch_metrics``. The trainer logs what these return (docs/metrics.md
is the table of every key):

* ``throughput_metrics``: ``perf/train_tokens_per_s`` and ``perf/samples_per_s``;
  ``idle_seconds``: the part of ``timing_s/step`` outside its sections; ``step_end_metrics``: the
  step's time, its idle part and its throughput;
* ``ResidentMemory``: this rank's resident memory now and its peak in the step (``memory/...``), and
  its peak memory of the run (``perf/max_memory_gib/<policy>``: CUDA allocator peak, else peak RSS);
* ``policy_update_metrics``: a worker's update metrics under its policy's keys.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

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


class ResidentMemory:
    """This process's memory step by step. Each ``step_metrics`` call reads the resident set now
    (``VmRSS``) and its peak since the previous call (``VmHWM``), then resets that peak
    (``clear_refs``; the kernel's high-water mark and ``ru_maxrss`` restart from the current RSS), so
    a step's peak is the step's own, and keeps the run's peak. ``proc``: the ``/proc/<pid>`` to read
    (a test points it at a directory of its own); where it cannot be read (not Linux) only the
    run's peak is reported, from ``ru_maxrss``."""

    def __init__(self, proc: str | Path = "/proc/self") -> None:
        self.proc = Path(proc)
        self.run_peak = 0  # bytes, over every window read so far

    def _read(self) -> tuple[int, int] | None:
        """(VmRSS, VmHWM) in bytes, or None."""
        fields = {}
        try:
            for line in (self.proc / "status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0]) * 1024  # kB
        except (OSError, ValueError, IndexError):
            return None
        return (fields["VmRSS"], fields["VmHWM"]) if len(fields) == 2 else None

    def step_metrics(self, rank: int, *, policies: Iterable[str]) -> dict[str, float]:
        """``memory/rss_gib/rank<rank>``, ``memory/peak_rss_gib/rank<rank>`` (GiB; this window's) and
        ``perf/max_memory_gib/<policy>`` for each of ``policies`` (the run's peak so far)."""
        metrics = {}
        read = self._read()
        if read is not None:
            rss, window_peak = read
            self.run_peak = max(self.run_peak, window_peak)
            metrics[f"memory/rss_gib/rank{rank}"] = rss / 2**30
            metrics[f"memory/peak_rss_gib/rank{rank}"] = window_peak / 2**30
            try:
                (self.proc / "clear_refs").write_text("5")  # 5: reset the peak resident set size
            except OSError:
                pass  # the next window's peak is then the run's
        peak = self.peak_gib()
        metrics.update({f"perf/max_memory_gib/{policy}": peak for policy in policies})
        return metrics

    def peak_gib(self) -> float:
        """The run's peak memory: ``torch.cuda.max_memory_allocated`` when this process uses CUDA, else
        its peak resident set (on CPU every worker group of the rank, and rank 0's engines, share it)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.max_memory_allocated() / 2**30
        if self.proc != Path("/proc/self"):  # another process's /proc (a test's): its windows only
            return self.run_peak / 2**30
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        peak = peak if sys.platform == "darwin" else peak * 1024
        return max(peak, self.run_peak) / 2**30


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
