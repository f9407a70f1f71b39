"""The training loop: rollout -> advantages -> update each policy -> sync weights -> log/eval/save.

SPMD under torchrun: every rank runs ``Trainer.fit``. Rank 0 is also the *driver*: it hosts the
engines (colocated, in-process), runs the episodes, computes advantages on the gathered agent-tagged
batch and logs. Every rank holding a shard of a policy's worker group (WG) trains it; the batch
reaches workers as one broadcast object over the CPU control group. Variants (estimators, engines,
envs, orchestras) are looked up by name in registries; the loop itself has no per-variant branches.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megamarl.config import RunConfig, to_yaml
from megamarl.parallel.distributed import control_group, init_distributed
from megamarl.parallel.placement import build_worker_groups
from megamarl.rl.advantages import AdvantageConfig, compute_advantages, group_ids
from megamarl.rl.batch import SampleBatch, collate
from megamarl.rl.losses import LossConfig
from megamarl.rl.rewards import RewardConfig, dynamic_sampling_mask, shape_rewards
from megamarl.rl.worker import PolicyWorker
from megamarl.rollout.weight_sync import sync_weights

DRIVER = 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: RunConfig, *, run_dir: str | Path | None = None):
        init_distributed()
        self.cfg = cfg
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_driver = self.rank == DRIVER
        self.run_dir = Path(run_dir or Path(cfg.output_dir) / cfg.name)
        self.step = 0
        self.versions = {name: 0 for name in cfg.policies}
        seed_everything(cfg.trainer.seed)
        self.wgs = build_worker_groups(cfg.placement(self.world_size))
        self.workers = self._build_workers()
        self.driver = RolloutDriver(cfg, self.run_dir) if self.is_driver else None
        self._maybe_resume()

    # ---- set-up ---------------------------------------------------------------------------------
    def _build_workers(self) -> dict[str, PolicyWorker]:
        from megamarl.policy_io import load_policy_model

        algo = self.cfg.algorithm
        workers = {}
        for name, policy in self.cfg.policies.items():
            wg = self.wgs[name]
            if not wg.is_member or policy.frozen:
                continue
            loss_cfg = LossConfig(
                clip_low=policy.clip_low, clip_high=policy.clip_high, kl_coef=policy.kl_coef,
                kl_type=algo.kl_type, entropy_coef=policy.entropy_coef, agg_mode=algo.loss_agg,
                tis_mode="token" if algo.tis_cap > 0 else "none", tis_cap=algo.tis_cap or 2.0,
            )
            handle = load_policy_model(policy, wg, seed=self.cfg.trainer.seed)
            workers[name] = PolicyWorker(name, policy, wg, handle, loss_cfg)
        return workers

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self) -> None:
        total = self.cfg.trainer.total_steps
        if self.step == 0:
            self.sync_all_weights()  # engines start from the (possibly resumed) trained weights
            self.evaluate()
        while self.step < total:
            step_start = time.perf_counter()
            batch, metrics = self.rollout_and_prepare()
            metrics.update(self.update(batch))
            metrics.update(self.sync_all_weights())
            self.step += 1
            metrics["timing/step_s"] = time.perf_counter() - step_start
            self.log(metrics)
            if self._due(self.cfg.eval.every) or self.step == total:
                self.evaluate()
            if self._due(self.cfg.trainer.save_every) or self.step == total:
                self.save()
        self.close()

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def rollout_and_prepare(self) -> tuple[SampleBatch, dict[str, float]]:
        """Driver runs episodes and computes advantages; every rank receives the batch."""
        payload = [self.driver.collect(self.step) if self.is_driver else None]
        dist.broadcast_object_list(payload, src=DRIVER, group=control_group())
        return payload[0]

    def update(self, batch: SampleBatch) -> dict[str, float]:
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        for name, part in batch.split_by_policy().items():
            if name in self.workers:
                for key, value in self.workers[name].train_step(part).items():
                    metrics[f"policy/{name}/{key}"] = value
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, metrics, group=control_group())
        merged = {k: v for rank_metrics in gathered for k, v in rank_metrics.items()}
        merged["timing/update_s"] = time.perf_counter() - start
        return merged

    def sync_all_weights(self) -> dict[str, float]:
        start = time.perf_counter()
        metrics = {}
        for name, policy in self.cfg.policies.items():
            self.versions[name] += 1
            worker = self.workers.get(name)
            engines = self.driver.engines_for(name) if self.is_driver else None
            stats = sync_weights(
                self.wgs[name], worker.export if worker else None, engines,
                version=self.versions[name], engine_rank=DRIVER, bucket_mb=policy.engine.bucket_mb,
            )
            metrics.update(stats.as_dict(f"weight_sync/{name}"))
        dist.barrier(group=control_group())
        metrics["timing/weight_sync_s"] = time.perf_counter() - start
        return metrics

    def evaluate(self) -> None:
        if self.is_driver and self.cfg.eval.num_tasks > 0:
            self.driver.evaluate(self.step)

    def log(self, metrics: dict[str, float]) -> None:
        if self.is_driver:
            self.driver.log(self.step, metrics)

    # ---- checkpoint / resume --------------------------------------------------------------------
    def _ckpt_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step:06d}"

    def save(self) -> None:
        from megamarl.policy_io import save_checkpoint

        path = self._ckpt_dir(self.step)
        for name, worker in self.workers.items():
            save_checkpoint(path / name, worker)
        dist.barrier(group=control_group())
        if self.is_driver:
            state = {"step": self.step, "versions": self.versions, "driver": self.driver.state_dict()}
            torch.save(state, path / "trainer.pt")
            (path / "COMPLETE").touch()  # a checkpoint without it is ignored on resume
        dist.barrier(group=control_group())

    def _maybe_resume(self) -> None:
        from megamarl.policy_io import load_checkpoint

        if self.cfg.trainer.resume == "none":
            return
        root = self.run_dir if self.cfg.trainer.resume == "auto" else Path(self.cfg.trainer.resume)
        done = sorted((root / "checkpoints").glob("step_*/COMPLETE")) if (root / "checkpoints").is_dir() else []
        if not done:
            return
        path = done[-1].parent
        for name, worker in self.workers.items():
            load_checkpoint(path / name, worker)
        state = torch.load(path / "trainer.pt", weights_only=False)
        self.step, self.versions = state["step"], state["versions"]
        if self.is_driver:
            self.driver.load_state_dict(state["driver"])
            self.driver.console_print(f"resumed from {path} at step {self.step}")
        self.sync_all_weights()

    def close(self) -> None:
        if self.is_driver:
            self.driver.close()
        dist.barrier(group=control_group())


class RolloutDriver:
    """Rank 0's half: engines, agents, env, orchestra, advantages, logging and evaluation."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
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
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        import_plugins(cfg.plugins)
        paths = {name: resolve_model_path(p.model, key=f"policies.{name}.model") for name, p in cfg.policies.items()}
        self.tokenizers = {name: AutoTokenizer.from_pretrained(path) for name, path in paths.items()}
        self.pad_ids = {name: (t.pad_token_id if t.pad_token_id is not None else t.eos_token_id) for name, t in self.tokenizers.items()}
        self.engines = {name: build_engines(p.engine, paths[name], seed=cfg.trainer.seed) for name, p in cfg.policies.items()}
        self.env = EnvMaker(cfg.env.name, **cfg.env.kwargs)
        self.orchestra = build_orchestra(cfg.orchestra.name, **cfg.orchestra.kwargs)
        self.agents = build_agents(
            {role: a.to_orchestration(self.tokenizers[a.policy]) for role, a in cfg.agents.items()}, self.tokenizers,
            default_kinds=self.env.default_agents,
        )
        self.logger = MetricsLogger(run_dir, cfg.logger, cfg.name, json.loads(json.dumps(asdict(cfg), default=str)), rank=0)
        self.rollout_seconds = 0.0
        self.totals = {"dropped_episodes": 0, "failed_episodes": 0, "dropped_groups": 0}

    def engines_for(self, policy: str) -> list:
        return self.engines[policy]

    def _run(self, tasks, *, group_size: int, agents=None):
        from megamarl.orchestration.driver import run_episodes

        engines = {name: pool[0] if len(pool) == 1 else pool for name, pool in self.engines.items()}
        return asyncio.run(run_episodes(
            self.orchestra, self.env, tasks, agents=agents or self.agents, engines=engines,
            group_size=group_size, max_concurrency=self.cfg.rollout.max_concurrency,
            step_timeout_s=self.cfg.rollout.env_timeout_s,
        ))

    def collect(self, step: int) -> tuple[SampleBatch, dict[str, float]]:
        start = time.perf_counter()
        r = self.cfg.rollout
        tasks = self.env.tasks(r.num_tasks, seed=self.cfg.trainer.seed * 1_000_003 + step)
        result = self._run(tasks, group_size=r.group_size)
        metrics = {"timing/rollout_s": time.perf_counter() - start, **result.summary()}
        self.totals["dropped_episodes"] += result.num_dropped
        self.totals["failed_episodes"] += result.num_failed
        if not result.samples:
            raise RuntimeError(f"step {step}: no samples (all {len(result.episodes)} episodes failed: {dict(result.reasons())})")
        pad_id = next(iter(self.pad_ids.values()))
        batch = collate(result.samples, pad_id=pad_id)
        batch, adv_metrics = self.advantages(batch)
        metrics.update(adv_metrics)
        metrics.update(per_agent_metrics(batch, result))
        return batch, metrics

    def advantages(self, batch: SampleBatch) -> tuple[SampleBatch, dict[str, float]]:
        a = self.cfg.algorithm
        index = batch.group_index()
        rewards = shape_rewards(
            batch.team_rewards, batch.local_rewards, valid=batch.valid,
            seq_ids=group_ids(index, ("task", "episode", "agent")), turns=batch.turn,
            cfg=RewardConfig(alpha=a.team_alpha, turn_gamma=a.turn_gamma, invalid_penalty=a.invalid_penalty),
        )
        batch = batch.replace(rewards=rewards)
        metrics = {}
        if a.dynamic_sampling:
            keep, num_dropped = dynamic_sampling_mask(batch.rewards, group_ids(index, tuple(a.group_by)))
            metrics["rollout/dropped_groups"] = float(num_dropped)
            self.totals["dropped_groups"] += num_dropped
            if keep.any():
                batch = batch.select(keep)
        adv_cfg = AdvantageConfig(estimator=a.estimator, group_by=list(a.group_by), norm_std=a.normalize_std, **a.estimator_kwargs)
        advantages = compute_advantages(batch.rewards, batch.group_index(), adv_cfg)
        return batch.replace(advantages=advantages), metrics

    def evaluate(self, step: int) -> dict:
        from megamarl.orchestration.agents import build_agents
        from megamarl.orchestration.driver import RolloutResult  # noqa: F401 - result type

        e = self.cfg.eval
        greedy = {}
        for role, a in self.cfg.agents.items():
            oc = a.to_orchestration(self.tokenizers[a.policy])
            oc.sampling = replace(oc.sampling, temperature=e.temperature, top_p=1.0, top_k=-1)
            greedy[role] = oc
        agents = build_agents(greedy, self.tokenizers, default_kinds=self.env.default_agents)
        tasks = self.env.tasks(e.num_tasks, seed=10**9 + 7)  # held out: a seed the training stream never uses
        result = self._run(tasks, group_size=e.k, agents=agents)
        results = eval_summary(result, k=e.k)
        results["step"] = step
        self.logger.log_eval(step, results)
        self.console_print(f"eval step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in results.items() if k != "step"))
        return results

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in self.totals.items():
            metrics[f"rollout/total_{key}"] = float(value)
        self.logger.log(step, metrics)
        shown = {k: metrics[k] for k in ("rollout/team_reward_mean", "rollout/success_rate", "timing/step_s") if k in metrics}
        self.console_print(f"step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in shown.items()))

    def console_print(self, text: str) -> None:
        print(f"[megamarl] {text}", flush=True)

    def state_dict(self) -> dict:
        return {"totals": dict(self.totals), "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.totals = state["totals"]
        random.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])

    def close(self) -> None:
        from megamarl.plot import plot_run

        self.logger.close()
        for pool in self.engines.values():
            for engine in pool:
                engine.shutdown()
        plot_run(self.run_dir)


def per_agent_metrics(batch: SampleBatch, result) -> dict[str, float]:
    out = {}
    names = batch.names("agent")
    lengths = batch.response_mask.sum(1).float()
    for agent in sorted(set(names)):
        rows = torch.tensor([n == agent for n in names])
        out[f"agent/{agent}/reward_mean"] = float(batch.rewards[rows].mean())
        out[f"agent/{agent}/response_len"] = float(lengths[rows].mean())
        out[f"agent/{agent}/invalid_rate"] = float((~batch.valid[rows]).float().mean())
        out[f"agent/{agent}/num_samples"] = float(rows.sum())
        out[f"agent/{agent}/success"] = float((batch.team_rewards[rows] > 0).float().mean())
    return out


def eval_summary(result, *, k: int) -> dict[str, float]:
    """Team accuracy (mean success over all episodes), avg@k and pass@k over each task's k episodes."""
    by_task: dict[str, list[bool]] = {}
    for episode in result.episodes:
        by_task.setdefault(episode.task_id, []).append(episode.status == "ok" and episode.success)
    num = max(len(by_task), 1)
    return {
        "team_accuracy": sum(sum(v) for v in by_task.values()) / max(sum(len(v) for v in by_task.values()), 1),
        f"avg@{k}": sum(sum(v) / len(v) for v in by_task.values()) / num,
        f"pass@{k}": sum(any(v) for v in by_task.values()) / num,
        "num_tasks": float(len(by_task)),
    }
