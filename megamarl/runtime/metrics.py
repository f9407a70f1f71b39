"""Run metrics: a local JSONL log that needs no account, wandb (offline by default), timers, progress.

Only global rank 0 writes. ``log(step, metrics)`` appends one strict-JSON line (``step``, ``time``,
``elapsed_s``, the metrics; non-finite values as ``null``) to ``<run_dir>/metrics.jsonl`` and sends the
same dict to wandb (files in ``<run_dir>/wandb``; ``offline``/``disabled`` need no account).
``log_eval`` rewrites ``<run_dir>/eval.json`` atomically; ``log_trained_groups`` appends a step's trained
groups to ``<run_dir>/trained_groups.jsonl`` (``runtime.transcripts.trained_groups``). Metric names
group by prefix: ``agent/<role>/*``, ``policy/<policy>/*``, ``perf/*``, ``timing_s/<section>``
(``Timer``), ``weight_sync/<policy>/*``, ``rollout/*``, ``async/*``, ``eval/*``; docs/metrics.md lists
every key, checked by tests/integration/test_tictactoe.py. Details: docs/design-notes.md,
"megamarl/runtime/metrics.py".
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from megamarl.config_sections import LoggerConfig
from megamarl.runtime.transcripts import TABLE_COLUMNS, table_rows, write_transcripts

# Values of the machine and the moment, not of the seeded run: the record's time stamp, durations,
# throughputs, async time ratios and resident memory (``memory/``). Two runs of one seed, resumed or
# not, on one node or two, differ only in these (scripts/compare_runs.py compares every other key).
MEASURED = re.compile(
    r"^time$|^(timing|perf|progress|memory)/|timing_|_s$|_per_s$|gbps$|/seconds$|^async/.*_ratio$"
)


def measured(key: str) -> bool:
    """A metric of the machine and the moment (``MEASURED``), which no seed makes repeatable."""
    return MEASURED.search(key) is not None


if TYPE_CHECKING:  # typing.Self is Python 3.11+, and requires-python allows 3.10
    from typing_extensions import Self

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.json"
TRAINED_GROUPS_FILE = "trained_groups.jsonl"


class MetricsLogger:
    """JSONL + wandb logger for one run. On ranks other than 0 every method is a no-op."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        cfg: LoggerConfig,
        run_name: str,
        config_dict: Mapping[str, Any] | None = None,
        rank: int = 0,
    ):
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.is_writer = rank == 0
        self._start = time.time()
        self._wandb_run = None
        self._groups_jsonl: IO[str] | None = None  # trained_groups.jsonl, opened at its first line
        if not self.is_writer:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115 - open for the run, closed by close()
        if cfg.wandb.mode != "disabled":
            self._wandb_run = _init_wandb(self.run_dir, cfg, run_name, dict(config_dict or {}))

    @property
    def wandb_run(self):
        """The wandb ``Run`` (None when disabled or on ranks other than 0)."""
        return self._wandb_run

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append one JSONL record and log ``metrics`` to wandb at ``step``."""
        if not self.is_writer:
            return
        values = {key: _to_float(value) for key, value in metrics.items()}
        now = time.time()
        record: dict[str, float | None] = {
            "step": int(step),
            "time": round(now, 3),
            "elapsed_s": round(now - self._start, 3),
        }
        record.update(values)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()  # a crashed run still leaves every completed step on disk
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in values.items() if v is not None}, step=int(step))

    def last_step(self) -> int:
        """The step of metrics.jsonl's last record (0: none; on ranks other than 0 always 0)."""
        records = read_metrics(self.run_dir) if self.is_writer else []
        return int(records[-1]["step"]) if records else 0

    def log_trained_groups(self, step: int, groups: Mapping[str, Any]) -> None:
        """Append ``{"step": step, "policies": groups}`` to trained_groups.jsonl (``trained_groups``)."""
        if not self.is_writer:
            return
        if self._groups_jsonl is None:
            self._groups_jsonl = open(self.run_dir / TRAINED_GROUPS_FILE, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._groups_jsonl.write(json.dumps({"step": int(step), "policies": groups}) + "\n")
        self._groups_jsonl.flush()

    def log_eval(self, step: int, results: Mapping[str, Any], *, failure: str | None = None) -> None:
        """Add ``{"step", "time", "results"}`` to eval.json (rewritten atomically) and to wandb.
        ``failure``: the set could not be evaluated (every episode failed); the entry gets
        ``"failed": true`` and ``"error"`` (the first traceback), and wandb gets no scores."""
        if not self.is_writer:
            return
        path = self.run_dir / EVAL_FILE
        entries = read_eval(self.run_dir)
        values = {key: _to_float(value) for key, value in results.items()}
        entry = {"step": int(step), "time": round(time.time(), 3), "results": values}
        if failure is not None:
            entry.update(failed=True, error=failure)
        entries.append(entry)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(entries, indent=1), encoding="utf-8")
        os.replace(tmp, path)  # atomic on POSIX: readers see the old or the new list, never half
        if self._wandb_run is not None and failure is None:
            prefixed = {k if k.startswith("eval/") else f"eval/{k}": v for k, v in values.items()}
            self._wandb_run.log({k: v for k, v in prefixed.items() if v is not None}, step=int(step))

    def log_episodes(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Episode transcripts of ``step`` (``runtime.transcripts``) to ``episodes/step_<step>.jsonl``
        and, with wandb, to an ``episodes`` table (one row per agent call)."""
        if not self.is_writer or not records:
            return
        write_transcripts(self.run_dir, step, records)
        if self._wandb_run is not None:
            import wandb  # imported where used, as in _init_wandb: it takes seconds to import

            table = wandb.Table(columns=list(TABLE_COLUMNS), data=table_rows(records))
            self._wandb_run.log({"episodes": table}, step=int(step))

    def progress(self, total: int, description: str):
        """``progress(...)`` bound to this logger: silent off rank 0 or with ``logger.progress=false``."""
        return progress(total, description, enabled=self.is_writer and self.cfg.progress)

    def close(self) -> None:
        if not self.is_writer:
            return
        for f in (self._jsonl, self._groups_jsonl):
            if f is not None and not f.closed:
                f.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _init_wandb(run_dir: Path, cfg: LoggerConfig, run_name: str, config_dict: dict):
    import wandb

    # console="off": stdout already goes to the Slurm log; system stats (GPU memory/util) stay on.
    settings = wandb.Settings(silent=True, console="off", disable_git=True)
    return wandb.init(
        project=cfg.wandb.project,
        entity=cfg.wandb.entity,
        name=run_name,
        config=config_dict,
        dir=str(run_dir),  # wandb writes <run_dir>/wandb/<offline-run-...>
        mode=cfg.wandb.mode,  # type: ignore[arg-type]  # one of WANDB_MODES (WandbConfig checks it)
        settings=settings,
    )


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of ``run_dir/metrics.jsonl`` (a truncated last line from a crash is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_eval(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / EVAL_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []


def _to_float(value: Any) -> float | None:
    if hasattr(value, "item"):  # torch / numpy scalars
        value = value.item()
    value = float(value)
    return value if math.isfinite(value) else None


# ----------------------------------------------------------------------------------- aggregation


def mean(values: Sequence[float]) -> float:
    """Mean of ``values``; NaN for an empty list (logged as null rather than a misleading 0)."""
    return float(statistics.fmean(values)) if len(values) else float("nan")


def describe(name: str, values: Sequence[float]) -> dict[str, float]:
    """``{name_mean, name_std, name_min, name_max}`` (population std) of a list of values."""
    if not len(values):
        return {f"{name}_mean": float("nan")}
    return {
        f"{name}_mean": mean(values),
        f"{name}_std": float(statistics.pstdev(values)),
        f"{name}_min": float(min(values)),
        f"{name}_max": float(max(values)),
    }


def agent_metrics(per_agent: Mapping[str, Mapping[str, Sequence[float]]]) -> dict[str, float]:
    """``{agent: {metric: [values]}}`` -> ``{"agent/<agent>/<metric>": mean}``.

    >>> agent_metrics({"planner": {"reward_mean": [1.0, 0.0], "success": [1, 1]}})
    {'agent/planner/reward_mean': 0.5, 'agent/planner/success': 1.0}
    """
    return {
        f"agent/{agent}/{metric}": mean(values)
        for agent, metrics in per_agent.items()
        for metric, values in metrics.items()
    }


# ----------------------------------------------------------------------------------- timing


class Timer:
    """Wall-clock sections of a step, reported as ``timing_s/<name>``; repeated sections add up.

    ``with timer("step"):`` around the whole step also yields ``timing_s/idle`` = step minus the
    other sections (the time no named section accounts for), unless ``idle`` was timed explicitly.
    On CUDA the device is synchronized at the end of a section, so GPU work is charged to the
    section that queued it.
    """

    def __init__(self):
        self._totals: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            _cuda_sync()
            self._totals[name] = self._totals.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self._totals[name] = self._totals.get(name, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        out = {f"timing_s/{name}": seconds for name, seconds in self._totals.items()}
        if "step" in self._totals and "idle" not in self._totals:
            accounted = sum(s for name, s in self._totals.items() if name != "step")
            out["timing_s/idle"] = max(0.0, self._totals["step"] - accounted)
        return out

    def pop(self) -> dict[str, float]:
        """``metrics()`` and reset: call once per step."""
        out = self.metrics()
        self._totals.clear()
        return out


def _cuda_sync() -> None:
    torch = sys.modules.get("torch")  # never import torch just to time a section
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------- progress


class _Bar:
    def __init__(self, progress=None, task=None):
        self._progress, self._task = progress, task

    def advance(self, n: float = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def update(self, *, completed: float | None = None, description: str | None = None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, description=description)


@contextlib.contextmanager
def progress(total: int, description: str, *, enabled: bool = True) -> Iterator[_Bar]:
    """A rich progress bar for rollout / update loops: ``with progress(n, "rollout") as bar: bar.advance()``.

    Silent (a no-op bar) when disabled or when stderr is not a terminal (batch jobs, CI, log files):
    bars in a Slurm log are noise.
    """
    if not enabled or not sys.stderr.isatty():
        yield _Bar()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        yield _Bar(bar, bar.add_task(description, total=total))
