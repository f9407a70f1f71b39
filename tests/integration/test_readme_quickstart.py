"""The README's first command, run as a new user would: from the repo root, with an empty model cache
(``MEGAMARL_CACHE`` pointing at a new directory, so both ranks race to prepare the packaged model),
2 ranks under torchrun, and a tiny budget appended as overrides. The command line itself is read
from README.md, so the test fails when the README and the code drift apart."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(1560),
]  # the run's own 1500 s bound, not the suite's 600 s default

ROOT = Path(__file__).resolve().parents[2]
BUDGET = ["trainer.total_steps=1", "eval.num_tasks=8", "rollout.num_tasks=2", "rollout.group_size=4"]


def readme_main_command() -> str:
    """The quickstart's first command (install + train) exactly as the README prints it."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart.*?```bash\n(.*?)```", text, re.DOTALL).group(1)
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    main = commands[0]
    assert "scripts/train.py" in main and "torchrun" in main, main
    return main


def test_readme_main_command_on_an_empty_cache(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MEGAMARL_", "VLLM_"))}
    env.update(MEGAMARL_CACHE=str(cache), PYTHONUNBUFFERED="1")
    command = " ".join([readme_main_command(), *BUDGET, f"output_dir={out}"])
    proc = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500, check=False
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    run = out / "quickstart_cpu"
    evals = json.loads((run / "eval.json").read_text())
    assert [e["step"] for e in evals] == [0, 1] and all(
        0.0 <= e["results"]["team_accuracy"] <= 1.0 for e in evals
    )
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["perf/rollout_tokens_per_s"] > 0
    assert sorted(p.name for p in (run / "plots").glob("*.png")), "no PNG curves written"
    # progress without a terminal: one plain line per phase
    for line in (
        "[megamarl] model preparation: 1/1 policies",
        "[megamarl] step 1/1 rollout: 8/8 episodes",
        "[megamarl] step 1/1 train:",
        "[megamarl] eval at step 0: 8/8 episodes",
    ):
        assert line in log, line
    assert "Transformer Engine and Apex are not installed" not in log
    assert (cache / "models" / "smollm2-135m-instruct" / ".megamarl-complete").is_file()
