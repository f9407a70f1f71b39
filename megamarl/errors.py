"""The errors that stop a run, and the exit code of each (docs/reliability.md, "Exit codes").

The ground floor: any layer raises these, the launch (``scripts/train.py``) turns each into its
code, and nothing here imports megamarl. Every rank raises a ``RunStoppedError`` together (the
condition is reduced over the ranks first), so the launch reports it once and exits with
``exc.exit_code``. A lost rank cannot raise on the others: they leave at once with
``EXIT_LOST_RANKS`` (``parallel.peers.PeerWatch``'s ``on_lost``).
"""

from __future__ import annotations

from pathlib import Path

EXIT_OK = 0  # finished, or preempted after saving a checkpoint
EXIT_CONFIG_ERROR = 2  # one line naming the key; also a dry-run / placement that does not fit
EXIT_NUMERICAL_FAULT = 3
EXIT_CHECKPOINT_WRITE = 4
EXIT_ROLLOUT_FAILURE = 5
EXIT_LOST_RANKS = 6  # a rank's node died or became unreachable


class RunStoppedError(RuntimeError):
    """A condition every rank sees alike and the run cannot go on from; ``exit_code`` is the launch's."""

    exit_code: int


class NumericalFaultError(RunStoppedError):
    """Too many non-finite updates in a row (``trainer.max_nonfinite_updates``)."""

    exit_code = EXIT_NUMERICAL_FAULT


class CheckpointWriteError(RunStoppedError):
    """A checkpoint could not be written (disk full, ...); the earlier ones are untouched."""

    exit_code = EXIT_CHECKPOINT_WRITE

    def __init__(self, path: Path, errors: list[str], complete: list[Path]) -> None:
        last = (
            f"the previous checkpoint {complete[-1]} is complete and loadable (trainer.resume=auto resumes "
            "from it)"
            if complete
            else "no earlier checkpoint exists"
        )
        super().__init__(
            f"writing checkpoint {path} failed ({'; '.join(errors)}); its partial directory "
            f"was removed; {last}"
        )


class RolloutFailureError(RunStoppedError):
    """More episodes failed than ``rollout.max_failed_fraction`` allows."""

    exit_code = EXIT_ROLLOUT_FAILURE


class RefillExhaustedError(RolloutFailureError):
    """``algorithm.refill_exhausted=stop`` and the refill rounds left too few informative tasks."""


class ProgramCrashLoopError(RolloutFailureError):
    """A long-lived external program exited before finishing an episode ``orchestra.kwargs.
    max_start_failures`` times in a row, with no episode finished in between (``orchestration.programs``)."""
