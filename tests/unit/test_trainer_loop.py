"""``Trainer`` over recording fakes (one process, a one-rank gloo world, no engine, no model): the
order of the phases' calls per step, the push cadence (``WeightVersions``), the saves that are due
(``Checkpointer`` over a storage that keeps no shards), the evaluations and ``eval.stop_at``, and a
resume that continues the saved versions. The real loop, checkpointer, weight versions, evaluator,
pushes and batch dispatch run; the workers, the replicas and the rollout driver are fakes."""

from __future__ import annotations

import io
import json
import re
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megamarl.cli.configure import load_config
from megamarl.driver.engine_pushes import EnginePushes
from megamarl.driver.evaluator import Evaluator
from megamarl.parallel import distributed
from megamarl.parallel.placement import WorkerGroupLayout
from megamarl.planning.phases import final_save_phases, start_phases, step_phases
from megamarl.rl.batch import collate
from megamarl.rl.dispatch import BatchSplit
from megamarl.rl.sample import Sample
from megamarl.rollout.weight_versions import WeightVersions
from megamarl.run import Run
from megamarl.runtime import checkpoint
from megamarl.runtime.checkpointer import Checkpointer, RunDirStorage
from megamarl.runtime.progress import RunProgress
from megamarl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


class _Worker:
    def __init__(self, events: list[str]) -> None:
        self.events, self.num_updates, self.skip_streak, self.last_fault = events, 0, 0, ""
        self.scheduler = SimpleNamespace(num_steps=0, step=lambda increment: None)
        self.on_micro_batch = None

    def train_share(self, share) -> dict[str, float]:
        self.num_updates += 1
        self.scheduler.num_steps += 1
        self.events.append(f"train {len(share.minis)}")
        return {"loss": 0.5, "timing_s/forward": 0.0}


class _Replicas:
    served = False  # in-process engines: nothing to re-sync after a restart

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def register_adapters(self) -> None:
        self.events.append("register")

    def push(self, version: int, *, adapters=None) -> dict[str, float]:
        self.events.append(f"push v{version}")
        return {}

    def wake(self, parts) -> None:
        self.events.append(f"wake {','.join(parts)}")

    def sleep(self) -> None:
        self.events.append("sleep")

    def verify_pushed(self) -> dict[str, float]:
        return {}

    def resync(self, version, indices) -> dict[str, float]:
        raise AssertionError("no replica restarted here")

    def close(self) -> None:
        self.events.append("close replicas")


class _Driver:
    """The rollout driver: a real two-row batch per step, evaluation results from ``results``."""

    def __init__(self, events: list[str], results: dict[int, dict[str, float]]) -> None:
        self.events, self.results, self.restored = events, results, None

    def collect(self, step: int, versions: dict[str, int]):
        self.events.append(f"collect {step} v{versions['shared']}")
        samples = [
            Sample(
                "t",
                f"e{step}-{i}",
                agent,
                "shared",
                versions["shared"],
                prompt_ids=[5],
                response_ids=[7, 8],
                rollout_logprobs=[-0.5, -0.5],
            )
            for i, agent in enumerate(("sender", "receiver"))
        ]
        return collate(samples, pad_id=0), {"reward/mean": 1.0}

    def evaluate(self, step: int) -> dict[str, float]:
        self.events.append(f"evaluate {step}")
        return self.results.get(step, {"team_accuracy": 0.0})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.events.append(f"log {step}")

    def log_if_missing(self, step: int, line: dict[str, float]) -> None:
        self.events.append(f"log if missing {step}: {line.get('reward/mean')}")

    @contextmanager
    def weight_update(self):
        yield

    def console_print(self, text: str) -> None:
        self.events.append(f"say {text}")

    def state_dict(self) -> dict:
        return {"episodes": 2}

    def load_state_dict(self, state: dict) -> None:
        self.restored = state

    def close(self) -> None:
        self.events.append("close driver")

    def close_env_workers(self) -> None:
        pass


class _Storage(RunDirStorage):
    """The run directory's checkpoints without the policies' shards (the workers are fakes)."""

    def __init__(self, run_dir: Path, events: list[str]) -> None:
        super().__init__(run_dir)
        self.events = events

    def write_shards(self, staging, policies, workers, wgs, *, rank) -> None:
        staging.mkdir(parents=True)
        self.events.append(f"save {int(staging.name.split('_')[1].split('.')[0])}")

    def read(self, path, policies, workers, wgs, *, rank):
        return checkpoint.load_trainer_state(path), True  # the run state; the RNG "was saved"


