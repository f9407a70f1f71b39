"""When the run evaluates and whether an evaluation stops it (``eval.every``, ``eval.stop_at``).

Collective: the driver evaluates (``RolloutDriver.evaluate``: the held-out tasks, eval.json) while the
other ranks serve its engines and wait. After a training step (not the last), every rank learns
whether every ``eval.stop_at`` metric reached its threshold: then the run saves and ends there.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megamarl.config import EvalConfig
from megamarl.parallel.distributed import control_group, wait_for_driver

DRIVER = 0


def is_due(cfg: EvalConfig, step: int, *, total_steps: int) -> bool:
    return (cfg.every > 0 and step % cfg.every == 0) or step == total_steps


def eval_steps(cfg: EvalConfig, *, total_steps: int) -> frozenset[int]:
    """The training steps after which the run evaluates (none with ``eval.num_tasks`` 0): what the
    progress's ETA prices besides the steps."""
    if cfg.num_tasks <= 0:
        return frozenset()
    return frozenset(s for s in range(1, total_steps + 1) if is_due(cfg, s, total_steps=total_steps))


class Evaluator:
    def __init__(self, cfg: EvalConfig, *, total_steps: int, driver: Any, timeout_s: float) -> None:
        """``driver``: the rollout driver on rank 0, None elsewhere; ``timeout_s``: how long the
        other ranks wait for it."""
        self.cfg, self.total_steps, self.driver, self.timeout_s = cfg, total_steps, driver, timeout_s

    def due(self, step: int) -> bool:
        """After a training step: every ``eval.every`` steps, and after the last."""
        return is_due(self.cfg, step, total_steps=self.total_steps)

    def evaluate(self, step: int) -> dict[str, float]:
        """One evaluation labelled ``step``: the results on the driver, {} elsewhere."""
        results = self.driver.evaluate(step) if self.driver is not None else {}
        wait_for_driver(f"the evaluation at step {step}", driver=DRIVER, timeout_s=self.timeout_s)
        return results

    def stop_reason(self, step: int) -> str:
        """Evaluate (when ``eval.num_tasks`` > 0); after a training step that is not the last, why
        ``eval.stop_at`` stops the run (the same on every rank), or ""."""
        if self.cfg.num_tasks <= 0:
            return ""
        results, stop_at = self.evaluate(step), self.cfg.stop_at
        if not stop_at or step == 0 or step >= self.total_steps:
            return ""  # not before training, and the last step ends the run anyway
        reached = self.driver is not None and all(
            results.get(k, float("-inf")) >= v for k, v in stop_at.items()
        )
        reason = [", ".join(f"{k}={results[k]:.3f} >= {v}" for k, v in stop_at.items()) if reached else ""]
        dist.broadcast_object_list(reason, src=DRIVER, group=control_group())
        return f"eval.stop_at reached ({reason[0]})" if reason[0] else ""
