"""The run's checkpointer: ``load`` at start-up, ``save(step, last=...)`` when due, ``close`` at the end.

Collective: every rank writes its policies' shards (layout-free) and its RNG, then the driver commits
the run state, the step's metrics line so far and the COMPLETE marker atomically
(``megamarl.runtime.checkpoint``, docs/checkpointing.md).
``save`` decides whether a step is due (``trainer.save_every``, or ``last``). A failed write on any
rank (disk full, quota, I/O error) is agreed by all ranks: the partial directory goes and
``CheckpointWriteError`` stops the run, naming the previous complete checkpoint, which nothing touched.
Where checkpoints live is the storage's (``RunDirStorage``, the run directory's files): a test swaps
the storage instead of patching the module.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from megamarl.config import PolicyConfig, TrainerConfig
from megamarl.parallel.distributed import control_group
from megamarl.runtime import checkpoint

DRIVER = 0


class Stateful(Protocol):
    """What a checkpoint carries besides the policies: the weight versions, the driver's state."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Driver(Stateful, Protocol):
    """The driver's state, and its metrics log: a resumed run logs the checkpoint's step when the
    killed run had not (``log_if_missing``)."""

    def log_if_missing(self, step: int, line: dict[str, float]) -> None: ...


class RunDirStorage:
    """Checkpoints as files under ``run_dir/checkpoints`` (``megamarl.runtime.checkpoint``)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def paths(self, step: int) -> tuple[Path, Path]:
        """The step's checkpoint and the staging directory it is written in before the commit."""
        final = checkpoint.checkpoint_path(self.run_dir, step)
        return final, checkpoint.staging_path(final)

    def write_shards(
        self, staging: Path, policies: dict[str, PolicyConfig], workers: dict, wgs: dict, *, rank: int
    ) -> None:
        checkpoint.save_policies(staging, policies, workers, wgs)
        checkpoint.save_rng(staging, rank)

    def commit(self, staging: Path, final: Path, state: dict, line: dict[str, float] | None) -> None:
        checkpoint.commit(staging, final, state, line)

    def prune(self, *, keep_last: int) -> None:
        checkpoint.prune(self.run_dir, keep_last=keep_last)

    def clear(self, path: Path) -> None:
        checkpoint.clear(path)

    def complete(self) -> list[Path]:
        return checkpoint.list_checkpoints(self.run_dir)

    def find(self, resume: str) -> Path | None:
        return checkpoint.find_checkpoint(resume, self.run_dir)

    def read(
        self, path: Path, policies: dict[str, PolicyConfig], workers: dict, wgs: dict, *, rank: int
    ) -> tuple[dict, bool]:
        """The run state; the policies loaded at this run's layout; whether this rank's RNG was saved."""
        state = checkpoint.load_trainer_state(path)
        checkpoint.load_policies(path, policies, workers, wgs)
        return state, checkpoint.load_rng(path, rank)

    def metrics_line(self, path: Path) -> dict[str, float]:
        """The metrics line of the checkpoint's step as it stood at the save ({}: none, or the checkpoint
        is another run directory's, whose earlier lines are not here either)."""
        own = path.resolve().parent == checkpoint.checkpoint_path(self.run_dir, 0).resolve().parent
        return checkpoint.load_metrics_line(path) if own else {}

    def rewind(self, step: int) -> None:
        """Later metrics lines are logged again by the resumed run."""
        checkpoint.rewind_run_dir(self.run_dir, step)

    def start_over(self) -> str:
        """A run from step 0: what an earlier run left here is cut (its checkpoints set aside as
        ``*.discarded``), so the run directory holds this run alone. Returns what was found."""
        found = checkpoint.earlier_run(self.run_dir)
        if found:
            checkpoint.rewind_run_dir(self.run_dir, -1)
        return found


