"""``scripts/train.py`` that stops for good at one chosen point of one step, so that a test can SIGKILL it
exactly there (tests/integration/test_async_resume.py):

    gated_train.py GATE STEP MARKER --config ... [overrides]   (then train.py's arguments)

At the gate the rank writes ``MARKER`` (its text: the gate and step) and sleeps; nothing else changes
(``scripts/train.py``'s own ``main`` runs, its ``Trainer`` a subclass that wraps one of the run's
objects after they are built). Gates, for a run of two or more policies, "second" meaning the last in
``policies:`` order (or in the order the step calls them):

* ``rollout``: the second policy's engine, at its first call of the episodes of task chunk ``STEP``
  (``rollout.num_tasks x rollout.group_size`` calls per chunk, one call of that policy per episode, as
  in the signalling game); in fully_async with a one-batch buffer that chunk rolls out while step
  ``STEP`` trains, and the first agent of those episodes has already acted: mid-episode. The marker is
  written once step ``STEP``'s update is done: its push then waits for the drain of those episodes.
* ``update``: step ``STEP``'s update, after the first policy's optimizer step, before the second's.
* ``push``: step ``STEP``'s weight push, after the first policy's engines got the new weights, before
  the second's.
* ``save``: right after step ``STEP``'s checkpoint is complete, before the step's metrics line is logged
  (any number of policies).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from script_loader import load_script  # tests/ helper

import megamarl.trainer

SLEEP_S = 900  # longer than any test waits; the test SIGKILLs the rank long before


def _stop_here(marker: Path, what: str) -> None:
    marker.write_text(what)
    time.sleep(SLEEP_S)
    raise SystemExit(f"gate {what}: not killed within {SLEEP_S} s")


def _gate_rollout(trainer: megamarl.trainer.Trainer, step: int, marker: Path) -> None:
    rollout = trainer.cfg.rollout
    first_call = step * rollout.num_tasks * rollout.group_size  # calls of chunks 0 .. step-1 come first
    engine = trainer.run.driver.engines[list(trainer.cfg.policies)[-1]]
    generate, calls = engine.generate, [0]

    async def gated(*args, **kwargs):
        if calls[0] == first_call:  # blocks the rollout loop: every episode stops
            while trainer.step < step:  # ... once the main thread has trained step STEP
                time.sleep(0.01)  # noqa: ASYNC251 - blocking the loop is the point: no episode moves on
            _stop_here(marker, f"rollout {step}")
        calls[0] += 1
        return await generate(*args, **kwargs)

    engine.generate = gated


def _gate_update(trainer: megamarl.trainer.Trainer, step: int, marker: Path) -> None:
    calls = [0]
    for worker in trainer.workers.values():

        def gated(share, train_share=worker.train_share):
            if trainer.step == step - 1:  # the update of step STEP (the step counts it when done)
                calls[0] += 1
                if calls[0] == 2:
                    _stop_here(marker, f"update {step}")
            return train_share(share)

        worker.train_share = gated


def _gate_push(trainer: megamarl.trainer.Trainer, step: int, marker: Path) -> None:
    calls = [0]
    for replicas in trainer.run.replicas.values():

        def gated(version, push=replicas.push, **kwargs):
            if trainer.step == step:  # the push phase follows the update that made it STEP
                calls[0] += 1
                if calls[0] == 2:
                    _stop_here(marker, f"push {step}")
            return push(version, **kwargs)  # e.g. adapters= (L2: the adapters that stepped)

        replicas.push = gated


def _gate_save(trainer: megamarl.trainer.Trainer, step: int, marker: Path) -> None:
    checkpointer = trainer.run.checkpointer
    save = checkpointer.save

    def gated(at: int, **kwargs) -> bool:
        saved = save(at, **kwargs)
        if saved and at == step:
            _stop_here(marker, f"save {step}")
        return saved

    checkpointer.save = gated


GATES = {"rollout": _gate_rollout, "update": _gate_update, "push": _gate_push, "save": _gate_save}


def main(argv: list[str]) -> int:
    gate, step, marker = GATES[argv[0]], int(argv[1]), Path(argv[2])

    class GatedTrainer(megamarl.trainer.Trainer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            gate(self, step, marker)

    megamarl.trainer.Trainer = GatedTrainer  # what scripts/train.py's main builds (looked up per call)
    return load_script("scripts/train.py", name="gated_train_script").main(argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
