"""``build_fleet``'s start-up decisions (no server is started here;
tests/integration/test_train_with_servers.py runs real ones)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

from megamarl.cli.configure import load_config
from megamarl.rollout.engine_placement import plan_engines, ranks_per_node
from megamarl.rollout.replicas.policy import PolicyReplicas
from megamarl.rollout.servers.fleet import build_fleet

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str):
    return load_config(ROOT / "configs" / "signalling_tiny.yaml", list(overrides))


def _build(cfg, run_dir, *, world_size: int = 2):
    """``build_fleet`` on the plan the trainer computes once and hands in."""
    plan = plan_engines(cfg, world_size, ranks_per_node(cfg.cluster, world_size))
    return build_fleet(cfg, plan=plan, rank=0, world_size=world_size, run_dir=run_dir, control_group=None)


def test_in_process_plans_start_no_fleet(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _build(_cfg(), tmp_path) is None


def test_sglang_servers_refuse_allowed_tokens_by_key(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = _cfg("policies.shared.engine.backend=sglang", "policies.shared.engine.launch=server")
    with pytest.raises(
        ValueError,
        match=r"^agents\.sender\.sampling\.allowed_tokens: policy shared serves through "
        r"SGLang",
    ):
        _build(cfg, tmp_path)


def test_senders_and_clients_by_backend():
    from megamarl.rollout.engines.sglang import SGLangClient
    from megamarl.rollout.engines.vllm_server import VLLMServerClient
    from megamarl.rollout.servers.fleet import CLIENTS
    from megamarl.rollout.weights.server_sync import WeightSender
    from megamarl.rollout.weights.sglang_sync import SGLangWeightSender
    from megamarl.rollout.weights.transport import SENDERS
    from megamarl.rollout.weights.vllm_native_sync import VLLMNativeSender

    kw = {"master_addr": "127.0.0.1", "master_port": 29999, "replica_tp": [1]}
    sglang = SENDERS["sglang"](["http://127.0.0.1:1"], transport="gloo", **kw)
    assert isinstance(sglang, SGLangWeightSender) and sglang.transport == "gloo"
    vllm = SENDERS["vllm"](["http://127.0.0.1:1"], transport="megamarl_shm", **kw)
    assert type(vllm) is WeightSender and vllm.backend == "megamarl_shm"
    native = SENDERS["vllm"](["http://127.0.0.1:1"], transport="nccl", **kw)
    assert isinstance(native, VLLMNativeSender) and native.transport == "nccl"
    assert isinstance(CLIENTS["sglang"]("http://127.0.0.1:1", "default"), SGLangClient)
    assert isinstance(CLIENTS["vllm"]("http://127.0.0.1:1", "default"), VLLMServerClient)


@pytest.mark.parametrize(
    "choice,colocated,pp,tp,on_gpu,vllm,sglang",
    [
        ("auto", False, 1, 1, False, "megamarl_gloo", "gloo"),  # CPU: megamarl's data planes
        ("auto", True, 1, 1, False, "megamarl_shm", "gloo"),
        ("auto", True, 2, 1, False, "megamarl_shm", "gloo"),  # colocated PP>1: the leader relays (vLLM)
        ("auto", False, 1, 2, True, "nccl", "nccl"),  # GPU: the backend's own
        ("auto", True, 1, 1, True, "ipc", "cuda_ipc"),
        ("native", True, 1, 2, True, "megamarl_shm", "cuda_ipc"),  # vLLM IPC needs the replica on one GPU
        ("auto", False, 2, 1, True, "nccl", "nccl"),  # PP>1: the stages gathered to one nccl sender
        (
            "auto",
            True,
            2,
            8,
            True,
            "megamarl_shm",
            "nccl",
        ),  # colocated PP>1: the leader relays, no NCCL group
        ("auto", True, 2, 1, True, "ipc", "nccl"),
        ("megamarl", False, 1, 1, True, "megamarl_gloo", "gloo"),
        ("megamarl", True, 1, 1, True, "megamarl_shm", "gloo"),
    ],
)
def test_weight_transfer_choice(choice, colocated, pp, tp, on_gpu, vllm, sglang):
    from types import SimpleNamespace

    from megamarl.rollout.weights.transport import TRANSPORTS

    engine = SimpleNamespace(weight_transfer=choice, tp=tp)
    assert TRANSPORTS["vllm"](engine, colocated=colocated, pp=pp, on_gpu=on_gpu) == vllm
    assert TRANSPORTS["sglang"](engine, colocated=colocated, pp=pp, on_gpu=on_gpu) == sglang


def test_weight_transfer_errors_name_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(
        ValueError,
        match=r"engine.weight_transfer='nvlink' unknown; allowed: \['auto', 'native', "
        r"'megamarl'\]",
    ):
        _cfg("policies.shared.engine.weight_transfer=nvlink")
    cfg = _cfg("policies.shared.engine.weight_transfer=megamarl")  # in-process engines: nothing to choose
    with pytest.raises(
        ValueError,
        match=r"^policies\.shared\.engine\.weight_transfer=megamarl applies to engine "
        r"servers only",
    ):
        _build(cfg, tmp_path)
    cfg = _cfg(
        "policies.shared.model=tiny-vllm-llama",
        "policies.shared.engine.backend=vllm",
        "policies.shared.engine.launch=server",
        "policies.shared.engine.weight_transfer=native",
    )
    with pytest.raises(ValueError, match=r"^policies\.shared\.engine\.weight_transfer=native needs CUDA"):
        _build(cfg, tmp_path)


def test_ipc_servers_may_unpickle_handles():
    from megamarl.rollout.servers.server_launch import ServerSpec, server_env

    spec = {
        "policy": "p",
        "replica": 0,
        "rank": 0,
        "backend": "vllm",
        "model_path": "m",
        "on_gpu": True,
        "devices": (0,),
    }
    assert (
        server_env(ServerSpec(**spec, weight_transfer="ipc"), base={})["VLLM_ALLOW_INSECURE_SERIALIZATION"]
        == "1"
    )
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in server_env(
        ServerSpec(**spec, weight_transfer="nccl"), base={}
    )


def test_a_seq_len_beyond_the_models_context_names_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = _cfg(
        "policies.shared.model=tiny-vllm-llama",
        "policies.shared.engine.backend=vllm",
        "policies.shared.engine.launch=server",
        "policies.shared.seq_len=4096",
    )
    with pytest.raises(
        ValueError, match=r"^policies\.shared\.seq_len=4096 exceeds the model's max_position_embeddings=512"
    ):
        _build(cfg, tmp_path)


# -- GPU memory hand-over: config keys, server specs, start order ------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["policies.shared.engine.backend=vllm", "policies.shared.engine.gpu_memory_utilization=0"],
            r"^policies\.shared\.engine\.gpu_memory_utilization must be in \(0, 1\], got 0",
        ),
        (
            ["policies.shared.engine.backend=vllm", "policies.shared.engine.gpu_memory_utilization=1.2"],
            r"^policies\.shared\.engine\.gpu_memory_utilization must be in \(0, 1\], got 1.2",
        ),
        (
            ["policies.shared.engine.enforce_eager=false"],
            r"^policies\.shared\.engine\.enforce_eager applies to vllm and sglang engines; engine.backend=hf",
        ),
        (
            ["policies.shared.engine.gpu_memory_utilization=0.5"],
            r"^policies\.shared\.engine\.gpu_memory_utilization applies to vllm and sglang engines",
        ),
        (
            ["policies.shared.engine.backend=vllm", "policies.shared.engine.server_start_timeout_s=0"],
            r"^policies\.shared\.engine\.server_start_timeout_s must be > 0, got 0",
        ),
        (
            ["policies.shared.engine.server_start_timeout_s=900"],
            (
                r"^policies\.shared\.engine\.server_start_timeout_s bounds a server's start-up; "
                r"engine.backend=hf has no server"
            ),
        ),
        (
            [
                "policies.shared.engine.backend=vllm",
                "policies.shared.engine.server_start_timeout_s=3600",
                "trainer.collective_timeout_s=1800",
            ],
            (
                r"^policies\.shared\.engine\.server_start_timeout_s=3600 exceeds "
                r"trainer\.collective_timeout_s=1800"
            ),
        ),
    ],
)
def test_gpu_engine_keys_are_checked_at_load(overrides, message):
    with pytest.raises(ValueError, match=message):
        _cfg(*overrides)


def test_gpu_memory_utilization_needs_a_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = _cfg("policies.shared.engine.backend=vllm", "policies.shared.engine.gpu_memory_utilization=0.5")
    with pytest.raises(
        ValueError,
        match=r"^policies\.shared\.engine\.gpu_memory_utilization=0.5 sizes an engine on a "
        r"GPU and this node has none",
    ):
        _build(cfg, tmp_path)


class _FakeServer:
    """Stands in for ``ServerProcess``: logs its start-up; ``delay_s`` before it answers."""

    events: ClassVar[list[str]] = []
    delay_s = 0.0
    gate: threading.Event | None = None  # start-up blocks until it is set (shows overlap)
    specs: ClassVar[list] = []

    def __init__(self, spec) -> None:
        self.spec, self.proc = spec, SimpleNamespace(pid=4242, poll=lambda: None)
        type(self).specs.append(spec)

    def start(self) -> str:
        label = f"{self.spec.policy}#{self.spec.replica}"
        self.events.append(f"start {label}")
        if self.gate is not None:
            assert self.gate.wait(timeout=30)
        time.sleep(self.delay_s)
        self.events.append(f"healthy {label}")
        return f"http://127.0.0.1:{8000 + self.spec.replica}"

    def alive(self) -> bool:
        return True

    def stop(self) -> None:
        pass


class _FakeClient:
    def __init__(self, url: str, events: list[str]) -> None:
        self.url, self.events = url, events

    def sleep(self, *, level: int = 1) -> None:
        self.events.append(f"sleep {self.url} level {level}")

    def wake(self, tags=("weights", "kv_cache")) -> None:
        self.events.append(f"wake {self.url} {list(tags)}")


@pytest.fixture
def fake_servers(monkeypatch):
    """``ServerFleet`` with recording fake servers and clients in a one-rank gloo world (its
    ``wait_ready`` is a collective over the control group)."""
    from megamarl.rollout.servers import fleet as fleet_module

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    events: list[str] = []
    monkeypatch.setattr(_FakeServer, "events", events)
    monkeypatch.setattr(_FakeServer, "specs", [])
    monkeypatch.setattr(fleet_module, "ServerProcess", _FakeServer)
    monkeypatch.setitem(fleet_module.CLIENTS, "vllm", lambda url, model: _FakeClient(url, events))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    fleets = []

    def make(*overrides, on_gpu: bool, rank: int = 0, overlaps_training: bool = False, fractions=None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu)
        cfg = _cfg(
            "policies.shared.model=tiny-vllm-llama",
            "policies.shared.engine.backend=vllm",
            "policies.shared.engine.launch=server",
            *overrides,
        )
        fleet = fleet_module.ServerFleet(
            cfg,
            plan=plan_engines(cfg, 2, 2),
            rank=rank,
            world_size=2,
            ranks_per_node=2,
            model_paths={"shared": Path("/m")},
            log_dir=Path("/tmp"),
            control_group=dist.group.WORLD,
            num_threads=lambda policy: 1,
            kv_cache_gib=lambda policy: 1.0,
            overlaps_training=overlaps_training,
            memory_fractions=fractions,
        )
        fleets.append(fleet)
        return fleet

    try:
        yield make, events
    finally:
        for fleet in fleets:
            fleet.close()
        dist.destroy_process_group()


def _replicas(fleet) -> PolicyReplicas:
    """The policy's replicas on the driver (rank 0): the object that sleeps and wakes them."""
    return PolicyReplicas(
        fleet.cfg,
        "shared",
        wg=None,
        worker=None,
        fleet=fleet,
        run_dir=Path("/tmp"),
        driver_rank=0,
        control_group=dist.group.WORLD,
    )


