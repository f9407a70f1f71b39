"""The phases of a training step, in the order the trainer runs them, and what each keeps resident.

One list drives both the trainer (``Trainer`` runs ``phase.action`` for each phase, in order) and the
memory plan (``planning.dryrun`` prices every phase per GPU and names the peak phase). A phase names
what is resident on a GPU while it runs (``KINDS``) for the parts that move: the training state of a
policy that offloads it, the update's activations (one policy at a time), and the weights and KV
cache of engines that sleep; the reference model, the NCCL communicators and the reserve are resident
everywhere. Sync mode, colocated: wake weights -> push -> offload and release -> wake KV cache ->
rollout -> sleep -> restore -> train -> release, and around; start-up runs the same push half. In the
async modes the engines never sleep and nothing is offloaded.
The order's reasons and restarted replicas: docs/design-notes.md, "megamarl/planning/phases.py".
"""

from __future__ import annotations

from dataclasses import dataclass

# what a phase can hold; the training state's four kinds move together (``TRAIN_STATE``)
TRAIN_STATE = ("weights", "grads", "main_params", "optimizer")
ENGINE = ("engine_weights", "kv_cache")
# push_buffers: what a push that moves stages between training ranks holds on them (colocated PP>1
# replicas fed by their leaders: ``planning.memory.relay_buffer_bytes``), in the phases that push
KINDS = (
    *TRAIN_STATE,
    "reference",
    "activations",
    "cached_blocks",
    *ENGINE,
    "push_buffers",
    "nccl",
    "reserve",
)


@dataclass(frozen=True)
class Phase:
    """One phase: ``action`` is the trainer's step to run (``Trainer`` maps it to a method);
    ``resident`` the kinds on the GPU while it runs (module docstring)."""

    name: str
    action: str
    resident: frozenset[str]

    def __post_init__(self) -> None:
        unknown = set(self.resident) - set(KINDS)
        if unknown:
            raise ValueError(
                f"phase '{self.name}': unknown resident kinds {sorted(unknown)}; allowed: {list(KINDS)}"
            )

    def holds(self, kind: str) -> bool:
        return kind in self.resident


def _phase(name: str, action: str, *kinds: str) -> Phase:
    return Phase(name, action, frozenset((*kinds, "reference", "nccl", "reserve")))


# sync: the push half (train state resident, engine weights woken, no KV cache yet), then the
# engines' half (train state away), then the update (engines asleep)
_PUSH = (
    _phase("wake weights", "wake_weights", *TRAIN_STATE, "engine_weights"),
    _phase("push", "push", *TRAIN_STATE, "engine_weights", "push_buffers"),
    _phase("save", "save", *TRAIN_STATE, "engine_weights"),
    _phase("offload", "offload", "engine_weights"),
    _phase("wake kv cache", "wake_kv", *ENGINE),
)
_EVALUATE = _phase("evaluate", "evaluate", *ENGINE)
_UPDATE = (
    _phase("re-sync restarted", "resync", *ENGINE),  # a colocated replica's re-sync waits for the push phase
    _phase("rollout", "rollout", *ENGINE),
    _phase("sleep", "sleep"),
    _phase("restore", "restore", *TRAIN_STATE),
    _phase("train", "train", *TRAIN_STATE, "activations"),
    _phase("release", "release", *TRAIN_STATE),
)
# async modes: engines awake throughout, the update overlaps generation, nothing offloaded
_ASYNC_PUSH = (
    _phase("push", "push", *TRAIN_STATE, *ENGINE, "push_buffers"),
    _phase("save", "save", *TRAIN_STATE, *ENGINE),
)
_ASYNC_UPDATE = (
    _phase("re-sync restarted", "resync", *TRAIN_STATE, *ENGINE, "push_buffers"),
    _phase("rollout", "rollout", *TRAIN_STATE, *ENGINE),
    _phase("train", "train", *TRAIN_STATE, "activations", *ENGINE),
    _phase("release", "release", *TRAIN_STATE, *ENGINE),
)
# a run that stops after its evaluation (eval.stop_at, preemption) saves with the engines asleep
_FINAL_SAVE = (
    _phase("sleep", "sleep"),
    _phase("restore", "restore", *TRAIN_STATE),
    _phase("final save", "final_save", *TRAIN_STATE),
)


def start_phases(*, overlaps_training: bool) -> tuple[Phase, ...]:
    """Before the first step (step 0 or a resumed run): the weights into the engines, then the
    step-0 evaluation, in the same order as every step's push half."""
    push = [p for p in (_ASYNC_PUSH if overlaps_training else _PUSH) if p.action != "save"]
    push = [Phase(p.name, "push_all", p.resident) if p.action == "push" else p for p in push]
    return (*push, _phase("evaluate", "evaluate", *_evaluate_kinds(overlaps_training)))


def step_phases(*, overlaps_training: bool) -> tuple[Phase, ...]:
    """One training step: re-sync restarted replicas whose train state is resident, rollout, update,
    push (and re-sync the others), save when due, hand the GPU back to the engines, evaluate when due."""
    if overlaps_training:
        return (*_ASYNC_UPDATE, *_ASYNC_PUSH, _phase("evaluate", "evaluate", *_evaluate_kinds(True)))
    return (*_UPDATE, *_PUSH, _EVALUATE)


def _evaluate_kinds(overlaps_training: bool) -> tuple[str, ...]:
    return (*TRAIN_STATE, *ENGINE) if overlaps_training else ENGINE


def final_save_phases(*, overlaps_training: bool) -> tuple[Phase, ...]:
    """A run that stops after an evaluation (``eval.stop_at``, preemption) and has not saved this
    step: the train state comes back with the engines asleep (sync), then the checkpoint."""
    return (_phase("final save", "final_save", *TRAIN_STATE, *ENGINE),) if overlaps_training else _FINAL_SAVE


def run_phases(*, overlaps_training: bool) -> tuple[Phase, ...]:
    """Every phase a run can go through, in order (what the plan prices): start-up, one step, the
    final save of a run that stops after an evaluation."""
    return (
        *start_phases(overlaps_training=overlaps_training),
        *step_phases(overlaps_training=overlaps_training),
        *final_save_phases(overlaps_training=overlaps_training),
    )
