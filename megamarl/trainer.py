"""The training loop: rollout -> advantages -> update each policy -> sync weights -> log/eval/save.

SPMD under torchrun: every rank runs ``Trainer.fit``. Rank 0 is also the *driver*: it hosts the
engines (colocated, in-process), runs the episodes, computes advantages on the gathered agent-tagged
batch and logs. Every rank holding a shard of a policy's worker group (WG) trains it; the batch
reaches workers as one broadcast object over the CPU control group. Variants (estimators, engines,
envs, orchestras) are looked up by name in registries; the loop itself has no per-variant branches.
``trainer.mode`` names the driver's rollout schedule (``megamarl.schedules``: sync, one_step_off,
fully_async; docs/async.md): where the next batch comes from and what a weight push waits for.
"""

from __future__ import annotations

import json
import os
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megamarl.async_rollout import RolloutLoop
from megamarl.config import RunConfig, to_yaml
from megamarl.orchestration.driver import RolloutFailureError, check_failures
from megamarl.parallel.distributed import control_group, init_distributed, wait_for_driver
from megamarl.parallel.hardware import DTYPES, describe_dtype_choice, resolve_dtype
from megamarl.progress import RunProgress
from megamarl.parallel.placement import build_worker_groups
from megamarl.preemption import PreemptionFlag
from megamarl.rl.advantages import CRITIC_ESTIMATORS, AdvantageConfig
from megamarl.rl.batch import SampleBatch, collate
from megamarl.rl.losses import LossConfig
from megamarl.rl.prepare import prepare_batch
from megamarl.rl.worker import AgentTraining, CriticConfig, NumericalFaultError, PolicyWorker
from megamarl.rollout.weight_sync import sync_weights
from megamarl.schedules import build_schedule, sync_interval
from megamarl.step_metrics import (
    agent_batch_metrics, idle_seconds, merge_rank_metrics, peak_memory_gib, success_metrics, throughput_metrics,
    trained_tokens,
)

