"""``EngineFleet``: the engine servers of every policy, seen from every rank.

Built on every rank at start-up from the same plan (``megamarl.parallel.engine_placement``):

- each rank starts the servers whose device block it leads (``ServerProcess``; started in a thread,
  so the ~70 s a vLLM-CPU server takes to come up overlaps model preparation; on GPU colocated
  servers come up, and those that hand memory over fall asleep, before any model is built:
  ``model_preparation``), watches them and restarts one that dies (same port, so its URL stays valid);
- ``wait_ready`` exchanges the addresses over the control group; a server that failed to start
  stops every rank with its error (policy, replica, rank, last log lines);
- the driver reaches a policy's replicas through one ``EnginePool`` of server clients
  (``driver_pool``; ``CLIENTS`` by engine backend: ``VLLMServerClient``, ``SGLangClient``):
  least-loaded routing, failover; a dead replica's client is rebuilt once its
  owner has restarted the server, and it takes traffic only after the next weight push re-synced it;
- ``push`` moves a policy's new weights from the training ranks straight into the servers
  (``SENDERS`` by engine backend: ``server_sync.WeightSender`` for vLLM on CPU,
  ``vllm_native_sync.VLLMNativeSender`` for vLLM on GPU, ``sglang_sync.SGLangWeightSender`` for
  SGLang; the data plane from ``engine.weight_transfer``, ``TRANSPORTS``), never through the
  driver: disaggregated replicas get one broadcast per bucket from each stage's sender (all replicas
  at once); colocated replicas (PP=1) are fed by their own leader rank, which holds full tensors
  after the export's TP gather (vLLM: shared memory, on GPU CUDA IPC at engine TP=1; SGLang: CUDA
  IPC on GPU, on CPU a gloo group of the leader and its replica).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megamarl.driver.schedules import SCHEDULES
from megamarl.models.packaged import resolve_model_path
from megamarl.parallel.engine_placement import ReplicaPlacement, plan_engines, ranks_per_node, replicas_led_by
from megamarl.parallel.hardware import node_cores
from megamarl.parallel.network import host_address
from megamarl.parallel.placement import WorkerGroup
from megamarl.planning.dryrun import engine_memory
from megamarl.planning.model_presets import resolve_model_shape
from megamarl.rollout.engines.sglang import SGLangClient
from megamarl.rollout.engines.vllm_server import VLLMServerClient
from megamarl.rollout.replicas.pool import EnginePool
from megamarl.rollout.servers.server_launch import (
    ServerProcess,
    ServerSpec,
    ServerStartError,
    free_port,
    healthy,
)
from megamarl.rollout.weights.server_sync import WeightSender
from megamarl.rollout.weights.sglang_sync import SGLangWeightSender
from megamarl.rollout.weights.sync_check import verify_replicas
from megamarl.rollout.weights.vllm_native_sync import TRANSPORTS as VLLM_NATIVE
from megamarl.rollout.weights.vllm_native_sync import VLLMNativeSender
from megamarl.rollout.weights.weight_sync import SyncStats, drain, stage_sender

log = logging.getLogger(__name__)

WATCH_S = 2.0  # how often an owner checks its servers
HANG_S = 300.0  # a live process that has not answered /health for this long is restarted
UNSYNCED = -1
SERVED_MODEL = "default"  # the model name requests use; L2 adapters are served under their own names  # weight_version of a restarted replica until a push reaches it


def vllm_transport(engine, *, colocated: bool, pp: int, on_gpu: bool) -> str:
    """The data plane into a policy's vLLM replicas (their ``--weight-transfer-config`` backend and the
    sender's), from ``engine.weight_transfer``. vLLM's own backends (GPU): CUDA IPC into a colocated
    replica at engine TP=1, NCCL to disaggregated replicas at PP=1 (a vLLM worker holds ONE nccl
    group, and each pipeline stage sends on its own). megamarl's plugin backends: shared memory into
    a colocated replica (PP=1) fed by its own rank, a gloo broadcast per stage otherwise."""
    native = on_gpu and engine.weight_transfer != "megamarl"
    if colocated and pp == 1:
        return "ipc" if native and engine.tp == 1 else "megamarl_shm"
    return "nccl" if native and pp == 1 else "megamarl_gloo"


def sglang_transport(engine, *, colocated: bool, pp: int, on_gpu: bool) -> str:
    """SGLang's own data planes on GPU (CUDA IPC into a colocated replica, NCCL otherwise); a gloo
    group on CPU or with ``engine.weight_transfer: megamarl`` (on CPU also for a colocated replica:
    its own leader rank is the group's sender)."""
    if not on_gpu or engine.weight_transfer == "megamarl":
        return "gloo"
    return "cuda_ipc" if colocated else "nccl"


def _vllm_sender(urls: list[str], *, transport: str, **kw) -> WeightSender | VLLMNativeSender:
    if transport in VLLM_NATIVE:
        return VLLMNativeSender(urls, transport=transport, **kw)
    return WeightSender(urls, backend=transport, **kw)


def _sglang_sender(urls: list[str], *, transport: str, **kw) -> SGLangWeightSender:
    return SGLangWeightSender(urls, transport=transport, **kw)


# engine backend -> how its servers receive weights (the transport from the policy's engine config)
TRANSPORTS: dict[str, Callable[..., str]] = {"vllm": vllm_transport, "sglang": sglang_transport}
# engine backend -> the weight sender into its servers (connect/begin/send/end/push/close) and the
# driver's client of one server
SENDERS: dict[str, Callable[..., WeightSender | VLLMNativeSender | SGLangWeightSender]] = {"vllm": _vllm_sender, "sglang": _sglang_sender}
CLIENTS: dict[str, Callable[[str, str], VLLMServerClient | SGLangClient]] = {
    "vllm": lambda url, model: VLLMServerClient(url, model=model),
    "sglang": lambda url, model: SGLangClient(url),  # one base model per server: requests name no model
}


@dataclass
class _Transfer:
    """A live weight-transfer connection from this rank to some replicas of one policy."""

    sender: WeightSender | SGLangWeightSender
    key: tuple  # (replica indices, their restart generations): a change means a new group


@dataclass
class PolicyServers:
    name: str
    replicas: list[ReplicaPlacement]
    urls: list[str] = field(default_factory=list)

    @property
    def colocated(self) -> bool:
        return self.replicas[0].colocated


class EngineFleet:
    def __init__(
        self,
        cfg,
        *,
        rank: int,
        world_size: int,
        ranks_per_node: int,
        model_paths: dict[str, Path],
        log_dir: Path,
        control_group,
        num_threads: Callable[[str], int],
        overlaps_training: bool = False,
        memory_fractions: dict[tuple[str, int], float] | None = None,
    ) -> None:
        self.cfg, self.rank, self.control = cfg, rank, control_group
        self.model_paths = model_paths
        self.multi_node = world_size > ranks_per_node
        self.on_gpu = torch.cuda.is_available()
        self.memory_fractions = memory_fractions or {}  # (policy, replica) -> the plan's GPU fraction
        self.plan = plan_engines(cfg, world_size, ranks_per_node)
        self.policies = {
            name: PolicyServers(name, reps) for name, reps in self.plan.items() if reps and reps[0].launch == "server"
        }
        self.local: dict[tuple[str, int], ServerProcess] = {}
        self.restarts: dict[tuple[str, int], int] = {}
        self._starting: dict[tuple[str, int], Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="engine-server")
        self._transfers: dict[tuple[str, int], _Transfer] = {}
        self._stop = threading.Event()
        self.overlaps_training = overlaps_training
        # policy -> its replicas' released memory tags (the driver's view); on GPU the servers that
        # hand memory over fall asleep right after start-up (``model_preparation``)
        self._asleep: dict[str, set[str]] = {
            name: {"weights", "kv_cache"} for name in self.policies if self.on_gpu and self.hands_over(name)}
        self._watchdog: threading.Thread | None = None
        for name, servers in self.policies.items():
            for rep in replicas_led_by({name: servers.replicas}, rank):  # all of them are servers
                spec = self._spec(rep, model_paths[name], log_dir, num_threads(name))
                proc = ServerProcess(spec)
                self.local[(name, rep.index)] = proc
                self.restarts[(name, rep.index)] = 0
                self._starting[(name, rep.index)] = self._pool.submit(self._start, proc)

    def serves(self, policy: str) -> bool:
        return policy in self.policies

    def _spec(self, rep: ReplicaPlacement, path: Path, log_dir: Path, threads: int) -> ServerSpec:
        from megamarl.driver.rollout_driver import _lora_serving  # the driver's LoRA serving rule

        p = self.cfg.policies[rep.policy]
        fraction = p.engine.gpu_memory_utilization or self.memory_fractions.get((rep.policy, rep.index))
        return ServerSpec(
            policy=rep.policy, replica=rep.index, rank=self.rank, backend=p.engine.backend,
            model_path=str(path), tp=p.engine.tp, devices=tuple(rep.devices), dtype=p.engine.dtype,
            max_num_seqs=p.engine.max_num_seqs, max_model_len=p.seq_len, kv_cache_gib=_kv_cache_gib(p, path),
            num_threads=threads, seed=self.cfg.trainer.seed + rep.index, lora=_lora_serving(self.cfg, rep.policy),
            log_path=log_dir / f"{rep.policy}-replica{rep.index}.log", weight_transfer=self._transport(rep.policy, rep.colocated),
            served_model_name=SERVED_MODEL, on_gpu=self.on_gpu,
            host="0.0.0.0" if self.multi_node else "127.0.0.1",
            sleeps=self.hands_over(rep.policy), enforce_eager=p.engine.eager(on_gpu=self.on_gpu),
            memory_fraction=fraction if self.on_gpu else None,
        )

    def _transport(self, policy: str, colocated: bool) -> str:
        """The data plane of pushes into ``policy``'s servers (``TRANSPORTS``; the same on the server's
        command line and in the sender)."""
        p = self.cfg.policies[policy]
        return TRANSPORTS[p.engine.backend](p.engine, colocated=colocated, pp=p.pp, on_gpu=torch.cuda.is_available())

    # -- start-up --------------------------------------------------------------------------------

    @property
    def starts_first(self) -> bool:
        """On GPU, colocated servers come up before any rank builds a model: vLLM and SGLang size
        themselves from the memory they find free at start-up (vLLM refuses to start when its
        fraction is not free), so a trainer allocating at the same time would make them fail or
        over-commit the GPU. Servers that hand memory over then fall asleep before the trainer
        allocates. On CPU, and with disaggregated servers only (their own GPUs), start-up overlaps
        model preparation. The same on every rank (a collective follows)."""
        return self.on_gpu and any(servers.colocated for servers in self.policies.values())

    @contextmanager
    def model_preparation(self) -> Iterator[None]:
        """Around the trainer's model building: every rank's servers ready (``wait_ready``) before it
        when they ``starts_first``, after it otherwise."""
        if self.starts_first:
            self.wait_ready()
        yield
        if not self.starts_first:
            self.wait_ready()

    def _start(self, proc: ServerProcess) -> str:
        """Start one server (in a thread); on GPU a server that hands its memory over goes to sleep
        once it answers (level 1: weights kept in host memory; start-up has profiled and warmed it),
        and the first weight push or rollout wakes it (``_asleep``)."""
        url, spec = proc.start(), proc.spec
        if spec.on_gpu and spec.sleeps:
            try:
                CLIENTS[spec.backend](url, SERVED_MODEL).sleep(level=1)
            except Exception as exc:  # reported on every rank by wait_ready
                raise ServerStartError(f"{spec.backend} server for {spec.label} answered at {url} but did not go to "
                                       f"sleep after start-up: {exc}") from exc
        return url

    def wait_ready(self) -> None:
        """Collective: every rank's servers are healthy, and every rank knows every address."""
        mine, error = {}, None
        for key, future in self._starting.items():
            try:
                mine[key] = future.result()
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = error or str(exc)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, error), group=self.control)
        errors = [e for _, e in gathered if e]
        if errors:
            self.close()
            raise RuntimeError(errors[0])
        urls = {key: url for m, _ in gathered for key, url in m.items()}
        for name, servers in self.policies.items():
            servers.urls = [urls[(name, rep.index)] for rep in servers.replicas]
        pids: list = [None] * dist.get_world_size()
        dist.all_gather_object(pids, {key: proc.proc.pid for key, proc in self.local.items() if proc.proc}, group=self.control)
        self.pids = {key: pid for m in pids for key, pid in m.items()}
        if self.local:
            self._watchdog = threading.Thread(target=self._watch, daemon=True, name="engine-watchdog")
            self._watchdog.start()

    def _watch(self) -> None:
        """The owner restarts its servers whose process exited, or that have not answered ``/health``
        for ``HANG_S`` (a slow answer under load is not death: a false restart would drop a healthy
        replica's requests). Same port, so the driver's pool finds it again by itself."""
        silent_since: dict[tuple[str, int], float] = {}
        while not self._stop.wait(WATCH_S):
            for key, proc in self.local.items():
                if self._stop.is_set():
                    return
                exited = proc.proc is None or proc.proc.poll() is not None
                if not exited:
                    if proc.alive():
                        silent_since.pop(key, None)
                        continue
                    if time.monotonic() - silent_since.setdefault(key, time.monotonic()) < HANG_S:
                        continue
                what = "exited" if exited else f"did not answer /health for {HANG_S:.0f} s"
                log.warning("engine server %s replica %d (rank %d) %s; restarting", key[0], key[1], self.rank, what)
                try:
                    proc.restart()
                    self.restarts[key] += 1
                    silent_since.pop(key, None)
                except Exception:
                    log.exception("restarting engine server %s replica %d failed", *key)

    def table(self) -> list[dict]:
        """One row per server (written to ``<run_dir>/engine_servers.json`` by the driver)."""
        return [
            {"policy": name, "replica": rep.index, "ranks": list(rep.ranks), "devices": list(rep.devices),
             "url": url, "pid": self.pids.get((name, rep.index)), "colocated": rep.colocated}
            for name, servers in self.policies.items() for rep, url in zip(servers.replicas, servers.urls)
        ]

    # -- the driver's view -----------------------------------------------------------------------

    def driver_pool(self, policy: str, *, served_model: str = "") -> EnginePool:
        urls = self.policies[policy].urls
        restart_timeout = self.cfg.trainer.collective_timeout_s

        p = self.cfg.policies[policy]
        make_client = CLIENTS[p.engine.backend]
        # A restarted server serves the checkpoint it was started from: current already when the base
        # weights never change (frozen, L2: the pool re-loads the newest adapters), else it waits
        # for a push (``stale_replicas``; the trainer re-syncs it at the next step boundary).
        base_moves = not p.frozen and p.lora is None

        def replica(index: int, *, restarted: bool = False) -> VLLMServerClient | SGLangClient:
            if restarted:  # the owner rank restarts the process; wait until it answers again
                _await_health(urls[index], timeout_s=restart_timeout)
            client = make_client(urls[index], served_model or SERVED_MODEL)
            client.weight_version = (UNSYNCED if base_moves else pool.weight_version) if restarted else 0
            return client

        pool = EnginePool(lambda i: replica(i), len(urls))
        pool.factory = lambda i: replica(i, restarted=True)
        return pool

    # -- colocated memory hand-over (sync mode) ----------------------------------------------------

    def hands_over(self, policy: str) -> bool:
        """Colocated servers in a schedule where training never overlaps rollout: they sleep while
        their worker group trains (vLLM on CPU accepts the calls and keeps its memory)."""
        return self.serves(policy) and self.policies[policy].colocated and not self.overlaps_training

    def sleep(self, policy: str, pool: EnginePool) -> None:
        """After the rollout: release weights and KV cache (level 1: weights kept in host memory)."""
        if self.hands_over(policy) and policy not in self._asleep:
            _each_live(pool, lambda r: r.sleep(level=1))
            self._asleep[policy] = {"weights", "kv_cache"}

    def wake(self, policy: str, pool: EnginePool, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Weights first (before a push writes into them), the KV cache after it (before the rollout)."""
        asleep = self._asleep.get(policy, set())
        wanted = [t for t in tags if t in asleep]
        if wanted:
            _each_live(pool, lambda r: r.wake(tags=wanted))
            asleep.difference_update(wanted)
            if not asleep:
                del self._asleep[policy]

    # -- weight sync -----------------------------------------------------------------------------

    def sync_policy(self, policy: str, wg: WorkerGroup, export, *, version: int, bucket_bytes: int,
                    pool: EnginePool | None, only: list[int] | None = None) -> dict[str, float]:
        """Collective over all ranks: the driver's ``pool`` (None elsewhere) drains and pauses the
        replicas and names the targets; the training ranks push; the pool stamps ``version``.
        ``only``: re-sync just these (restarted) replicas at the current ``version``; metrics then
        go under ``weight_sync/<policy>/resync/``.
        Returns the push's metrics summed over the sending ranks (on every rank)."""
        prefix = f"weight_sync/{policy}" + ("/resync" if only is not None else "")
        with pool.external_update(version, only=only) if pool is not None else _nothing() as targets:
            holder = [targets]
            dist.broadcast_object_list(holder, src=0, group=self.control)
            stats, check = self.push(policy, wg, export, version=version, bucket_bytes=bucket_bytes,
                                     targets=holder[0])
            gathered: list = [None] * dist.get_world_size(self.control)
            dist.all_gather_object(gathered, stats, group=self.control)  # also: every sender is done
        if pool is not None:
            self.wake(policy, pool, tags=("kv_cache",))  # colocated: the KV cache back before any request
        dist.barrier(group=self.control)  # the driver's pool has resumed the replicas: they can answer probes
        verified = check() if check is not None else 0
        counts: list = [None] * dist.get_world_size(self.control)
        dist.all_gather_object(counts, verified, group=self.control)
        total = SyncStats(
            num_tensors=sum(s.num_tensors for s in gathered), num_bytes=sum(s.num_bytes for s in gathered),
            num_buckets=sum(s.num_buckets for s in gathered), seconds=max(s.seconds for s in gathered),
        )
        metrics = total.as_dict(prefix)
        metrics[f"{prefix}/replicas"] = float(len(holder[0]))
        if self.cfg.policies[policy].engine.verify_sync:
            metrics[f"{prefix}/verified_replicas"] = float(sum(counts))
        return metrics

    def push(
        self,
        policy: str,
        wg: WorkerGroup,
        export: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None,
        *,
        version: int,
        bucket_bytes: int,
        targets: list[tuple[int, int]],
    ) -> tuple[SyncStats, Callable[[], int] | None]:
        """This rank's part of a push. ``targets``: the (replica, restart generation) pairs that take
        this update, the same on every rank. Returns what this rank sent and, with
        ``engine.verify_sync``, the check to run once the replicas have resumed (it returns how many
        replicas matched)."""
        servers = self.policies[policy]
        stats, start = SyncStats(), time.perf_counter()
        generations = dict(targets)
        if servers.colocated and wg.layout.pp == 1:
            leaders = {servers.replicas[i].leader: i for i in generations}
            if wg.is_member and export is not None and any(r in leaders for r in tp_group_ranks(wg)):
                named = export()
                if self.rank not in leaders:
                    drain(named)  # a TP peer takes part in the leader's gathers
                    return stats, None
                index = leaders[self.rank]
                sender = self._sender(policy, (self.rank,), [(index, generations[index])], colocated=True)
                return self._send(policy, sender, named, [index], version, bucket_bytes, stats, start)
            return stats, None
        pp_rank = wg.pp_rank if wg.is_member else None
        if pp_rank is None or wg.dp_rank != 0 or export is None:
            return stats, None
        named = export()
        if self.rank != stage_sender(wg, pp_rank):
            drain(named)
            return stats, None
        sender = self._sender(policy, (pp_rank,), targets, colocated=False)
        verify_here = wg.layout.pp == 1  # a stage alone is not a model to decode with
        return self._send(policy, sender, named, list(generations) if verify_here else [], version, bucket_bytes,
                          stats, start)

    def _send(self, policy, sender, named, verify: list[int], version, bucket_bytes, stats, start):
        check = self.cfg.policies[policy].engine.verify_sync and verify
        pushed: dict[str, torch.Tensor] = {}
        if check:
            named = _keep(named, pushed)
        stats = sender.push(named, version=version, bucket_bytes=bucket_bytes, pause=False)  # the pool paused
        stats.seconds = time.perf_counter() - start
        if not check:
            return stats, None
        urls = {i: self.policies[policy].urls[i] for i in verify}
        backend = self.cfg.policies[policy].engine.backend
        return stats, lambda: verify_replicas(policy, self.model_paths[policy], pushed, urls,
                                              served_model=SERVED_MODEL, version=version, backend=backend)

    def _sender(self, policy: str, where: tuple, targets: list[tuple[int, int]], *,
                colocated: bool) -> WeightSender | VLLMNativeSender | SGLangWeightSender:
        """The connection for ``targets``, rebuilt when the replica set or a restart changed it."""
        key = (policy, *where)
        wanted = tuple(sorted(targets))
        current = self._transfers.get(key)
        if current is not None and current.key == wanted:
            return current.sender
        if current is not None:
            current.sender.close()
        servers = self.policies[policy]
        indices = [i for i, _ in wanted]
        sender = SENDERS[self.cfg.policies[policy].engine.backend](
            [servers.urls[i] for i in indices], transport=self._transport(policy, colocated),
            master_addr=host_address(multi_node=self.multi_node), master_port=free_port("0.0.0.0"),
            replica_tp=[len(servers.replicas[i].ranks) for i in indices],
        )
        sender.connect()
        self._transfers[key] = _Transfer(sender, wanted)
        return sender

    def close(self) -> None:
        self._stop.set()
        for transfer in self._transfers.values():
            try:
                transfer.sender.close()
            except Exception:  # noqa: BLE001, S110 - servers may already be gone
                pass
        for proc in self.local.values():
            proc.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _check_context(policy: str, seq_len: int, path: Path) -> None:
    """A server is started with ``--max-model-len policies.<p>.seq_len``: say so before it fails."""
    config = json.loads((Path(path) / "config.json").read_text())
    limit = config.get("max_position_embeddings")
    if limit and seq_len > limit:
        raise ValueError(f"policies.{policy}.seq_len={seq_len} exceeds the model's max_position_embeddings={limit} "
                         f"({path}); its engine servers would refuse to start")


def _check_weight_transfer(cfg, policy: str, *, servers: bool) -> None:
    """``engine.weight_transfer`` chooses how pushes reach SERVERS, and ``native`` needs CUDA."""
    choice = cfg.policies[policy].engine.weight_transfer
    if choice != "auto" and not servers:
        raise ValueError(f"policies.{policy}.engine.weight_transfer={choice} applies to engine servers only, and this "
                         f"policy's engines run in-process (engine.launch); drop the key or set engine.launch=server")
    if choice == "native" and not torch.cuda.is_available():
        raise ValueError(f"policies.{policy}.engine.weight_transfer=native needs CUDA (the backend's own NCCL / CUDA "
                         f"IPC transfer) and this node has none; use auto or megamarl")


def _check_gpu_memory(cfg, policy: str) -> None:
    """``engine.gpu_memory_utilization`` is a GPU engine's share of its device: refuse it without CUDA."""
    value = cfg.policies[policy].engine.gpu_memory_utilization
    if value is not None and not torch.cuda.is_available():
        raise ValueError(f"policies.{policy}.engine.gpu_memory_utilization={value} sizes an engine on a GPU and this "
                         f"node has none (CPU engines take engine.kv_cache_gib); drop the key")


def _check_sglang_sampling(cfg, policy: str) -> None:
    """SGLang's sampling parameters have no ``allowed_token_ids``: refuse the key, never ignore it."""
    for agent, acfg in cfg.agents.items():
        if acfg.policy == policy and acfg.sampling.allowed_tokens:
            raise ValueError(f"agents.{agent}.sampling.allowed_tokens: policy {policy} serves through SGLang "
                             "(engine.backend=sglang), whose sampling parameters cannot restrict tokens; drop the "
                             "key or use engine.backend=vllm")


def _kv_cache_gib(policy, path: Path) -> float:
    """``engine.kv_cache_gib``, or (0) what ``max_num_seqs`` sequences of ``seq_len`` need (the
    dry-run's estimate, so start-up gives the server what the plan counted)."""
    if policy.engine.kv_cache_gib > 0:
        return policy.engine.kv_cache_gib
    shape = resolve_model_shape(str(path), key="policies.<p>.model")
    return engine_memory(shape, policy).kv_cache / 2**30


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


def build_fleet(cfg, *, rank: int, world_size: int, run_dir: Path, control_group,
                memory_fractions: dict[tuple[str, int], float] | None = None) -> EngineFleet | None:
    """The run's fleet when any policy's replicas are servers (None: in-process engines only).
    ``memory_fractions``: the plan's GPU fraction per (policy, replica) (``planning.engine_budget``)."""
    per_node = ranks_per_node(cfg.cluster, world_size)
    plan = plan_engines(cfg, world_size, per_node)
    served = {name: bool(reps and reps[0].launch == "server") for name, reps in plan.items()}
    for name in plan:
        _check_weight_transfer(cfg, name, servers=served[name])
        _check_gpu_memory(cfg, name)
    if not any(served.values()):
        return None
    paths = {name: resolve_model_path(p.model, key=f"policies.{name}.model") for name, p in cfg.policies.items()}
    for name in plan:  # on every rank, before any server or model starts
        if served[name]:
            backend = cfg.policies[name].engine.backend
            if backend not in SENDERS:
                raise ValueError(f"policies.{name}.engine.backend={backend} with launch=server: megamarl starts and "
                                 f"feeds servers of {sorted(SENDERS)} only")
            if backend == "sglang":
                _check_sglang_sampling(cfg, name)
            _check_context(name, cfg.policies[name].seq_len, paths[name])
    local_servers = sum(
        1 for reps in plan.values() for r in reps if r.launch == "server" and r.node == rank // per_node
    )

    def threads(policy: str) -> int:  # CPU servers share the node's cores (the trainer idles during rollout)
        return cfg.policies[policy].engine.num_threads or max(1, node_cores() // max(1, local_servers))

    return EngineFleet(cfg, rank=rank, world_size=world_size, ranks_per_node=per_node, model_paths=paths,
                       log_dir=run_dir / "engine_logs", control_group=control_group, num_threads=threads,
                       overlaps_training=SCHEDULES.traits(cfg.trainer.mode, key="trainer.mode").overlaps_training,
                       memory_fractions=memory_fractions)


def _keep(named: Iterable[tuple[str, torch.Tensor]], into: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named:
        into[name] = tensor
        yield name, tensor


def tp_group_ranks(wg: WorkerGroup) -> list[int]:
    """The ranks of this rank's TP group (its stage, its DP replica): tp is megatron's fastest axis."""
    layout = wg.layout
    block = layout.tp
    start = (wg.layout.ranks.index(dist.get_rank()) // block) * block
    return layout.ranks[start : start + block]


def _await_health(url: str, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not healthy(url, timeout_s=5):
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine server {url} did not come back within {timeout_s:.0f} s")
        time.sleep(1.0)

