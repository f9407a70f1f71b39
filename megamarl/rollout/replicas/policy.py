"""``PolicyReplicas``: one policy's engine replicas, seen from every rank, and the one object that
decides and performs pause / sleep / wake / weight push for them.

Built on every rank for every policy (``build_replicas``); the driver attaches the engine it serves
rollouts with (``attach``: an in-process ``Engine`` / ``EnginePool``, or for a server-backed policy
the pool of server clients that ``connect`` builds; external servers, ``engine.server_urls``, too when
the fleet feeds them: ``fleet.fed_by_fleet``). Every method below that says *collective* runs
on every rank together; the driver's copy holds the engine, the others ``None``. Pushes carry full
weights or (L2) each agent's adapter: into in-process engines through the driver
(``weights.weight_sync.sync_weights``); into engine servers straight from the training ranks, the
driver's pool pausing the replicas and naming the targets, each stage's sender pushing over the
policy's transport (``weights.transport``); L2 adapters as PEFT directories every replica reloads.
Sleep / wake of colocated servers that hand memory over follow the trainer's phase list
(``megamarl.planning.phases``). The push paths in full: docs/design-notes.md,
"megamarl/rollout/replicas/policy.py".
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from megamarl.models.lora import save_peft_adapter
from megamarl.parallel.hardware import DTYPES, resolve_dtype
from megamarl.parallel.network import free_port
from megamarl.parallel.placement import WorkerGroup
from megamarl.rollout.engines.base import Engine, ServerReplica, ServesAdapters
from megamarl.rollout.engines.lora_backends import policy_adapters
from megamarl.rollout.engines.sglang import SGLangClient
from megamarl.rollout.engines.vllm_server import VLLMServerClient
from megamarl.rollout.replicas.pool import EnginePool
from megamarl.rollout.servers.fleet import CLIENTS, SERVED_MODEL, PolicyServers, ServerFleet
from megamarl.rollout.servers.server_launch import healthy
from megamarl.rollout.weights.delta import DeltaSelector, common_version
from megamarl.rollout.weights.server_sync import WeightSender
from megamarl.rollout.weights.sglang_sync import SGLangWeightSender
from megamarl.rollout.weights.stage_gather import (
    forward_device,
    forward_stage,
    receive_stage,
    relay_roles,
    relay_stage,
)
from megamarl.rollout.weights.sync_check import verify_adapter, verify_replicas
from megamarl.rollout.weights.transport import (
    CONCURRENT_STAGES,
    SENDERS,
    gathers_stages,
    relays_stages,
    transport_for,
)
from megamarl.rollout.weights.vllm_native_sync import VLLMNativeSender
from megamarl.rollout.weights.weight_sync import (
    Select,
    SyncStats,
    drain,
    stage_role,
    stage_sender,
    sync_weights,
)

if TYPE_CHECKING:
    from megamarl.config import RunConfig

UNSYNCED = -1  # weight_version of a restarted replica until a push reaches it
ASLEEP = ("weights", "kv_cache")  # the memory a sleeping replica has released (level 1)


@dataclass
class _Transfer:
    """A live weight-transfer connection from this rank to some replicas of one policy."""

    sender: WeightSender | SGLangWeightSender | VLLMNativeSender
    key: tuple  # (replica indices, their restart generations): a change means a new group


class PolicyReplicas:
    def __init__(
        self,
        cfg: RunConfig,
        name: str,
        *,
        wg: WorkerGroup,
        worker,
        fleet: ServerFleet | None,
        run_dir: Path,
        driver_rank: int,
        control_group,
    ) -> None:
        """``worker``: this rank's ``PolicyWorker`` of ``name`` (None: no shard here); ``fleet``: the run's
        servers (None: in-process engines only)."""
        self.cfg, self.name, self.policy = cfg, name, cfg.policies[name]
        self.wg, self.worker, self.run_dir = wg, worker, run_dir
        self.driver_rank, self.control = driver_rank, control_group
        self.rank = dist.get_rank()
        self.is_driver = self.rank == driver_rank
        self.fleet = fleet if fleet is not None and fleet.serves(name) else None
        self.servers = self.fleet.policies[name] if self.fleet is not None else None
        self.adapters = policy_adapters(cfg, name)  # L2: its adapters (sorted)
        self.engine: Engine | None = None  # the driver's engine of this policy (``attach``)
        # the memory its replicas have released; on GPU servers that hand memory over fall asleep right
        # after start-up (``ServerFleet._start``)
        self.asleep: set[str] = (
            set(ASLEEP) if self.hands_over and self.fleet is not None and self.fleet.on_gpu else set()
        )
        self._transfers: dict[tuple, _Transfer] = {}
        # engine.delta_sync: what this rank last streamed to the replicas (``weights.delta``)
        self.delta = DeltaSelector() if self.policy.engine.delta_sync == "tensors" else None
        self._stages_key: tuple | None = None  # the targets every stage's sender is connected to
        self._unverified: list[
            tuple[Callable[[], int] | None, str]
        ] = []  # pushes whose probes wait for the KV cache

    @property
    def served(self) -> bool:
        """Its replicas are engine servers (``ServerFleet``), not in-process engines."""
        return self.fleet is not None

    @property
    def hands_over(self) -> bool:
        """Its replicas sleep while the worker group trains (colocated servers, no overlap)."""
        return self.servers is not None and self.servers.hands_over

    # -- the driver's engine ------------------------------------------------------------------------

    def attach(self, engine: Engine) -> None:
        """On the driver: the engine (in-process ``Engine`` / ``EnginePool``) rollouts of this policy use."""
        self.engine = engine

    def connect(self) -> EnginePool:
        """On the driver, for a server-backed policy: one pool of clients of its servers (least-loaded
        routing, failover; ``engine.stall_s`` and ``engine.health_patience_s`` bound how long an
        unreachable one keeps requests), attached. A dead replica's client is rebuilt once the server
        answers again (its owner restarted it; an external one's node is reachable again), and it takes
        traffic only after a push re-synced it (``resync``, at the next step boundary)."""
        assert self.servers is not None and self.fleet is not None  # served (``served``)
        urls, engine = self.servers.urls, self.policy.engine
        restart_timeout = self.cfg.trainer.collective_timeout_s
        make_client = CLIENTS[engine.backend]
        # A restarted server serves the checkpoint it was started from: current already when the base
        # weights never change (frozen, L2: the pool re-loads the newest adapters), else it waits
        # for a push (``stale``; the trainer re-syncs it at the next step boundary).
        base_moves = self.policy.base_moves

        def replica(index: int, *, restarted: bool = False) -> VLLMServerClient | SGLangClient:
            if restarted:  # the owner rank restarts the process (or the link returns); wait until it answers
                _await_health(urls[index], timeout_s=restart_timeout)
            client = make_client(urls[index], SERVED_MODEL, health_patience_s=engine.health_patience_s)
            client.weight_version = (UNSYNCED if base_moves else pool.weight_version) if restarted else 0
            return client

        pool = EnginePool(lambda i: replica(i), len(urls), stall_s=engine.stall_s)
        pool.factory = lambda i: replica(i, restarted=True)
        self.attach(pool)
        return pool

    # -- colocated memory hand-over (sync mode) -------------------------------------------------------

    def sleep(self) -> None:
        """On the driver, after the rollout: release weights and KV cache (level 1: weights kept in
        host memory): servers that hand their memory over, and in-process engines."""
        if self.hands_over and not self.asleep:
            _each_live(cast(EnginePool, self.engine), lambda r: r.sleep(level=1))  # served: connect()'s
            self.asleep = set(ASLEEP)
        elif not self.served and self.engine is not None and not self.asleep:
            # in-process engines on the driver (the sleep phase runs only where training never overlaps
            # rollout): their KV cache's memory is free while the update runs
            self.engine.sleep(level=1)
            self.asleep = set(ASLEEP)

    def wake(self, tags: tuple[str, ...] = ASLEEP) -> None:
        """On the driver: weights first (before a push writes into them), the KV cache after it (before
        the rollout)."""
        wanted = [t for t in tags if t in self.asleep]
        if wanted and not self.served:  # in-process: one wake, before the push writes and probes
            cast(Engine, self.engine).wake()
            self.asleep.clear()
        elif wanted:
            _each_live(cast(EnginePool, self.engine), lambda r: r.wake(tags=wanted))  # asleep: served
            self.asleep.difference_update(wanted)

    # -- weight pushes (collective) -------------------------------------------------------------------

    def push(self, version: int, *, adapters: list[str] | None = None) -> dict[str, float]:
        """Collective: this policy's current trained weights (L2: each adapter in ``adapters``, default
        all; the others keep their weights and version) into its replicas, stamped ``version``."""
        if self.policy.lora is not None:
            return self._push_adapters(version, self.adapters if adapters is None else adapters)
        if self.served:  # colocated: the trainer's wake-weights phase woke them (megamarl.planning.phases)
            return self._push_to_servers(version, bucket_bytes=int(self.policy.engine.bucket_mb * 2**20))
        held = None
        if self.delta is not None:  # the versions the in-process replicas hold, from the driver
            holder = [self._held_in_process() if self.is_driver else None]
            dist.broadcast_object_list(holder, src=0, group=self.control)
            held = holder[0]
        stats = sync_weights(
            self.wg,
            self.export(),
            self._engines(),
            version=version,
            engine_rank=self.driver_rank,
            bucket_mb=self.policy.engine.bucket_mb,
            select=self._selection(held, version),
        )
        prefix = f"weight_sync/{self.name}"
        return {**stats.as_dict(prefix), **self._delta_metrics(prefix)}

    def _held_in_process(self) -> list[int]:
        """On the driver: the weight version each live in-process replica holds."""
        engine = self.engine
        if isinstance(engine, EnginePool):
            return [r.weight_version for i, r in enumerate(engine.replicas) if engine.live[i]]
        return [cast(Engine, engine).weight_version]

    def _selection(self, held: list[int] | None, version: int) -> Select | None:
        """``engine.delta_sync``: the filter of this push, a delta against the version every target
        replica holds (``held``), else everything (None: delta_sync off)."""
        delta = self.delta
        if delta is None or held is None:
            return None
        base = common_version(held)
        return lambda named: delta.select(named, base=base, version=version)

    def _delta_metrics(self, prefix: str) -> dict[str, float]:
        """Collective: ``<prefix>/tensors_skipped``, summed over the ranks that selected (delta_sync)."""
        if self.delta is None:
            return {}
        counts: list = [None] * dist.get_world_size(self.control)
        dist.all_gather_object(counts, self.delta.num_skipped, group=self.control)
        self.delta.num_skipped = 0  # counted once: a rank may not select in the next push
        return {f"{prefix}/tensors_skipped": float(sum(counts))}

    def snapshot_from(self, source: PolicyReplicas, version: int) -> dict[str, float]:
        """Collective: copy ``source``'s current trained weights into this (frozen) policy's in-process
        engines (an opponent-pool slot), stamping ``version``."""
        if self.served:
            raise ValueError(
                f"rollout.opponent_pool.snapshots: policies.{self.name} is served by engine servers; "
                "snapshots are copied into in-process engines only"
            )
        stats = sync_weights(
            source.wg,
            source.export(),
            self._engines(),
            version=version,
            engine_rank=self.driver_rank,
            bucket_mb=self.policy.engine.bucket_mb,
        )
        return stats.as_dict(f"weight_sync/{self.name}")

    def stale(self) -> list[int]:
        """On the driver: the replicas restarted since their last push (server-backed policies whose
        base weights train; frozen and L2 replicas are never stale, ``connect``)."""
        return cast(EnginePool, self.engine).stale_replicas() if self.served else []

    def resync(self, version: int, replicas: list[int]) -> dict[str, float]:
        """Collective: push the current weights (``version``, unchanged) into restarted ``replicas``
        only, before they take traffic; the other replicas keep serving."""
        return self._push_to_servers(
            version, bucket_bytes=int(self.policy.engine.bucket_mb * 2**20), only=replicas
        )

    def export(self) -> Callable[[], Iterator[tuple[str, torch.Tensor]]] | None:
        """This rank's export of the full weights, in the engine's dtype (None: no shard here)."""
        worker = self.worker
        dtype = DTYPES[resolve_dtype(self.policy.engine.dtype)]  # tensors travel in the engine's dtype
        return (lambda: ((n, t.to(dtype)) for n, t in worker.export())) if worker else None

    def _engines(self) -> list[Engine] | None:
        return [cast(Engine, self.engine)] if self.is_driver else None  # attached on the driver

    def _push_to_servers(
        self, version: int, *, bucket_bytes: int, only: list[int] | None = None
    ) -> dict[str, float]:
        """Collective over all ranks: the driver's pool (None elsewhere) drains and pauses the replicas
        and names the targets; the training ranks push; the pool stamps ``version``. ``only``: re-sync
        just these (restarted) replicas at the current ``version``; metrics then go under
        ``weight_sync/<policy>/resync/``. Returns the push's metrics summed over the sending ranks."""
        prefix = f"weight_sync/{self.name}" + ("/resync" if only is not None else "")
        pool = cast(EnginePool, self.engine) if self.is_driver else None  # served: connect()'s pool
        with pool.external_update(version, only=only) if pool is not None else _nothing() as targets:
            # the versions the targets hold before this push (a restarted one: UNSYNCED)
            held = [pool.replicas[i].weight_version for i, _ in targets] if pool is not None else None
            holder = [(targets, held)]
            dist.broadcast_object_list(holder, src=0, group=self.control)
            targets, held = holder[0]
            stats, check = self._send_from_here(
                version=version,
                bucket_bytes=bucket_bytes,
                targets=targets,
                select=self._selection(held, version),
            )
            gathered: list = [None] * dist.get_world_size(self.control)
            dist.all_gather_object(gathered, stats, group=self.control)  # also: every sender is done
        dist.barrier(group=self.control)  # the driver's pool has resumed the replicas: they can answer probes
        total = SyncStats(
            num_tensors=sum(s.num_tensors for s in gathered),
            num_bytes=sum(s.num_bytes for s in gathered),
            num_buckets=sum(s.num_buckets for s in gathered),
            seconds=max(s.seconds for s in gathered),
        )
        metrics = {**total.as_dict(prefix), **self._delta_metrics(prefix)}
        metrics[f"{prefix}/replicas"] = float(len(targets))
        if self.hands_over:  # their KV cache is still asleep: probed once it wakes (``verify_pushed``)
            self._unverified.append((check, prefix))
        else:
            metrics.update(self._verify(check, prefix))
        return metrics

    def verify_pushed(self) -> dict[str, float]:
        """Collective: ``engine.verify_sync``'s probes of the pushes since the last call, for replicas
        that sleep (their KV cache wakes only after the train state has left: ``planning.phases``)."""
        metrics: dict[str, float] = {}
        if self._unverified:
            dist.barrier(group=self.control)  # the driver has woken the KV caches
        for check, prefix in self._unverified:
            metrics.update(self._verify(check, prefix))
        self._unverified = []
        return metrics

    def _verify(self, check: Callable[[], int] | None, prefix: str) -> dict[str, float]:
        """Collective: run this rank's probe (``_send``'s check) and count the replicas that matched."""
        verified = check() if check is not None else 0
        counts: list = [None] * dist.get_world_size(self.control)
        dist.all_gather_object(counts, verified, group=self.control)
        return {f"{prefix}/verified_replicas": float(sum(counts))} if self.policy.engine.verify_sync else {}

    def _send_from_here(
        self, *, version: int, bucket_bytes: int, targets: list[tuple[int, int]], select: Select | None
    ) -> tuple[SyncStats, Callable[[], int] | None]:
        """This rank's part of a push into the servers. ``targets``: the (replica, restart generation)
        pairs that take this update, the same on every rank. Returns what this rank sent and, with
        ``engine.verify_sync``, the check to run once the replicas have resumed (it returns how many
        replicas matched). ``select``: a delta push's filter, applied where each stream starts towards
        the replicas, after the verifier kept the whole stream (its reference is the whole model)."""
        assert self.servers is not None and self.fleet is not None  # served (``served``)
        servers, wg, export = self.servers, self.wg, self.export()
        stats, start = SyncStats(), time.perf_counter()
        on_gpu = torch.cuda.is_available()
        colocated = servers.colocated and (
            wg.layout.pp == 1 or relays_stages(self.policy, colocated=True, on_gpu=on_gpu)
        )
        send = self._feed_leaders if colocated else self._send_stages
        return send(
            export,
            targets,
            version=version,
            bucket_bytes=bucket_bytes,
            stats=stats,
            start=start,
            select=select or iter,
        )

    def _feed_leaders(
        self,
        export,
        targets: list[tuple[int, int]],
        *,
        version: int,
        bucket_bytes: int,
        stats: SyncStats,
        start: float,
        select: Select,
    ) -> tuple[SyncStats, Callable[[], int] | None]:
        """Colocated replicas, each fed by its own leader rank, which holds full tensors after the
        export's TP gather. At PP>1 (``transport.relays_stages``) the leader receives the stages it does
        not hold point to point from its DP replica's ranks of those stages (``stage_gather.relay_roles``)
        and feeds its replica every stage, in pp order, as ONE update."""
        assert self.servers is not None and self.fleet is not None  # served (``served``)
        generations = dict(targets)
        # colocated replicas are started by a rank of the run, never None (external)
        leaders = cast("dict[int, int]", {self.servers.replicas[i].leader: i for i in generations})
        roles = relay_roles(self.wg.layout, leaders) if self.wg.is_member else {}
        role = roles.get(self.rank)
        if export is None or role is None or not role.exports:
            return stats, None
        device = forward_device(on_gpu=torch.cuda.is_available())
        named = export()
        if role.destinations:
            named = relay_stage(
                named, destinations=role.destinations, bucket_bytes=bucket_bytes, device=device
            )
        if not role.feeds:
            drain(named)  # a TP peer takes part in the gathers; a source forwards its stage
            return stats, None
        stages = [
            named if stage == role.stage else receive_stage(role.sources[stage], device=device)
            for stage in range(self.wg.layout.pp)
        ]
        index = leaders[self.rank]
        sender = self._sender((self.rank,), [(index, generations[index])], colocated=True)
        named = itertools.chain(*stages)
        return self._send(sender, named, [index], version, bucket_bytes, stats, start, select)

    def _send_stages(
        self,
        export,
        targets: list[tuple[int, int]],
        *,
        version: int,
        bucket_bytes: int,
        stats: SyncStats,
        start: float,
        select: Select,
    ) -> tuple[SyncStats, Callable[[], int] | None]:
        """Collective: every pipeline stage's sender pushes its stage into ``targets``, as ONE update
        per replica: stage 0's sender opens it (``begin``) and closes it (``end``), every stage sends
        in between (concurrently where the servers allow it, ``transport.CONCURRENT_STAGES``; else in
        pp order; or all through stage 0's sender, ``transport.gathers_stages``).
        A vLLM worker refuses a second ``start_weight_update`` while one is open, and a stage that
        closed the update early would finalize the other stage's layers unloaded. Each phase ends in an
        agreement over the control group, so a failure anywhere raises on every rank."""
        assert self.servers is not None and self.fleet is not None  # served (``served``)
        wg, on_gpu = self.wg, torch.cuda.is_available()
        colocated = self.servers.colocated
        role = stage_role(wg, self.rank) if export is not None else None
        # one connection per stage's sender, or (``gathers_stages``) stage 0's alone, fed by the others
        gather = gathers_stages(self.policy, colocated=colocated, on_gpu=on_gpu)
        sender = self._stage_sender(targets, sending=role == "sender" and (not gather or wg.pp_rank == 0))
        opens = sender is not None and wg.pp_rank == 0
        verify = self.policy.engine.verify_sync and wg.layout.pp == 1  # a stage alone is not a model
        pushed: dict[str, torch.Tensor] = {}
        device = forward_device(on_gpu=on_gpu)

        def send() -> None:
            named = export()
            if role != "sender":
                drain(named)  # a TP peer takes part in its sender's gathers
            elif sender is None:  # gathered: this stage's tensors go to stage 0's sender
                forward_stage(named, dst=stage_sender(wg, 0), bucket_bytes=bucket_bytes, device=device)
            else:
                if gather:
                    named = itertools.chain(
                        named,
                        *(receive_stage(stage_sender(wg, s), device=device) for s in range(1, wg.layout.pp)),
                    )
                named = select(_keep(named, pushed) if verify else named)
                sender.send(named, bucket_bytes=bucket_bytes, stats=stats)

        self._agree(lambda: sender.begin(pause=False) if opens else None)  # the pool paused the replicas
        concurrent = gather or CONCURRENT_STAGES[self.policy.engine.backend]
        for stage in (None,) if concurrent else range(wg.layout.pp):
            mine = role is not None and (stage is None or wg.pp_rank == stage)
            self._agree(send if mine else None)
        self._agree(lambda: sender.end(version=version, resume=False) if opens else None)
        stats.seconds = time.perf_counter() - start
        if not (verify and sender is not None):
            return stats, None
        urls = {i: self.servers.urls[i] for i, _ in targets}
        return stats, lambda: verify_replicas(
            self.name,
            self.fleet.model_paths[self.name],
            pushed,
            urls,
            served_model=SERVED_MODEL,
            version=version,
            backend=self.policy.engine.backend,
        )

    def _agree(self, step: Callable[[], object] | None) -> None:
        """Collective: run ``step`` here (None: nothing) and wait for every rank's; raise on every rank
        when any rank's failed (its own error here, a summary elsewhere), instead of leaving the others
        waiting in the next collective until its timeout."""
        error = None
        try:
            if step is not None:
                step()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others heard of it
            error = exc
        errors: list = [None] * dist.get_world_size(self.control)
        dist.all_gather_object(
            errors, None if error is None else f"rank {self.rank}: {error!r}", group=self.control
        )
        if error is not None:
            raise error
        failed = [e for e in errors if e is not None]
        if failed:
            raise RuntimeError(f"push of '{self.name}' failed on another rank: {failed[0]}")

    def _stage_sender(self, targets: list[tuple[int, int]], *, sending: bool):
        """Collective: this rank's connection to ``targets`` (None unless it sends a stage), rebuilt on
        every rank together when the targets changed. Stages reconnect one at a time, in pp order, each
        behind an agreement: every replica's engine core runs one utility call at a time and a worker
        blocks in ``/init_weight_transfer_engine`` until the group forms, so two stages joining at once
        could each hold one replica while waiting for the other (a deadlock across replicas). Each
        stage releases only its own old group (``WeightSender.close``)."""
        assert self.servers is not None and self.fleet is not None  # served (``served``)
        wanted = tuple(sorted(targets))
        where = ("stage",)
        if self._stages_key != wanted:
            for stage in range(self.wg.layout.pp):
                mine = sending and self.wg.pp_rank == stage
                self._agree(
                    (
                        lambda: self._sender(
                            where, targets, colocated=cast(PolicyServers, self.servers).colocated
                        )
                    )
                    if mine
                    else None
                )
            self._stages_key = wanted
        return self._transfers[where].sender if sending else None

    def _send(self, sender, named, verify: list[int], version, bucket_bytes, stats, start, select):
        assert self.servers is not None and self.fleet is not None  # served (``served``)
        check = self.policy.engine.verify_sync and verify
        pushed: dict[str, torch.Tensor] = {}  # the whole stream: the verifier's reference model
        if check:
            named = _keep(named, pushed)
        named = select(named)
        stats = sender.push(named, version=version, bucket_bytes=bucket_bytes, pause=False)  # the pool paused
        stats.seconds = time.perf_counter() - start
        if not check:
            return stats, None
        urls = {i: self.servers.urls[i] for i in verify}
        return stats, lambda: verify_replicas(
            self.name,
            self.fleet.model_paths[self.name],
            pushed,
            urls,
            served_model=SERVED_MODEL,
            version=version,
            backend=self.policy.engine.backend,
        )

    def _sender(
        self, where: tuple, targets: list[tuple[int, int]], *, colocated: bool
    ) -> WeightSender | VLLMNativeSender | SGLangWeightSender:
        """The connection for ``targets``, rebuilt when the replica set or a restart changed it."""
        wanted = tuple(sorted(targets))
        current = self._transfers.get(where)
        if current is not None and current.key == wanted:
            return current.sender
        if current is not None:
            current.sender.close()
        assert self.servers is not None and self.fleet is not None  # served (``served``)
        servers = self.servers
        indices = [i for i, _ in wanted]
        sender = SENDERS[self.policy.engine.backend](
            [servers.urls[i] for i in indices],
            transport=transport_for(self.policy, colocated=colocated, on_gpu=torch.cuda.is_available()),
            master_addr=self.fleet.rendezvous_address(self.name),
            master_port=free_port("0.0.0.0"),
            replica_tp=[self.policy.engine.tp] * len(indices),  # an external replica holds no rank here
        )
        sender.connect()
        self._transfers[where] = _Transfer(sender, wanted)
        return sender

    # -- L2 adapters ----------------------------------------------------------------------------------

    def adapter_dir(self, adapter: str, version: int) -> Path:
        return self.run_dir / "adapters" / self.name / adapter / f"v{version}"

    def register_adapters(self) -> None:
        """Collective, L2: write each adapter's initial PEFT directory (over its WG) and register it
        with the policy's engines, which then receive adapter-only updates."""
        if self.policy.lora is None:
            return
        for adapter in self.adapters:
            path = self.adapter_dir(adapter, 0)
            if self.worker is not None:
                save_peft_adapter(self.worker.model, self.wg, adapter, path)
            dist.barrier(group=self.control)
            if self.is_driver:
                if self.served:
                    self.wake()  # on GPU asleep since start-up (ServerFleet._start)
                cast(ServesAdapters, self.engine).add_lora(adapter, path)  # attached on the driver

    def _push_adapters(self, version: int, pushed: list[str]) -> dict[str, float]:
        """``pushed`` adapters' weights into the replicas, stamped ``version``; the others keep theirs (and
        their version: ``WeightVersions.serving``). ``weight_sync/<p>/bytes``: the bytes of this push."""
        metrics, worker = {}, self.worker
        for adapter in (a for a in self.adapters if a in pushed):
            if self.served:
                stats, verified = self._adapter_to_servers(adapter, version)
                if self.policy.engine.verify_sync and self.is_driver:
                    metrics[f"weight_sync/{self.name}/{adapter}/verified_replicas"] = float(verified)
            else:
                export = (lambda a=adapter: worker.export_adapter(a)) if worker else None
                stats = sync_weights(
                    self.wg,
                    export,
                    self._engines(),
                    version=version,
                    engine_rank=self.driver_rank,
                    bucket_mb=self.policy.engine.bucket_mb,
                    lora=adapter,
                )
            metrics.update(stats.as_dict(f"weight_sync/{self.name}/{adapter}"))
        prefix = f"weight_sync/{self.name}/"
        metrics[f"{prefix}bytes"] = sum(metrics.get(f"{prefix}{a}/bytes", 0.0) for a in pushed)
        metrics[f"{prefix}adapters_pushed"] = float(len(pushed))
        return metrics

    def _adapter_to_servers(self, adapter: str, version: int) -> tuple[SyncStats, int]:
        path = self.adapter_dir(adapter, version)
        if self.worker is not None:
            save_peft_adapter(self.worker.model, self.wg, adapter, path)
        dist.barrier(group=self.control)
        stats = SyncStats(num_tensors=sum(1 for _ in path.glob("*.safetensors")) if self.is_driver else 0)
        verified = 0  # replicas whose greedy tokens matched (engine.verify_sync)
        if self.is_driver:
            stats.num_bytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            assert self.servers is not None and self.fleet is not None  # served (``served``)
            engine = cast(EnginePool, self.engine)  # served: connect()'s pool
            self.wake()  # colocated, asleep since the rollout: weights, KV cache back
            with engine.external_update(version, lora=adapter) as targets:
                for index, _ in targets:  # every replica reloads the adapter in place
                    replica = cast(ServerReplica, engine.replicas[index])
                    replica.add_lora(adapter, path)
                    replica.lora_versions[adapter] = version
            engine.adapter_updated(adapter, path, version)  # a restarted replica loads the newest directory
            if self.policy.engine.verify_sync:
                urls = {i: cast(ServerReplica, engine.replicas[i]).base_url for i, _ in targets}
                verified += verify_adapter(
                    self.name,
                    adapter,
                    self.fleet.model_paths[self.name],
                    path,
                    urls,
                    version=version,
                    served_model=SERVED_MODEL,
                    backend=self.policy.engine.backend,
                )
        return stats, verified

    def close(self) -> None:
        for transfer in self._transfers.values():
            try:
                transfer.sender.close()
            except Exception:  # noqa: BLE001, S110 - servers may already be gone
                pass