class Checkpointer:
    def __init__(
        self,
        trainer: TrainerConfig,
        policies: dict[str, PolicyConfig],
        storage: RunDirStorage,
        *,
        rank: int,
        world_size: int,
        workers: dict,
        wgs: dict,
        versions: Stateful,
        driver: Driver | None,
        say: Callable[[str], None],
    ) -> None:
        self.trainer, self.policies, self.storage = trainer, policies, storage
        self.rank, self.world_size = rank, world_size
        self.workers, self.wgs, self.versions, self.driver, self.say = workers, wgs, versions, driver, say
        self.saved_step = -1  # the step last saved

    def load(self, *, rewind: bool = True) -> tuple[int, str] | None:
        """``trainer.resume``'s checkpoint into the workers, the weight versions and this rank's RNG:
        (step, stop reason), None without one. ``rewind=False`` (an evaluation): nothing of the run
        is continued, the driver's state and the run directory stay as they are."""
        path = self.storage.find(self.trainer.resume)
        if path is None:
            if self.trainer.resume == "auto":
                self.say(f"trainer.resume=auto: no checkpoint in {self.storage.run_dir}; from step 0")
            if rewind and self.driver is not None:  # a training run, on the rank that writes the logs
                found = self.storage.start_over()
                if found:
                    self.say(
                        f"{self.storage.run_dir} held an earlier run ({found}): trainer.resume="
                        f"{self.trainer.resume} starts over (its records cut, its checkpoints renamed "
                        "*.discarded); trainer.resume=auto continues a run"
                    )
            return None
        state, has_rng = self.storage.read(path, self.policies, self.workers, self.wgs, rank=self.rank)
        for name, worker in self.workers.items():
            worker.num_updates = state["num_updates"][name]
            worker.scheduler.step(increment=state.get("lr_steps", {}).get(name, 0))  # the schedule's position
        step = state["step"]
        self.versions.load_state_dict(state["versions"])
        if not has_rng:  # saved with fewer ranks
            checkpoint.seed_everything(self.trainer.seed + 1_000_003 * step + self.rank)
        if not rewind:
            self.say(f"loaded {path} (step {step})")
        elif self.driver is not None:
            self.driver.load_state_dict(state["driver"])
            self.storage.rewind(step)
            self.say(f"resumed from {path} at step {step}")
            # a run killed after this save but before the step's metrics line: the line it carries
            self.driver.log_if_missing(step, self.storage.metrics_line(path))
        return step, state.get("stop_reason", "")

    def save(
        self, step: int, *, last: bool = False, stop_reason: str = "", line: dict[str, float] | None = None
    ) -> bool:
        """Collective: saves when ``last`` or at the ``trainer.save_every`` cadence; returns whether it
        saved. ``stop_reason``: a resumed run that stopped at ``eval.stop_at`` stays stopped. ``line``:
        the step's metrics as they stand (the driver's), logged on resume when the run died before it
        logged the step."""
        every = self.trainer.save_every
        if not (last or (every > 0 and step % every == 0)):
            return False
        final, staging = self.storage.paths(step)
        if self.driver is not None:
            self.storage.clear(staging)  # left by a run killed while saving this step
        dist.barrier(group=control_group())
        error = checkpoint.attempt_write(
            lambda: self.storage.write_shards(staging, self.policies, self.workers, self.wgs, rank=self.rank)
        )
        gathered: list = [None] * self.world_size
        counts = {name: (w.num_updates, w.scheduler.num_steps) for name, w in self.workers.items()}
        dist.all_gather_object(gathered, (counts, error), group=control_group())
        errors = [f"rank {rank}: {e}" for rank, (_, e) in enumerate(gathered) if e]
        if self.driver is not None and not errors:
            state = {
                "step": step,
                "versions": self.versions.state_dict(),
                "world_size": self.world_size,
                "num_updates": {k: v[0] for counts, _ in gathered for k, v in counts.items()},
                "lr_steps": {k: v[1] for counts, _ in gathered for k, v in counts.items()},
                "driver": self.driver.state_dict(),
                "stop_reason": stop_reason,
            }
            error = checkpoint.attempt_write(lambda: self.storage.commit(staging, final, state, line))
            errors += [f"rank {self.rank}: {error}"] if error else []
            if not errors:
                self.storage.prune(keep_last=self.trainer.keep_last)
        outcome = [errors]
        dist.broadcast_object_list(outcome, src=DRIVER, group=control_group())
        if outcome[0]:
            if self.driver is not None:
                checkpoint.attempt_write(lambda: self.storage.clear(staging))
            dist.barrier(group=control_group())
            raise checkpoint.CheckpointWriteError(final, outcome[0], self.storage.complete())
        self.saved_step = step
        return True

    def last_complete(self) -> str:
        """The last complete checkpoint, for an error that stops the run."""
        found = self.storage.complete()
        return f"the last good checkpoint is {found[-1]}" if found else "no checkpoint was saved yet"

    def close(self) -> None:
        """Writes are synchronous: nothing is in flight at the end of a run; the references go."""
        self.workers, self.driver = {}, None
