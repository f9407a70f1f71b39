"""A real SGLang server (CPU, ``.venv-sglang``) started by a rank that a real ``torchrun`` launched.

torchrun gives its workers ``TORCHELASTIC_USE_AGENT_STORE=True`` (and RANK, WORLD_SIZE, MASTER_*,
LOCAL_RANK, TORCHELASTIC_*). A server inheriting them forms its own one-process world over a ``tcp://``
rendezvous, and with the agent-store variable torch's rendezvous dials a store instead of hosting one:
nothing listens there, so the server never answers ``/health``. The ranks ``run_ranks`` forks do not
set that variable, so only a real torchrun shows it. One tiny server, one generation; this file is
also the rank's script (``torchrun <this file> <out> <log dir>``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
MODEL = "tiny-plain-llama"
START_TIMEOUT_S = 420  # a healthy start takes ~80-150 s on the 2-core CI machine


def _rank_main(out: Path, log_dir: Path, timeout_s: float) -> None:
    from megamarl.models.packaged import resolve_model_path
    from megamarl.rollout.engines.base import SamplingParams
    from megamarl.rollout.engines.sglang import SGLangClient
    from megamarl.rollout.servers.server_launch import ServerProcess, ServerSpec, sglang_venv_python

    assert os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the condition under test
    proc = ServerProcess(
        ServerSpec(
            policy="p",
            replica=0,
            rank=int(os.environ["RANK"]),
            backend="sglang",
            model_path=str(resolve_model_path(MODEL, key="test")),
            dtype="fp32",
            max_num_seqs=2,
            max_model_len=128,
            kv_cache_gib=2**-6,
            num_threads=1,
            seed=0,
            log_path=log_dir / "server.log",
            python=str(sglang_venv_python()),
            on_gpu=False,
        )
    )
    try:
        url = proc.start(timeout_s=timeout_s)
        (gen,) = asyncio.run(
            SGLangClient(url).generate([1, 17, 42], SamplingParams(temperature=0.0, max_tokens=4))
        )
        out.write_text(json.dumps({"tokens": gen.token_ids}))
    finally:
        proc.stop()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sglang_server_started_under_torchrun_forms_its_world_and_generates(tmp_path):
    from megamarl.parallel.network import free_port
    from megamarl.rollout.servers.server_launch import sglang_venv_python

    if not os.access(sglang_venv_python(), os.X_OK):
        pytest.skip(
            f"no real SGLang: {sglang_venv_python()} missing (bash scripts/setup.sh --extras sglang-cpu)"
        )
    out = tmp_path / "out.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.run(
        [
            str(TORCHRUN),
            "--nproc-per-node",
            "1",
            "--master-port",
            str(free_port("127.0.0.1")),
            __file__,
            str(out),
            str(tmp_path),
            str(START_TIMEOUT_S),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S + 300,
        check=False,
    )
    log = (tmp_path / "server.log").read_text(errors="replace") if (tmp_path / "server.log").exists() else ""
    errors = [line for line in proc.stderr.splitlines() if "Error" in line][
        -10:
    ]  # the rank's, then torchrun's
    progress = [line for line in log.splitlines() if line.startswith("[") and "server_args=" not in line][
        -15:
    ]
    assert proc.returncode == 0, "\n".join([*errors, "--- server log ---", *progress])
    assert len(json.loads(out.read_text())["tokens"]) > 0


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]))
