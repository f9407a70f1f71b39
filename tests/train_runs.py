"""``scripts/train.py`` on local ranks, for the integration tests that check a run from its outputs, and
checks shared by several of them.

``launch`` runs ``scripts/train.py`` exactly as ``torchrun --nproc_per_node N scripts/train.py ...``
does from the ranks' point of view (torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, OMP_NUM_THREADS=1 for N > 1; ``__main__`` is the script; one
rank's failure ends the others; exit codes), but each rank is a fork of a server that imported torch,
megatron-core, transformers and megamarl once per test worker (``megamarl.parallel.launch``). A rank's
start then costs ~0.1 CPU-s instead of 15-20 (measured on the 2-core CI machine: the imports were most
of a tiny run's CPU time). What only the real torchrun does (its agent, signal forwarding, its exit
codes, the README's command line) is tested through torchrun itself: test_readme_quickstart,
test_config_errors, test_front_door_torchrun, test_plugin_tutorial (docs/testing.md).

NO_PLOTS: a run of ``scripts/train.py`` started here gets ``logger.plots=false`` unless its arguments
set ``logger.plots``: drawing and saving the PNGs at the end of a run takes ~3.5 CPU-s (four figures),
and only test_tictactoe, the README's command and tests/unit/test_plot look at them.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

from megamarl.parallel.launch import rank_context, set_rank_environ
from megamarl.parallel.network import free_port

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"
# What a rank of scripts/train.py imports, loaded once in the fork server.
TRAIN_PRELOAD = ("megamarl.trainer", "megamarl.orchestration", "megamarl.runtime.plot", "matplotlib.pyplot")


def _rank_main(
    rank: int,
    nproc: int,
    port: int,
    script: str,
    argv: list[str],
    environ: dict[str, str],
    cwd: str,
    log: str,
) -> None:
    """One rank: torchrun's environment, output appended to ``log``, ``script`` run as ``__main__``."""
    os.setsid()  # its own process group: a timeout kills the rank and whatever it started
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    set_rank_environ(environ, rank, nproc, port)
    os.environ.update(
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(nproc),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID="megamarl-tests",
    )
    if nproc > 1 and "OMP_NUM_THREADS" not in environ:  # torchrun's default for several local ranks
        os.environ["OMP_NUM_THREADS"] = "1"
    # What a fresh interpreter would put first on sys.path: the script's directory, then PYTHONPATH.
    sys.path[:0] = [
        str(Path(script).parent),
        *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p),
    ]
    if os.environ.get("PYTHONWARNINGS"):  # read at interpreter start-up, which a fork skips
        import warnings

        warnings._processoptions(os.environ["PYTHONWARNINGS"].split(","))
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    sys.argv = [script, *argv]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed as a crashing script would
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # an interpreter's exit runs them; a multiprocessing child does not
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Ranks:
    """The ranks of one ``start``ed run: ``poll`` / ``wait`` like a ``subprocess.Popen`` of torchrun
    (the first failing rank's exit code; a rank that fails ends the others), ``kill`` like a node loss."""

    def __init__(self, procs: list, log: Path) -> None:
        self.procs, self.log = procs, log

    def poll(self) -> int | None:
        failed = next((p for p in self.procs if p.exitcode not in (None, 0)), None)
        if failed is not None:  # torchrun stops the others once one rank fails
            _signal(self.procs, signal.SIGTERM, grace_s=10)
            _signal(self.procs, signal.SIGKILL, grace_s=10)
            return failed.exitcode
        return None if any(p.is_alive() for p in self.procs) else 0

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(
                    f"still running after {timeout:.0f}s; log tail:\n"
                    f"{self.log.read_text(errors='replace')[-4000:]}"
                )
            time.sleep(0.1)
        return code

    def kill(self) -> None:
        """SIGKILL every rank's process group at once, like a node loss."""
        _signal(self.procs, signal.SIGKILL, grace_s=10)

    def send_signal(self, sig: int) -> None:
        """``sig`` to every rank's process group (SIGTERM: a scheduler's preemption notice)."""
        _signal(self.procs, sig, grace_s=0)


def start(
    argv: list[str],
    *,
    nproc: int,
    log: Path,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    script: Path = TRAIN,
) -> Ranks:
    """Start ``script argv`` on ``nproc`` local ranks (module docstring), every rank's output appended
    to ``log``; returns at once."""
    if Path(script) == TRAIN and not any(a.lstrip("+").startswith("logger.plots=") for a in argv):
        argv = [*argv, "logger.plots=false"]  # NO_PLOTS (module docstring)
    ctx = rank_context(TRAIN_PRELOAD)
    port = free_port()
    environ = {**os.environ, "CI": "true", **(env or {})}
    procs = [
        ctx.Process(
            target=_rank_main, args=(rank, nproc, port, str(script), list(argv), environ, str(cwd), str(log))
        )
        for rank in range(nproc)
    ]
    for proc in procs:
        proc.start()
    return Ranks(procs, log)


