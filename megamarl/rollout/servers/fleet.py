"""``ServerFleet``: the engine server processes of every policy, seen from every rank.

Built on every rank at start-up from the engine plan (``megamarl.rollout.engine_placement``, handed
in): each rank starts the servers whose device block it leads (``ServerProcess``, in a thread, before
any model is built on GPU), watches them and restarts one that dies on the same port; ``wait_ready``
exchanges the addresses over the control group, and a server that failed to start stops every rank
with its error. External servers (``engine.server_urls``) of a backend with a sender are in the fleet
too, fed as disaggregated servers and started by nobody here. What happens to running servers
afterwards is ``rollout.replicas.policy.PolicyReplicas``.
Details: docs/design-notes.md, "megamarl/rollout/servers/fleet.py".
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from megamarl.models.packaged import resolve_model_path
from megamarl.parallel.hardware import node_cores
from megamarl.parallel.network import HOST_ADDR_ENV, host_address, route_source
from megamarl.rollout.engine_placement import ReplicaPlacement, ranks_per_node, replicas_led_by
from megamarl.rollout.engines.lora_backends import lora_serving
from megamarl.rollout.engines.sglang import SGLangClient
from megamarl.rollout.engines.vllm_server import VLLMServerClient
from megamarl.rollout.servers.server_launch import ServerProcess, ServerSpec, ServerStartError
from megamarl.rollout.weights.transport import SENDERS, transport_for

if TYPE_CHECKING:
    from megamarl.config import RunConfig

log = logging.getLogger(__name__)

WATCH_S = 2.0  # how often an owner checks its servers
HANG_S = 300.0  # a live process that has not answered /health for this long is restarted
SERVED_MODEL = "default"  # the model name requests use; L2 adapters are served under their own names

# engine backend -> the driver's client of one server (keywords: the clients' own, e.g. health_patience_s)
CLIENTS: dict[str, Callable[..., VLLMServerClient | SGLangClient]] = {
    "vllm": lambda url, model, **kw: VLLMServerClient(url, model=model, **kw),
    "sglang": lambda url, model, **kw: SGLangClient(
        url, **kw
    ),  # one base model per server: requests name no model
}


def _external_url(rep: ReplicaPlacement) -> str:
    """An external replica's ``engine.server_urls`` entry (the placement sets one for each)."""
    assert rep.url is not None, f"replica {rep.index} of {rep.policy} has no engine.server_urls entry"
    return rep.url


def _host_of(url: str) -> str:
    host = urlsplit(url).hostname
    assert host, f"{url!r} names no host"  # EngineConfig refuses such a server_urls entry at load
    return host


@dataclass
class PolicyServers:
    name: str
    replicas: list[ReplicaPlacement]
    hands_over: bool = False  # colocated, and training never overlaps rollout: asleep while its WG trains
    urls: list[str] = field(default_factory=list)

    @property
    def colocated(self) -> bool:
        return self.replicas[0].colocated

    @property
    def external(self) -> bool:
        """Servers someone else runs (``engine.server_urls``): fed here, never started or restarted."""
        return self.replicas[0].launch == "external"


def fed_by_fleet(cfg, policy: str, replicas: list[ReplicaPlacement]) -> bool:
    """The fleet pushes into these replicas: servers it starts, and external servers of a backend it has a
    sender for (the others, in-process engines, are fed through the driver)."""
    launch = replicas[0].launch if replicas else None
    return launch == "server" or (launch == "external" and cfg.policies[policy].engine.backend in SENDERS)


