"""Every preset in ``configs/presets/`` trains end to end, and its weights reach the engines.

Each preset runs through ``scripts/train.py``'s ``main`` on local ranks (``train_runs.launch``:
torchrun's environment, ranks forked from a preloaded server) at the world size its ranks imply (1, 2
or 3). Process start-up and the first model build are most of a tiny run's time, so the presets of one
world size share one launch: this file is also the ranks' script (``launch([OUT, CONFIG...],
script=this file)`` runs the configs one after the other in the same ranks), and the worlds run
concurrently.

Checked from the run directory only (metrics.jsonl, eval.json, checkpoints), per preset:

* every step logged (2, or 1: see Steps below), per-agent metrics for every agent;
* every trained policy's step-1 gradient was non-zero (its weights changed), and each step pushed
  it to its engines: ``weight_sync/<policy>/bytes`` equals the model's HF checkpoint size (every
  tensor arrived at the engine rank, through the TP gather or gloo point-to-point); an L2 policy
  pushes each adapter that stepped (``weight_sync/<policy>/<adapter>/bytes``, their sum
  ``weight_sync/<policy>/bytes``) and nothing else, each stepping adapter logs one step
  (``policy/<policy>/adapter/<a>/steps``) and none dropped: ``l2_l3_hybrid`` runs with its searcher frozen
  (``PRESET_OVERRIDES``), whose adapter then never steps and is never pushed after start-up; its
  samples carry the start-up version, which stays its adapter's version (staleness 0 below, per adapter);
* the engines served the pushed weights: step 2's samples carry the pushed weight version
  (``async/staleness_max == 0``) and the trainer's recomputed log-probs equal the engine's rollout
  log-probs (TIS weights ``exp(trainer - rollout)`` are 1 within 1e-3; 3e-6 measured). With the
  engine left on the initial weights they are ~0.73 (mean) and ~8 (max) on ``signalling``;
* the final checkpoint is complete and eval ran at step 0 and the last step.

Steps: the layout presets (2-3 ranks: L1/L2/L3/hybrid, colocated and disaggregated) and
``signalling`` (the 1-rank L1 layout with tiny Llama) train their 2 steps. The other 1-rank presets
(code, grid, math, pettingzoo, search_qa, sokoban, sudoku) differ from ``signalling`` only in their
task (env, orchestra, agents) and train 1 step (reasoning_gym, an optional extra's, trains 2 steps in its
own test_reasoning_gym.py) (``trainer.total_steps=1`` at launch): their task is
exercised by eval at step 0, the step-1 rollout, update and push, eval at step 1 and the checkpoint,
and the step-1 TIS check still shows the engine serving exactly the trainer's weights (the push before
the first rollout); that the push after an update is served is the 2-step presets' check, on the same
1-rank path (``signalling``) and on tiny Qwen2 (``l3_*``, ``hybrid_*``). The cut saves 7 steps, 7
evals and 7 checkpoints of the suite's longest module.

The ``l3_*`` presets are two tokenizer families in one run (the sender's tiny Llama with SmolLM2's
tokenizer, the receiver's ``tiny-bpe-qwen2`` with a Qwen2-style one of its own): the checks above hold
for each policy on its own vocabulary.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from train_runs import launch  # tests/ helper

from megamarl.parallel.placement import placement_of

ROOT = Path(__file__).resolve().parents[2]
PRESET_DIR = ROOT / "configs" / "presets"
NUM_STEPS = 2
TIS_TOLERANCE = 1e-3
WORLD_TIMEOUT_S = 1200


@dataclass(frozen=True)
class Preset:
    name: str  # file stem
    path: Path
    world_size: int


# Test-only overrides of one preset (on top of the fp32 ones): a frozen L2 adapter beside a trained one.
PRESET_OVERRIDES = {"l2_l3_hybrid": ["agents.searcher.frozen=true"]}


def _fp32_overrides(names) -> list[str]:
    """fp32 engines and training on every policy (``names``): the TIS check below compares the
    trainer's log-probs with the engine's to 1e-3, which ``auto`` (bf16 on a node with native bf16)
    would not meet."""
    return [f"policies.{n}.{k}=fp32" for n in names for k in ("dtype", "engine.dtype")]


@functools.cache
def _load(path: Path):
    from megamarl.cli.configure import load_config

    return load_config(
        path, [*_fp32_overrides(load_config(path).policies), *PRESET_OVERRIDES.get(path.stem, [])]
    )


def _world_size(cfg) -> int:
    """World size from the policies' explicit ranks (presets without ranks run on 1 rank). The
    composed config: presets take their ranks from layout/ groups in their defaults list."""
    return max((r for p in cfg.policies.values() for r in p.ranks or []), default=0) + 1


# Each preset's world size, written out: collection (in every xdist worker) then needs no Hydra compose
# (~0.5 s per preset); test_presets_load_and_place checks the table against the composed configs.
WORLD_SIZES = {
    "code": 1,
    "grid": 1,
    "hybrid_colocated": 2,
    "hybrid_disaggregated": 3,
    "l1_colocated": 2,
    "l1_disaggregated": 2,
    "l2_colocated": 2,
    "l2_l3_hybrid": 2,
    "l3_colocated": 2,
    "l3_disaggregated": 3,
    "math": 1,
    "openenv": 1,
    "pettingzoo": 1,
    "reasoning_gym": 1,
    "search_qa": 1,
    "signalling": 1,
    "sokoban": 1,
    "sudoku": 1,
    "textarena": 1,
}
PRESETS = [
    Preset(path.stem, path, WORLD_SIZES.get(path.stem, 0)) for path in sorted(PRESET_DIR.glob("*.yaml"))
]
FULL_RUN_1_RANK = "signalling"  # the 1-rank preset that trains all NUM_STEPS (see the docstring)
# Presets of an optional extra: the package they need, and the test that trains them (2 steps) instead
# of this module; without the package they are not loaded here either.
EXTRA_PRESETS = {
    "openenv": ("openenv", "tests/integration/test_openenv.py"),
    "reasoning_gym": ("reasoning_gym", "tests/integration/test_reasoning_gym.py"),
    "textarena": ("textarena", "tests/integration/test_textarena.py"),
}


def _loadable(preset: Preset) -> bool:
    package = EXTRA_PRESETS.get(preset.name, ("",))[0]
    return not package or importlib.util.find_spec(package) is not None


def _num_steps(name: str, world_size: int) -> int:
    return NUM_STEPS if world_size > 1 or name == FULL_RUN_1_RANK else 1


def _param(preset: Preset):
    marks = [pytest.mark.distributed] if preset.world_size > 1 else []
    return pytest.param(preset, id=preset.name, marks=marks)


# ---- launching ------------------------------------------------------------------------------------
def _materialize_models() -> None:
    """Write the packaged tiny models once here: ranks that create one concurrently race on the
    cache directory (one rank's rename deletes the other's half-read copy)."""
    from megamarl.models.packaged import resolve_model_path

    for model in sorted(
        {p.model for pr in PRESETS if _loadable(pr) for p in _load(pr.path).policies.values()}
    ):
        resolve_model_path(model)


@pytest.fixture(scope="module")
def preset_runs(request, tmp_path_factory) -> dict[str, Path]:
    """Run the selected presets (``-k``); returns preset name -> its output dir. One torchrun per
    world size, all started together."""
    base = tmp_path_factory.mktemp("presets")
    _materialize_models()
    selected = {
        item.callspec.params["preset"].name
        for item in request.session.items
        if hasattr(item, "callspec") and isinstance(item.callspec.params.get("preset"), Preset)
    }
    worlds: dict[int, list[Preset]] = {}
    for preset in PRESETS:
        if preset.name in selected and _loadable(preset):
            worlds.setdefault(preset.world_size, []).append(preset)
    env = {
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "PYTHONWARNINGS": "ignore",
        "TOKENIZERS_PARALLELISM": "false",
    }

    def run_world(world_size: int, presets: list[Preset]) -> None:
        out = base / f"world{world_size}"
        out.mkdir()
        try:  # a world that fails or times out leaves its presets unfinished: each test says so
            launch(
                [str(out), *(str(p.path) for p in presets)],
                nproc=world_size,
                log=out / "launch.log",
                timeout=WORLD_TIMEOUT_S,
                env=env,
                script=Path(__file__).resolve(),
            )
        except TimeoutError:
            pass

    with ThreadPoolExecutor(len(worlds)) as pool:  # the worlds run side by side
        for done in [pool.submit(run_world, w, presets) for w, presets in worlds.items()]:
            done.result()
    return {p.name: base / f"world{p.world_size}" for ps in worlds.values() for p in ps}


def _outcome(out: Path, preset: Preset) -> dict | None:
    results = out / "results.jsonl"
    lines = results.read_text().splitlines() if results.is_file() else []
    return next((r for r in map(json.loads, lines) if r["preset"] == preset.name), None)


def _hf_checkpoint_bytes(model: str) -> int:
    """Bytes of every tensor in the model's HF safetensors file (its header lists them)."""
    from megamarl.models.packaged import resolve_model_path

    total = 0
    for path in sorted(resolve_model_path(model).glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        header.pop("__metadata__", None)
        total += sum(end - start for start, end in (v["data_offsets"] for v in header.values()))
    return total


def _run_records(preset: Preset, out: Path) -> list[dict]:
    outcome = _outcome(out, preset)
    log = (out / "launch.log").read_text()[-4000:]
    assert outcome is not None, f"{preset.name} did not finish (world {preset.world_size}); log tail:\n{log}"
    assert outcome["rc"] == 0, f"{preset.name}: scripts/train.py returned {outcome['rc']}\n{log}"
    run_dir = out / "runs" / f"preset_{preset.name}"
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_policy(
    name: str, policy, adapters: set[str], records: list[dict], frozen: set[str] = frozenset()
) -> None:
    """The step-1 update changed the weights (non-zero gradient), every step pushed them (the full
    model, or L2: each trained adapter and nothing else; never a ``frozen`` one), and the engines served
    them at the last step (step 2: the weights pushed after step 1's update; a 1-step preset: the push
    before its rollout)."""
    full_bytes = _hf_checkpoint_bytes(policy.model)
    prefix = f"weight_sync/{name}/"
    for r in records:
        pushed = {k: v for k, v in r.items() if k.startswith(prefix) and k.endswith("/bytes")}
        if policy.lora is None:  # every tensor of the model reached the engine rank
            assert pushed == {f"{prefix}bytes": full_bytes}, f"step {r['step']}: '{name}' pushed {pushed}"
        else:
            each = {k: v for k, v in pushed.items() if k != f"{prefix}bytes"}
            assert set(each) == {f"{prefix}{a}/bytes" for a in adapters}, f"'{name}' pushed {pushed}"
            assert 0 < sum(each.values()) < full_bytes / 10, f"'{name}': not adapter-only: {pushed}"
            assert pushed[f"{prefix}bytes"] == sum(each.values()) and r[f"{prefix}adapters_pushed"] == len(
                adapters
            )
            for a in adapters | frozen:
                steps, dropped = (r[f"policy/{name}/adapter/{a}/{k}"] for k in ("steps", "samples_dropped"))
                assert (steps, dropped) == (float(a in adapters), 0.0), f"step {r['step']} adapter '{a}'"
    assert records[0][f"policy/{name}/grad_norm"] > 0, f"policy '{name}': zero gradient at step 1"
    for key in ("tis_weight_mean", "tis_weight_max"):
        value = records[-1][f"policy/{name}/{key}"]
        assert abs(value - 1) < TIS_TOLERANCE, (
            f"policy '{name}': last step's {key}={value}: the engine did not serve the weights pushed before "
            "it"
        )


# ---- the checks -----------------------------------------------------------------------------------
def test_presets_load_and_place():
    """Every preset (L2 included) passes config validation and placement at its world size."""
    for preset in filter(_loadable, PRESETS):
        cfg = _load(preset.path)
        assert preset.world_size == _world_size(cfg), f"{preset.name}: WORLD_SIZES says {preset.world_size}"
        placement_of(cfg, preset.world_size)
        assert cfg.trainer.total_steps == NUM_STEPS, f"{preset.name}: presets are 2-step smoke runs"
        assert cfg.name == f"preset_{preset.name}", f"{preset.name}: run name should be preset_<file stem>"


def test_docs_list_every_preset():
    text = (ROOT / "docs" / "configs.md").read_text()
    missing = [p.name for p in PRESETS if f"presets/{p.name}.yaml" not in text]
    assert not missing, f"docs/configs.md does not list {missing}"


@pytest.mark.slow
@pytest.mark.timeout(WORLD_TIMEOUT_S + 300)
# the presets of an optional extra are trained by their own tests (EXTRA_PRESETS), not launched here
@pytest.mark.parametrize("preset", [_param(p) for p in PRESETS if p.name not in EXTRA_PRESETS])
def test_preset_trains_and_syncs(preset: Preset, preset_runs):
    out = preset_runs[preset.name]
    records = _run_records(preset, out)
    num_steps = _num_steps(preset.name, preset.world_size)
    assert [r["step"] for r in records] == list(range(1, num_steps + 1))
    cfg = _load(preset.path)
    stats = ("num_samples", "reward_mean", "success", "invalid_rate", "response_len")
    for agent in cfg.agents:
        assert all(f"agent/{agent}/{s}" in r for r in records for s in stats), f"agent '{agent}': no metrics"
        assert all(r[f"agent/{agent}/num_samples"] > 0 for r in records), f"agent '{agent}' missed a step"
    frozen = {name for name, p in cfg.policies.items() if p.frozen}
    for name in sorted({a.policy for a in cfg.agents.values() if not a.frozen} - frozen):
        adapters = {a.lora for a in cfg.agents.values() if a.policy == name and a.lora and not a.frozen}
        frozen_adapters = {a.lora for a in cfg.agents.values() if a.policy == name and a.lora} - adapters
        _check_policy(name, cfg.policies[name], adapters, records, frozen_adapters)
    assert records[-1]["async/staleness_max"] == 0, (
        "the last step's samples lack the weight version pushed before it"
    )
    if cfg.rollout.env_workers.backend != "inline":  # code: the judge's steps ran in the env workers
        assert all(r["env_workers/calls"] > 0 for r in records), (
            "no env step went through rollout.env_workers"
        )
    run_dir = out / "runs" / cfg.name
    assert (run_dir / "checkpoints" / f"step_{num_steps:06d}" / "COMPLETE").is_file()
    if cfg.eval.num_tasks > 0:
        evals = json.loads((run_dir / "eval.json").read_text())
        assert [e["step"] for e in evals] == [0, num_steps]


# ---- the launcher (runs in each rank of a world) ---------------------------------------------------------
def _run_presets(out: Path, configs: list[str]) -> None:
    """Run ``scripts/train.py`` for each config in turn inside this world; rank 0 appends each
    result to ``out/results.jsonl``. A failing preset raises, which ends the world (the launcher
    stops the other ranks, as torchrun does): the presets after it are reported as not finished."""
    import runpy

    from megamarl.cli.configure import load_config

    train = runpy.run_path(str(ROOT / "scripts" / "train.py"), run_name="megamarl_train")["main"]
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    for config in configs:
        start = time.perf_counter()
        steps = _num_steps(Path(config).stem, world_size)
        rc = train(
            [
                "--config",
                config,
                f"output_dir={out / 'runs'}",
                *_fp32_overrides(load_config(config).policies),
                *PRESET_OVERRIDES.get(Path(config).stem, []),
                f"trainer.total_steps={steps}",
            ]
        )
        if rank == 0:
            record = {"preset": Path(config).stem, "rc": rc, "seconds": round(time.perf_counter() - start, 1)}
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[presets] {record}", flush=True)


if __name__ == "__main__":
    _run_presets(Path(sys.argv[1]), sys.argv[2:])
