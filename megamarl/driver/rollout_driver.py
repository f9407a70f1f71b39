"""Rank 0's half of a run: engines, agents, env, orchestra, the rollout schedule, batch preparation,
logging and evaluation.

The trainer (``megamarl.trainer.Trainer``) asks the driver for the next training batch
(``collect``), brackets weight pushes with ``weight_update`` and hands it the step's metrics
(``log``). Where the batch comes from is the schedule's business (``driver.schedules``, one class
per ``trainer.mode``); what happens to collected samples is ``rl.prepare.prepare_rollout``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

from transformers import AutoTokenizer

import megamarl.orchestration  # noqa: F401 - registers the built-in agents, envs, orchestras
from megamarl.config import RunConfig, to_yaml
from megamarl.driver.opponent_pool import OpponentPool
from megamarl.driver.schedules import SCHEDULES, build_schedule
from megamarl.driver.streaming import RolloutLoop
from megamarl.errors import RolloutFailureError
from megamarl.models.packaged import resolve_model_path
from megamarl.orchestration.agents import build_agents
from megamarl.orchestration.env import EnvMaker
from megamarl.orchestration.episodes import RolloutResult, check_failures, run_episodes
from megamarl.orchestration.orchestras import build_orchestra, default_kinds
from megamarl.orchestration.workers import EnvWorkers, make_workers
from megamarl.parallel.hardware import describe_dtype_choice, policy_dtype
from megamarl.registry import import_plugins, resolve_callable
from megamarl.rl.advantages import estimator_traits
from megamarl.rl.batch import SampleBatch, collate
from megamarl.rl.batch_metrics import success_metrics
from megamarl.rl.prepare import prepare_rollout
from megamarl.rl.rewards import algorithm_at_step
from megamarl.rl.sample import mark_episode_ends
from megamarl.rollout.engines.base import Engine
from megamarl.rollout.engines.lora_backends import lora_serving
from megamarl.rollout.replicas.factory import build_engine, engine_threads
from megamarl.rollout.replicas.policy import PolicyReplicas
from megamarl.rollout.replicas.pool import EnginePool
from megamarl.runtime.metrics import MetricsLogger
from megamarl.runtime.plot import plot_run
from megamarl.runtime.progress import Phase, RunProgress
from megamarl.runtime.transcripts import episode_transcripts, trained_groups

EVAL_SEED = 10**9 + 7  # held-out tasks: a seed the training stream never uses


class RolloutDriver:
    """Rank 0's half: engines, agents, env, orchestra, batch preparation, logging and evaluation."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        progress: RunProgress | None = None,
        replicas: dict[str, PolicyReplicas] | None = None,
    ):
        self.cfg = cfg
        # every policy's replicas (megamarl.rollout.replicas.policy): the driver's engines are attached to
        # them, and they pause / sleep / wake / push (None: in-process engines only, none attached)
        self.replicas = replicas or {}
        self.run_dir = run_dir
        self.progress = progress or RunProgress(
            total_steps=cfg.trainer.total_steps, enabled=cfg.logger.progress
        )
        self._phase: Phase | None = None  # the phase that finished episodes count towards (rollout or eval)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        import_plugins(cfg.plugins, paths=cfg.plugin_paths)
        paths = {
            name: resolve_model_path(p.model, key=f"policies.{name}.model")
            for name, p in cfg.policies.items()
        }
        self.tokenizers = {name: AutoTokenizer.from_pretrained(path) for name, path in paths.items()}
        # each policy's rows are padded with its own tokenizer's id (an L3 team may mix tokenizer families)
        self.pad_ids = policy_pad_ids(self.tokenizers)
        self.engines = self._start_engines(paths)
        self.env = EnvMaker(cfg.env.name, **cfg.env.kwargs)
        self.orchestra = build_orchestra(cfg.orchestra.name, **cfg.orchestra.kwargs)
        self.agents = build_agents(cfg.agents, self.tokenizers, default_kinds=self._default_kinds(self.env))
        self.policy_mapping = _policy_mapping(cfg, self.tokenizers)
        # rollout.opponent_pool: the mapping's alias becomes a snapshot policy per episode
        self.opponent_pool = (
            OpponentPool(cfg.rollout.opponent_pool) if cfg.rollout.opponent_pool.enabled else None
        )
        if self.opponent_pool is not None:
            self.policy_mapping = self.opponent_pool.mapping(self.policy_mapping)
        self.logger = MetricsLogger(
            run_dir, cfg.logger, cfg.name, json.loads(json.dumps(asdict(cfg), default=str)), rank=0
        )
        self.rollout_seconds = 0.0
        self.totals = {
            "dropped_episodes": 0,
            "failed_episodes": 0,
            "dropped_groups": 0,
            "refill_rounds": 0,
            "refill_exhausted": 0,
            "dropped_incomplete_episodes": 0,
        }
        # eval set name ("" = the unnamed default set) -> env (eval.env / eval.sets; default: training env)
        self.eval_envs = {
            name: EnvMaker(env.name, **env.kwargs) for name, env in cfg.eval.resolved_sets(cfg.env).items()
        }
        if cfg.eval.sets or cfg.eval.env.is_set():
            for name, env in cfg.eval.resolved_sets(cfg.env).items():
                self.console_print(f"eval set {name or '(default)'}: env {env.name} {env.kwargs}")
        self.env_workers = self._start_env_workers()
        self.loop = RolloutLoop()  # every engine call of the driver runs on this one event loop
        self.schedule = build_schedule(cfg, self, self.loop)  # trainer.mode
        self.console_print(self.schedule.describe())

    def _start_engines(self, paths: dict[str, Path]) -> dict[str, Engine]:
        """One engine per policy (several replicas: an EnginePool), with its CPU threads and dtype."""
        cfg = self.cfg
        overlaps = SCHEDULES.traits(cfg.trainer.mode, key="trainer.mode").overlaps_training
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        engines: dict[str, Engine] = {}
        with self.progress.phase(
            "engine start-up", total=len(cfg.policies), unit="policies", in_step=False
        ) as phase:
            for name, p in cfg.policies.items():
                replicas = self.replicas.get(name)
                if replicas is not None and replicas.served:
                    servers = replicas.servers
                    assert servers is not None  # served
                    self.progress.line(
                        f"policy {name}: {len(servers.urls)} x {p.engine.backend} server "
                        f"(tp {p.engine.tp}) at {', '.join(servers.urls)}"
                    )
                    engines[name] = replicas.connect()
                    phase.advance()
                    continue
                threads = engine_threads(p.engine, overlaps_training=overlaps, num_local_ranks=local_ranks)
                self.progress.line(
                    f"policy {name}: {p.engine.num_replicas} x {p.engine.backend} engine, "
                    f"dtype {describe_dtype_choice(p.engine.dtype)}, {threads} CPU threads; "
                    f"training dtype {policy_dtype(cfg, name)}"
                )
                engines[name] = build_engine(
                    p.engine,
                    paths[name],
                    seed=cfg.trainer.seed,
                    lora=lora_serving(cfg, name),
                    num_threads=threads,
                )
                if replicas is not None:
                    replicas.attach(engines[name])
                phase.advance()
        return engines

    def _start_env_workers(self) -> EnvWorkers | None:
        """``rollout.env_workers``, built once for the run when an env of the run (training or eval)
        steps remotely (``Env.remote_step``: the code env's judge); None when none does: every env
        step is then a cheap call on the event loop and no worker would ever be used."""
        config = self.cfg.rollout.env_workers
        makers = [self.env, *self.eval_envs.values()]
        remote = sorted({maker.name for maker in makers if maker.env_cls.remote_step})
        if not remote:
            if config.backend != "inline":
                self.console_print(
                    f"rollout.env_workers: no {config.backend} workers started: no env of this run "
                    "has remote steps (Env.remote_step)"
                )
            return None
        with self.progress.phase("env workers start-up", in_step=False):
            workers = make_workers(config)
        where = (
            "on the driver's event loop"
            if config.backend == "inline"
            else f"in {config.num_workers} {config.backend} workers"
            + (f" at {config.address}" if config.address else "")
        )
        self.console_print(f"env steps of {', '.join(remote)}: {where} (rollout.env_workers)")
        return workers

    def engines_for(self, policy: str) -> list[Engine]:
        """The engines a weight push of ``policy`` goes to (one Engine or EnginePool per policy)."""
        return [self.engines[policy]]

    def task_chunk(self, index: int):
        """The ``index``-th chunk of training tasks and its sampling seed (sync: chunk = step)."""
        seed = self.cfg.trainer.seed * 1_000_003 + index
        return self.env.tasks(self.cfg.rollout.num_tasks, seed=seed), seed

    async def episodes(self, tasks, *, group_size: int, agents=None, seed: int | None = None, env=None):
        result = await run_episodes(
            self.orchestra,
            env or self.env,
            tasks,
            agents=agents or self.agents,
            engines=self.engines,
            group_size=group_size,
            max_concurrency=self.cfg.rollout.max_concurrency,
            workers=self.env_workers,
            step_timeout_s=self.cfg.rollout.env_timeout_s,
            seed=seed,
            policy_mapping=self.policy_mapping,
            on_episode=self._episode_done,
        )
        # before a schedule can drop any part of an episode (a stale policy share): preparation then
        # knows which episodes lost their last step
        mark_episode_ends(result.samples)
        return result

    def _episode_done(self, samples) -> None:
        """Counts a finished episode (and its generated tokens) towards the current phase's display."""
        phase = self._phase
        if phase is not None:
            phase.advance(tokens=sum(len(s.response_ids) for s in samples))

    def _run(self, tasks, *, group_size: int, agents=None, seed: int | None = None, env=None):
        return self.loop.run(self.episodes(tasks, group_size=group_size, agents=agents, seed=seed, env=env))

    def weight_update(self):
        """Context for a weight push: the schedule drains or pauses the rollout around it."""
        return self.schedule.weight_update()

    def collect(self, step: int, versions: dict[str, int]) -> tuple[SampleBatch, dict[str, float]]:
        """The next batch from the schedule, with advantages; ``versions`` are the trainer's weight
        versions, against which samples beyond ``trainer.max_staleness`` are dropped."""
        start = time.perf_counter()
        # keys: policies, and <policy>/<agent> for L2 agents (WeightVersions.serving)
        trainable = {k: v for k, v in versions.items() if not self.cfg.policies[k.split("/")[0]].frozen}
        expected = (
            None
            if self.schedule.overlaps_training
            else self.cfg.rollout.num_tasks * self.cfg.rollout.group_size
        )
        with self.progress.phase("rollout", total=expected) as self._phase:
            result, metrics = self.schedule.next_rollout(step, trainable)
        self._phase = None
        rollout_s = time.perf_counter() - start
        num_tokens = sum(len(s.response_ids) for s in result.samples)
        metrics.update(
            {
                "timing_s/rollout": rollout_s,
                "perf/rollout_tokens_per_s": num_tokens / max(rollout_s, 1e-9),
                **result.summary(),
            }
        )
        self.totals["dropped_episodes"] += result.num_dropped
        self.totals["failed_episodes"] += result.num_failed
        for key in ("dropped_stale_groups", "dropped_stale_samples"):
            self.totals[key] = self.totals.get(key, 0) + int(
                metrics[f"async/{key}"]
            )  # absent in old checkpoints
        check_failures(
            result, max_failed_fraction=self.cfg.rollout.max_failed_fraction, what=f"step {step + 1} rollout"
        )
        self._log_transcripts(step + 1, result)
        if not result.samples:
            raise RolloutFailureError(result.failure_report(f"step {step + 1}: no samples"))
        algo = algorithm_at_step(
            self.cfg.algorithm, step, total_steps=self.cfg.trainer.total_steps
        )  # annealed team_alpha
        # policies.<p>.algorithm changes advantages (a mismatch override only the worker's loss)
        own = any(p.algorithm.advantage_overrides() for p in self.cfg.policies.values())
        batch, prepare_metrics = prepare_rollout(
            result.samples,
            result.episodes,
            algo,
            pad_id=self.pad_ids,
            num_tasks=self.cfg.rollout.num_tasks,
            draw=lambda round_: self._refill(step, round_),
            policy_algos=self.cfg.policy_algorithms(algo) if own else None,
        )
        if self.cfg.logger.trained_groups:
            keys = {
                name: estimator_traits(a.estimator).key(a.group_by)
                for name, a in self.cfg.policy_algorithms(algo).items()
            }
            self.logger.log_trained_groups(step + 1, trained_groups(batch, keys))
        self.totals["dropped_groups"] += int(prepare_metrics.get("rollout/dropped_groups", 0))
        for key in ("refill_rounds", "refill_exhausted", "dropped_incomplete_episodes"):
            self.totals[key] += int(prepare_metrics.get(f"rollout/{key}", 0))
        metrics.update(prepare_metrics)
        if algo.team_alpha_schedule.anneals:
            metrics["algorithm/team_alpha"] = algo.team_alpha
        if self.opponent_pool is not None:
            metrics.update(self.opponent_pool.metrics())
        for name, engine in self.engines.items():
            if isinstance(engine, EnginePool):
                metrics.update({f"engine/{name}/{k}": v for k, v in engine.counters().items()})
        if self.env_workers is not None:
            metrics.update({f"env_workers/{k}": v for k, v in self.env_workers.counters().items()})
        metrics.update({f"orchestra/{k}": v for k, v in self.orchestra.counters().items()})
        return batch, metrics

    def _log_transcripts(self, step: int, result: RolloutResult) -> None:
        """A few of the step's episodes, as the agents saw and said them (``logger.episodes_per_step``)."""

        def parse(agent: str, text: str):
            value, valid = self.agents[agent].parse(text)
            return value if valid else None

        def decode(policy: str, ids: list[int]) -> str:
            # policies that share an agent (rollout.policy_mapping) share one vocabulary (_policy_mapping)
            tokenizer = self.tokenizers.get(policy) or next(iter(self.tokenizers.values()))
            return tokenizer.decode(ids, skip_special_tokens=False)

        records = episode_transcripts(
            result.samples,
            result.episodes,
            step=step,
            parse=parse,
            decode=decode,
            limit=self.cfg.logger.episodes_per_step,
        )
        self.logger.log_episodes(step, records)

    def _refill(self, step: int, round_: int) -> SampleBatch | None:
        """A fresh chunk for dynamic sampling's refill: its own seed (negative chunk indices, which the
        training stream never uses) and task ids suffixed so its groups never merge with the batch's."""
        tasks, seed = self.task_chunk(-(step * self.cfg.algorithm.max_refill_rounds + round_))
        tasks = [replace(t, task_id=f"{t.task_id}~refill{round_}") for t in tasks]
        result = self._run(tasks, group_size=self.cfg.rollout.group_size, seed=seed)
        self.totals["dropped_episodes"] += result.num_dropped
        self.totals["failed_episodes"] += result.num_failed
        if not result.samples:
            return None
        return collate(result.samples, pad_id=self.pad_ids)

    def evaluate(self, step: int) -> dict:
        """Greedy evaluation on every eval set (``eval.env`` / ``eval.sets``); one eval.json entry
        holds them all: the unnamed default set as ``team_accuracy``, ``avg@k``, ...; a named set as
        ``<set>/team_accuracy`` (logged as ``eval/<set>/team_accuracy``)."""
        e, start = self.cfg.eval, time.perf_counter()
        # evaluation is one pass: no best-of-K with the env's check fn (tree_k=1)
        greedy = {
            role: replace(
                a, sampling=replace(a.sampling, temperature=e.temperature, top_p=1.0, top_k=-1), tree_k=1
            )
            for role, a in self.cfg.agents.items()
        }
        results: dict = {}
        failures, outcomes = [], []
        for name, env in self.eval_envs.items():
            agents = build_agents(greedy, self.tokenizers, default_kinds=self._default_kinds(env))
            tasks = env.tasks(e.num_tasks, seed=EVAL_SEED)
            label = f"eval {name} at step {step}" if name else f"eval at step {step}"
            with self.progress.phase(label, total=len(tasks) * e.k, in_step=False) as self._phase:
                result = self._run(tasks, group_size=e.k, agents=agents, seed=EVAL_SEED, env=env)
            self._phase = None
            prefix = f"{name}/" if name else ""
            results.update({prefix + key: value for key, value in eval_summary(result, k=e.k).items()})
            what = f"eval {name + ' ' if name else ''}step {step}"
            outcomes.append((result, what))
            if result.num_failed == len(result.episodes) and result.episodes:
                # an all-failed set is marked failed, not scored: its 0.000 says nothing about the model
                failures.append(result.failure_report(what))
                self.console_print(f"FAILED (no episode finished) {failures[-1]}")
            elif result.num_failed:
                self.console_print(result.failure_report(what))
        self.logger.log_eval(step, results, failure="; ".join(failures) or None)
        self.progress.evaluated(step, time.perf_counter() - start)
        self.console_print(f"eval step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in results.items()))
        for result, what in outcomes:
            check_failures(result, max_failed_fraction=self.cfg.rollout.max_failed_fraction, what=what)
        return results

    def log(self, step: int, metrics: dict[str, float]) -> None:
        metrics.update(self.schedule.interval_metrics())
        for key, value in self.totals.items():
            metrics[f"rollout/total_{key}"] = float(value)
        self.logger.log(step, metrics)
        shown = {
            k: metrics[k]
            for k in ("rollout/team_reward_mean", "rollout/success_rate", "timing_s/step")
            if k in metrics
        }
        self.console_print(f"step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in shown.items()))

    def log_if_missing(self, step: int, line: dict[str, float]) -> None:
        """Resume: ``line`` (the metrics of ``step`` as they stood at its save) logged when metrics.jsonl
        ends before ``step``: the run died between the save and the line. It lacks what the step
        measured after its save (its time is the time to the save)."""
        if line and self.logger.last_step() < step:
            self.console_print(f"step {step}'s metrics line, logged from its checkpoint:")
            self.log(step, dict(line))

    def console_print(self, text: str) -> None:
        self.progress.line(text)

    def state_dict(self) -> dict:
        """Running totals and ``rollout_state``: what the schedule owns at this step boundary (the
        prefetched batch of one_step_off; fully_async's drained buffer and task cursor). Tasks and
        sampling seeds are functions of (trainer.seed, chunk); RNGs are saved per rank by the Checkpointer.
        A schedule that cannot be saved (its rollout already failed) saves no rollout_state: the
        resumed run regenerates from the step, and meets the error again."""
        try:
            rollout = {"mode": self.cfg.trainer.mode, **self.schedule.state_dict()}
        except Exception as exc:  # noqa: BLE001 - never break the collective save over the rollout side
            self.console_print(f"rollout_state not saved ({type(exc).__name__}: {exc})")
            rollout = None
        return {"totals": dict(self.totals), "rollout_state": rollout}

    def load_state_dict(self, state: dict) -> None:
        self.totals = {**self.totals, **state["totals"]}  # counters added since an old checkpoint start at 0
        rollout, mode = state.get("rollout_state"), self.cfg.trainer.mode
        if rollout is not None and rollout["mode"] == mode:
            self.schedule.load_state_dict(rollout)
        elif SCHEDULES.traits(mode, key="trainer.mode").overlaps_training or (
            rollout and rollout["mode"] != "sync"
        ):
            saved = (
                "no rollout_state" if rollout is None else f"rollout_state of trainer.mode={rollout['mode']}"
            )
            self.console_print(
                f"resume: the checkpoint has {saved}; trainer.mode={mode} starts its rollout afresh "
                "from the checkpoint's step (buffered or prefetched groups are regenerated or lost)"
            )

    def _default_kinds(self, env: EnvMaker) -> dict[str, str]:
        return default_kinds(self.orchestra, env.agents, env.default_agents)

    def close_env_workers(self) -> None:
        """Stop the env workers now (a step still running is killed; a local Ray cluster the run started
        is stopped). Idempotent; ``close`` calls it, and the trainer on its way out of an error, where
        no collective ``close`` runs: a worker left running would outlive the run or hold up its exit."""
        if self.env_workers is not None:
            self.env_workers.close()

    def close(self) -> None:
        self.schedule.close()
        self.loop.close()  # no episode runs any more: the env workers can go
        self.close_env_workers()
        self.logger.close()
        for engine in self.engines.values():
            engine.shutdown()
        if self.cfg.logger.plots:
            plot_run(self.run_dir)


def policy_pad_ids(tokenizers: dict) -> dict[str, int]:
    """Policy -> its tokenizer's pad id (its eos id where it has none)."""
    return {
        name: t.eos_token_id if t.pad_token_id is None else t.pad_token_id for name, t in tokenizers.items()
    }


def _policy_mapping(cfg: RunConfig, tokenizers: dict):
    """``rollout.policy_mapping`` resolved; its policies must share one vocabulary, since an agent's
    prompt is tokenized once, whichever policy serves it."""
    if not cfg.rollout.policy_mapping:
        return None
    vocabs = {name: tok.get_vocab() for name, tok in tokenizers.items()}
    first = next(iter(vocabs))
    for name, vocab in vocabs.items():
        if vocab != vocabs[first]:
            raise ValueError(
                f"rollout.policy_mapping: policies '{first}' and '{name}' have different tokenizers"
            )
    return resolve_callable(cfg.rollout.policy_mapping, key="rollout.policy_mapping")


def eval_summary(result: RolloutResult, *, k: int) -> dict[str, float]:
    """Team accuracy (mean success over all episodes), avg@k and pass@k over each task's k episodes,
    and each agent's / policy's own success rate."""
    by_task: dict[str, list[bool]] = {}
    for episode in result.episodes:
        by_task.setdefault(episode.task_id, []).append(episode.status == "ok" and episode.success)
    num = max(len(by_task), 1)
    return {
        "team_accuracy": sum(sum(v) for v in by_task.values())
        / max(sum(len(v) for v in by_task.values()), 1),
        f"avg@{k}": sum(sum(v) / len(v) for v in by_task.values()) / num,
        f"pass@{k}": sum(any(v) for v in by_task.values()) / num,
        "num_tasks": float(len(by_task)),
        **success_metrics(e for e in result.episodes if e.status == "ok"),
        "num_failed": float(result.num_failed),
    }
