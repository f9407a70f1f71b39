"""Shared fixtures, tier skips (vllm, gpu) and the parallel schedule (pytest-xdist, docs/testing.md)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# ---- the parallel schedule (docs/testing.md) --------------------------------------------------------
# `python -m pytest` runs on two xdist workers (pyproject: -n 2 --dist loadscope --no-loadscope-reorder);
# `UnitScheduling` below replaces loadscope's scopes with these work units. A unit goes to one worker
# whole, and units are handed out in the order of the collection, which `_order_units` sets:
#
# * "serial": the tests that must not run at the same time as each other: the real vLLM servers and
#   in-process vLLM (vLLM-CPU start-up is the most CPU-hungry phase of the suite, and test_vllm_servers
#   checks that /dev/shm holds no bucket file of a push after it, which a concurrent colocated push
#   would break), the README's command (2 ranks of SmolLM2 + vLLM, on torchrun's default port) and
#   test_driver_wait (collective timeouts of 2 s). First in the queue: one worker runs these one at a
#   time while the other takes the rest.
# * every other module is a unit of its own, so its module-scoped fixtures (one training run shared by
#   several tests) run once; in SPLIT_MODULES every test is a unit. Units are queued longest first
#   (LONG_MODULES, then by tier, unit tests last), so both workers end on short unit tests.
#
# Ports: scripts/train.py runs through tests/train_runs.py (a free port per launch); the few modules that
# launch the real torchrun pass --standalone (a free port) or their own --master_port, except the README's
# command (torchrun's default port), which is in "serial".
# (xdist's own `--dist loadgroup` cannot group here: it renames `item._nodeid`, which pytest 9 ignores.)
SERIAL = "serial"
SERIAL_MODULES = (
    "tests/distributed/test_driver_wait.py",
    "tests/integration/test_readme_quickstart.py",
    "tests/integration/test_train_l2_servers.py",
    "tests/integration/test_train_pp_servers.py",
    "tests/integration/test_train_with_servers.py",
    "tests/integration/test_vllm_engine.py",
    "tests/integration/test_vllm_servers.py",
    "tests/integration/test_weight_sync_vllm.py",
)
# Modules whose tests are units of their own (no module fixture; their runs use distinct ports): the
# three learning runs may go to both workers.
SPLIT_MODULES = ("tests/learning/test_signalling.py",)
# vLLM outside "serial": one in-process engine of a 2-layer tiny model, started once.
VLLM_BESIDE_OTHERS = ("tests/integration/test_export.py",)
# Modules that take a minute or more on 2 cores, longest first: queued right after "serial".
LONG_MODULES = (
    "tests/slurm/test_slurm_nodes.py",  # 2 slurmd in namespace nodes, a requeued 4-rank job: ~5 min (idle)
    "tests/multinode/test_lost_node.py",  # a 2-node run, node 1 killed, the relaunch: ~3 min
    "tests/multinode/test_torchrun_nodes.py",  # torchrun --nnodes 2 in namespace nodes, a reference: ~3 min
    "tests/multinode/test_ray_nodes.py",  # a Ray cluster on two namespace nodes and a run: ~2 min
    "tests/multinode/test_link_down_run.py",  # a run whose second engine node loses its link: ~1.5 min
    "tests/integration/test_resume_training_path.py",
    "tests/integration/test_train_sglang_servers.py",  # fake and, with .venv-sglang, real SGLang servers
    "tests/integration/test_sglang_backends.py",
    "tests/integration/test_sglang_under_torchrun.py",  # with .venv-sglang: one real server, 1.5-5 min
    "tests/learning/test_signalling.py",
    "tests/integration/test_presets.py",
    "tests/integration/test_export.py",
    "tests/integration/test_evaluate.py",
    "tests/integration/test_resume.py",
    "tests/distributed/test_models_bridge.py",
    "tests/integration/test_preemption.py",
    "tests/integration/test_async_resume.py",
    "tests/integration/test_trainer_features.py",
    "tests/integration/test_async_modes.py",
    "tests/integration/test_env_workers.py",  # ~1.3 min: a process-worker run, a Ray run, a killed driver
    "tests/integration/test_openai_team_example.py",  # the example through scripts/train.py, 2 steps
)
TIERS = ("learning", "slow", "integration", "distributed")  # then the unit tests, in collection order


def work_unit(nodeid: str) -> str:
    """The unit a test belongs to, from its node id alone (the xdist controller has no items)."""
    module = nodeid.split("::", 1)[0]
    if module in SERIAL_MODULES:
        return SERIAL
    return nodeid if module in SPLIT_MODULES else module


def _queue_key(item) -> tuple[int, int]:
    module = item.nodeid.split("::", 1)[0]
    if work_unit(item.nodeid) == SERIAL:
        return (0, 0)
    if module in LONG_MODULES:
        return (1, LONG_MODULES.index(module))
    for i, marker in enumerate(TIERS):
        if item.get_closest_marker(marker):
            return (2, i)
    return (3, 0)


def _order_units(items) -> None:
    """Order the items unit by unit, in queue order. A unit's place is that of its earliest-queued test;
    the sort is stable, so each unit keeps its tests in their collected order."""
    place: dict[str, tuple] = {}
    for i, item in enumerate(items):
        unit = work_unit(item.nodeid)
        place[unit] = min(place.get(unit, (*_queue_key(item), i)), (*_queue_key(item), i))
    items.sort(key=lambda item: place[work_unit(item.nodeid)])


def _check_serial(items) -> None:
    """A test that starts vLLM must be in "serial" (see above): fail the collection, not the run later."""
    stray = [
        i.nodeid
        for i in items
        if i.get_closest_marker("vllm") and work_unit(i.nodeid) not in (SERIAL, *VLLM_BESIDE_OTHERS)
    ]
    if stray:
        raise pytest.UsageError(f"vllm tests outside tests/conftest.py's SERIAL_MODULES: {stray}")


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") != "loadscope":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class UnitScheduling(LoadScopeScheduling):
            """loadscope with ``work_unit`` as the scope."""

            def _split_scope(self, nodeid: str) -> str:
                return work_unit(nodeid)

        return UnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    has_vllm = importlib.util.find_spec("vllm") is not None
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(
                pytest.mark.skip(
                    reason="vllm (vllm-cpu) not installed: bash scripts/setup.sh --extras vllm-cpu"
                )
            )
        if (
            item.get_closest_marker("gpu") and not has_cuda
        ):  # the marker (a tests/gpu "keyword" is the folder)
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
    _check_serial(items)
    if hasattr(config, "workerinput"):  # an xdist worker: every worker orders the same collection alike
        _order_units(items)


@pytest.fixture(scope="session")
def smollm2_path():
    from megamarl.models.packaged import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


# ---- CPU time per test (docs/testing.md) ------------------------------------------------------------
# MEGAMARL_TEST_TIMES=<file>: every test appends "<cpu_s> <wall_s> <nodeid>" (setup + call + teardown;
# CPU of this process and of the children it waited for: torchrun, its ranks, engine servers). CPU
# seconds barely change with the machine's load, unlike --durations' wall times, so they say where the
# suite's time goes even when measured beside other work.
if os.environ.get("MEGAMARL_TEST_TIMES"):
    import resource
    import time

    def _cpu_s() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        cpu, wall = _cpu_s(), time.monotonic()
        yield
        with open(os.environ["MEGAMARL_TEST_TIMES"], "a") as f:
            f.write(f"{_cpu_s() - cpu:.1f} {time.monotonic() - wall:.1f} {item.nodeid}\n")


# ---- ranks forked from a preloaded server (tests/train_runs.py, megamarl.parallel.launch) ------------
# Registered before any test starts ranks, so the fork server, started by the first one, imports what
# scripts/train.py's ranks need as well as what run_ranks bodies need.
def pytest_configure(config):
    from train_runs import TRAIN_PRELOAD

    from megamarl.parallel.launch import rank_context

    rank_context(TRAIN_PRELOAD)