class ServerFleet:
    """The run's engine server processes, on every rank: which this rank starts and watches, and every
    server's address once ``wait_ready`` has exchanged them."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        plan: dict[str, list[ReplicaPlacement]],
        rank: int,
        world_size: int,
        ranks_per_node: int,
        model_paths: dict[str, Path],
        log_dir: Path,
        control_group,
        num_threads: Callable[[str], int],
        kv_cache_gib: Callable[[str], float],
        overlaps_training: bool = False,
        memory_fractions: dict[tuple[str, int], float] | None = None,
    ) -> None:
        """``plan``: the run's engine plan; ``kv_cache_gib``: a served policy's KV cache per server
        (``engine.kv_cache_gib`` or the caller's estimate); ``overlaps_training``: the schedule's trait
        (servers of a schedule that never overlaps training hand their memory over while it trains)."""
        self.cfg, self.rank, self.control = cfg, rank, control_group
        self.model_paths = model_paths
        self.multi_node = (
            world_size > ranks_per_node
        )  # servers bind every interface, pushes a routable address
        self.on_gpu = torch.cuda.is_available()
        self.memory_fractions = memory_fractions or {}  # (policy, replica) -> the plan's GPU fraction
        self.kv_cache_gib = kv_cache_gib
        self.plan = plan
        self.policies = {
            name: PolicyServers(
                name,
                reps,
                hands_over=reps[0].colocated and not overlaps_training,
                urls=[_external_url(rep) for rep in reps] if reps[0].launch == "external" else [],
            )
            for name, reps in plan.items()
            if fed_by_fleet(cfg, name, reps)
        }
        self.local: dict[tuple[str, int], ServerProcess] = {}
        self.restarts: dict[tuple[str, int], int] = {}
        self.pids: dict[tuple[str, int], int] = {}
        self._starting: dict[tuple[str, int], Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="engine-server")
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        for name, servers in self.policies.items():
            for rep in replicas_led_by(
                {name: servers.replicas}, rank
            ):  # started here (external: led by none)
                spec = self._spec(rep, model_paths[name], log_dir, num_threads(name))
                proc = ServerProcess(spec)
                self.local[(name, rep.index)] = proc
                self.restarts[(name, rep.index)] = 0
                self._starting[(name, rep.index)] = self._pool.submit(self._start, proc)

    def serves(self, policy: str) -> bool:
        return policy in self.policies

    def hands_over(self, policy: str) -> bool:
        """Colocated servers in a schedule where training never overlaps rollout: they sleep while
        their worker group trains (vLLM on CPU accepts the calls and keeps its memory)."""
        return self.serves(policy) and self.policies[policy].hands_over

    def _spec(self, rep: ReplicaPlacement, path: Path, log_dir: Path, threads: int) -> ServerSpec:
        p = self.cfg.policies[rep.policy]
        fraction = p.engine.gpu_memory_utilization or self.memory_fractions.get((rep.policy, rep.index))
        return ServerSpec(
            policy=rep.policy,
            replica=rep.index,
            rank=self.rank,
            backend=p.engine.backend,
            model_path=str(path),
            tp=p.engine.tp,
            devices=tuple(rep.devices),
            dtype=p.engine.dtype,
            max_num_seqs=p.engine.max_num_seqs,
            max_model_len=p.seq_len,
            kv_cache_gib=self.kv_cache_gib(rep.policy),
            num_threads=threads,
            seed=self.cfg.trainer.seed + rep.index,
            lora=lora_serving(self.cfg, rep.policy),
            log_path=log_dir / f"{rep.policy}-replica{rep.index}.log",
            weight_transfer=transport_for(p, colocated=rep.colocated, on_gpu=self.on_gpu),
            served_model_name=SERVED_MODEL,
            on_gpu=self.on_gpu,
            host="0.0.0.0" if self.multi_node else "127.0.0.1",
            sleeps=self.policies[rep.policy].hands_over,
            enforce_eager=p.engine.eager(on_gpu=self.on_gpu),
            memory_fraction=fraction if self.on_gpu else None,
            python=p.engine.server_python or "",
            weights_pushed=p.base_moves,  # frozen, L2: no push after a wake rewrites the base
            start_timeout_s=p.engine.server_start_timeout(on_gpu=self.on_gpu),
        )

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
        and the first weight push or rollout wakes it (``PolicyReplicas`` starts out knowing it asleep)."""
        url, spec = proc.start(), proc.spec
        if spec.on_gpu and spec.sleeps:
            try:
                CLIENTS[spec.backend](url, SERVED_MODEL).sleep(level=1)
            except Exception as exc:  # reported on every rank by wait_ready
                raise ServerStartError(
                    f"{spec.backend} server for {spec.label} answered at {url} but did not go to "
                    f"sleep after start-up: {exc}"
                ) from exc
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
            servers.urls = [
                urls[(name, rep.index)] if (name, rep.index) in urls else _external_url(rep)
                for rep in servers.replicas
            ]
        pids: list = [None] * dist.get_world_size()
        dist.all_gather_object(
            pids, {key: proc.proc.pid for key, proc in self.local.items() if proc.proc}, group=self.control
        )
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
                log.warning(
                    "engine server %s replica %d (rank %d) %s; restarting", key[0], key[1], self.rank, what
                )
                try:
                    proc.restart()
                    self.restarts[key] += 1
                    silent_since.pop(key, None)
                except Exception:
                    log.exception("restarting engine server %s replica %d failed", *key)

    def rendezvous_address(self, policy: str) -> str:
        """Where a rank pushing into ``policy``'s servers hosts the group's rendezvous: an address they
        reach. External servers may be on any node: the source address of the route to one of them,
        not loopback unless every one is local (``MEGAMARL_HOST_ADDR`` overrides, as for started servers)."""
        servers = self.policies[policy]
        if servers.external and not os.environ.get(HOST_ADDR_ENV):
            sources = [route_source(_host_of(url)) for url in servers.urls]
            return next((a for a in sources if not ipaddress.ip_address(a).is_loopback), sources[0])
        return host_address(multi_node=self.multi_node)

    def table(self) -> list[dict]:
        """One row per server (written to ``<run_dir>/engine_servers.json`` by the driver)."""
        return [
            {
                "policy": name,
                "replica": rep.index,
                "ranks": list(rep.ranks),
                "devices": list(rep.devices),
                "url": url,
                "pid": self.pids.get((name, rep.index)),
                "colocated": rep.colocated,
            }
            for name, servers in self.policies.items()
            for rep, url in zip(
                servers.replicas, servers.urls, strict=False
            )  # strict=False: urls are filled once the servers are up
        ]

    def close(self) -> None:
        self._stop.set()
        for proc in self.local.values():
            proc.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _check_context(policy: str, seq_len: int, path: Path) -> None:
    """A server is started with ``--max-model-len policies.<p>.seq_len``: say so before it fails."""
    config = json.loads((Path(path) / "config.json").read_text())
    limit = config.get("max_position_embeddings")
    if limit and seq_len > limit:
        raise ValueError(
            f"policies.{policy}.seq_len={seq_len} exceeds the model's max_position_embeddings={limit} "
            f"({path}); its engine servers would refuse to start"
        )


def _check_weight_transfer(cfg: RunConfig, policy: str, *, servers: bool) -> None:
    """``engine.weight_transfer`` chooses how pushes reach SERVERS, and ``native`` needs CUDA."""
    choice = cfg.policies[policy].engine.weight_transfer
    if choice != "auto" and not servers:
        raise ValueError(
            f"policies.{policy}.engine.weight_transfer={choice} applies to engine servers only, and this "
            f"policy's engines run in-process (engine.launch); drop the key or set engine.launch=server"
        )
    if choice == "native" and not torch.cuda.is_available():
        raise ValueError(
            f"policies.{policy}.engine.weight_transfer=native needs CUDA (the backend's own NCCL / CUDA "
            f"IPC transfer) and this node has none; use auto or megamarl"
        )


def _check_gpu_memory(cfg: RunConfig, policy: str) -> None:
    """``engine.gpu_memory_utilization`` is a GPU engine's share of its device: refuse it without CUDA."""
    value = cfg.policies[policy].engine.gpu_memory_utilization
    if value is not None and not torch.cuda.is_available():
        raise ValueError(
            f"policies.{policy}.engine.gpu_memory_utilization={value} sizes an engine on a GPU and this "
            f"node has none (CPU engines take engine.kv_cache_gib); drop the key"
        )


def _check_sglang_sampling(cfg: RunConfig, policy: str) -> None:
    """SGLang's sampling parameters have no ``allowed_token_ids``: refuse the key, never ignore it."""
    for agent, acfg in cfg.agents.items():
        if acfg.policy == policy and acfg.sampling.allowed_tokens:
            raise ValueError(
                f"agents.{agent}.sampling.allowed_tokens: policy {policy} serves through SGLang "
                "(engine.backend=sglang), whose sampling parameters cannot restrict tokens; drop the "
                "key or use engine.backend=vllm"
            )


def build_fleet(
    cfg: RunConfig,
    *,
    plan: dict[str, list[ReplicaPlacement]],
    rank: int,
    world_size: int,
    run_dir: Path,
    control_group,
    overlaps_training: bool = False,
    kv_estimate: Callable[[str, Path], float] | None = None,
    memory_fractions: dict[tuple[str, int], float] | None = None,
) -> ServerFleet | None:
    """The run's server fleet when any policy's replicas are servers (None: in-process engines only).
    ``plan``: the run's engine plan (``rollout.engine_placement.plan_engines``, computed once by the
    caller); ``kv_estimate(policy, model_path)``: the GiB of KV cache a server of a policy with
    ``engine.kv_cache_gib: 0`` gets (the caller's memory plan); ``memory_fractions``: the plan's GPU
    fraction per (policy, replica) (``planning.engine_budget``)."""
    per_node = ranks_per_node(cfg.cluster, world_size)
    served = {name: fed_by_fleet(cfg, name, reps) for name, reps in plan.items()}
    for name in plan:
        _check_weight_transfer(cfg, name, servers=served[name])
        _check_gpu_memory(cfg, name)
    if not any(served.values()):
        return None
    paths = {
        name: resolve_model_path(p.model, key=f"policies.{name}.model") for name, p in cfg.policies.items()
    }
    for name in plan:  # on every rank, before any server or model starts
        if served[name]:  # an external one is fed only by a sender (fed_by_fleet)
            backend = cfg.policies[name].engine.backend
            if backend not in SENDERS:
                raise ValueError(
                    f"policies.{name}.engine.backend={backend} with launch=server: megamarl starts and "
                    f"feeds servers of {sorted(SENDERS)} only"
                )
            if backend == "sglang":
                _check_sglang_sampling(cfg, name)
            _check_context(name, cfg.policies[name].seq_len, paths[name])
    local_servers = sum(
        1 for reps in plan.values() for r in reps if r.launch == "server" and r.node == rank // per_node
    )

    def threads(policy: str) -> int:  # CPU servers share the node's cores (the trainer idles during rollout)
        return cfg.policies[policy].engine.num_threads or max(1, node_cores() // max(1, local_servers))

    def kv_cache_gib(policy: str) -> float:  # engine.kv_cache_gib, or (0; null on GPU) what the plan counted
        configured = cfg.policies[policy].engine.kv_cache_setting(on_gpu=torch.cuda.is_available())
        if configured > 0 or kv_estimate is None:
            return configured
        return kv_estimate(policy, paths[policy])

    return ServerFleet(
        cfg,
        plan=plan,
        rank=rank,
        world_size=world_size,
        ranks_per_node=per_node,
        model_paths=paths,
        log_dir=run_dir / "engine_logs",
        control_group=control_group,
        num_threads=threads,
        kv_cache_gib=kv_cache_gib,
        overlaps_training=overlaps_training,
        memory_fractions=memory_fractions,
    )
