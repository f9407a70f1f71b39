"""``planning.phases``: the one phase list the trainer runs and the dry-run prices."""

from __future__ import annotations

import pytest

from megamarl.planning.dryrun import GIB, price_phase
from megamarl.planning.memory import Memory
from megamarl.planning.phases import (
    ENGINE,
    TRAIN_STATE,
    Phase,
    final_save_phases,
    run_phases,
    start_phases,
    step_phases,
)


def _actions(phases):
    return [p.action for p in phases]


def test_sync_order_offloads_before_the_kv_cache_wakes():
    """wake weights -> push -> offload (+ release) -> wake KV -> rollout -> sleep -> restore -> train,
    with the start-up (step 0 or resumed) in the same order before its evaluation."""
    assert _actions(start_phases(overlaps_training=False)) == [
        "wake_weights",
        "push_all",
        "offload",
        "wake_kv",
        "evaluate",
    ]
    assert _actions(step_phases(overlaps_training=False)) == [
        "resync",
        "rollout",
        "sleep",
        "restore",
        "train",
        "release",
        "wake_weights",
        "push",
        "save",
        "offload",
        "wake_kv",
        "evaluate",
    ]
    assert _actions(final_save_phases(overlaps_training=False)) == ["sleep", "restore", "final_save"]
    for phase in run_phases(overlaps_training=False):
        # never the KV cache next to the train state, never the engines next to the activations
        assert not (phase.holds("kv_cache") and any(phase.holds(k) for k in TRAIN_STATE)), phase
        assert not (phase.holds("activations") and any(phase.holds(k) for k in ENGINE)), phase
        assert phase.holds("reference") and phase.holds("reserve")


def test_async_modes_keep_the_engines_awake_and_offload_nothing():
    phases = run_phases(overlaps_training=True)
    assert not {"sleep", "restore", "offload", "wake_weights", "wake_kv"} & set(_actions(phases))
    assert all(p.holds(k) for p in phases for k in (*TRAIN_STATE, *ENGINE))
    assert _actions(step_phases(overlaps_training=True)) == [
        "resync",
        "rollout",
        "train",
        "release",
        "push",
        "save",
        "evaluate",
    ]


def test_unknown_resident_kind_is_refused():
    with pytest.raises(ValueError, match="unknown resident kinds"):
        Phase("x", "x", frozenset({"weights", "nonsense"}))


def test_price_phase_follows_offload_and_sleep():
    """A policy that offloads drops its train state outside the phases that hold it; one that does not
    keeps it everywhere; a sleeping engine only where the phase holds it (what it releases asleep); one
    that never sleeps always."""
    train = Memory(
        weights=1 * GIB,
        grads=2 * GIB,
        main_params=0.5 * GIB,
        optimizer=1 * GIB,
        reference=0.25 * GIB,
        activations=3 * GIB,
        lora=0.125 * GIB,
    )
    kept = Memory(weights=1 * GIB)
    engine = Memory(weights=4 * GIB, kv_cache=8 * GIB)
    phases = {p.name: p for p in run_phases(overlaps_training=False)}

    def price(name, *, released=("engine_weights", "kv_cache")):
        return price_phase(
            phases[name], [(train, True), (kept, False)], [(engine, released)], reserved=1 * GIB
        )

    rollout = price("rollout")
    assert rollout.kinds == {
        "weights": 1 * GIB,
        "grads": 0.0,
        "main_params": 0.0,
        "optimizer": 0.0,
        "reference": 0.25 * GIB,
        "engine_weights": 4 * GIB,
        "kv_cache": 8 * GIB,
        "nccl": 0.0,
        "reserve": 1 * GIB,
    }
    assert (
        price("train").total == (1.125 + 2 + 0.5 + 1 + 0.25 + 1 + 3 + 1) * GIB
    )  # activations: one WG at a time
    assert price("push").total == (1.125 + 2 + 0.5 + 1 + 0.25 + 1 + 4 + 1) * GIB  # weights woken, no KV yet
    assert price("sleep").total == (1 + 0.25 + 1) * GIB
    assert price("sleep", released=()).total == (1 + 0.25 + 1 + 12) * GIB
    # an in-process engine on CPU: asleep it releases its KV cache and keeps its weights
    assert price("sleep", released=("kv_cache",)).total == (1 + 0.25 + 1 + 4) * GIB
    assert price("rollout", released=("kv_cache",)).total == rollout.total
