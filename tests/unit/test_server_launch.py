"""Server command lines and environments (vLLM; SGLang against its documented CLI flags only: it is
not installed here), the packed bucket wire format, WeightSender argument checks, and the
plugin shim that lets vLLM find megamarl's weight-transfer backends without a reinstall."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_loader import load_script  # tests/ helper

from megamarl.rollout.engines.lora_backends import LoraServing
from megamarl.rollout.servers import server_launch
from megamarl.rollout.servers.server_launch import ServerSpec, plugin_env, server_command, server_env
from megamarl.rollout.weights.server_sync import (
    ALIGN,
    BufferPool,
    WeightSender,
    bucket_info,
    pack_bucket,
    unpack_bucket,
)


def spec(**overrides):
    base = {
        "policy": "planner",
        "replica": 1,
        "rank": 8,
        "backend": "vllm",
        "model_path": "/m",
        "tp": 2,
        "dtype": "bf16",
        "max_num_seqs": 16,
        "max_model_len": 1024,
        "kv_cache_gib": 2.0,
        "num_threads": 3,
        "seed": 5,
        "port": 8001,
        "on_gpu": False,
    }
    return ServerSpec(**dict(base, **overrides))


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_vllm_command():
    cmd = server_command(spec(lora=LoraServing(num_adapters=3, rank=16)))
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert (
        flag(cmd, "--model") == "/m" and flag(cmd, "--port") == "8001" and flag(cmd, "--host") == "127.0.0.1"
    )
    assert flag(cmd, "--tensor-parallel-size") == "2" and flag(cmd, "--dtype") == "bfloat16"
    assert (
        flag(cmd, "--max-num-seqs") == "16"
        and flag(cmd, "--max-model-len") == "1024"
        and flag(cmd, "--seed") == "5"
    )
    assert flag(cmd, "--logprobs-mode") == "processed_logprobs" and "--enforce-eager" in cmd
    assert json.loads(flag(cmd, "--weight-transfer-config")) == {"backend": "megamarl_gloo"}
    assert flag(cmd, "--served-model-name") == "default"
    assert "--enable-lora" in cmd and flag(cmd, "--max-loras") == "3" and flag(cmd, "--max-lora-rank") == "16"
    assert "--kv-cache-memory-bytes" not in cmd  # CPU, whole GiB: VLLM_CPU_KVCACHE_SPACE instead
    assert flag(server_command(spec(kv_cache_gib=0.25)), "--kv-cache-memory-bytes") == str(2**28)
    assert flag(server_command(spec(on_gpu=True, devices=(4, 5))), "--kv-cache-memory-bytes") == str(
        2 * 2**30
    )
    assert json.loads(
        flag(server_command(spec(weight_transfer="megamarl_shm")), "--weight-transfer-config")
    ) == {"backend": "megamarl_shm"}


def test_vllm_env_cpu_and_gpu():
    env = server_env(spec(), base={"PATH": "/bin", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert (
        env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    )  # TP=2: workers
    # one CPU worker runs inside the engine core (no third process); on a GPU that is vLLM's default anyway
    assert server_env(spec(tp=1), base={})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert server_env(spec(tp=1, on_gpu=True), base={})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["OMP_NUM_THREADS"] == "3"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and "CUDA_VISIBLE_DEVICES" not in env
    assert "CUDA_VISIBLE_DEVICES" not in server_env(
        spec(devices=(2, 3)), base={}
    )  # CPU: placement's ids only
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    assert server_env(spec(lora=LoraServing(1, 8)), base={})["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # vLLM takes only some max_lora_rank values: rank-4 adapters need 8
    assert flag(server_command(spec(lora=LoraServing(2, 4))), "--max-lora-rank") == "8"
    gpu = server_env(spec(on_gpu=True, devices=(4, 5)), base={})
    assert (
        gpu["CUDA_VISIBLE_DEVICES"] == "4,5"
        and "VLLM_CPU_KVCACHE_SPACE" not in gpu
        and "OMP_NUM_THREADS" not in gpu
    )


GPU_ONLY = {
    "vllm": ("--enable-sleep-mode", "--gpu-memory-utilization"),
    "sglang": ("--enable-memory-saver", "--mem-fraction-static", "--disable-cuda-graph"),
}


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
@pytest.mark.parametrize("colocated", [True, False])
@pytest.mark.parametrize("on_gpu", [True, False])
def test_memory_hand_over_flags(backend, colocated, on_gpu):
    """Colocated servers (they hand their memory to training) start with vLLM's sleep mode / SGLang's
    memory saver and the plan's memory fraction on GPU; disaggregated ones never sleep; a CPU command
    line carries no GPU-only flag (vLLM-CPU refuses sleep mode) and stays eager as before."""
    devices = (0, 1) if on_gpu else ()
    cmd = server_command(
        spec(backend=backend, on_gpu=on_gpu, devices=devices, sleeps=colocated, memory_fraction=0.35)
    )
    sleep_flag = "--enable-sleep-mode" if backend == "vllm" else "--enable-memory-saver"
    fraction_flag = "--gpu-memory-utilization" if backend == "vllm" else "--mem-fraction-static"
    eager_flag = "--enforce-eager" if backend == "vllm" else "--disable-cuda-graph"
    assert (sleep_flag in cmd) == (on_gpu and colocated)
    if on_gpu:
        assert flag(cmd, fraction_flag) == "0.35"
        assert eager_flag not in cmd  # GPU default: CUDA graphs
        assert eager_flag in server_command(
            spec(backend=backend, on_gpu=True, devices=devices, enforce_eager=True)
        )
    else:
        assert not set(GPU_ONLY[backend]) & set(cmd)
        assert ("--enforce-eager" in cmd) == (backend == "vllm")  # CPU default: eager, as before
        assert "--enforce-eager" not in server_command(spec(backend=backend, enforce_eager=False))
    assert fraction_flag not in server_command(
        spec(backend=backend, on_gpu=on_gpu, devices=devices)
    )  # no plan: default


def test_sglang_gpu_command_line_parses_with_its_cli():
    """SGLang's GPU flags against the fake server's parser, which mirrors SGLang's CLI and refuses
    unknown flags (loaded by path: the fake ``sglang`` package must not shadow a real one here)."""
    fake = load_script("tests/fake_sglang/sglang/launch_server.py", name="_fake_sglang_launch_server")
    cmd = server_command(
        spec(
            backend="sglang",
            on_gpu=True,
            devices=(0, 1),
            sleeps=True,
            memory_fraction=0.4,
            enforce_eager=True,
        )
    )
    args = fake.parse(cmd[3:])
    assert args.enable_memory_saver and args.mem_fraction_static == 0.4 and args.disable_cuda_graph


def test_vllm_gpu_command_line_parses_with_vllms_cli():
    """vLLM's GPU flags against vLLM's own server argument parser (import takes seconds)."""
    cli_args = pytest.importorskip("vllm.entrypoints.launchers.cli_args")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = cli_args.make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(
        server_command(spec(on_gpu=True, devices=(0, 1), sleeps=True, memory_fraction=0.4))[3:]
    )
    assert args.enable_sleep_mode and args.gpu_memory_utilization == 0.4 and not args.enforce_eager
    assert args.kv_cache_memory_bytes == 2 * 2**30 and args.tensor_parallel_size == 2


def test_spec_rejects_a_fraction_outside_0_1():
    with pytest.raises(ValueError, match=r"memory_fraction must be in \(0, 1\], got 1.5"):
        spec(memory_fraction=1.5)


def test_servers_for_other_nodes_advertise_and_bind_the_chosen_address(monkeypatch):
    """A server bound to 0.0.0.0 gets this node's address (parallel.network.host_address) as
    MEGAMARL_HOST_ADDR, so its transfer-group workers bind where its URL points; one set by the
    operator is kept; a local server gets none."""

    monkeypatch.setattr(server_launch, "host_address", lambda *, multi_node, environ=None: "10.1.2.3")
    assert server_env(spec(host="0.0.0.0"), base={})["MEGAMARL_HOST_ADDR"] == "10.1.2.3"
    assert (
        server_env(spec(host="0.0.0.0"), base={"MEGAMARL_HOST_ADDR": "10.9.9.9"})["MEGAMARL_HOST_ADDR"]
        == "10.9.9.9"
    )
    assert "MEGAMARL_HOST_ADDR" not in server_env(spec(), base={})
    assert server_launch.ServerProcess(spec(host="0.0.0.0"))._advertised_host() == "10.1.2.3"
    assert server_launch.ServerProcess(spec())._advertised_host() == "127.0.0.1"


def test_sglang_command_uses_documented_flags():
    lora = LoraServing(num_adapters=2, rank=8, target_modules=("o_proj", "q_proj"))
    cmd = server_command(spec(backend="sglang", lora=lora, on_gpu=True))
    assert cmd[:3] == [server_launch.server_python("sglang"), "-m", "sglang.launch_server"]
    assert (
        flag(cmd, "--model-path") == "/m" and flag(cmd, "--tp-size") == "2" and flag(cmd, "--port") == "8001"
    )
    assert flag(cmd, "--dtype") == "bfloat16" and flag(cmd, "--max-running-requests") == "16"
    assert flag(cmd, "--context-length") == "1024" and flag(cmd, "--random-seed") == "5"
    assert (
        "--enable-lora" in cmd
        and flag(cmd, "--max-loras-per-batch") == "2"
        and flag(cmd, "--max-lora-rank") == "8"
    )
    i = cmd.index("--lora-target-modules")  # nargs="*": the names up to the next flag
    assert cmd[i + 1 : i + 3] == ["o_proj", "q_proj"] and all(
        arg.startswith("--") for arg in cmd[i + 3 : i + 4]
    )


def test_lora_targets_map_to_the_hf_modules_of_the_exported_adapters():
    """``policies.<p>.lora.targets`` (megamarl's names) -> the HF module names the exported PEFT adapters
    carry (``target_modules``), which SGLang must be started with."""
    from types import SimpleNamespace

    from megamarl.config_sections import LoraConfig
    from megamarl.models.lora import peft_adapter_config
    from megamarl.rollout.engines.lora_backends import lora_serving

    every = LoraConfig(rank=4)
    cfg = SimpleNamespace(
        policies={"p": SimpleNamespace(lora=every)},
        agents={"a": SimpleNamespace(policy="p", lora="x"), "b": SimpleNamespace(policy="p", lora="y")},
    )
    served = lora_serving(cfg, "p")
    assert served.target_modules == (
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    )
    assert list(served.target_modules) == peft_adapter_config(every)["target_modules"]
    cfg.policies["p"].lora = LoraConfig(targets=["qkv", "fc2"])
    assert lora_serving(cfg, "p").target_modules == ("down_proj", "k_proj", "q_proj", "v_proj")
    with pytest.raises(ValueError, match="needs the adapted modules"):
        spec(backend="sglang", lora=LoraServing(num_adapters=1, rank=4), on_gpu=True)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
@pytest.mark.parametrize("on_gpu", [True, False])
@pytest.mark.parametrize("sleeps", [True, False])
@pytest.mark.parametrize("weights_pushed", [True, False])
def test_sleeping_sglang_servers_whose_weights_are_never_pushed_keep_a_host_copy(
    backend, on_gpu, sleeps, weights_pushed
):
    """SGLang's memory saver releases the weights at a level-1 sleep and resumes them as they are in
    memory: only a push repairs them, so a server nothing pushes into after a wake (frozen, L2 base)
    needs --enable-weights-cpu-backup. vLLM's level-1 sleep keeps a host copy by itself."""
    cmd = server_command(
        spec(
            backend=backend,
            on_gpu=on_gpu,
            devices=(0, 1) if on_gpu else (),
            sleeps=sleeps,
            weights_pushed=weights_pushed,
        )
    )
    assert ("--enable-weights-cpu-backup" in cmd) == (
        backend == "sglang" and on_gpu and sleeps and not weights_pushed
    )


def test_start_timeout_is_the_specs_and_larger_on_gpu(monkeypatch):
    from megamarl.config import SERVER_START_TIMEOUT_S

    assert spec(on_gpu=False).start_timeout_s == SERVER_START_TIMEOUT_S["cpu"] == 600
    assert spec(on_gpu=True, devices=(0, 1)).start_timeout_s == SERVER_START_TIMEOUT_S["gpu"] == 1800
    waited = []
    proc = server_launch.ServerProcess(spec(start_timeout_s=42.0))
    monkeypatch.setattr(proc, "_start_once", lambda timeout_s, port=0: waited.append(timeout_s) or "http://x")
    monkeypatch.setattr(proc, "stop", lambda: None)
    proc.start()
    proc.restart()
    proc.start(timeout_s=7)
    assert waited == [42.0, 42.0, 7]


PROBE = Path(__file__).resolve().parents[1] / "sglang_args_probe.py"


@pytest.mark.slow
@pytest.mark.skipif(
    not server_launch.sglang_venv_python().exists(), reason="no .venv-sglang (setup.sh --extras sglang-cpu)"
)
def test_sglang_gpu_lora_and_weight_backup_pass_sglangs_own_checks():
    """The GPU command lines through SGLang's own argument path (``prepare_server_args``,
    ``resolve_once``, ``check_server_args``: its launcher's steps) in ``.venv-sglang``: an L2 server
    without adapters starts with every module ``lora.targets`` names (without
    ``--lora-target-modules`` SGLang's LoRA check asserts: the command line before the fix), and a
    frozen colocated server with the memory saver and the weights' host copy."""
    from megamarl.models.packaged import resolve_model_path

    model = str(resolve_model_path("tiny-plain-llama", key="test"))
    lora = LoraServing(
        num_adapters=2,
        rank=8,
        target_modules=("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"),
    )
    gpu = {
        "backend": "sglang",
        "model_path": model,
        "tp": 1,
        "devices": (0,),
        "on_gpu": True,
        "dtype": "fp32",
        "max_model_len": 256,
    }
    l2 = server_command(spec(**gpu, lora=lora, sleeps=True, weights_pushed=False))[3:]
    i = l2.index("--lora-target-modules")
    unmapped = l2[:i] + l2[i + 1 + len(lora.target_modules) :]  # what d98cadd emitted
    frozen = server_command(spec(**gpu, sleeps=True, weights_pushed=False, memory_fraction=0.5))[3:]
    trained = server_command(spec(**gpu, sleeps=True, memory_fraction=0.5))[3:]
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}  # resolution needs a platform: SGLang's CPU one here
    out = subprocess.run(
        [str(server_launch.sglang_venv_python()), str(PROBE), json.dumps([l2, unmapped, frozen, trained])],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        check=False,
    )
    results = [
        json.loads(line[len("PROBE ") :]) for line in out.stdout.splitlines() if line.startswith("PROBE ")
    ]
    assert len(results) == 4, out.stdout[-2000:] + out.stderr[-3000:]
    assert results[0]["ok"] and results[0]["enable_lora"] and results[0]["max_lora_rank"] == 8, results[0]
    assert results[0]["lora_target_modules"] == sorted(lora.target_modules)
    assert not results[1]["ok"] and "--lora-target-modules" in results[1]["error"], results[1]
    assert (
        results[2]["ok"] and results[2]["enable_memory_saver"] and results[2]["enable_weights_cpu_backup"]
    ), results[2]
    assert (
        results[3]["ok"] and results[3]["enable_memory_saver"] and not results[3]["enable_weights_cpu_backup"]
    )