def _build_models(events: list[str]):
    events.append("models built")
    if _FakeServer.gate is not None:
        _FakeServer.gate.set()


def test_gpu_colocated_servers_are_up_and_asleep_before_models_are_built(fake_servers, monkeypatch):
    """The start order on GPU (docs/cluster.md): the colocated server starts with sleep mode and the
    plan's fraction, answers, goes to sleep, and only then does any rank build a model; the first
    push wakes its weights."""
    make, events = fake_servers
    monkeypatch.setattr(_FakeServer, "delay_s", 0.3)  # a slow start-up: a race would build models first
    fleet = make(on_gpu=True, fractions={("shared", 0): 0.42})
    assert fleet.starts_first
    with fleet.model_preparation():
        _build_models(events)
    assert events == [
        "start shared#0",
        "healthy shared#0",
        "sleep http://127.0.0.1:8000 level 1",
        "models built",
    ]
    spec = _FakeServer.specs[0]
    assert spec.sleeps and spec.on_gpu and spec.memory_fraction == 0.42 and not spec.enforce_eager
    replicas = _replicas(fleet)
    replicas.attach(SimpleNamespace(replicas=[_FakeClient("http://127.0.0.1:8000", events)], live=[True]))
    replicas.sleep()  # already asleep since start-up: nothing sent
    replicas.wake(tags=("weights",))  # the first push
    replicas.wake(tags=("kv_cache",))
    assert events[4:] == ["wake http://127.0.0.1:8000 ['weights']", "wake http://127.0.0.1:8000 ['kv_cache']"]


