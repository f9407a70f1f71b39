"""Start, watch, restart and stop one engine replica as a real inference server process.

The rank that leads a replica's device block (``rollout.engine_placement``) owns its server:
``ServerProcess(spec).start()`` runs vLLM's OpenAI-compatible server (or SGLang's) in its own
process group under ``server_guard`` (the server goes down with its owner, even on SIGKILL), logs to
a file, and returns the base URL once ``/health`` answers. A server that dies during start-up, or
does not answer within ``engine.server_start_timeout_s``, raises ``ServerStartError`` naming the
policy, replica and rank with the last lines of its log. A server's environment is its owner's
without the launcher's rank variables (it forms a world of its own), its GPUs the block's devices;
its interpreter is ``engine.server_python`` (or ``server_python(backend)``). GPU-only flags (sleep
mode, memory fraction, CUDA graphs) never reach a CPU command line. The per-backend environment and
flags: docs/design-notes.md, "megamarl/rollout/servers/server_launch.py".
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import NoReturn

import torch

from megamarl.config import SERVER_START_TIMEOUT_S
from megamarl.models.packaged import cache_dir
from megamarl.parallel.network import ANY_HOST, HOST_ADDR_ENV, free_port, host_address
from megamarl.rollout.engines.lora_backends import SGLANG_CPU_LORA, LoraServing

log = logging.getLogger(__name__)

SERVER_BACKENDS = ("vllm", "sglang")
_VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
PLUGIN_ENTRY_POINT = "megamarl = megamarl.vllm_plugins:register"


SGLANG_VENV_ENV = "MEGAMARL_SGLANG_VENV"  # where scripts/setup.sh --extras sglang-cpu builds SGLang's env
_KV_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}


def sglang_venv_python() -> Path:
    """The interpreter of the environment ``scripts/setup.sh --extras sglang-cpu`` builds."""
    root = Path(__file__).resolve().parents[3]  # the checkout megamarl runs from (setup.sh's working dir)
    venv = Path(os.environ.get(SGLANG_VENV_ENV) or root / ".venv-sglang")
    return (venv if venv.is_absolute() else root / venv) / "bin" / "python"


def server_python(backend: str, configured: str | None = None) -> str:
    """The interpreter ``backend``'s server runs in: ``configured`` (``engine.server_python``), else
    this process's, except for an SGLang that this environment cannot import while setup.sh's
    SGLang environment exists."""
    if configured:
        return configured
    if (
        backend == "sglang"
        and importlib.util.find_spec("sglang") is None
        and os.access(sglang_venv_python(), os.X_OK)
    ):
        return str(sglang_venv_python())
    return sys.executable


def check_server_python(python: str, backend: str, *, key: str = "policies.<p>.engine.server_python") -> None:
    """Load-time check of ``engine.server_python``: it exists, is executable and finds ``backend``
    (``importlib.util.find_spec``: finds the package without running it -- importing SGLang costs
    ~12 CPU-s, too much for every load of a config)."""
    path = Path(python).expanduser()
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a name the OS refuses (over 255 bytes, a NUL byte)
        is_file = False
    if not is_file:
        raise ValueError(
            f"{key}='{python}' does not exist (the {backend} server's Python interpreter; "
            "scripts/setup.sh --extras sglang-cpu builds .venv-sglang/bin/python)"
        )
    if not os.access(path, os.X_OK):
        raise ValueError(f"{key}='{python}' is not executable")
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({backend!r}) is None)"
    try:
        found = (
            subprocess.run([str(path), "-c", probe], capture_output=True, timeout=60, check=False).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"{key}='{python}' does not run: {exc}") from exc
    if not found:
        raise ValueError(
            f"{key}='{python}' cannot import '{backend}' (engine.backend={backend}); install it "
            "there or name the environment that has it"
        )


def _model_config(model_path: str) -> dict:
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _sglang_cpu_args(spec: ServerSpec) -> list[str]:
    """SGLang's CPU flags: its plain-PyTorch attention and sampling, no overlap scheduler, and a KV
    cache of ``kv_cache_gib`` (at most ``max_num_seqs`` full-length sequences) as ``--max-total-tokens``."""
    config = _model_config(spec.model_path)
    tokens = spec.max_num_seqs * spec.max_model_len
    layers, heads = (
        config.get("num_hidden_layers"),
        config.get("num_key_value_heads", config.get("num_attention_heads")),
    )
    if spec.kv_cache_gib > 0 and layers and heads and config.get("hidden_size"):
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        per_token = 2 * layers * heads * head_dim * _KV_BYTES.get(spec.dtype, 4)
        tokens = min(tokens, int(spec.kv_cache_gib * 2**30) // per_token)
    # No --mem-fraction-static (GPU-only here, like the other memory flags): --max-total-tokens caps
    # the KV pool SGLang would otherwise size from the machine's free RAM.
    return [
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        "--disable-overlap-schedule",
        "--max-total-tokens",
        str(max(tokens, spec.max_model_len)),
    ]


class ServerStartError(RuntimeError):
    """A replica server exited or never became healthy during start-up."""


@dataclass
class ServerSpec:
    policy: str
    replica: int
    rank: int  # the owning (leader) rank, for error messages
    backend: str  # "vllm" | "sglang"
    model_path: str
    tp: int = 1
    devices: tuple[int, ...] = ()  # local GPU ids of the block (empty on CPU)
    dtype: str = "bf16"  # bf16 | fp16 | fp32 (or vLLM's own names)
    max_num_seqs: int = 64
    max_model_len: int = 2048
    kv_cache_gib: float = 1.0  # 0: the server's own default
    num_threads: int = 1  # CPU: OpenMP threads of each worker
    seed: int = 0
    lora: LoraServing | None = None
    port: int = 0  # 0: a free port
    log_path: Path | None = None
    weight_transfer: str = "megamarl_gloo"  # vLLM weight-transfer backend (weights.transport.vllm_transport)
    host: str = "127.0.0.1"  # bind address; 0.0.0.0 to serve other nodes
    served_model_name: str = "default"  # the name requests use (``VLLMServerClient(model=...)``)
    on_gpu: bool | None = None  # None: this node has a CUDA device
    # colocated and handing its memory to training (fleet.PolicyServers.hands_over): on GPU started
    # with vLLM's sleep mode / SGLang's memory saver, so that sleeping frees its memory
    sleeps: bool = False
    enforce_eager: bool | None = None  # no CUDA graphs; None: eager on CPU, CUDA graphs on GPU
    # GPU: the fraction of each device the server may take (vLLM --gpu-memory-utilization, SGLang
    # --mem-fraction-static); None: the server's own default
    memory_fraction: float | None = None
    python: str = ""  # the server's interpreter (engine.server_python); empty: server_python(backend)
    # False: no push rewrites the weights after a wake (frozen policies, an L2 policy's base), so a
    # sleeping SGLang server keeps a host copy of them (--enable-weights-cpu-backup; its memory saver
    # otherwise hands back whatever the released memory holds). vLLM's level-1 sleep always keeps one.
    weights_pushed: bool = True
    start_timeout_s: float | None = (
        None  # until /health answers (engine.server_start_timeout_s); None: by device
    )

    def __post_init__(self) -> None:
        if self.on_gpu is None:
            self.on_gpu = torch.cuda.is_available()
        if self.start_timeout_s is None:
            self.start_timeout_s = SERVER_START_TIMEOUT_S["gpu" if self.on_gpu else "cpu"]
        if self.enforce_eager is None:
            self.enforce_eager = not self.on_gpu
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"ServerSpec.memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.backend not in SERVER_BACKENDS:
            raise ValueError(
                f"ServerSpec.backend '{self.backend}' has no server; allowed: {list(SERVER_BACKENDS)}"
            )
        if self.tp < 1:
            raise ValueError(f"ServerSpec.tp must be >= 1, got {self.tp}")
        if self.backend == "sglang" and self.lora is not None and not self.on_gpu:
            raise ValueError(SGLANG_CPU_LORA.format(policy=self.policy))  # preflight refuses it first
        if self.backend == "sglang" and self.lora is not None and not self.lora.target_modules:
            raise ValueError(
                f"{self.label}: an SGLang server started without adapters needs the adapted modules "
                "(LoraServing.target_modules, from policies.<p>.lora.targets)"
            )
        if self.devices and len(self.devices) != self.tp:
            raise ValueError(f"ServerSpec.devices {self.devices} must list tp={self.tp} devices")

    @property
    def label(self) -> str:
        return f"policy '{self.policy}' replica {self.replica} (rank {self.rank})"


def server_command(spec: ServerSpec) -> list[str]:
    """The server's command line (``spec.port`` must be set). GPU-only flags (sleep mode / memory
    saver, the memory fraction, SGLang's ``--disable-cuda-graph``) only on GPU: vLLM-CPU refuses
    sleep mode, and a CPU server's memory is sized by ``kv_cache_gib`` alone."""
    python = spec.python or server_python(spec.backend)
    if spec.backend == "sglang":
        cmd = [
            python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            spec.model_path,
            "--host",
            spec.host,
            "--port",
            str(spec.port),
            "--tp-size",
            str(spec.tp),
            "--dtype",
            _VLLM_DTYPES.get(spec.dtype, spec.dtype),
            "--max-running-requests",
            str(spec.max_num_seqs),
            "--context-length",
            str(spec.max_model_len),
            "--random-seed",
            str(spec.seed),
            "--served-model-name",
            spec.served_model_name,
        ]
        if (
            spec.lora is not None
        ):  # no --lora-paths (adapters arrive later): SGLang needs the rank and modules
            cmd += [
                "--enable-lora",
                "--max-loras-per-batch",
                str(max(1, spec.lora.num_adapters)),
                "--max-lora-rank",
                str(spec.lora.rank),
                "--lora-target-modules",
                *spec.lora.target_modules,
            ]
        config = _model_config(spec.model_path)
        if not config.get("architectures") and config.get(
            "model_type"
        ):  # SGLang picks its model class by them
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config["model_type"])
            cmd += ["--json-model-override-args", json.dumps({"architectures": [arch]})] if arch else []
        if not spec.on_gpu:
            cmd += _sglang_cpu_args(spec)
        if spec.on_gpu:
            cmd += ["--enable-memory-saver"] if spec.sleeps else []
            cmd += ["--enable-weights-cpu-backup"] if spec.sleeps and not spec.weights_pushed else []
            cmd += (
                ["--mem-fraction-static", str(spec.memory_fraction)]
                if spec.memory_fraction is not None
                else []
            )
            cmd += ["--disable-cuda-graph"] if spec.enforce_eager else []
        return cmd
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        spec.model_path,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--tensor-parallel-size",
        str(spec.tp),
        "--dtype",
        _VLLM_DTYPES.get(spec.dtype, spec.dtype),
        "--max-num-seqs",
        str(spec.max_num_seqs),
        "--max-model-len",
        str(spec.max_model_len),
        "--seed",
        str(spec.seed),
        *(["--enforce-eager"] if spec.enforce_eager else []),
        "--logprobs-mode",
        "processed_logprobs",
        "--weight-transfer-config",
        json.dumps({"backend": spec.weight_transfer}),
    ]
    if spec.kv_cache_gib > 0 and (spec.on_gpu or spec.kv_cache_gib != int(spec.kv_cache_gib)):
        cmd += ["--kv-cache-memory-bytes", str(int(spec.kv_cache_gib * 2**30))]
    if spec.lora is not None:
        cmd += [
            "--enable-lora",
            "--max-loras",
            str(max(1, spec.lora.num_adapters)),
            "--max-lora-rank",
            str(spec.lora.vllm_max_rank),
        ]
    if spec.on_gpu:
        cmd += ["--enable-sleep-mode"] if spec.sleeps else []
        cmd += (
            ["--gpu-memory-utilization", str(spec.memory_fraction)]
            if spec.memory_fraction is not None
            else []
        )
    return cmd


