"""What the run is doing, for a person watching it: a live display on a terminal, plain lines in logs.

``RunProgress`` knows the run's steps and the current *phase* (model preparation, engine start-up,
rollout, eval, training, weight sync, checkpoint). On a terminal (``logger.progress`` on and stdout a
TTY) it draws a rich live display: the run's step N/total with its ETA, and the phase's bar with
episodes (or micro-batches) done/total and generated tokens/s; per-step and eval summaries print
above it. Without a terminal (Slurm and CI logs) it prints exactly one line when a phase ends, e.g.::

    [megamarl] step 3/20 rollout: 64/64 episodes, 1843 tokens in 5.2 s (354 tokens/s) | ETA 4m10s

Counting is thread-safe: episodes finish on the driver's rollout thread. Only the driver rank shows
anything; other ranks get a silent instance.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)

PREFIX = "[megamarl]"


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@dataclass
class Phase:
    """One phase's counters; ``advance`` may be called from any thread."""

    name: str
    total: int | None
    unit: str
    done: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _on_change: Callable[[], None] | None = field(default=None, repr=False)

    def advance(self, num: int = 1, *, tokens: int = 0) -> None:
        with self._lock:
            self.done += num
            self.tokens += tokens
        if self._on_change is not None:
            self._on_change()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def summary(self) -> str:
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        text = f"{count} {self.unit}" if self.total is not None or self.done else ""
        if self.tokens:
            text += f", {self.tokens} tokens"
        text += f" in {self.seconds:.1f} s" if text else f"{self.seconds:.1f} s"
        if self.tokens:
            text += f" ({self.tokens_per_s:.0f} tokens/s)"
        return text


class RunProgress:
    """The driver's view of the run (see the module docstring). ``live``: None = auto (a TTY)."""

    def __init__(
        self,
        *,
        total_steps: int,
        enabled: bool = True,
        live: bool | None = None,
        stream=None,
        quiet: bool = False,
        eval_steps: Collection[int] = (),
    ) -> None:
        self.quiet = quiet  # prints nothing at all (ranks other than the driver)
        self.total_steps = total_steps
        self.eval_steps = frozenset(eval_steps)  # steps whose evaluation the ETA prices (Evaluator's)
        self.eval_seconds: float | None = None  # the last evaluation's wall time
        self.evaluated_step = -1  # the step the last evaluation was labelled with
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.live = enabled and not quiet and (self.stream.isatty() if live is None else live)
        self.step = 0
        self.first_step = 0  # a resumed run's ETA counts only the steps it ran itself
        self.step_seconds: list[float] = []
        self._bars: Progress | None = None
        self._run_task: TaskID | None
        self._phase_task: TaskID | None
        self._run_task = self._phase_task = None
        if self.live:
            self._bars = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TaskProgressColumn(),
                TextColumn("{task.fields[extra]}"),
                TimeElapsedColumn(),
                console=Console(file=self.stream, force_terminal=True),
                transient=False,
                refresh_per_second=4,
            )
            self._run_task = self._bars.add_task("steps", total=max(total_steps, 1), extra="")
            self._bars.start()

    # ---- the run --------------------------------------------------------------------------------
    def start_at(self, step: int) -> None:
        self.step = self.first_step = step
        self._refresh_run()

    def step_done(self, step: int, seconds: float) -> None:
        self.step = step
        self.step_seconds.append(seconds)
        self._refresh_run()

    def evaluated(self, step: int, seconds: float) -> None:
        """An evaluation labelled ``step`` took ``seconds``; the ETA prices each one still due at that."""
        self.evaluated_step, self.eval_seconds = step, seconds

    def eta_seconds(self) -> float | None:
        """The steps left at the recent steps' mean (a step's clock stops before its evaluation) plus
        the evaluations still due at the last one's duration (the final one included)."""
        if not self.step_seconds:
            return None
        recent = self.step_seconds[-5:]
        steps = sum(recent) / len(recent) * max(self.total_steps - self.step, 0)
        due = sum(s > self.step or (s == self.step and s > self.evaluated_step) for s in self.eval_steps)
        return steps + (self.eval_seconds or 0.0) * due

    def _eta_text(self) -> str:
        eta = self.eta_seconds()
        return "" if eta is None else f"ETA {format_duration(eta)}"

    def _refresh_run(self) -> None:
        if self._bars is not None:
            assert self._run_task is not None  # added with the bars
            self._bars.update(self._run_task, completed=self.step, extra=self._eta_text())

    # ---- phases ---------------------------------------------------------------------------------
    @contextmanager
    def phase(
        self, name: str, *, total: int | None = None, unit: str = "episodes", in_step: bool = True
    ) -> Iterator[Phase]:
        """A phase (of the current step when ``in_step``); its counters show live and as one line
        when it ends."""
        phase = Phase(name, total, unit)
        label = self._label(name) if in_step else name
        if self._bars is not None:
            self._phase_task = self._bars.add_task(label, total=total, extra="")
            phase._on_change = lambda: self._refresh_phase(phase)
        try:
            yield phase
        finally:
            if self._bars is not None:
                assert self._phase_task is not None  # added above, with the bars
                self._bars.remove_task(self._phase_task)
                self._phase_task = None
            if self.enabled and not self.live:  # on a terminal the live bars replace these lines
                # a step's phases carry the ETA; an evaluation's line ends before its own time is known
                eta = f" | {self._eta_text()}" if self.step_seconds and in_step else ""
                self.line(f"{label}: {phase.summary()}{eta}")

    def _label(self, name: str) -> str:
        return f"step {self.step + 1}/{self.total_steps} {name}" if self.total_steps else name

    def _refresh_phase(self, phase: Phase) -> None:
        if self._bars is not None and self._phase_task is not None:
            extra = f"{phase.tokens_per_s:.0f} tok/s" if phase.tokens else ""
            self._bars.update(self._phase_task, completed=phase.done, extra=extra)

    # ---- output ---------------------------------------------------------------------------------
    def line(self, text: str) -> None:
        """One line for the log, always printed (above the live display on a terminal) unless quiet."""
        if self.quiet:
            return
        if self._bars is not None:
            self._bars.console.print(f"{PREFIX} {text}", highlight=False, markup=False)
        else:
            print(f"{PREFIX} {text}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bars is not None:
            self._bars.stop()
            self._bars = None