def test_spec_validation():
    with pytest.raises(ValueError, match="backend 'hf' has no server"):
        spec(backend="hf")
    with pytest.raises(ValueError, match="must list tp=2 devices"):
        spec(devices=(0,))


def test_pack_unpack_roundtrip_mixed_dtypes():
    bucket = [
        ("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("b", torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)),
        ("c", torch.arange(5, dtype=torch.int64)),
    ]
    info = bucket_info(bucket)
    assert info["offsets"] == [0, ALIGN, 2 * ALIGN] and info["num_bytes"] == 3 * ALIGN
    assert info["dtype_names"] == ["float32", "bfloat16", "int64"] and info["shapes"] == [[2, 3], [3], [5]]
    out = unpack_bucket(pack_bucket(bucket, info), info)
    for (name, ref), (got_name, got) in zip(bucket, out):
        assert name == got_name and got.dtype == ref.dtype and torch.equal(got, ref)


def test_pack_casts_into_a_reused_buffer():
    """Floating tensors travel in the engine dtype (cast inside the one copy into place); a reused
    buffer larger than the bucket is packed in place; integer tensors keep their dtype."""
    bucket = [
        ("w", torch.tensor([[1.0, -2.5], [3.25, 4.0]]).t()),  # non-contiguous float32
        ("ids", torch.arange(3)),
    ]
    info = bucket_info(bucket, dtype=torch.bfloat16)
    assert info["dtype_names"] == ["bfloat16", "int64"] and info["num_bytes"] == 2 * ALIGN
    buffer = torch.full((4 * ALIGN,), 7, dtype=torch.uint8)
    flat = pack_bucket(bucket, info, out=buffer)
    assert flat.data_ptr() == buffer.data_ptr() and flat.numel() == info["num_bytes"]
    (_, w), (_, ids) = unpack_bucket(flat, info)
    assert w.dtype == torch.bfloat16 and torch.equal(w, bucket[0][1].to(torch.bfloat16))
    assert torch.equal(ids, torch.arange(3))


def test_receive_buffers_are_reused_only_when_no_view_is_alive():
    pool = BufferPool(max_buffers=2)
    first = pool.take(100)
    view = first[10:20].view(torch.int16)  # a layer still holding a tensor of the bucket
    del first
    second = pool.take(50)
    assert second.data_ptr() != view.data_ptr() - 10 and len(pool.buffers) == 2
    del view
    again = pool.take(80)
    assert again.data_ptr() == pool.buffers[0].data_ptr()  # the first buffer, free again


def test_weight_sender_checks_arguments():
    with pytest.raises(ValueError, match="backend 'nccl' unknown"):
        WeightSender(["http://x"], backend="nccl")
    with pytest.raises(ValueError, match="needs master_port"):
        WeightSender(["http://x"], backend="megamarl_gloo")
    with pytest.raises(ValueError, match="replica_tp has 1 entries for 2"):
        WeightSender(["http://x", "http://y"], backend="megamarl_shm", replica_tp=[1])
    with pytest.raises(RuntimeError, match="before connect"):
        WeightSender(["http://x"], backend="megamarl_shm").push([], version=1)


def test_plugin_shim_declares_the_entry_point(tmp_path, monkeypatch):
    """A process with the shim on its path finds megamarl's vllm.general_plugins entry point."""
    monkeypatch.setenv("MEGAMARL_CACHE", str(tmp_path))
    env = plugin_env({"PYTHONPATH": "/somewhere", "VLLM_PLUGINS": "other"})
    assert env["VLLM_PLUGINS"] == "other,megamarl"
    code = (
        "from importlib.metadata import entry_points; "
        "print([e.value for e in entry_points(group='vllm.general_plugins') if e.name == 'megamarl'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(env, PATH="/usr/bin"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "megamarl.vllm_plugins:register" in out


def test_server_trait_matches_the_launchable_backends():
    from megamarl.rollout import ENGINES
    from megamarl.rollout.servers.server_launch import SERVER_BACKENDS

    assert {n for n in ENGINES.names() if ENGINES.traits(n).server} == set(SERVER_BACKENDS)


def test_guard_stops_the_server_when_its_owner_dies(tmp_path):
    """The owner is SIGKILLed: the guard terminates the command's whole process group."""
    import os
    import signal
    import time

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pid_file = tmp_path / "child.pid"
    # a "server" that forks a child of its own (like vLLM's engine core) and records both pids
    server = (
        "import os, subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
        f"time.sleep(600)']); open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}'); "
        "time.sleep(600)"
    )
    guard = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megamarl.runtime.server_guard",
            "--owner",
            str(owner.pid),
            "--",
            sys.executable,
            "-c",
            server,
        ],
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not pid_file.exists() or len(pid_file.read_text().split()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    pids = [int(p) for p in pid_file.read_text().split()]
    owner.kill()
    owner.wait()
    assert guard.wait(timeout=30) == 128 + signal.SIGTERM  # the server's exit status, shell style
    for pid in pids:
        deadline = time.monotonic() + 10
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"process {pid} survived its owner"
            time.sleep(0.1)


def test_guard_and_its_server_ignore_slurms_warning_signal(tmp_path):
    """Slurm's time-limit warning (USR1) reaches every process of the job step: the guard and the
    server it starts (the disposition is inherited through exec) live on; the ranks act on it."""
    import os
    import signal
    import time

    pid_file = tmp_path / "server.pid"
    server = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    guard = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megamarl.runtime.server_guard",
            "--owner",
            str(os.getpid()),
            "--",
            sys.executable,
            "-c",
            server,
        ],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.killpg(guard.pid, signal.SIGUSR1)  # as scancel --signal=USR1 does to the step's processes
        time.sleep(1.0)
        assert guard.poll() is None
        os.kill(int(pid_file.read_text()), 0)  # the server is alive (raises ProcessLookupError otherwise)
    finally:
        os.killpg(guard.pid, signal.SIGKILL)
        guard.wait()


def test_sglang_on_cpu_takes_its_plain_pytorch_paths(tmp_path):
    """SGLang's CPU flags and environment, a KV cache of kv_cache_gib, and the architectures a
    config.json without them needs."""
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, '
        '"num_attention_heads": 4, "num_key_value_heads": 2}'
    )
    cpu = spec(
        backend="sglang",
        model_path=str(tmp_path),
        on_gpu=False,
        kv_cache_gib=2**-10,
        dtype="fp32",
        python="/envs/sglang/bin/python",
    )
    cmd = server_command(cpu)
    assert cmd[:3] == ["/envs/sglang/bin/python", "-m", "sglang.launch_server"]  # engine.server_python
    assert (flag(cmd, "--device"), flag(cmd, "--attention-backend"), flag(cmd, "--sampling-backend")) == (
        "cpu",
        "torch_native",
        "pytorch",
    ) and "--disable-overlap-schedule" in cmd
    # 1 MiB of KV cache / (2 (K, V) * 2 layers * 2 KV heads * 16 head_dim * 4 bytes) = 2048 tokens
    assert flag(cmd, "--max-total-tokens") == "2048"
    assert flag(cmd, "--json-model-override-args") == '{"architectures": ["LlamaForCausalLM"]}'
    assert server_env(cpu, base={})["SGLANG_USE_CPU_ENGINE"] == "1"
    assert (
        server_env(cpu, base={})["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    )  # no probe in a push's way
    gpu = server_command(spec(backend="sglang", model_path=str(tmp_path), on_gpu=True))
    assert "--device" not in gpu and "SGLANG_USE_CPU_ENGINE" not in server_env(
        spec(backend="sglang", on_gpu=True), base={}
    )


def test_sglang_lora_on_cpu_is_refused_before_any_server_starts():
    with pytest.raises(ValueError, match="policies.planner.lora with engine.backend=sglang on CPU"):
        spec(backend="sglang", lora=LoraServing(num_adapters=1, rank=4), on_gpu=False)
    spec(backend="vllm", lora=LoraServing(num_adapters=1, rank=4), on_gpu=False)  # vLLM-CPU serves adapters


# what torchrun gives its workers (torch.distributed.elastic's LocalElasticAgent), and megamarl's rank
# launcher
LAUNCHER_ENV = {
    "RANK": "3",
    "LOCAL_RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "2",
    "ROLE_RANK": "3",
    "ROLE_NAME": "default",
    "ROLE_WORLD_SIZE": "8",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "job",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_ERROR_FILE": "/tmp/err.json",
    "TORCHELASTIC_TIMER_FILE": "/tmp/timer",
}


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
@pytest.mark.parametrize("on_gpu", [True, False])
def test_servers_never_inherit_the_launchers_rank_variables(backend, on_gpu):
    """A server forms its own world (SGLang and vLLM: a ``tcp://`` rendezvous); with torchrun's
    ``TORCHELASTIC_USE_AGENT_STORE`` inherited, torch's rendezvous dials a store instead of hosting
    one and the server never starts (tests/integration/test_sglang_under_torchrun.py runs the real
    one). Everything else the rank had is kept."""
    base = {
        **LAUNCHER_ENV,
        "PATH": "/bin",
        "PYTHONPATH": "/src",
        "MEGAMARL_CACHE": "/c",
        "NCCL_DEBUG": "INFO",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    }
    env = server_env(spec(backend=backend, on_gpu=on_gpu, devices=(0, 1) if on_gpu else ()), base=base)
    assert not set(LAUNCHER_ENV) & set(env)
    assert {k: env[k] for k in ("PATH", "PYTHONPATH", "MEGAMARL_CACHE", "NCCL_DEBUG")} == {
        "PATH": "/bin",
        "PYTHONPATH": "/src",
        "MEGAMARL_CACHE": "/c",
        "NCCL_DEBUG": "INFO",
    }


def test_a_server_for_other_nodes_finds_its_address_through_the_ranks_master_addr(monkeypatch):
    """The address a 0.0.0.0 server advertises comes from the rank's route to MASTER_ADDR, which the
    server's own environment then drops."""
    seen = []
    monkeypatch.setattr(
        server_launch,
        "host_address",
        lambda *, multi_node, environ=None: seen.append(environ.get("MASTER_ADDR")) or "10.1.2.3",
    )
    env = server_env(spec(host="0.0.0.0"), base=dict(LAUNCHER_ENV))
    assert seen == ["10.0.0.1"] and env["MEGAMARL_HOST_ADDR"] == "10.1.2.3" and "MASTER_ADDR" not in env


@pytest.mark.parametrize(
    ("inherited", "expected"),
    [
        (None, "2,3"),  # the node's devices as they are
        ("4,5,6,7", "6,7"),  # a job given GPUs 4-7: its local devices 2, 3 are the node's 6, 7
        (" 7, 6 ,5,4", "5,4"),
        ("GPU-aaaa,GPU-bbbb,GPU-cccc,GPU-dddd", "GPU-cccc,GPU-dddd"),
        ("MIG-1,MIG-2,MIG-3,MIG-4", "MIG-3,MIG-4"),
    ],
)
def test_server_devices_map_through_the_inherited_visible_devices(inherited, expected):
    """The placement's devices are indices into what the rank sees (the rank itself takes the
    LOCAL_RANK-th visible device): the server's CUDA_VISIBLE_DEVICES names the same physical devices."""
    base = {} if inherited is None else {"CUDA_VISIBLE_DEVICES": inherited}
    assert server_env(spec(on_gpu=True, devices=(2, 3)), base=base)["CUDA_VISIBLE_DEVICES"] == expected
    assert (
        server_env(spec(backend="sglang", on_gpu=True, devices=(2, 3)), base=base)["CUDA_VISIBLE_DEVICES"]
        == expected
    )


def test_server_devices_beyond_the_inherited_list_are_refused():
    with pytest.raises(
        ValueError,
        match=r"policy 'planner' replica 1 \(rank 8\) runs on local devices \(2, 3\) but "
        r"this process sees 2 \(CUDA_VISIBLE_DEVICES=4,5\)",
    ):
        server_env(spec(on_gpu=True, devices=(2, 3)), base={"CUDA_VISIBLE_DEVICES": "4,5"})


def test_an_sglang_server_that_killed_itself_in_its_own_warm_up_is_started_once_more(tmp_path):
    """SGLang polls its own /model_info for 120 s after launch and then SIGKILLs its process tree; on
    the loaded CI host its HTTP server was not up by then and the run died at start-up. The first start
    here does exactly that (SGLang's log line, then SIGKILL of itself); the second serves /health."""
    import signal

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    marker = tmp_path / "started-once"
    python = tmp_path / "python"
    python.write_text(f"""#!{sys.executable}
import http.server, os, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
if not os.path.exists({str(marker)!r}):
    open({str(marker)!r}, "w").close()
    print("[2026-11-28 10:41:07] Initialization failed. warmup error: Traceback (most recent call last):", flush=True)
    print("requests.exceptions.ConnectionError: HTTPConnectionPool(host='127.0.0.1'): Max retries exceeded", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")  # noqa: E501 - the fake server's program keeps its own layout
    python.chmod(0o755)
    proc = server_launch.ServerProcess(
        spec(
            backend="sglang",
            python=str(python),
            model_path=str(model),
            port=0,
            host="127.0.0.1",
            tp=1,
            log_path=str(tmp_path / "server.log"),
        )
    )
    try:
        url = proc.start(timeout_s=60)
        assert proc.num_starts == 2 and proc.alive(), (tmp_path / "server.log").read_text()
        assert url.startswith("http://127.0.0.1:")
    finally:
        proc.stop()
    # a server that dies at start-up for any other reason is not started again: the error names it
    marker.unlink()
    python.write_text(f"#!{sys.executable}\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    proc = server_launch.ServerProcess(
        spec(
            backend="sglang",
            python=str(python),
            model_path=str(model),
            port=0,
            host="127.0.0.1",
            tp=1,
            log_path=str(tmp_path / "other.log"),
        )
    )
    with pytest.raises(server_launch.ServerStartError, match=f"exited with code {128 + signal.SIGKILL}"):
        proc.start(timeout_s=60)
    assert proc.num_starts == 1