def plugin_env(env: dict[str, str]) -> dict[str, str]:
    """Make vLLM load megamarl's plugin in every server process. Installed megamarl declares the
    ``vllm.general_plugins`` entry point; an older install (editable from before it existed) gets a
    one-file distribution declaring it, prepended to ``PYTHONPATH`` (entry points are read from the
    ``*.dist-info`` directories on ``sys.path``)."""
    env = dict(env)
    if "megamarl" not in {ep.name for ep in entry_points(group="vllm.general_plugins")}:
        dist_info = cache_dir() / "vllm_plugin" / "megamarl_vllm_plugin-0.1.dist-info"
        dist_info.mkdir(parents=True, exist_ok=True)
        (dist_info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: megamarl-vllm-plugin\nVersion: 0.1\n"
        )
        (dist_info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN_ENTRY_POINT}\n")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(dist_info.parent), env.get("PYTHONPATH")) if p)
    if env.get("VLLM_PLUGINS"):  # an allow-list: keep ours on it
        env["VLLM_PLUGINS"] = env["VLLM_PLUGINS"] + ",megamarl"
    return env


# What torchrun (torch.distributed.elastic's agent) and megamarl's rank launcher give a rank: a server
# forms a world of its own (a ``tcp://`` rendezvous), and with ``TORCHELASTIC_USE_AGENT_STORE`` inherited
# torch's rendezvous dials the agent's store instead of hosting one, so the server never starts.
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
LAUNCHER_PREFIXES = ("TORCHELASTIC_",)


