"""Two LLM policies train on PettingZoo tic-tac-toe against each other (configs/tictactoe.yaml, tiny
random models, hf engines) through ``scripts/train.py`` under torchrun, 2 steps; the same run checks
that docs/metrics.md documents exactly the keys a run writes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from train_runs import train  # tests/ helper

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tictactoe.yaml"
METRICS_DOC = ROOT / "docs" / "metrics.md"
NUM_STEPS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    pytest.importorskip("pygame")  # pettingzoo.classic needs it (the pettingzoo extra installs it)
    out = tmp_path_factory.mktemp("tictactoe")
    run_dir, _, _ = train(
        CONFIG,
        out,
        nproc=1,
        timeout=600,
        env={"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"},
        overrides=(
            "name=run",
            f"trainer.total_steps={NUM_STEPS}",
            "logger.progress=false",
            "logger.plots=true",
        ),
    )
    return run_dir


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _evals(run: Path) -> list[dict]:
    return json.loads((run / "eval.json").read_text())


def test_self_play_trains_both_policies_on_their_own_moves(run):
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for policy in ("alpha", "beta"):
            assert row[f"policy/{policy}/grad_norm"] > 0  # both policies trained every step
            assert row[f"weight_sync/{policy}/bytes"] > 0
        # competitive scoring: no team reward; exactly one winner per decisive game, so the seats'
        # win rates (and the policies', each playing one seat per game) add up to the decisive rate
        assert row["rollout/team_reward_mean"] == 0.0
        seats = row["agent/player_1/success"] + row["agent/player_2/success"]
        assert seats == pytest.approx(row["rollout/success_rate"])
        assert row["policy/alpha/success"] + row["policy/beta/success"] == pytest.approx(
            row["rollout/success_rate"]
        )
        # (the seats may win equally often: 0.5 and 0.5 of a step's games is a legal outcome, seen at 06fd11e)
        # illegal moves forfeit (-1) and are counted; every reply is one constrained token
        for seat in ("player_1", "player_2"):
            assert row[f"agent/{seat}/reward_min"] == -1.0
            assert row[f"agent/{seat}/response_len"] == 1.0
            assert 0 < row[f"agent/{seat}/invalid_rate"] < 1
    evals = _evals(run)
    assert [e["step"] for e in evals] == [0, NUM_STEPS]
    assert {"agent/player_1/success", "policy/alpha/success"} <= set(evals[-1]["results"])
    assert {p.name for p in (run / "plots").iterdir()} >= {"rewards.png", "eval.png", "timing.png"}


# ---- docs/metrics.md is the table of every key ----------------------------------------------------
def _documented() -> list[tuple[str, str]]:
    """(key, when) for every row of the key table."""
    rows = re.findall(r"^\| `([^`]+)` \| .* \| ([^|]+) \|$", METRICS_DOC.read_text(), re.MULTILINE)
    assert len(rows) > 50
    return [(key, when.strip()) for key, when in rows]


def _pattern(key: str) -> re.Pattern:
    return re.compile("^" + re.sub(r"<[a-z]+>", "[^/]+", re.escape(key)) + "$")


def test_every_emitted_key_is_documented_and_every_documented_key_emitted(run):
    documented = _documented()
    patterns = [(key, when, _pattern(key)) for key, when in documented]
    emitted = {k for row in _rows(run) for k in row}
    emitted |= {"eval/" + k for entry in _evals(run) for k in entry["results"]}
    undocumented = sorted(k for k in emitted if not any(p.match(k) for _, _, p in patterns))
    assert not undocumented, f"keys written by the run but missing from docs/metrics.md: {undocumented}"
    always = [(key, p) for key, when, p in patterns if when in ("step", "eval")]
    missing = sorted(key for key, p in always if not any(p.match(k) for k in emitted))
    assert not missing, f"docs/metrics.md lists these as always written, the run wrote none: {missing}"