def test_in_process_engines_sleep_through_the_update(fake_servers):
    """An in-process engine (the quickstart's vLLM-CPU on rank 0) sleeps in the sleep phase (on CPU its
    KV cache's pages go back to the kernel while the update runs) and wakes once, at the weights'
    wake, before the push writes into it and probes it."""
    make, _ = fake_servers
    fleet = make(on_gpu=False)
    replicas = PolicyReplicas(
        fleet.cfg,
        "shared",
        wg=None,
        worker=None,
        fleet=None,  # in-process engines only
        run_dir=Path("/tmp"),
        driver_rank=0,
        control_group=dist.group.WORLD,
    )
    log: list[str] = []
    replicas.attach(_FakeClient("in-process", log))
    replicas.sleep()
    replicas.sleep()  # asleep already
    replicas.wake(tags=("weights",))
    replicas.wake(tags=("kv_cache",))
    assert log == ["sleep in-process level 1", "wake in-process ['weights', 'kv_cache']"]


def test_gpu_colocated_servers_that_never_sleep_still_start_first(fake_servers, monkeypatch):
    """Async modes (training overlaps rollout): no hand-over, no sleep, but the server still sizes
    itself before the trainer allocates; ``engine.gpu_memory_utilization`` replaces the plan."""
    make, events = fake_servers
    monkeypatch.setattr(_FakeServer, "delay_s", 0.3)
    fleet = make(
        "policies.shared.engine.gpu_memory_utilization=0.3",
        "policies.shared.engine.enforce_eager=true",
        on_gpu=True,
        overlaps_training=True,
        fractions={("shared", 0): 0.42},
    )
    with fleet.model_preparation():
        _build_models(events)
    assert events == ["start shared#0", "healthy shared#0", "models built"]
    spec = _FakeServer.specs[0]
    assert not spec.sleeps and spec.memory_fraction == 0.3 and spec.enforce_eager