DRIVER = 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: RunConfig, *, run_dir: str | Path | None = None):
        init_distributed(timeout_s=cfg.trainer.collective_timeout_s)
        self.cfg = cfg
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_driver = self.rank == DRIVER
        # the driver shows the run (live on a terminal, one line per phase in logs); others are silent
        self.progress = RunProgress(total_steps=cfg.trainer.total_steps, enabled=cfg.logger.progress) if self.is_driver \
            else RunProgress(total_steps=cfg.trainer.total_steps, enabled=False, live=False, stream=open(os.devnull, "w"))
        self.run_dir = Path(run_dir or Path(cfg.output_dir) / cfg.name)
        self.step = 0
        self.versions = {name: 0 for name in cfg.policies}  # weight pushes into the engines so far
        self.updates_since_sync = {name: 0 for name in cfg.policies}
        self.sync_every = sync_interval(cfg.trainer)  # updates of a policy per weight push
        seed_everything(cfg.trainer.seed)
        self.wgs = build_worker_groups(cfg.placement(self.world_size))
        with self.progress.phase("model preparation", total=len(cfg.policies), unit="policies", in_step=False) as phase:
            self.workers = self._build_workers(on_policy=phase.advance)
        self.driver = RolloutDriver(cfg, self.run_dir, self.progress) if self.is_driver else None
        self._wait_for_driver("engine start-up")
        self._register_adapters()
        self._maybe_resume()

    # ---- set-up ---------------------------------------------------------------------------------
    def _build_workers(self, on_policy=lambda: None) -> dict[str, PolicyWorker]:
        from megamarl.policy_io import load_policy_model

        workers = {}
        for name, policy in self.cfg.policies.items():
            wg = self.wgs[name]
            if not wg.is_member or policy.frozen:
                on_policy()
                continue
            loss_cfg = self._loss_config(policy)
            agents = {
                role: AgentTraining(
                    loss=self._loss_config(policy, **agent.train_overrides()),
                    micro_batch_size=agent.micro_batch_size or policy.micro_batch_size,
                    # an agent of a LoRA policy without an adapter acts with the frozen base
                    frozen=agent.frozen or (policy.lora is not None and agent.lora is None),
                    adapter=agent.lora, lr=agent.lr,
                )
                for role, agent in self.cfg.agents.items()
                if agent.policy == name and (agent.train_overrides() or agent.frozen or policy.lora is not None)
            }
            handle = load_policy_model(policy, wg, seed=self.cfg.trainer.seed)
            needs_ref = policy.kl_coef > 0 or any(a.loss.kl_coef > 0 for a in agents.values())
            # LoRA policies use their frozen base as the reference (adapters off): no second model
            ref = load_policy_model(policy, wg, seed=self.cfg.trainer.seed) if needs_ref and policy.lora is None else None
            workers[name] = PolicyWorker(name, policy, wg, handle, loss_cfg, agents=agents, ref_handle=ref,
                                         critic=self._critic_config(policy), lora=_lora_config(policy),
                                         compute_dtype=DTYPES[self.cfg.policy_dtype(name)])
            on_policy()
        return workers

    def _wait_for_driver(self, what: str) -> None:
        wait_for_driver(what, driver=DRIVER, timeout_s=self.cfg.trainer.collective_timeout_s)

    def _critic_config(self, policy) -> CriticConfig | None:
        algo = self.cfg.algorithm
        if algo.estimator not in CRITIC_ESTIMATORS:
            return None
        adv = AdvantageConfig(estimator=algo.estimator, norm_std=algo.normalize_std, **algo.estimator_kwargs)
        return CriticConfig(gamma=adv.gamma, lam=adv.lam, whiten=adv.norm_std, std_ddof=algo.std_ddof,
                            value_coef=policy.value_coef,
                            value_clip=policy.value_clip)

    def _loss_config(self, policy, **overrides) -> LossConfig:
        """The policy's loss settings, with an agent's overrides (``agents.<a>.clip_high``, ...) applied."""
        algo = self.cfg.algorithm
        values = dict(clip_low=policy.clip_low, clip_high=policy.clip_high, kl_coef=policy.kl_coef,
                      entropy_coef=policy.entropy_coef)
        values.update({k: v for k, v in overrides.items() if k in values})
        return LossConfig(
            **values, kl_type=algo.kl_type, agg_mode=algo.loss_agg,
            tis_mode="token" if algo.tis_cap > 0 else "none", tis_cap=algo.tis_cap or 2.0,
        )

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self) -> None:
        total = self.cfg.trainer.total_steps
        self.progress.start_at(self.step)
        if self.step == 0:
            self.sync_all_weights()  # engines start from the (possibly resumed) trained weights
            self.evaluate()
        preemption = PreemptionFlag()
        while self.step < total:
            step_start = time.perf_counter()
            batch, metrics = self.rollout_and_prepare()
            metrics.update(self.update(batch))
            metrics.update(self.sync_all_weights(self.due_for_sync()))
            self.step += 1
            metrics["timing_s/step"] = time.perf_counter() - step_start
            metrics["timing_s/idle"] = idle_seconds(metrics)
            metrics.update(throughput_metrics(
                num_train_tokens=trained_tokens(batch, self.trained_policies()), update_s=metrics["timing_s/update"],
                num_samples=batch.num_samples, step_s=metrics["timing_s/step"],
            ))
            self.progress.step_done(self.step, metrics["timing_s/step"])
            self.log(metrics)
            if self._due(self.cfg.eval.every) or self.step == total:
                self.evaluate()
            saved = self._due(self.cfg.trainer.save_every) or self.step == total
            if saved:
                self.save()
            if preemption.agreed(control_group()):  # every rank, same step (megamarl.preemption)
                if not saved:
                    self.save()
                if self.is_driver:
                    self.driver.console_print(f"preempted ({preemption.received.name if preemption.received else 'another rank'}): saved step "
                                              f"{self.step}; trainer.resume=auto continues from it")
                break
        preemption.uninstall()
        self.close()

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def rollout_and_prepare(self) -> tuple[SampleBatch, dict[str, float]]:
        """Driver takes the next batch from its schedule (trainer.mode) and computes advantages;
        every rank receives the batch. It may hold only some policies (fully_async, per-policy)."""
        payload = [self.driver.collect(self.step, self.versions) if self.is_driver else None]
        self._wait_for_driver(f"the rollout of step {self.step + 1}")
        dist.broadcast_object_list(payload, src=DRIVER, group=control_group())
        return payload[0]

    def update(self, batch: SampleBatch) -> dict[str, float]:
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        with self.progress.phase("train", unit="micro-batches") as phase:
            for name, part in batch.split_by_policy().items():
                if self.cfg.policies[name].frozen:
                    continue
                self.updates_since_sync[name] += 1  # on every rank: the batch is the same everywhere
                if name in self.workers:
                    self.workers[name].on_micro_batch = phase.advance
                    for key, value in self.workers[name].train_step(part).items():
                        # the worker's sections (timing_s/<section>) become timing_s/<policy>/<section>
                        section = key.removeprefix("timing_s/")
                        metrics[f"timing_s/{name}/{section}" if section != key else f"policy/{name}/{key}"] = value
                    metrics[f"perf/max_memory_gib/{name}"] = peak_memory_gib()
        faults = {name: w.last_fault for name, w in self.workers.items() if w.skip_streak}
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, (metrics, faults), group=control_group())
        merged = merge_rank_metrics([rank_metrics for rank_metrics, _ in gathered])
        merged["timing_s/update"] = time.perf_counter() - start
        self._check_numerics(merged, {k: v for _, rank_faults in gathered for k, v in rank_faults.items()})
        return merged

    def trained_policies(self) -> list[str]:
        return [name for name, policy in self.cfg.policies.items() if not policy.frozen]

    def _check_numerics(self, metrics: dict[str, float], faults: dict[str, str]) -> None:
        """Skipped (non-finite) updates are reported; too many in a row stop the run on every rank
        (the metrics are the same everywhere) before anything of this step is pushed or saved."""
        from megamarl.policy_io import list_checkpoints

        limit = self.cfg.trainer.max_nonfinite_updates
        for name, fault in faults.items():
            streak = int(metrics.get(f"policy/{name}/nonfinite_streak", 0))
            if self.is_driver:
                self.driver.console_print(f"step {self.step + 1}: skipped the update of '{name}' ({streak} in a row): {fault}")
            if streak >= limit:
                good = list_checkpoints(self.run_dir)
                last = f"the last good checkpoint is {good[-1]}" if good else "no checkpoint was saved yet"
                raise NumericalFaultError(
                    f"{streak} non-finite updates in a row (trainer.max_nonfinite_updates={limit}); last: {fault}; "
                    f"no NaN weights were applied or pushed; {last}")

    def due_for_sync(self) -> list[str]:
        """Policies with ``sync_every`` updates since their last weight push (same on every rank)."""
        return [name for name, num in self.updates_since_sync.items() if num >= self.sync_every]

    def sync_all_weights(self, policies: list[str] | None = None) -> dict[str, float]:
        """Push ``policies`` (default: all) into their engines; each push is one new weight version,
        stamped on everything the engines generate afterwards. Frozen policies get the version but
        no push (their engines already serve the checkpoint)."""
        names = list(self.cfg.policies) if policies is None else policies
        if not names:
            return {}
        start = time.perf_counter()
        metrics = {}
        with self.driver.weight_update() if self.is_driver else nullcontext():  # drain/pause rollout
            for name in names:
                self.versions[name] += 1
                self.updates_since_sync[name] = 0
                policy = self.cfg.policies[name]
                if policy.frozen:
                    continue
                worker = self.workers.get(name)
                engines = self.driver.engines_for(name) if self.is_driver else None
                with self.progress.phase(f"weight sync {name}", unit=""):
                    metrics.update(self._push_policy(name, worker, engines))
        dist.barrier(group=control_group())
        metrics["timing_s/weight_sync"] = time.perf_counter() - start
        return metrics

    def _push_policy(self, name: str, worker: PolicyWorker | None, engines: list | None) -> dict[str, float]:
        """Sync one policy into its engines: full weights, or (L2) each agent adapter's tensors only."""
        policy = self.cfg.policies[name]
        kwargs = dict(version=self.versions[name], engine_rank=DRIVER, bucket_mb=policy.engine.bucket_mb)
        if policy.lora is None:
            dtype = DTYPES[resolve_dtype(policy.engine.dtype)]  # tensors travel in the engine's dtype
            export = (lambda: ((n, t.to(dtype)) for n, t in worker.export())) if worker else None
            stats = sync_weights(self.wgs[name], export, engines, **kwargs)
            return stats.as_dict(f"weight_sync/{name}")
        metrics = {}
        for adapter in self.adapters(name):
            export = (lambda a=adapter: worker.export_adapter(a)) if worker else None
            stats = sync_weights(self.wgs[name], export, engines, lora=adapter, **kwargs)
            metrics.update(stats.as_dict(f"weight_sync/{name}/{adapter}"))
        return metrics

    def adapters(self, policy: str) -> list[str]:
        return policy_adapters(self.cfg, policy)

    def _register_adapters(self) -> None:
        """L2: write each adapter's initial PEFT directory (collective over its WG) and register it with
        the policy's engines, which then receive adapter-only updates."""
        from megamarl.models.lora import save_peft_adapter

        for name, policy in self.cfg.policies.items():
            if policy.lora is None:
                continue
            root = self.run_dir / "adapters" / name
            worker = self.workers.get(name)
            for adapter in self.adapters(name):
                if worker is not None:
                    save_peft_adapter(worker.model, self.wgs[name], adapter, root / adapter)
                dist.barrier(group=control_group())
                if self.is_driver:
                    for engine in self.driver.engines_for(name):
                        engine.add_lora(adapter, root / adapter)

    def evaluate(self) -> None:
        if self.cfg.eval.num_tasks <= 0:
            return
        if self.is_driver:
            self.driver.evaluate(self.step)
        self._wait_for_driver(f"the evaluation at step {self.step}")

    def log(self, metrics: dict[str, float]) -> None:
        if self.is_driver:
            self.driver.log(self.step, metrics)

    # ---- checkpoint / resume --------------------------------------------------------------------
    def _ckpt_dir(self, step: int) -> Path:
        from megamarl.policy_io import checkpoint_path

        return checkpoint_path(self.run_dir, step)

    def save(self) -> None:
        """Collective: every policy's shards (layout-free), every rank's RNG, then the driver commits
        the run state and the COMPLETE marker atomically (megamarl.policy_io, docs/checkpointing.md).
        A failed write on any rank (disk full, quota, I/O error) is agreed by all ranks: the partial
        directory is removed and ``CheckpointWriteError`` stops the run, naming the previous complete
        checkpoint, which nothing touched."""
        from megamarl import policy_io

        final = self._ckpt_dir(self.step)
        staging = policy_io.staging_path(final)
        if self.is_driver:
            policy_io.clear(staging)  # left by a run killed while saving this step
        dist.barrier(group=control_group())
        error = _attempt(lambda: (policy_io.save_policies(staging, self.cfg.policies, self.workers, self.wgs),
                                  policy_io.save_rng(staging, self.rank)))
        num_updates = [None] * self.world_size
        dist.all_gather_object(
            num_updates, ({name: w.num_updates for name, w in self.workers.items()}, error), group=control_group()
        )
        errors = [f"rank {rank}: {e}" for rank, (_, e) in enumerate(num_updates) if e]
        if self.is_driver and not errors:
            state = {
                "step": self.step, "versions": dict(self.versions), "world_size": self.world_size,
                "num_updates": {k: v for counts, _ in num_updates for k, v in counts.items()},
                "driver": self.driver.state_dict(),
            }
            error = _attempt(lambda: policy_io.commit(staging, final, state))
            errors += [f"rank {self.rank}: {error}"] if error else []
            if not errors:
                policy_io.prune(self.run_dir, keep_last=self.cfg.trainer.keep_last)
        outcome = [errors]
        dist.broadcast_object_list(outcome, src=DRIVER, group=control_group())
        if outcome[0]:
            if self.is_driver:
                _attempt(lambda: policy_io.clear(staging))
            dist.barrier(group=control_group())
            raise policy_io.CheckpointWriteError(final, outcome[0], policy_io.list_checkpoints(self.run_dir))

    def _maybe_resume(self) -> None:
        from megamarl import policy_io

        path = policy_io.find_checkpoint(self.cfg.trainer.resume, self.run_dir)
        if path is None:
            if self.is_driver and self.cfg.trainer.resume == "auto":
                self.driver.console_print(f"trainer.resume=auto: no checkpoint in {self.run_dir}; from step 0")
            return
        state = policy_io.load_trainer_state(path)
        policy_io.load_policies(path, self.cfg.policies, self.workers, self.wgs)  # at this run's layout
        for name, worker in self.workers.items():
            worker.num_updates = state["num_updates"][name]
        self.step = state["step"]
        # sync_all_weights stamps version + 1: start one below so engines carry the saved versions
        self.versions = {name: state["versions"].get(name, 1) - 1 for name in self.cfg.policies}
        self.sync_all_weights()
        if not policy_io.load_rng(path, self.rank):  # saved with fewer ranks
            seed_everything(self.cfg.trainer.seed + 1_000_003 * self.step + self.rank)
        if self.is_driver:
            self.driver.load_state_dict(state["driver"])
            policy_io.rewind_run_dir(self.run_dir, self.step)  # later metrics lines are logged again
            self.driver.console_print(f"resumed from {path} at step {self.step}")

    def close(self) -> None:
        if self.is_driver:
            self.driver.close()
        self.progress.close()
        self._wait_for_driver("shutting down engines and plotting")
        dist.barrier(group=control_group())