def visible_devices(spec: ServerSpec, inherited: str | None) -> str:
    """The server's ``CUDA_VISIBLE_DEVICES``: the block's devices are indices into what this process
    sees (a rank takes the ``LOCAL_RANK``-th visible device), so they map through the inherited list
    (indices or GPU-/MIG- UUIDs: a job given GPUs 4-7 starts its servers on 4-7, not on 0-3)."""
    if inherited is None:
        return ",".join(str(d) for d in spec.devices)
    seen = [entry.strip() for entry in inherited.split(",") if entry.strip()]
    if any(d >= len(seen) for d in spec.devices):
        raise ValueError(
            f"{spec.label} runs on local devices {spec.devices} but this process sees {len(seen)} "
            f"(CUDA_VISIBLE_DEVICES={inherited}): give every rank of a node all of the node's GPUs "
            "(no per-rank binding by the launcher)"
        )
    return ",".join(seen[d] for d in spec.devices)


def server_env(spec: ServerSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    rank_env = os.environ if base is None else base
    env = {
        key: value
        for key, value in rank_env.items()
        if key not in LAUNCHER_VARIABLES and not key.startswith(LAUNCHER_PREFIXES)
    }
    if spec.host in ANY_HOST and not env.get(HOST_ADDR_ENV):  # serving other nodes: its transfer groups
        # bind where its URL points (found through the rank's route to MASTER_ADDR, dropped below it)
        env[HOST_ADDR_ENV] = host_address(multi_node=True, environ=rank_env)
    if spec.backend == "vllm":
        env = plugin_env(env)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        # megamarl.rollout (imported by the plugin) defaults these for in-process engines. A server
        # always runs its engine core in a process of its own (vLLM's AsyncLLM) and logs at INFO into
        # its log file. The variable only decides where a one-worker engine core runs its worker: vLLM's
        # CPU platform moves it into a third process unless it is "0" (one more start-up of vLLM and
        # torch: ~15 CPU-s per server on this project's 2-core CI machine); TP > 1 has worker processes
        # either way, and GPU engines run a single worker in the engine core already.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if (not spec.on_gpu and spec.tp == 1) else "1"
        env["VLLM_LOGGING_LEVEL"] = "INFO"
        if spec.lora is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter
        if spec.weight_transfer == "ipc":  # CUDA IPC handles arrive pickled in /update_weights
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if not spec.on_gpu:
            if spec.kv_cache_gib > 0 and spec.kv_cache_gib == int(spec.kv_cache_gib):
                env["VLLM_CPU_KVCACHE_SPACE"] = str(int(spec.kv_cache_gib))
            if spec.num_threads > 0:
                env["OMP_NUM_THREADS"] = str(spec.num_threads)
                env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # servers share the node's cores
    else:
        # SGLang's /health runs a one-token generation by default: the owner's watchdog probes it every
        # few seconds, and a probe in flight when a weight push ends makes /flush_cache refuse ("pending
        # requests"; seen with the real server). /health then answers like vLLM's: the server is up.
        env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "0"
        if not spec.on_gpu:
            env["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's CPU platform (sglang.srt.platforms)
            if spec.num_threads > 0:
                env["OMP_NUM_THREADS"] = str(spec.num_threads)
    if spec.devices and spec.on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(spec, env.get("CUDA_VISIBLE_DEVICES"))
    return env


class ServerProcess:
    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.port = 0
        self.log_path = (
            Path(spec.log_path)
            if spec.log_path
            else Path(f"/tmp/megamarl-server-{spec.policy}-{spec.replica}-{os.getpid()}.log")
        )
        self.num_starts = 0
        self._log_start = 0  # where this start's lines begin in the log

    def _advertised_host(self) -> str:
        host = self.spec.host
        return host_address(multi_node=True) if host in ANY_HOST else host

    def start(self, timeout_s: float | None = None) -> str:
        """Launch the server and wait until ``/health`` answers (``timeout_s``, default the spec's
        ``start_timeout_s``); returns its base URL. With
        ``spec.port == 0`` a free port is picked, and picked again when another process took it
        between the pick and the server's bind (several ranks of a node start servers at once)."""
        timeout_s = self.spec.start_timeout_s if timeout_s is None else timeout_s
        assert timeout_s is not None  # the fleet's specs carry the device's resolved timeout
        warmup_retried = False
        for attempt in range(4):
            try:
                return self._start_once(timeout_s)
            except ServerStartError as exc:
                if "Address already in use" in str(exc) and not self.spec.port and attempt < 3:
                    continue
                # SGLang polls its own /model_info for 120 s and then kills its process tree; on an
                # overloaded host its HTTP server was not up by then (seen in CI). Once more, warm.
                if not warmup_retried and self._killed_itself_in_warmup():
                    warmup_retried = True
                    log.warning(
                        "%s: the SGLang server killed itself in its own warm-up; starting it once more",
                        self.spec.label,
                    )
                    continue
                raise
        raise AssertionError("unreachable")

    def _killed_itself_in_warmup(self) -> bool:
        return self.spec.backend == "sglang" and any(
            "Initialization failed. warmup error" in line
            for line in tail(self.log_path, 400, since=self._log_start)
        )

    def _start_once(self, timeout_s: float, *, port: int = 0) -> str:
        spec = self.spec
        port = port or spec.port or free_port(spec.host)
        self.port = port
        cmd = server_command(_with_port(spec, port))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            log.write(f"[megamarl] {spec.label}: {' '.join(cmd)}\n".encode())
            log.flush()
            # The guard leads the new process group and stops the server if this process dies.
            guarded = [
                sys.executable,
                "-m",
                "megamarl.runtime.server_guard",
                "--owner",
                str(os.getpid()),
                "--",
                *cmd,
            ]
            self.proc = subprocess.Popen(
                guarded,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=server_env(spec),
                start_new_session=True,
            )
        self.num_starts += 1
        self.url = f"http://{self._advertised_host()}:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"exited with code {self.proc.returncode} during start-up")
            if healthy(self.url, timeout_s=2):
                return self.url
            time.sleep(0.5)
        self.stop()
        self._fail(f"did not answer {self.url}/health within {timeout_s:.0f} s")

    def _fail(self, what: str) -> NoReturn:
        self.stop()
        raise ServerStartError(
            f"{self.spec.backend} server for {self.spec.label} {what}; log {self.log_path}, last lines:\n"
            + "\n".join(tail(self.log_path, 30))
        )

    def alive(self) -> bool:
        """The process runs and answers ``/health``."""
        return self.proc is not None and self.proc.poll() is None and healthy(self.url, timeout_s=5)

    def restart(self, timeout_s: float | None = None) -> str:
        """Stop and start again on the same port, so the URL everyone holds stays valid."""
        self.stop()
        timeout_s = self.spec.start_timeout_s if timeout_s is None else timeout_s
        assert timeout_s is not None  # the fleet's specs carry the device's resolved timeout
        return self._start_once(timeout_s, port=self.port) if self.port else self.start(timeout_s)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group (API server, engine core, workers), SIGKILL after
        ``grace_s``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                _reap_group(proc.pid, wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        if proc.poll() is None:
            proc.wait(timeout=5)


def _with_port(spec: ServerSpec, port: int) -> ServerSpec:
    from dataclasses import replace

    return replace(spec, port=port)


def _reap_group(pgid: int, wait_s: float) -> None:
    """Wait until no process of the group is left (children outlive the leader briefly)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def healthy(url: str, *, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except Exception:  # noqa: BLE001 - any failure means not (yet) healthy
        return False


def tail(path: Path, num_lines: int, *, since: int = 0) -> list[str]:
    """The last ``num_lines`` lines of ``path`` from byte ``since`` on."""
    try:
        with open(path, "rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace").splitlines()[-num_lines:]
    except OSError:
        return [f"(no log at {path})"]
