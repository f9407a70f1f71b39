"""The GPU check kit on any machine (no CUDA needed; ``gpu_kit``, run by ``scripts/gpu_check.sh`` before
the tier): every module the tier imports -- at module level and inside its rank bodies, megamarl's and
the tests/ helpers -- and every module the rank fork server preloads for them imports with this Python. On the
GPU node (torch, transformers, peft, pytest, einops and the carried wheels; no aiohttp, no vLLM) a
missing package then fails here, by name, instead of halfway through a GPU test. The imports are read
from the tier's own sources, so a new import in a test is checked without a list to keep."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu_kit]

TESTS = Path(__file__).resolve().parents[1]
# the tier's own sources: its test modules and the tests/ helpers they import
SOURCES = sorted((TESTS / "gpu").glob("*.py")) + [
    TESTS / f for f in ("device_checker.py", "megatron_steps.py", "saved_storage.py")
]


def tier_imports() -> list[str]:
    """Every absolute module an import statement of the tier names (``from x import y``: ``x``)."""
    names: set[str] = set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
                names.add(node.module)
    return sorted(names)


def test_tier_sources_are_read():
    names = tier_imports()
    assert {"megamarl.rl.worker", "megamarl.rollout.weights.vllm_native_sync", "gpu_common"} <= set(names), (
        names
    )


def test_every_module_the_tier_and_its_ranks_import_imports_here():
    from train_runs import TRAIN_PRELOAD  # added by tests/conftest.py for the script runs, not the tier

    from megamarl.parallel.launch import RANK_PRELOAD

    modules = sorted(set(tier_imports()) | (set(RANK_PRELOAD) - set(TRAIN_PRELOAD)))
    probe = (
        "import importlib, sys, traceback\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(bool(failed))\n"
    )
    env_path = [str(TESTS / "gpu"), str(TESTS), *sys.path]
    env = {**os.environ, "PYTHONPATH": ":".join(p for p in env_path if p)}
    result = subprocess.run(
        [sys.executable, "-c", probe, *modules],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, f"{sys.executable} cannot import:\n{result.stdout}{result.stderr[-2000:]}"
