"""Issue #31 item 3: a calculator tool on the math env, in a ``scripts/train.py`` run
(configs/math_calculator.yaml on one rank, one step, a tiny random model with SmolLM2's tokenizer and
chat template): every episode's first solver reply is a calculator call (``tool_choice``), the
orchestra runs it (a random expression is an ``error: ...`` result, counted), the result is the next
turn of the solver's token-exact transcript, and both replies are trained. The packaged SmolLM2 runs
the same config in docs/tools.md (it needs ~9 GB on one rank: too much beside CI's other worker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_runs import train  # tests/ helper

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
OPENING = '<tool_call>{"name": "calculator", "arguments": {"expression": "'


def test_math_calculator_config_calls_the_tool_in_a_run(tmp_path):
    run_dir, rows, _ = train(
        ROOT / "configs" / "math_calculator.yaml",
        tmp_path,
        nproc=1,
        timeout=420,
        overrides=(
            "policies.shared.model=tiny-random-llama",
            "policies.shared.dtype=fp32",
            "policies.shared.ranks=[0]",
            "policies.shared.engine={backend: hf, dtype: fp32}",
            "trainer.total_steps=1",
            "eval.num_tasks=0",
            "rollout.num_tasks=2",
            "rollout.group_size=4",
            "logger.episodes_per_step=8",
            "logger.progress=false",
        ),
    )
    [row] = rows
    episodes = [json.loads(line) for line in (run_dir / "episodes" / "step_1.jsonl").read_text().splitlines()]
    assert len(episodes) == 8 and row["rollout/num_failed"] == 0
    # every episode's solver opened with the call, the tool ran, and the solver answered after it
    solver = [[c for c in e["calls"] if c["agent"] == "solver"] for e in episodes]
    assert all(
        len(calls) == 2 and calls[0]["prompt"].endswith("<|im_start|>assistant\n" + OPENING)
        for calls in solver
    )
    assert row["agent/solver/tool_calls"] == 8 and 0 <= row["agent/solver/tool_errors"] <= 8
    for call, answer in solver:  # the tool's result is the answer's last turn; the answer is turn 1
        assert (call["turn"], answer["turn"]) == (0, 1)
        assert answer["prompt"].startswith(call["prompt"] + call["response"])
        assert "<|im_start|>tool\n" in answer["prompt"][len(call["prompt"]) :]
    # the trained batch holds both the calls and the answers (AT-GRPO groups them by turn)
    assert row["agent/solver/num_samples"] == sum(len(calls) for calls in solver)
    assert (
        "policy/shared/grad_norm" in row
    )  # the update ran (a random model earns no reward: zero advantages)