@pytest.mark.parametrize("on_gpu", [True, False])
def test_server_specs_carry_the_start_timeout_and_whether_pushes_rewrite_the_weights(fake_servers, on_gpu):
    """``engine.server_start_timeout_s`` (null: 600 s on CPU, 1800 s on GPU) reaches the server; a
    frozen policy's servers are never pushed into after a wake (SGLang keeps a host copy of them)."""
    make, _ = fake_servers
    make(on_gpu=on_gpu)
    make("policies.shared.engine.server_start_timeout_s=2400", "policies.shared.frozen=true", on_gpu=on_gpu)
    default, configured = _FakeServer.specs
    assert default.start_timeout_s == (1800 if on_gpu else 600) and default.weights_pushed
    assert configured.start_timeout_s == 2400 and not configured.weights_pushed


@pytest.mark.parametrize("disaggregated", [True, False])
def test_start_up_overlaps_model_building_elsewhere(fake_servers, monkeypatch, disaggregated):
    """CPU servers, and disaggregated servers on GPU (their own devices), start while the models are
    built: the server answers only after the models exist (it waits for them here), and none sleeps."""
    make, events = fake_servers
    monkeypatch.setattr(_FakeServer, "gate", threading.Event())
    on_gpu = disaggregated
    overrides = ["policies.shared.ranks=[0]", "policies.shared.engine.ranks=[1]"] if disaggregated else []
    fleet = make(*overrides, on_gpu=on_gpu, rank=1 if disaggregated else 0, fractions={("shared", 0): 0.9})
    assert not fleet.starts_first
    with fleet.model_preparation():
        _build_models(events)
    assert events.index("models built") < events.index("healthy shared#0")
    assert not any(e.startswith("sleep") for e in events)
    spec = _FakeServer.specs[0]
    assert spec.sleeps == (
        not disaggregated
    )  # a colocated CPU server hands over (its command omits the flag)
    assert spec.memory_fraction == (0.9 if on_gpu else None) and spec.enforce_eager == (not on_gpu)
    assert _replicas(fleet).asleep == set()