class RolloutDriver:
    """Rank 0's half: engines, agents, env, orchestra, advantages, logging and evaluation."""

    def __init__(self, cfg: RunConfig, run_dir: Path, progress: RunProgress | None = None):
        from transformers import AutoTokenizer

        from megamarl.metrics import MetricsLogger
        from megamarl.models.packaged import resolve_model_path
        import megamarl.orchestration  # noqa: F401 - registers the built-in agents, envs, orchestras
        from megamarl.orchestration.agents import build_agents
        from megamarl.orchestration.env import EnvMaker
        from megamarl.orchestration.orchestras import build_orchestra
        from megamarl.registry import import_plugins
        from megamarl.rollout.factory import build_engines

        self.cfg = cfg
        self.run_dir = run_dir
        self.progress = progress or RunProgress(total_steps=cfg.trainer.total_steps, enabled=cfg.logger.progress)
        self._phase = None  # the phase that finished episodes count towards (rollout or eval)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        import_plugins(cfg.plugins, paths=cfg.plugin_paths)
        paths = {name: resolve_model_path(p.model, key=f"policies.{name}.model") for name, p in cfg.policies.items()}
        self.tokenizers = {name: AutoTokenizer.from_pretrained(path) for name, path in paths.items()}
        self.pad_ids = {name: (t.pad_token_id if t.pad_token_id is not None else t.eos_token_id) for name, t in self.tokenizers.items()}
        from megamarl.rollout.factory import engine_threads
        from megamarl.schedules import SCHEDULES

        overlaps = SCHEDULES.get(cfg.trainer.mode, key="trainer.mode").overlaps_training
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.engines = {}
        with self.progress.phase("engine start-up", total=len(cfg.policies), unit="policies", in_step=False) as phase:
            for name, p in cfg.policies.items():
                threads = engine_threads(p.engine, overlaps_training=overlaps, num_local_ranks=local_ranks)
                self.progress.line(
                    f"policy {name}: {p.engine.num_replicas} x {p.engine.backend} engine, "
                    f"dtype {describe_dtype_choice(p.engine.dtype)}, {threads} CPU threads; "
                    f"training dtype {cfg.policy_dtype(name)}"
                )
                self.engines[name] = build_engines(p.engine, paths[name], seed=cfg.trainer.seed,
                                                   lora=_lora_serving(cfg, name), num_threads=threads)
                phase.advance()
        self.env = EnvMaker(cfg.env.name, **cfg.env.kwargs)
        self.orchestra = build_orchestra(cfg.orchestra.name, **cfg.orchestra.kwargs)
        self.agents = build_agents(
            {role: a.to_orchestration(self.tokenizers[a.policy]) for role, a in cfg.agents.items()}, self.tokenizers,
            default_kinds=self.env.default_agents,
        )
        self.policy_mapping = _policy_mapping(cfg, self.tokenizers)
        self.logger = MetricsLogger(run_dir, cfg.logger, cfg.name, json.loads(json.dumps(asdict(cfg), default=str)), rank=0)
        self.rollout_seconds = 0.0
        self.totals = {"dropped_episodes": 0, "failed_episodes": 0, "dropped_groups": 0, "refill_rounds": 0}
        # eval set name ("" = the unnamed default set) -> env (eval.env / eval.sets; default: training env)
        self.eval_envs = {name: EnvMaker(env.name, **env.kwargs)
                          for name, env in cfg.eval.resolved_sets(cfg.env).items()}
        if cfg.eval.sets or cfg.eval.env.is_set():
            for name, env in cfg.eval.resolved_sets(cfg.env).items():
                self.console_print(f"eval set {name or '(default)'}: env {env.name} {env.kwargs}")
        self.loop = RolloutLoop()  # every engine call of the driver runs on this one event loop
        self.schedule = build_schedule(cfg, self, self.loop)  # trainer.mode
        self.console_print(self.schedule.describe())

    def engines_for(self, policy: str) -> list:
        return self.engines[policy]

    def task_chunk(self, index: int):
        """The ``index``-th chunk of training tasks and its sampling seed (sync: chunk = step)."""
        seed = self.cfg.trainer.seed * 1_000_003 + index
        return self.env.tasks(self.cfg.rollout.num_tasks, seed=seed), seed

    async def episodes(self, tasks, *, group_size: int, agents=None, seed: int | None = None, env=None):
        from megamarl.orchestration.driver import run_episodes

        engines = {name: pool[0] if len(pool) == 1 else pool for name, pool in self.engines.items()}
        return await run_episodes(
            self.orchestra, env or self.env, tasks, agents=agents or self.agents, engines=engines,
            group_size=group_size, max_concurrency=self.cfg.rollout.max_concurrency,
            step_timeout_s=self.cfg.rollout.env_timeout_s, seed=seed, policy_mapping=self.policy_mapping,
            on_episode=self._episode_done,
        )

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
        trainable = {name: v for name, v in versions.items() if not self.cfg.policies[name].frozen}
        expected = None if self.schedule.overlaps_training else self.cfg.rollout.num_tasks * self.cfg.rollout.group_size
        with self.progress.phase("rollout", total=expected) as self._phase:
            result, metrics = self.schedule.next_rollout(step, trainable)
        self._phase = None
        rollout_s = time.perf_counter() - start
        num_tokens = sum(len(s.response_ids) for s in result.samples)
        metrics.update({"timing_s/rollout": rollout_s, "perf/rollout_tokens_per_s": num_tokens / max(rollout_s, 1e-9),
                        **result.summary()})
        self.totals["dropped_episodes"] += result.num_dropped
        self.totals["failed_episodes"] += result.num_failed
        for key in ("dropped_stale_groups", "dropped_stale_samples"):
            self.totals[key] = self.totals.get(key, 0) + int(metrics[f"async/{key}"])  # absent in old checkpoints
        check_failures(result, max_failed_fraction=self.cfg.rollout.max_failed_fraction, what=f"step {step + 1} rollout")
        if not result.samples:
            raise RolloutFailureError(result.failure_report(f"step {step + 1}: no samples"))
        pad_id = next(iter(self.pad_ids.values()))
        batch = collate(result.samples, pad_id=pad_id)
        batch, adv_metrics = self.advantages(batch, step=step)
        metrics.update(adv_metrics)
        metrics.update(per_agent_metrics(batch, result))
        return batch, metrics

    def advantages(self, batch: SampleBatch, *, step: int = 0) -> tuple[SampleBatch, dict[str, float]]:
        """Reward shaping, dynamic sampling with refill, advantages (``megamarl.rl.prepare``)."""
        batch, metrics = prepare_batch(batch, self.cfg.algorithm, num_tasks=self.cfg.rollout.num_tasks,
                                       draw=lambda round_: self._refill(step, round_))
        self.totals["dropped_groups"] += int(metrics.get("rollout/dropped_groups", 0))
        self.totals["refill_rounds"] += int(metrics.get("rollout/refill_rounds", 0))
        return batch, metrics

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
        return collate(result.samples, pad_id=next(iter(self.pad_ids.values())))

    def evaluate(self, step: int) -> dict:
        """Greedy evaluation on every eval set (``eval.env`` / ``eval.sets``); one eval.json entry
        holds them all: the unnamed default set as ``team_accuracy``, ``avg@k``, ...; a named set as
        ``<set>/team_accuracy`` (logged as ``eval/<set>/team_accuracy``)."""
        from megamarl.orchestration.agents import build_agents

        e = self.cfg.eval
        greedy = {}
        for role, a in self.cfg.agents.items():
            oc = a.to_orchestration(self.tokenizers[a.policy])
            oc.sampling = replace(oc.sampling, temperature=e.temperature, top_p=1.0, top_k=-1)
            oc.tree_k = 1  # evaluation is one pass: no best-of-K with the env's check fn
            greedy[role] = oc
        results: dict = {}
        failures, outcomes = [], []
        for name, env in self.eval_envs.items():
            agents = build_agents(greedy, self.tokenizers, default_kinds=env.default_agents)
            tasks = env.tasks(e.num_tasks, seed=10**9 + 7)  # held out: a seed the training stream never uses
            label = f"eval {name} at step {step}" if name else f"eval at step {step}"
            with self.progress.phase(label, total=len(tasks) * e.k, in_step=False) as self._phase:
                result = self._run(tasks, group_size=e.k, agents=agents, seed=10**9 + 7, env=env)
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
        self.console_print(f"eval step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in results.items()))
        for result, what in outcomes:
            check_failures(result, max_failed_fraction=self.cfg.rollout.max_failed_fraction, what=what)
        return results

    def log(self, step: int, metrics: dict[str, float]) -> None:
        metrics.update(self.schedule.interval_metrics())
        for key, value in self.totals.items():
            metrics[f"rollout/total_{key}"] = float(value)
        self.logger.log(step, metrics)
        shown = {k: metrics[k] for k in ("rollout/team_reward_mean", "rollout/success_rate", "timing_s/step") if k in metrics}
        self.console_print(f"step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in shown.items()))

    def console_print(self, text: str) -> None:
        self.progress.line(text)

    def state_dict(self) -> dict:
        """Running totals. Nothing else is stateful: tasks and sampling seeds are functions of
        (trainer.seed, step), and RNGs are saved per rank by Trainer.save."""
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        self.totals = {**self.totals, **state["totals"]}  # counters added since an old checkpoint start at 0

    def close(self) -> None:
        from megamarl.plot import plot_run

        self.schedule.close()
        self.loop.close()
        self.logger.close()
        for pool in self.engines.values():
            for engine in pool:
                engine.shutdown()
        plot_run(self.run_dir)


def _policy_mapping(cfg: RunConfig, tokenizers: dict):
    """``rollout.policy_mapping`` resolved; its policies must share one vocabulary, since an agent's
    prompt is tokenized once, whichever policy serves it."""
    if not cfg.rollout.policy_mapping:
        return None
    from megamarl.registry import resolve_callable

    vocabs = {name: tok.get_vocab() for name, tok in tokenizers.items()}
    first = next(iter(vocabs))
    for name, vocab in vocabs.items():
        if vocab != vocabs[first]:
            raise ValueError(f"rollout.policy_mapping: policies '{first}' and '{name}' have different tokenizers")
    return resolve_callable(cfg.rollout.policy_mapping, key="rollout.policy_mapping")


def _attempt(write) -> str:
    """Run a checkpoint write; '' on success, else the error as one line (any exception: a
    collective writer may wrap the OSError of another rank)."""
    try:
        write()
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised as CheckpointWriteError
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return ""


def _lora_serving(cfg: RunConfig, policy: str):
    from megamarl.rollout.factory import LoraServing

    lora = cfg.policies[policy].lora
    adapters = policy_adapters(cfg, policy)
    return LoraServing(num_adapters=len(adapters), rank=lora.rank) if lora is not None and adapters else None


def policy_adapters(cfg: RunConfig, policy: str) -> list[str]:
    """L2: the LoRA adapter names the agents of ``policy`` sample from (sorted, unique)."""
    return sorted({a.lora for a in cfg.agents.values() if a.policy == policy and a.lora})


def _lora_config(policy):
    """``policies.<p>.lora`` as the model layer's LoRA settings (None: no adapters)."""
    if policy.lora is None:
        return None
    from megamarl.models.lora import LoraConfig as ModelLoraConfig

    targets = {"qkv": "linear_qkv", "proj": "linear_proj", "fc1": "linear_fc1", "fc2": "linear_fc2"}
    return ModelLoraConfig(rank=policy.lora.rank, alpha=policy.lora.alpha, targets=tuple(targets[t] for t in policy.lora.targets))


def per_agent_metrics(batch: SampleBatch, result) -> dict[str, float]:
    """Per-agent batch statistics and each agent's (and policy's) own success (megamarl.step_metrics)."""
    return {**agent_batch_metrics(batch), **success_metrics(e for e in result.episodes if e.status == "ok")}


def eval_summary(result, *, k: int) -> dict[str, float]:
    """Team accuracy (mean success over all episodes), avg@k and pass@k over each task's k episodes,
    and each agent's / policy's own success rate."""
    by_task: dict[str, list[bool]] = {}
    for episode in result.episodes:
        by_task.setdefault(episode.task_id, []).append(episode.status == "ok" and episode.success)
    num = max(len(by_task), 1)
    return {
        "team_accuracy": sum(sum(v) for v in by_task.values()) / max(sum(len(v) for v in by_task.values()), 1),
        f"avg@{k}": sum(sum(v) / len(v) for v in by_task.values()) / num,
        f"pass@{k}": sum(any(v) for v in by_task.values()) / num,
        "num_tasks": float(len(by_task)),
        **success_metrics(e for e in result.episodes if e.status == "ok"),
        "num_failed": float(result.num_failed),
    }
