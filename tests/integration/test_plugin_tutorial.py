"""docs/tutorial_plugin.md is true: its code is examples/pair_sum/ verbatim, and that plugin trains 2
steps under torchrun launched from a directory that is neither the repository nor the plugin's,
with no PYTHONPATH to the plugin (``plugin_paths`` relative to the config file finds it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from train_runs import torchrun  # tests/ helper

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pair_sum"
CONFIG = EXAMPLE / "pair_sum.yaml"


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))  # megamarl only, not examples/


def test_tutorial_code_is_the_example_verbatim():
    text = (ROOT / "docs" / "tutorial_plugin.md").read_text()
    blocks = re.findall(r"```(python|yaml)\n(.*?)```", text, flags=re.DOTALL)
    assert [body for lang, body in blocks if lang == "python"] == [(EXAMPLE / "pair_sum.py").read_text()]
    assert [body for lang, body in blocks if lang == "yaml"] == [CONFIG.read_text()]


def test_a_plugin_that_is_not_found_is_one_line_naming_plugin_paths(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(CONFIG), "plugin_paths=[]"],
        check=False,
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    expected = (
        f"config error: plugins: module 'pair_sum' not found on plugin_paths [] or in the working "
        f"directory {tmp_path}; set plugin_paths (relative to the config file's directory)"
    )
    assert proc.stderr.strip().splitlines() == [expected]


@pytest.mark.integration
@pytest.mark.slow
def test_the_plugin_trains_under_torchrun_from_another_directory(tmp_path):
    proc = torchrun(
        ["--config", str(CONFIG)], cwd=tmp_path, env=_env()
    )  # the real torchrun, another directory
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "pair_sum"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert {"agent/proposer/reward_mean", "agent/finisher/reward_mean"} <= steps[-1].keys()
    assert f"- {EXAMPLE}" in (run / "config.yaml").read_text()  # plugin_paths saved absolute
    assert (run / "checkpoints" / "step_000002" / "COMPLETE").is_file()


# the tutorial's "Mistakes and their messages" rows, in order: the overrides that make each mistake
# ("BROKEN": plugin_paths towards a pair_sum.py that raises on import; first, before the real module
# is imported in the checking process)
MISTAKES = (
    ["plugin_paths=[]"],
    ["plugin_paths=[BROKEN]"],
    ["env.name=pair_summ"],
    ["+env.kwargs.max_targets=9"],
    ["+agents.judge={policy: shared}"],
    ["+agents.judge={policy: shared, kind: judg}"],
)
_CHECK = """
import json, sys
from megamarl.cli.configure import load_config
from megamarl.cli.front_door import config_error_line
lines = []
for overrides in json.loads(sys.argv[2]):
    try:
        load_config(sys.argv[1], overrides)
        lines.append("(loaded)")
    except (ValueError, ImportError) as exc:
        lines.append("config error: " + config_error_line(exc))
print(json.dumps(lines))
"""


def test_the_mistakes_table_is_what_loading_says(tmp_path):
    """Each row of the tutorial's mistakes table is the one line ``--check`` and start-up print
    (``config_error_line``, as ``report_config_error`` writes it), at load time: ``[...]`` and ``...``
    in the table stand for any text."""
    text = (ROOT / "docs" / "tutorial_plugin.md").read_text()
    table = text.split("Mistakes and their messages", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| .*? \| `(config error: .*)` \|$", table, flags=re.MULTILINE)
    assert len(rows) == len(MISTAKES), rows
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "pair_sum.py").write_text("raise RuntimeError('a plugin that fails on import')\n")
    overrides = [[o.replace("BROKEN", str(broken)) for o in row] for row in MISTAKES]
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK, str(CONFIG), json.dumps(overrides)],
        check=True,
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    for row, line in zip(rows, said, strict=True):
        pattern = ".*".join(re.escape(part) for part in re.split(r"\[\.\.\.\]|\.\.\.", row))
        assert re.fullmatch(pattern, line), (row, line)