def build_replicas(
    cfg: RunConfig,
    *,
    wgs: dict[str, WorkerGroup],
    workers: dict,
    fleet: ServerFleet | None,
    run_dir: Path,
    driver_rank: int,
    control_group,
) -> dict[str, PolicyReplicas]:
    """Every policy's replicas, on every rank."""
    return {
        name: PolicyReplicas(
            cfg,
            name,
            wg=wgs[name],
            worker=workers.get(name),
            fleet=fleet,
            run_dir=run_dir,
            driver_rank=driver_rank,
            control_group=control_group,
        )
        for name in cfg.policies
    }


def stale_replicas(
    replicas: dict[str, PolicyReplicas], *, driver_rank: int, control_group
) -> dict[str, list[int]]:
    """Collective: the driver's replicas (of server-backed policies whose weights train) that restarted
    since their last push, the same on every rank."""
    if not any(
        r.served for r in replicas.values()
    ):  # in-process engines: the pool re-sends the weights itself
        return {}
    found = {}
    if dist.get_rank() == driver_rank:
        for name, r in replicas.items():
            indices = r.stale()
            if indices:
                found[name] = indices
    holder = [found]
    dist.broadcast_object_list(holder, src=driver_rank, group=control_group)
    return holder[0]


def _each_live(pool: EnginePool, call) -> None:
    for index, replica in enumerate(pool.replicas):
        if pool.live[index]:
            try:
                call(replica)
            except ConnectionError:
                pool._mark_dead(index, replica)


@contextmanager
def _nothing():
    yield None


def _keep(named: Iterable[tuple[str, torch.Tensor]], into: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named:
        into[name] = tensor
        yield name, tensor


def _await_health(url: str, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not healthy(url, timeout_s=5):
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine server {url} did not come back within {timeout_s:.0f} s")
        time.sleep(1.0)
