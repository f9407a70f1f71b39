"""How an update's micro-batch metrics become the step's: losses summed (each micro-batch's is already
normalised by the mini-batch's global counts), maxima maxed, everything else averaged weighted by the
micro-batch's response tokens (``RESPONSE_TOKENS``), so a step's metrics do not depend on how its rows
were cut into micro-batches (padded, packed, prefix tree); per optimizer step, the mean over a pass's
steps, with the non-finite counters summed (skips) or maxed (the streak). The rollout/training
mismatch is kept per agent (``AgentMismatch``): sums over the agent's rows on every DP rank, divided at
the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megamarl.rl.mismatch import mismatch_metrics

RESPONSE_TOKENS = "response_tokens"  # a micro-batch's weight in the step's means (not reported)
SUMMED = frozenset({"loss", "pg_loss", "kl_loss", "vf_loss"})


def summarise(collected: list[dict[str, float]], **extra: float) -> dict[str, float]:
    """Micro-batch metrics -> sums for losses (they are already globally normalised), maxima for
    ``*_max``, response-token-weighted means otherwise (unweighted when no micro-batch has any)."""
    if not collected:
        return dict(extra)
    keys = [k for k in collected[0] if k != RESPONSE_TOKENS]
    out = {}
    for key in keys:
        rows = [c for c in collected if key in c]
        if key in SUMMED:
            out[key] = sum(c[key] for c in rows)
        elif key.endswith("_max"):
            out[key] = max(c[key] for c in rows)
        else:
            weights = [c.get(RESPONSE_TOKENS, 1.0) for c in rows]
            total = sum(weights)
            out[key] = (
                sum(w * c[key] for w, c in zip(weights, rows, strict=True)) / total
                if total
                else average([c[key] for c in rows])
            )
    out.update(extra)
    return out


class AgentMismatch:
    """Per-agent sums of ``mismatch.mismatch_row_sums`` over an update's micro-batches -> the
    ``agent/<a>/mismatch_*`` metrics. With several epochs every pass adds the same rows again (the old
    log-probs are fixed), which leaves the ratios unchanged. ``gather``: every DP rank's object, in
    rank order (``parallel.collectives.all_gather_objects`` over the policy's DP group; collective):
    a rank sums only its own rows, so the ranks' sums are added before the ratios are taken, which
    makes the means token-weighted over the whole batch (None: one DP rank)."""

    def __init__(self, gather: Callable[[Any], list[Any]] | None = None) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.gather = gather

    def add(self, agents: list[str], rows: torch.Tensor) -> None:
        """``agents``: the row's agent of each of ``rows [B, 6]``."""
        for agent in sorted(set(agents)):
            index = torch.tensor([i for i, a in enumerate(agents) if a == agent], device=rows.device)
            total = rows.index_select(0, index).sum(0).detach()
            self.sums[agent] = total if agent not in self.sums else self.sums[agent] + total

    def metrics(self) -> dict[str, float]:
        """``agent/<a>/mismatch_*`` of every agent with response tokens (on every DP rank: the sums of
        all of them); then empty until the next ``add``."""
        summed = self.sums
        if self.gather is not None:  # an agent's rows may sit on some DP ranks only
            summed = {}
            for rank_sums in self.gather({agent: sums.cpu() for agent, sums in self.sums.items()}):
                for agent, sums in rank_sums.items():
                    summed[agent] = sums if agent not in summed else summed[agent] + sums
        out = {
            f"agent/{agent}/{key}": value
            for agent, sums in sorted(summed.items())
            if float(sums[0]) > 0
            for key, value in mismatch_metrics(sums).items()
        }
        self.sums = {}
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


def skipped_updates(
    metrics: dict[str, float], faults: dict[str, str], *, step: int, limit: int
) -> tuple[list[str], str]:
    """The step's skipped (non-finite) updates, one note each, and why the run stops ("" if it goes on):
    a policy ``limit`` (``trainer.max_nonfinite_updates``) skips in a row; no note after that one."""
    notes = []
    for name, fault in faults.items():
        streak = int(metrics.get(f"policy/{name}/nonfinite_streak", 0))
        notes.append(f"step {step}: skipped the update of '{name}' ({streak} in a row): {fault}")
        if streak >= limit:
            return notes, (
                f"{streak} non-finite updates in a row (trainer.max_nonfinite_updates={limit}); "
                f"last: {fault}; no NaN weights were applied or pushed"
            )
    return notes, ""