@pytest.fixture
def world(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setattr(distributed, "_CONTROL_GROUP", None)
    yield
    dist.destroy_process_group()


def _untimed(line: str) -> str:
    """The closing line with its wall time as "T" (a loaded machine may take a second)."""
    return re.sub(r" in \d+s: ", " in Ts: ", line)


def _trainer(
    tmp_path: Path, events: list[str], *overrides: str, results=None, sync_every: int = 1, log=None
) -> Trainer:
    cfg = load_config(
        ROOT / "configs" / "signalling_tiny.yaml",
        [f"output_dir={tmp_path}", "name=run", "eval.num_tasks=2", "logger.progress=false", *overrides],
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    progress = RunProgress(  # log: a stream for its plain lines (a log file's view), else silent
        total_steps=cfg.trainer.total_steps, enabled=log is not None, live=False, stream=log
    )
    workers, replicas = {"shared": _Worker(events)}, {"shared": _Replicas(events)}
    driver = _Driver(events, results or {})
    versions = WeightVersions(["shared"], sync_every=sync_every)
    wgs = {"shared": SimpleNamespace(layout=WorkerGroupLayout([0]))}
    phases = SimpleNamespace(
        start=start_phases(overlaps_training=False),
        step=step_phases(overlaps_training=False),
        final_save=final_save_phases(overlaps_training=False),
    )
    run = Run(
        cfg=cfg,
        rank=0,
        world_size=1,
        run_dir=run_dir,
        progress=progress,
        peers=None,
        wgs=wgs,
        splits={"shared": BatchSplit()},
        plan={},
        fleet=None,
        workers=workers,
        replicas=replicas,
        driver=driver,
        offloaded=[],
        offloaded_anywhere=set(),
        versions=versions,
        pushes=EnginePushes(
            cfg.policies,
            cfg.rollout.opponent_pool,
            replicas=replicas,
            versions=versions,
            driver=driver,
            progress=progress,
        ),
        checkpointer=Checkpointer(
            cfg.trainer,
            cfg.policies,
            _Storage(run_dir, events),
            rank=0,
            world_size=1,
            workers=workers,
            wgs=wgs,
            versions=versions,
            driver=driver,
            say=driver.console_print,
        ),
        evaluator=Evaluator(cfg.eval, total_steps=cfg.trainer.total_steps, driver=driver, timeout_s=60),
        phases=phases,
    )
    return Trainer(cfg, run=run)


def test_each_step_runs_its_phases_in_order_with_the_due_pushes_saves_and_evaluations(world, tmp_path):
    events: list[str] = []
    trainer = _trainer(
        tmp_path, events, "trainer.total_steps=4", "trainer.save_every=3", "eval.every=2", sync_every=2
    )
    trainer.fit()
    events[-1] = _untimed(events[-1])
    # sync_every=2: a push after every second update; save_every=3 and the last step; eval at 0, 2, 4
    assert events == [
        "register",
        "wake weights",
        "push v1",
        "wake kv_cache",
        "evaluate 0",
        "collect 0 v1",
        "sleep",
        "train 1",
        "wake weights",
        "wake kv_cache",
        "log 1",
        "collect 1 v1",
        "sleep",
        "train 1",
        "wake weights",
        "push v2",
        "wake kv_cache",
        "log 2",
        "evaluate 2",
        "collect 2 v2",
        "sleep",
        "train 1",
        "wake weights",
        "save 3",
        "wake kv_cache",
        "log 3",
        "collect 3 v2",
        "sleep",
        "train 1",
        "wake weights",
        "push v3",
        "save 4",
        "wake kv_cache",
        "log 4",
        "evaluate 4",
        "close driver",
        "close replicas",
        # the closing line: how far, how long, where the run's files are (the fakes write no metrics)
        f"say finished at step 4/4 in Ts: checkpoint {tmp_path}/run/checkpoints/step_000004",
    ]
    assert trainer.step == 4 and trainer.run.versions.current == {"shared": 3}


def test_stop_at_saves_the_step_with_its_reason_and_a_resumed_run_stays_stopped(world, tmp_path):
    events: list[str] = []
    overrides = (
        "trainer.total_steps=5",
        "trainer.save_every=0",
        "eval.every=1",
        "eval.stop_at={team_accuracy: 0.9}",
    )
    trainer = _trainer(tmp_path, events, *overrides, results={2: {"team_accuracy": 1.0}})
    trainer.fit()
    assert trainer.step == 2 and trainer.stop_reason == "eval.stop_at reached (team_accuracy=1.000 >= 0.9)"
    events[-1] = _untimed(events[-1])
    after_step_2 = events[events.index("log 2") :]
    assert after_step_2 == [
        "log 2",
        "evaluate 2",
        "sleep",
        "save 2",  # the final-save phases: engines asleep
        f"say stopping at step 2: {trainer.stop_reason} (saved)",
        "close driver",
        "close replicas",
        f"say finished at step 2/5 in Ts: checkpoint {tmp_path}/run/checkpoints/step_000002",
    ]

    events.clear()
    resumed = _trainer(
        tmp_path, events, *overrides, "trainer.resume=auto", results={2: {"team_accuracy": 1.0}}
    )
    assert (resumed.step, resumed.stop_reason) == (2, trainer.stop_reason)
    assert resumed.run.versions.current == {
        "shared": 2
    }  # saved 3 (v1 at start-up, one push per step): one below
    assert resumed.driver.restored == {"episodes": 2}
    resumed.fit()
    assert events[-4:-1] == [
        f"say resumed a run that stopped at step 2: {trainer.stop_reason}; nothing to do",
        "close driver",
        "close replicas",
    ]


def test_a_resumed_run_continues_the_saved_versions(world, tmp_path):
    events: list[str] = []
    _trainer(tmp_path, events, "trainer.total_steps=2", "trainer.save_every=1", "eval.num_tasks=0").fit()
    events.clear()
    resumed = _trainer(
        tmp_path,
        events,
        "trainer.total_steps=3",
        "trainer.save_every=1",
        "eval.num_tasks=0",
        "trainer.resume=auto",
    )
    resumed.fit()
    # saved at step 2 with version 3: start-up pushes version 3 again, step 3 trains on it and pushes 4
    assert [e for e in events if e.startswith(("push", "collect", "save", "say resumed", "log if"))] == [
        f"say resumed from {tmp_path / 'run' / 'checkpoints' / 'step_000002'} at step 2",
        "log if missing 2: 1.0",  # the line step 2's checkpoint carries (its metrics as they stood)
        "push v3",
        "collect 2 v3",
        "push v4",
        "save 3",
    ]


def test_a_fresh_run_in_an_earlier_runs_directory_starts_it_over(world, tmp_path):
    """``trainer.resume=none`` (the default) in a directory an earlier run of the same ``name`` left:
    its records are cut and its checkpoints set aside, as a resume rewinds to the step it loads, so
    metrics.jsonl and eval.json hold this run alone; one line says so and names ``trainer.resume=auto``."""
    run_dir = tmp_path / "run"
    old = checkpoint.checkpoint_path(run_dir, 2)
    old.mkdir(parents=True)
    (old / checkpoint.COMPLETE).touch()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n')
    (run_dir / "eval.json").write_text('[{"step": 0, "team_accuracy": 0.5}]')
    events: list[str] = []
    trainer = _trainer(tmp_path, events)
    assert trainer.step == 0
    assert (run_dir / "metrics.jsonl").read_text() == ""
    assert json.loads((run_dir / "eval.json").read_text()) == []
    assert checkpoint.list_checkpoints(run_dir) == [] and old.with_name(old.name + ".discarded").is_dir()
    said = [e for e in events if e.startswith("say ")]
    assert said == [
        (
            f"say {run_dir} held an earlier run (2 metrics records, 1 eval entries, checkpoints up to step "
            "2): trainer.resume=none starts over (its records cut, its checkpoints renamed *.discarded); "
            "trainer.resume=auto continues a run"
        )
    ]


def test_the_start_up_push_is_not_labelled_as_a_step(world, tmp_path):
    """The push before the step-0 evaluation belongs to no step: its line must not read "step 1/N"
    ahead of "eval at step 0" (scripts/evaluate.py, which trains no step, printed it too)."""
    log = io.StringIO()
    _trainer(tmp_path, [], "trainer.total_steps=2", log=log).fit()
    syncs = [line for line in log.getvalue().splitlines() if "weight sync" in line]
    assert syncs[0].startswith("[megamarl] weight sync shared (start-up): "), syncs
    assert [line.split(":")[0] for line in syncs[1:]] == [
        "[megamarl] step 1/2 weight sync shared",
        "[megamarl] step 2/2 weight sync shared",
    ]
