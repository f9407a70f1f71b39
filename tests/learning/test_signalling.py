"""The learning test of the whole RL path (sample -> advantage -> loss -> update -> weight sync):
two agents of a tiny model play the signalling game and go from chance (~10%) to >= 90% team
success with AT-GRPO, in every trainer mode, within the config's 100 steps. Eval runs every 10 steps
and ``eval.stop_at`` ends a run at the first eval that reaches 90% (step 50-60 in our runs), so each
run costs what learning took, and the stop itself (checkpoint, exit 0, a resume that trains nothing
more) is checked on the way. The curve is printed to the test log.

The same runs check each mode's staleness on one rank (these were separate 3-step runs in
tests/integration/test_async_modes.py): every trained sample within trainer.max_staleness (1), sync
always on-policy, one_step_off on-policy at step 1 and exactly one version behind from then on, the
off-policy correction's (TIS) metrics logged in the async modes, and the rollout/training mismatch
per agent: ~0 in sync, real (KL > 100x step 1's) in one_step_off from step 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_runs import check_staleness, train  # tests/ helper

pytestmark = [pytest.mark.learning, pytest.mark.slow, pytest.mark.timeout(1260)]  # the run's own 1200 s bound

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "signalling_tiny.yaml"
TOTAL_STEPS, TARGET = 100, 0.9
STOP = ("eval.every=10", f"eval.stop_at.team_accuracy={TARGET}")


def run_signalling(run_dir: Path, mode: str, *overrides: str) -> tuple[list[dict], list[dict]]:
    """Train ``configs/signalling_tiny.yaml`` in ``mode`` (one rank); return (metrics rows, eval rows)."""
    run, rows, log = train(
        CONFIG,
        run_dir,
        nproc=1,
        timeout=1200,
        overrides=("name=run", f"trainer.mode={mode}", "logger.progress=false", *STOP, *overrides),
    )
    return rows, json.loads((run / "eval.json").read_text()), log


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_signalling_game_learns_to_90_percent(tmp_path, mode):
    metrics, evals, log = run_signalling(tmp_path, mode)
    curve = [(e["step"], e["results"]["team_accuracy"]) for e in evals]
    rollout = [
        (m["step"], round(m["rollout/success_rate"], 3)) for m in metrics if "rollout/success_rate" in m
    ]
    print(f"\n[{mode}] held-out team accuracy (greedy) by step: {curve}")
    print(f"[{mode}] training success rate by step: {rollout}")
    first_steps = [s for _, s in rollout[:3]]
    assert sum(first_steps) / len(first_steps) <= 0.2, rollout[:3]  # starts at chance (~10%)
    assert curve[-1][1] >= TARGET, curve
    assert all(acc < TARGET for _, acc in curve[1:-1]), curve  # stopped at the first eval that reached it
    last = curve[-1][0]
    if last < TOTAL_STEPS:  # stopped early: checkpointed there, and a resume trains nothing more
        assert f"stopping at step {last}: eval.stop_at reached (team_accuracy=" in log, log[-2000:]
        assert (tmp_path / "run" / "checkpoints" / f"step_{last:06d}" / "COMPLETE").is_file()
        if mode == "sync":
            again, _, resumed = run_signalling(tmp_path, mode, "trainer.resume=auto")
            assert f"resumed a run that stopped at step {last}: eval.stop_at reached" in resumed, resumed[
                -2000:
            ]
            assert again == metrics  # no step trained, nothing logged again

    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    check_staleness(metrics, max_staleness=1)
    lags = [m["async/staleness_mean"] for m in metrics]
    if mode == "sync":
        assert set(lags) == {0.0}
    if mode == "one_step_off":
        assert lags[0] == 0.0 and set(lags[1:]) == {1.0}  # the first batch is on-policy, then one version off
    if mode != "sync":  # off-policy correction on (token truncation at 2 by default), with its metrics
        assert all(
            "policy/shared/tis_weight_mean" in m and "policy/shared/tis_clip_frac" in m for m in metrics
        )
    check_mismatch(metrics, mode)


def check_mismatch(metrics: list[dict], mode: str) -> None:
    """The rollout/training mismatch per agent (agent/<a>/mismatch_*): ~0 on-policy (the hf engine and
    the trainer both fp32), real once the rollout lags. The default correction only truncates, so
    nothing is masked or rejected (tests/integration/test_async_modes.py rejects)."""
    for agent in ("sender", "receiver"):
        kl = [m[f"agent/{agent}/mismatch_kl"] for m in metrics]
        ppl = [m[f"agent/{agent}/mismatch_ppl_ratio"] for m in metrics]
        dropped = {m[f"agent/{agent}/mismatch_{k}_frac"] for m in metrics for k in ("masked", "rejected")}
        print(f"[{mode}] {agent} mismatch kl (k3) by step: {[round(x, 5) for x in kl]}")
        print(f"[{mode}] {agent} train/rollout ppl ratio by step: {[round(x, 4) for x in ppl]}")
        assert all(x >= 0 for x in kl) and all(p > 0 for p in ppl) and dropped == {0.0}
        if mode == "sync":
            assert max(kl) < 1e-4 and all(abs(p - 1) < 1e-2 for p in ppl)
        if mode == "one_step_off":
            assert kl[0] < 1e-4  # the first batch is on-policy
            assert sum(kl[1:]) / len(kl[1:]) > 100 * max(kl[0], 1e-7)  # then sampled one version behind
