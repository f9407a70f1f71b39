"""One policy's weight push, on every rank: full weights or (L2) each agent's adapter, into
in-process engines (``weight_sync.sync_weights``: through the driver) or engine servers
(``fleet.EngineFleet``: straight from the training ranks into the servers).

L2 through servers: an adapter's tensors travel as a PEFT directory (written collectively by its WG
under ``<run_dir>/adapters/<policy>/<adapter>/v<version>``) that every replica (re)loads through
``/v1/load_lora_adapter``, the way vLLM and SGLang servers take adapters; only that adapter's version
changes.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megamarl.models.lora import save_peft_adapter
from megamarl.parallel.distributed import control_group
from megamarl.parallel.hardware import DTYPES, resolve_dtype
from megamarl.rollout.servers.fleet import SERVED_MODEL
from megamarl.rollout.weights.sync_check import verify_adapter
from megamarl.rollout.weights.weight_sync import SyncStats, sync_weights


class WeightPusher:
    def __init__(self, cfg, *, wgs: dict, workers: dict, fleet, run_dir: Path, driver_rank: int, adapters) -> None:
        self.cfg, self.wgs, self.workers, self.fleet = cfg, wgs, workers, fleet
        self.run_dir, self.driver_rank = run_dir, driver_rank
        self.adapters = adapters  # policy -> its L2 adapter names (sorted)
        self.is_driver = dist.get_rank() == driver_rank

    def _served(self, name: str) -> bool:
        return self.fleet is not None and self.fleet.serves(name)

    def push(self, name: str, version: int, engines: list | None) -> dict[str, float]:
        """Sync one policy into its engines. ``engines``: the driver's engines of ``name`` (None elsewhere)."""
        policy = self.cfg.policies[name]
        if policy.lora is not None:
            return self._push_adapters(name, version, engines)
        export = self._export(name)
        if self._served(name):
            pool = engines[0] if engines else None
            if pool is not None:
                self.fleet.wake(name, pool, tags=("weights",))  # colocated: weights back before they are written
            metrics = self.fleet.sync_policy(name, self.wgs[name], export, version=version,
                                             bucket_bytes=int(policy.engine.bucket_mb * 2**20), pool=pool)
            return metrics  # the fleet woke the KV cache once the push was in
        else:
            stats = sync_weights(self.wgs[name], export, engines, version=version, engine_rank=self.driver_rank,
                                 bucket_mb=policy.engine.bucket_mb)
        return stats.as_dict(f"weight_sync/{name}")

    def snapshot(self, source: str, target: str, version: int, engines: list | None) -> dict[str, float]:
        """Collective: copy policy ``source``'s current trained weights into the in-process engines of
        the frozen policy ``target`` (an opponent-pool slot), stamping ``version``. ``engines``: the
        driver's engines of ``target`` (None elsewhere)."""
        if self._served(target):
            raise ValueError(f"rollout.opponent_pool.snapshots: policies.{target} is served by engine servers; "
                             "snapshots are copied into in-process engines only")
        stats = sync_weights(self.wgs[source], self._export(source), engines, version=version,
                             engine_rank=self.driver_rank, bucket_mb=self.cfg.policies[target].engine.bucket_mb)
        return stats.as_dict(f"weight_sync/{target}")

    def _export(self, name: str):
        """This rank's export of ``name``'s full weights, in the engine's dtype (None: no shard here)."""
        worker = self.workers.get(name)
        dtype = DTYPES[resolve_dtype(self.cfg.policies[name].engine.dtype)]  # tensors travel in the engine's dtype
        return (lambda: ((n, t.to(dtype)) for n, t in worker.export())) if worker else None

    def stale(self, engines_for) -> dict[str, list[int]]:
        """Collective: the driver's replicas (of server-served policies whose weights train) that
        restarted since their last push, the same on every rank. ``engines_for``: the driver's
        lookup (None elsewhere)."""
        if self.fleet is None:  # in-process engines: the pool re-sends the weights itself
            return {}
        found = {}
        if self.is_driver:
            for name in self.cfg.policies:
                if self._served(name):  # frozen and L2 replicas are never stale (EngineFleet.driver_pool)
                    indices = engines_for(name)[0].stale_replicas()
                    if indices:
                        found[name] = indices
        holder = [found]
        dist.broadcast_object_list(holder, src=self.driver_rank, group=control_group())
        return holder[0]

    def resync(self, name: str, version: int, engines: list | None, replicas: list[int]) -> dict[str, float]:
        """Push ``name``'s current weights (``version``, unchanged) into restarted ``replicas`` only,
        before they take traffic; the other replicas keep serving."""
        policy = self.cfg.policies[name]
        return self.fleet.sync_policy(name, self.wgs[name], self._export(name), version=version,
                                      bucket_bytes=int(policy.engine.bucket_mb * 2**20),
                                      pool=engines[0] if engines else None, only=replicas)

    def _push_adapters(self, name: str, version: int, engines: list | None) -> dict[str, float]:
        policy, worker, metrics = self.cfg.policies[name], self.workers.get(name), {}
        for adapter in self.adapters(name):
            if self._served(name):
                stats, verified = self._adapter_to_servers(name, adapter, version, engines)
                if policy.engine.verify_sync and self.is_driver:
                    metrics[f"weight_sync/{name}/{adapter}/verified_replicas"] = float(verified)
            else:
                export = (lambda a=adapter: worker.export_adapter(a)) if worker else None
                stats = sync_weights(self.wgs[name], export, engines, version=version, engine_rank=self.driver_rank,
                                     bucket_mb=policy.engine.bucket_mb, lora=adapter)
            metrics.update(stats.as_dict(f"weight_sync/{name}/{adapter}"))
        return metrics

    def _adapter_to_servers(self, name: str, adapter: str, version: int, engines: list | None) -> tuple[SyncStats, int]:
        path = self.adapter_dir(name, adapter, version)
        worker = self.workers.get(name)
        if worker is not None:
            save_peft_adapter(worker.model, self.wgs[name], adapter, path)
        dist.barrier(group=control_group())
        stats = SyncStats(num_tensors=sum(1 for _ in path.glob("*.safetensors")) if self.is_driver else 0)
        verified = 0  # replicas whose greedy tokens matched (engine.verify_sync)
        if self.is_driver:
            stats.num_bytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            for engine in engines:
                self.fleet.wake(name, engine)  # colocated, asleep since the rollout: weights, KV cache back
                with engine.external_update(version, lora=adapter) as targets:
                    for index, _ in targets:  # every replica reloads the adapter in place
                        replica = engine.replicas[index]
                        replica.add_lora(adapter, path)
                        replica.lora_versions[adapter] = version
                engine.adapter_updated(adapter, path, version)  # a restarted replica loads the newest directory
                if self.cfg.policies[name].engine.verify_sync:
                    urls = {i: engine.replicas[i].base_url for i, _ in targets}
                    verified += verify_adapter(name, adapter, self.fleet.model_paths[name], path, urls, version=version,
                                               served_model=SERVED_MODEL, backend=self.cfg.policies[name].engine.backend)
        return stats, verified

    def adapter_dir(self, name: str, adapter: str, version: int) -> Path:
        return self.run_dir / "adapters" / name / adapter / f"v{version}"

    def register_adapters(self, engines_for) -> None:
        """L2: write each adapter's initial PEFT directory (collective over its WG) and register it with
        the policy's engines, which then receive adapter-only updates."""
        for name, policy in self.cfg.policies.items():
            if policy.lora is None:
                continue
            worker = self.workers.get(name)
            for adapter in self.adapters(name):
                path = self.adapter_dir(name, adapter, 0)
                if worker is not None:
                    save_peft_adapter(worker.model, self.wgs[name], adapter, path)
                dist.barrier(group=control_group())
                if self.is_driver:
                    for engine in engines_for(name):
                        if self._served(name):
                            self.fleet.wake(name, engine)  # on GPU asleep since start-up (EngineFleet._start)
                        engine.add_lora(adapter, path)
