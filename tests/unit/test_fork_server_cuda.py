"""Ranks are forks of a fork server that imported ``RANK_PRELOAD`` (``megamarl.parallel.launch``; the
trainer's script runs add ``tests/train_runs.TRAIN_PRELOAD``). On a CUDA host, a fork of a process that
touched CUDA cannot use it ("Cannot re-initialize CUDA in forked subprocess"), and torch counts even a
device-count query (``torch.cuda.is_available``) as touching it. So the preloads must not call CUDA at
import: here every torch.cuda entry point that queries or initialises the driver is counted while a
fresh interpreter imports them, as the fork server does, and none may be called."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, sys
import torch
import torch.cuda

calls = []
NAMES = ["is_available", "device_count", "current_device", "init", "_lazy_init", "set_device", "get_device_name",
         "get_device_properties", "get_device_capability", "mem_get_info", "is_bf16_supported", "synchronize",
         "empty_cache", "memory_allocated", "max_memory_allocated"]
for name in NAMES:
    real = getattr(torch.cuda, name)
    def counted(*args, _name=name, _real=real, **kwargs):
        calls.append(_name)
        return _real(*args, **kwargs)
    setattr(torch.cuda, name, counted)
for name in ("_cuda_getDeviceCount", "_cuda_init"):
    if hasattr(torch._C, name):
        real = getattr(torch._C, name)
        setattr(torch._C, name, lambda *a, _name=name, _real=real, **k: (calls.append(_name), _real(*a, **k))[1])

from megamarl.parallel.launch import RANK_PRELOAD
from train_runs import TRAIN_PRELOAD
failed = {}
for module in [*RANK_PRELOAD, *TRAIN_PRELOAD]:
    try:
        __import__(module)
    except ImportError as exc:  # the fork server skips a preload it cannot import, as here
        failed[module] = str(exc)
at_import = list(calls)
torch.cuda.is_available()  # the probe's own control: a call is seen
print(json.dumps({"calls": at_import, "control": calls[len(at_import):], "initialized": torch.cuda.is_initialized(),
                  "failed": failed, "modules": [*RANK_PRELOAD, *TRAIN_PRELOAD]}))
"""  # noqa: E501 - the embedded program keeps its own layout


def test_fork_server_preloads_never_query_or_initialise_cuda():
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=TESTS.parent,
        env={**os.environ, "PYTHONPATH": f"{TESTS}:{TESTS.parent}"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"megatron.core", "megamarl.rl.worker", "megamarl.trainer"} <= set(got["modules"]), got["modules"]
    assert got["failed"] == {}, got["failed"]
    assert "is_available" in got["control"], got  # the counters see a call
    assert got["calls"] == [] and not got["initialized"], (
        f"CUDA touched at import by the fork server's preloads: {got}"
    )
