"""How an update's micro-batch metrics become the step's: losses summed (each micro-batch's is already
normalised by the mini-batch's global counts), everything else averaged; per optimizer step, the mean
over a pass's steps, with the non-finite counters summed (skips) or maxed (the streak)."""

from __future__ import annotations


def summarise(collected: list[dict[str, float]], **extra: float) -> dict[str, float]:
    """Micro-batch metrics -> sums for losses (they are already globally normalised), means otherwise."""
    if not collected:
        return dict(extra)
    keys = collected[0].keys()
    summed = {"loss", "pg_loss", "kl_loss", "vf_loss"}
    out = {k: (sum if k in summed else average)([c[k] for c in collected if k in c]) for k in keys}
    out.update(extra)
    return out


def mean_over_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """Per-optimizer-step metrics (the last epoch's) -> their mean; ``nonfinite_*`` summed."""
    if not steps:
        return {}
    keys = {k for step in steps for k in step}
    out = {k: average([step[k] for step in steps if k in step]) for k in keys}
    for key in ("nonfinite_skipped",):
        if key in out:
            out[key] = sum(step.get(key, 0.0) for step in steps)
    if "nonfinite_streak" in out:
        out["nonfinite_streak"] = max(step.get("nonfinite_streak", 0.0) for step in steps)
    return out


def average(values: list[float]) -> float:
    return sum(values) / len(values)
