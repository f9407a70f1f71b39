"""Env workers: a crashing, hanging or raising env fails only its episode (counted); the run goes on."""

import asyncio
import concurrent.futures
import sys
import time

import pytest
from scripted import ScriptedEngine, fixed, smollm2_tokenizer  # tests/ helper

from megamarl.orchestration import (
    AgentConfig,
    EnvMaker,
    EnvWorkerError,
    Task,
    WorkersConfig,
    build_agents,
    build_orchestra,
    make_workers,
    run_episodes,
)
from megamarl.orchestration.workers import ProcessWorkers, check_workers


def _rollout(workers, faults, *, step_timeout_s=30.0, **kwargs):
    tok = smollm2_tokenizer()
    maker = EnvMaker("testing_faulty")
    agents = build_agents({"actor": AgentConfig(policy="default")}, tok, default_kinds=maker.default_agents)
    tasks = [Task(f"t{i}-{fault}", fault) for i, fault in enumerate(faults)]
    return asyncio.run(
        run_episodes(
            build_orchestra("sequential", max_steps=2),
            maker,
            tasks,
            agents=agents,
            engines={"default": ScriptedEngine(tok, fixed("ok"))},
            workers=workers,
            step_timeout_s=step_timeout_s,
            **kwargs,
        )
    )


def test_config_validation():
    with pytest.raises(ValueError, match="rollout.env_workers.num_workers"):
        WorkersConfig(num_workers=0)
    with pytest.raises(ValueError, match="rollout.env_workers.backend='threads'"):
        make_workers(backend="threads")
    with pytest.raises(ValueError, match="rollout.env_workers.address is set but backend='process'"):
        check_workers(WorkersConfig(backend="process", address="auto"))  # load time
    with pytest.raises(ValueError, match="rollout.env_workers.resources is set but backend='process'"):
        check_workers(WorkersConfig(backend="process", resources={"CPU": 1}))
    with pytest.raises(ValueError, match="rollout.env_workers.resources.env_node must be a number >= 0"):
        WorkersConfig(backend="ray", resources={"env_node": -1})
    assert WorkersConfig().backend == "inline"  # the default: today's behaviour, no processes


def test_ray_backend_needs_ray_importable(monkeypatch):
    """Rejected at load time with what to install, not when the driver builds the workers."""
    monkeypatch.setitem(sys.modules, "ray", None)  # what Python does for a package that cannot be imported
    with pytest.raises(ValueError, match=r"backend=ray needs the 'ray' package.*megamarl\[ray\]"):
        check_workers(WorkersConfig(backend="ray"))


def test_inline_worker_error_fails_only_that_episode():
    result = _rollout(make_workers(backend="inline"), ["none", "raise", "none"])
    assert [e.status for e in result.episodes] == ["ok", "failed", "ok"]
    assert result.reasons() == {"env_worker:error": 1}
    assert [s.task_id for s in result.samples] == ["t0-none", "t2-none"]
    assert all(s.local_reward == 0.5 and s.team_reward == 1.0 for s in result.samples)


def test_process_pool_crash_hang_and_error_are_counted():
    workers = make_workers(backend="process", num_workers=2)
    try:
        result = _rollout(workers, ["none", "crash", "hang", "raise", "none", "none"], step_timeout_s=1.5)
        assert [e.status for e in result.episodes] == ["ok", "failed", "failed", "failed", "ok", "ok"]
        assert result.reasons() == {"env_worker:crash": 1, "env_worker:timeout": 1, "env_worker:error": 1}
        assert result.num_failed == 3 and len(result.samples) == 3
        assert workers.num_failures == {"crash": 1, "timeout": 1, "error": 1}
        again = _rollout(workers, ["none", "none"])  # replaced slots work, on a new event loop too
        assert [e.status for e in again.episodes] == ["ok", "ok"]
    finally:
        workers.close()


def _usr1_disposition() -> bool:
    import signal

    return signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN


def test_process_workers_ignore_slurms_warning_signal():
    """Slurm's time-limit warning (USR1) reaches every process of the job step: a process worker
    ignores it (it would die of it and fail its episodes); the driver acts on it."""
    workers = make_workers(backend="process", num_workers=1)
    try:
        assert asyncio.run(workers.call(_usr1_disposition, timeout_s=60.0)) is True
    finally:
        workers.close()


