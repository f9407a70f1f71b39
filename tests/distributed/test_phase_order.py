"""The trainer runs ``megamarl.planning.phases`` in order, and each phase holds what the plan says.

One 2-rank colocated run (the L1 preset: a tiny Llama at TP=2 on ranks 0-1, rank 0 also hosting the
in-process engine) of two steps, with the train state's offload forced on these CPU ranks (the
mechanism is device-agnostic, ``tests/distributed/test_offload_mechanism.py``). On every rank the
test records the calls that reach the real objects (``PolicyReplicas`` wake / sleep / push,
``TrainStateOffload`` offload / restore, ``PolicyWorker.train_share``, the driver's ``collect`` and
``evaluate``, ``Checkpointer.save``, the allocator release) and compares them with the phase list; after
each phase it measures the bytes the real objects hold (parameters, DDP buffers, main params, Adam
state, reference model: ``test_dryrun_measured.allocated_bytes``; the engine's weights) and compares
them with the plan's figure for that phase on that rank (``plan_memory``, offload applied) within 5%.
The engine's KV cache is not measured: the HF engine keeps none between requests (vLLM's is sized
to the plan's figure by ``--kv-cache-memory-bytes``, tests/unit/test_server_launch.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_dryrun_measured import allocated_bytes  # tests/distributed/

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "configs" / "presets" / "l1_colocated.yaml"
TOLERANCE = 0.05
OVERRIDES = [
    "trainer.total_steps=2",
    "trainer.save_every=1",
    "eval.every=1",
    "eval.num_tasks=2",
    "rollout.num_tasks=2",
    "rollout.group_size=2",
    "policies.shared.dtype=bf16",
    "policies.shared.distributed_optimizer=true",
    "policies.shared.kl_coef=0.1",
    "policies.shared.offload_train_state=true",
    "trainer.resume=none",
]
# what each phase action does to the real objects (the recorded names below)
CALLS = {
    "wake_weights": ["wake:weights"],
    "push_all": ["push"],
    "push": ["push"],
    "save": ["save"],
    "offload": ["offload", "release"],
    "wake_kv": ["wake:kv_cache", "verify"],
    "evaluate": ["evaluate"],
    "rollout": ["collect"],
    "sleep": ["sleep"],
    "restore": ["restore"],
    "train": ["train_share"],
    "release": ["release"],
    "final_save": ["save"],
    "resync": [],  # no replica restarted here
}


def _run_and_record(rank: int, output_dir: str):
    import megamarl.trainer as trainer_module
    from megamarl.cli.configure import load_config
    from megamarl.driver.rollout_driver import RolloutDriver
    from megamarl.rl.offload import TrainStateOffload
    from megamarl.rl.worker import PolicyWorker
    from megamarl.rollout.replicas.policy import PolicyReplicas
    from megamarl.runtime.checkpointer import Checkpointer

    calls: list[str] = []

    def spy(owner, attr, label=None):
        real = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            tags = kwargs.get("tags", args[1] if len(args) > 1 else None) if attr == "wake" else None
            calls.append(
                label or (f"wake:{','.join(tags or ('weights', 'kv_cache'))}" if attr == "wake" else attr)
            )
            return real(*args, **kwargs)

        setattr(owner, attr, wrapper)

    for owner, attr, label in [
        (PolicyReplicas, "wake", None),
        (PolicyReplicas, "sleep", None),
        (PolicyReplicas, "push", None),
        (PolicyReplicas, "verify_pushed", "verify"),
        (TrainStateOffload, "offload", None),
        (TrainStateOffload, "restore", None),
        (PolicyWorker, "train_share", None),
        (RolloutDriver, "collect", None),
        (RolloutDriver, "evaluate", None),
        (Checkpointer, "save", None),
        (trainer_module, "release_cached_memory", "release"),
    ]:
        spy(owner, attr, label)
    TrainStateOffload.applies = property(lambda self: True)  # offload on CPU ranks too

    measured: list[tuple[str, dict]] = []

    class MeasuringTrainer(trainer_module.Trainer):
        def run_phases(self, phases):
            for phase in phases:
                super().run_phases([phase])
                worker = self.workers["shared"]
                engine = _engine_bytes(self.driver.engines["shared"]) if self.is_driver else 0
                measured.append((phase.name, {**allocated_bytes(worker), "engine_weights": engine}))

    cfg = load_config(PRESET, [*OVERRIDES, f"output_dir={output_dir}", "name=run"])
    trainer = MeasuringTrainer(cfg)
    executed = [p.action for p in (*trainer.phases.start, *trainer.phases.step, *trainer.phases.step)]
    trainer.fit()
    return {
        "calls": calls,
        "executed": executed,
        "measured": measured,
        "offloaded": list(trainer.run.offloaded),
    }


def _engine_bytes(engine) -> int:
    """The weights the in-process HF engine holds (one replica, or each replica of a pool)."""
    replicas = getattr(engine, "replicas", [engine])
    return sum(p.untyped_storage().nbytes() for r in replicas for p in r.model.parameters())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("phases")
    return run_ranks(_run_and_record, 2, str(out), timeout_s=900)


def test_the_trainer_runs_the_phase_list_in_order(run):
    for rank, got in enumerate(run):
        expected = []
        for action in got["executed"]:
            for call in CALLS[action]:
                if call in ("wake:weights", "wake:kv_cache", "sleep", "collect", "evaluate") and rank != 0:
                    continue  # the driver's engines: woken, put to sleep, rolled out and evaluated on rank 0
                if call in ("offload", "restore") and not got["offloaded"]:
                    continue  # no engine on this rank: its train state stays (megamarl.run.offload_targets)
                expected.append(call)
        assert got["calls"] == expected, (rank, got["calls"], expected)
    assert run[0]["offloaded"] == ["shared"] and run[1]["offloaded"] == []


def test_each_phase_holds_what_the_plan_says(run):
    from megamarl.cli.configure import load_config
    from megamarl.driver.schedules import overlaps_training
    from megamarl.planning.dryrun import plan_memory

    cfg = load_config(PRESET, OVERRIDES)
    report = plan_memory(
        cfg,
        world_size=2,
        gpus_per_node=2,
        on_gpus=False,
        offload_applies=True,
        overlaps_training=overlaps_training(cfg.trainer),
    )
    kinds = ("weights", "grads", "main_params", "optimizer", "reference", "engine_weights")
    rows = []
    for rank, got in enumerate(run):
        phases = report.gpus[rank].phases
        trained = False
        for name, real in got["measured"]:
            planned = phases[name].kinds
            plan_bytes = {k: planned.get(k, 0.0) for k in kinds}
            trained = trained or name == "train"
            for kind in kinds:
                got_bytes = real["lora"] + real["weights"] if kind == "weights" else real[kind]
                rows.append((rank, name, kind, plan_bytes[kind], got_bytes))
                if kind == "optimizer" and not trained:  # Adam's moments appear at the first update (a
                    assert got_bytes == 0  # resumed run loads them: the plan counts them from the start)
                    continue
                assert abs(plan_bytes[kind] - got_bytes) <= TOLERANCE * max(got_bytes, 1), rows[-1]
    # the offload really moved something, and the rollout on rank 0 ran without it
    rollout = [real for name, real in run[0]["measured"] if name == "rollout"]
    assert rollout and all(r["grads"] == r["optimizer"] == 0 for r in rollout)
    print("\nrank phase kind planned measured")
    for row in rows:
        print(*row)