def launch(
    argv: list[str],
    *,
    nproc: int,
    log: Path,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    script: Path = TRAIN,
) -> int:
    """``start`` and wait: the exit code (0: every rank succeeded). Past ``timeout`` every rank is
    killed and ``TimeoutError`` raised."""
    return start(argv, nproc=nproc, log=log, env=env, cwd=cwd, script=script).wait(timeout)


def _signal(procs, sig: int, *, grace_s: float) -> None:
    """Send ``sig`` to every live rank's process group; wait up to ``grace_s`` for them to end."""
    for proc in procs:
        if proc.is_alive():
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
    end = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(end - time.monotonic(), 0.1))


def torchrun(
    argv: list[str],
    *,
    nproc: int = 1,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    script: Path = TRAIN,
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N script argv`` itself (a free rendezvous port), for
    the tests of what only torchrun does (module docstring); output captured as text."""
    command = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *argv,
    ]
    return subprocess.run(
        command,
        check=False,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train(
    config: Path,
    out: Path,
    *,
    nproc: int,
    timeout: int,
    env: dict[str, str] | None = None,
    overrides: tuple[str, ...] = (),
) -> tuple[Path, list[dict], str]:
    """Run ``config`` (with ``overrides``) on ``nproc`` local ranks (``launch``) with its outputs under
    ``out``. Returns the run directory (``out/<name>``: the config's stem unless ``name=`` is overridden), its
    metrics rows and the ranks' output; a failed run raises with the tails of that output and of every engine
    server's log."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "launch.log"
    rc = launch(
        ["--config", str(config), f"output_dir={out}", *overrides],
        nproc=nproc,
        log=log,
        timeout=timeout,
        env=env,
    )
    output = log.read_text(errors="replace")
    run_dir = out / next((o.split("=", 1)[1] for o in overrides if o.startswith("name=")), config.stem)
    if rc != 0:
        logs = sorted((run_dir / "engine_logs").glob("*.log")) if run_dir.exists() else []
        tails = "".join(f"\n--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in logs)
        raise AssertionError(f"train.py exited {rc}\n{_first_error(output)}{output[-12000:]}{tails}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, rows, output


def _first_error(output: str) -> str:
    """The first error the ranks printed (train.py's "training stopped: ..." or a traceback), shown
    before the output's tail: under server logs and the other ranks' c10d noise the tail alone may
    not reach it."""
    starts = [
        i
        for i in (output.find("training stopped:"), output.find("Traceback (most recent call last)"))
        if i >= 0
    ]
    return (
        f"--- first error in the output:\n{output[min(starts) : min(starts) + 4000]}\n--- tail:\n"
        if starts
        else ""
    )


def check_staleness(metrics: list[dict], max_staleness: int) -> None:
    """Every step's per-sample staleness (the histogram of every trained sample's weight version) is
    within ``max_staleness`` and covers every sample; the async metrics are logged."""
    for m in metrics:
        hist = {int(k.rsplit("/", 1)[1]): v for k, v in m.items() if k.startswith("async/staleness/")}
        assert hist and max(hist) <= max_staleness and m["async/staleness_max"] <= max_staleness, m
        assert sum(hist.values()) == m["rollout/num_samples"]  # every sample handed to the trainer
        # each agent's own histogram (async/agent/<role>/staleness/<lag>) adds up to the whole one
        per_agent: dict[int, float] = {}
        for key, value in m.items():
            if key.startswith("async/agent/") and "/staleness/" in key:
                lag = int(key.rsplit("/", 1)[1])
                per_agent[lag] = per_agent.get(lag, 0.0) + value
        assert per_agent == hist, (per_agent, hist)
        for key in (
            "async/rollout_idle_ratio",
            "async/trainer_idle_ratio",
            "async/weight_sync_bubble_s",
            "async/dropped_stale_groups",
            "rollout/total_dropped_stale_samples",
        ):
            assert key in m, key


def varies_between_runs(key: str) -> bool:
    """Metrics a resumed (or relaunched) run may log differently from an uninterrupted one: the
    machine's and the moment's (``megamarl.runtime.metrics.measured``: durations, rates, resident
    memory), the pushes (a resumed run's start-up push is its own) and every ratio."""
    from megamarl.runtime.metrics import measured

    return measured(key) or key.startswith("weight_sync/") or key.endswith("_ratio")