def test_episode_timeout_without_workers():
    tok = smollm2_tokenizer()
    maker = EnvMaker("math", kinds=("add1",), with_verifier=False)
    agents = build_agents({"solver": AgentConfig(policy="default")}, tok, default_kinds=maker.default_agents)
    slow = ScriptedEngine(tok, fixed("5"), delay_s=5.0)
    result = asyncio.run(
        run_episodes(
            build_orchestra("sequential"),
            maker,
            maker.tasks(2),
            agents=agents,
            engines={"default": slow},
            episode_timeout_s=0.05,
        )
    )
    assert result.reasons() == {"episode_timeout": 2} and result.samples == []


@pytest.mark.slow
def test_ray_actors_crash_and_timeout():
    pytest.importorskip("ray")
    import ray

    workers = make_workers(backend="ray", num_workers=2)
    try:
        result = _rollout(workers, ["none", "crash", "hang", "none"], step_timeout_s=3.0)
        assert [e.status for e in result.episodes] == ["ok", "failed", "failed", "ok"]
        assert result.reasons() == {"env_worker:crash": 1, "env_worker:timeout": 1}
    finally:
        workers.close()
        ray.shutdown()


def _code_rollout(workers):
    """Code env episodes whose replies depend on the task (some pass part of the hidden tests, some
    none), so local rewards, tester verdicts and feedback differ between episodes."""
    tok = smollm2_tokenizer()
    maker = EnvMaker("code", kinds=("scale", "clip"))
    replies = {"scale": "def scale(x):\n    return x * 3\n", "clip": "def clip(x):\n    return x\n"}

    def policy(request):
        kind = "scale" if "scale(" in request.last_user else "clip"
        if "Write tests" in request.last_user:
            return (
                "```python\nassert scale(1) == 3\n```"
                if kind == "scale"
                else "```python\nassert clip(100) == 100\n```"
            )
        return f"```python\n{replies[kind]}```"

    agents = build_agents(
        {"coder": AgentConfig(policy="default"), "tester": AgentConfig(policy="default")},
        tok,
        default_kinds=maker.default_agents,
    )
    return asyncio.run(
        run_episodes(
            build_orchestra("solve_verify", solver="coder", verifier="tester", max_loops=2),
            maker,
            maker.tasks(4, seed=3),
            agents=agents,
            engines={"default": ScriptedEngine(tok, policy)},
            workers=workers,
            step_timeout_s=60.0,
        )
    )


def test_code_env_round_trip_through_process_workers_equals_inline():
    """The code env's judge steps in a worker process: the env is pickled there with a stripped action
    (no token-heavy samples), stepped and sent back; every episode ends as when stepped inline."""
    inline = _code_rollout(make_workers(backend="inline"))
    workers = make_workers(backend="process", num_workers=2)
    try:
        remote = _code_rollout(workers)
        assert (
            workers.num_calls
            == sum(e.num_calls.get("coder", 0) + e.num_calls.get("tester", 0) for e in remote.episodes)
            > 0
        )
    finally:
        workers.close()

    def outcome(result):
        return (
            [(s.episode_id, s.agent, s.turn, s.local_reward, s.team_reward, s.valid) for s in result.samples],
            [(e.status, e.team_reward, e.env_done, e.env_metrics) for e in result.episodes],
        )

    assert outcome(remote) == outcome(inline)
    assert (
        len({s.local_reward for s in inline.samples}) > 1
    )  # the episodes differ: a comparison that can fail


class _SlowStartWorkers(ProcessWorkers):
    """Process workers whose every slot takes ``START_S`` to start (an interpreter on a loaded machine)."""

    START_S = 3.0

    def _new_slot(self):
        return concurrent.futures.ProcessPoolExecutor(
            1, mp_context=self._context, initializer=time.sleep, initargs=(self.START_S,)
        )


def test_a_replaced_process_slot_starts_before_it_takes_a_call():
    """A slot replaced after a timeout is started before it is handed a call, so the next call's
    timeout covers that call only: on a loaded machine (CI, ``test_env_workers``) a 0.05 s judge
    timed out at 5 s because its timeout included the fresh worker's start."""
    workers = _SlowStartWorkers(WorkersConfig(backend="process", num_workers=1))

    async def calls():
        with pytest.raises(EnvWorkerError, match="timeout"):
            await workers.call(time.sleep, 60.0, timeout_s=0.5)
        return await workers.call(abs, -7, timeout_s=_SlowStartWorkers.START_S / 2)

    try:
        assert asyncio.run(calls()) == 7
        assert workers.num_failures == {"timeout": 1}
    finally:
        workers.close()