def test_a_server_that_does_not_fall_asleep_stops_start_up(fake_servers, monkeypatch):
    from megamarl.rollout.servers import fleet as fleet_module

    make, events = fake_servers

    class Refusing(_FakeClient):
        def sleep(self, *, level: int = 1) -> None:
            raise ConnectionError("503 sleep mode is not enabled")

    monkeypatch.setitem(fleet_module.CLIENTS, "vllm", lambda url, model: Refusing(url, events))
    fleet = make(on_gpu=True)
    with (
        pytest.raises(
            RuntimeError,
            match=r"^vllm server for policy 'shared' replica 0 \(rank 0\) answered at "
            r"http://127\.0\.0\.1:8000 but did not go to sleep after start-up: 503",
        ),
        fleet.model_preparation(),
    ):
        _build_models(events)
    assert "models built" not in events


@pytest.mark.parametrize("on_gpu", [False, True])
def test_an_in_process_vllm_engine_takes_the_keys_too(monkeypatch, on_gpu):
    """``engine.enforce_eager`` (null: eager on CPU only) and ``engine.gpu_memory_utilization`` (null:
    the engine's 0.5) reach an in-process vLLM engine as well (its constructor replaced here)."""
    import importlib.util

    from megamarl.rollout.engines.vllm_engine import VLLMEngine

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed: the engine falls back to hf")

    class Captured(VLLMEngine):
        def __init__(self, path, **kwargs) -> None:
            self.kwargs = kwargs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu)
    engine = _cfg("policies.shared.engine.backend=vllm").policies["shared"].engine
    kwargs = Captured.from_config(engine, Path("/m"), replica=0, seed=0).kwargs
    assert kwargs["enforce_eager"] is (not on_gpu) and "gpu_memory_utilization" not in kwargs
    engine = (
        _cfg(
            "policies.shared.engine.backend=vllm",
            "policies.shared.engine.enforce_eager=true",
            "policies.shared.engine.gpu_memory_utilization=0.25",
        )
        .policies["shared"]
        .engine
    )
    kwargs = Captured.from_config(engine, Path("/m"), replica=0, seed=0).kwargs
    assert kwargs["enforce_eager"] is True and kwargs["gpu_memory_utilization"] == 0.25
