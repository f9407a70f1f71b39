"""``SGLangWeightSender`` and ``SGLangClient`` against ``FakeSGLangServer`` (SGLang's HTTP protocol,
real gloo groups, a real HFEngine behind): bucket order, dtype, one broadcast reaching two replicas,
version stamping, the CUDA-IPC payload format, memory tags and LoRA load/unload."""

from __future__ import annotations

import asyncio

import pytest
import torch
from fake_servers import FakeSGLangServer  # tests/ helper

from megamarl.models.tiny import tiny_model
from megamarl.parallel.network import free_port
from megamarl.rollout.engines.base import SamplingParams
from megamarl.rollout.engines.hf import HFEngine
from megamarl.rollout.engines.sglang import SGLangClient, deserialize_named_tensors
from megamarl.rollout.weights.sglang_sync import SGLangWeightSender, tensor_payload
from megamarl.rollout.weights.sync_check import served_tokens

PROMPTS = [[1, 9690, 198, 2683, 359], [1, 300, 301]]


def greedy(engine, prompts=PROMPTS):
    async def main():
        return await asyncio.gather(
            *(engine.generate(p, SamplingParams(temperature=0.0, max_tokens=6)) for p in prompts)
        )

    return [g[0] for g in asyncio.run(main())]


@pytest.fixture
def servers():
    made = [FakeSGLangServer(HFEngine(tiny_model("llama", seed=0), max_wait_ms=1)) for _ in range(2)]
    yield made
    for server in made:
        server.kill()


@pytest.mark.parametrize("flatten", [True, False])
def test_one_broadcast_per_bucket_reaches_both_replicas_in_order(servers, flatten):
    target = tiny_model("llama", seed=1)
    named = [(k, v.to(torch.bfloat16)) for k, v in target.state_dict().items()]
    sender = SGLangWeightSender(
        [s.url for s in servers],
        transport="gloo",
        master_port=free_port("127.0.0.1"),
        dtype=torch.bfloat16,
        timeout_s=60,
        flatten=flatten,
    )
    sender.connect()
    try:
        for server in servers:
            (group,) = server.weight_groups
            assert group["world_size"] == 3 and group["backend"] == "gloo"
        assert sorted(s.weight_groups[0]["rank_offset"] for s in servers) == [1, 2]
        stats = sender.push(iter(named), version=7, bucket_bytes=64 * 1024)
        assert stats.num_tensors == len(named) and stats.num_buckets > 2
        for server in servers:
            announced = [b for p, b in server.calls if p == "/update_weights_from_distributed"]
            assert len(announced) == stats.num_buckets
            assert [n for b in announced for n in b["names"]] == [
                n for n, _ in named
            ]  # export order, bucketed
            assert {d for b in announced for d in b["dtypes"]} == {"bfloat16"}  # the engine's dtype
            assert {b["load_format"] for b in announced} == {"flattened_bucket" if flatten else None}
            assert not any(b["flush_cache"] for b in announced)
            paths = server.paths()
            assert paths[-5:] == [
                "/update_weights_from_distributed",
                "/end_weight_update",
                "/update_weight_version",
                "/flush_cache",
                "/continue_generation",
            ]
            assert (
                paths.index("/pause_generation")
                < paths.index("/begin_weight_update")
                < paths.index("/update_weights_from_distributed")
            )
            assert server.weight_version == "7"
            loaded = server.engine.model.state_dict()
            for name, tensor in named:  # the fake loads in its own dtype (fp32): bf16 values exactly
                assert torch.equal(loaded[name], tensor.float()), name
        reference = HFEngine(tiny_model("llama", seed=1).to(torch.bfloat16).float())
        expected = [g.token_ids for g in greedy(reference)]
        for server in servers:
            got = greedy(SGLangClient(server.url))
            assert [g.token_ids for g in got] == expected and {g.weight_version for g in got} == {7}
    finally:
        sender.close()
    for server in servers:
        assert ("/destroy_weights_update_group", {"group_name": sender.group_name}) in server.calls


def test_greedy_probe_matches_transformers_after_push(servers):
    from transformers import AutoModelForCausalLM

    from megamarl.models.packaged import resolve_model_path
    from megamarl.rollout.weights.sync_check import reference_tokens

    path = resolve_model_path("tiny-plain-llama", key="test")
    weights = {
        k: v + 0.01 * torch.randn_like(v)
        for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()
    }
    server = FakeSGLangServer(HFEngine(path, max_wait_ms=1))
    sender = SGLangWeightSender(
        [server.url], transport="gloo", master_port=free_port("127.0.0.1"), timeout_s=60
    )
    try:
        sender.connect()
        sender.push(weights.items(), version=3)
        assert served_tokens(server.url, "default", backend="sglang") == reference_tokens(path, weights)
    finally:
        sender.close()
        server.kill()


def test_cuda_ipc_payload_is_sglangs_serialized_named_tensors():
    bucket = [("model.norm.weight", torch.randn(4)), ("lm_head.weight", torch.randn(3, 4))]
    payload = tensor_payload(bucket, tp=2)
    assert set(payload) == {"serialized_named_tensors", "load_format", "flush_cache"}
    assert payload["load_format"] is None and payload["flush_cache"] is False
    first, second = payload["serialized_named_tensors"]
    assert first == second  # every TP rank opens the same handles
    back = deserialize_named_tensors(first)
    assert [n for n, _ in back] == [n for n, _ in bucket]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(back, bucket))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            SGLangWeightSender(["http://127.0.0.1:1"], transport="cuda_ipc")


def test_memory_tags_and_lora_load_unload(tmp_path, servers):
    from peft import LoraConfig, get_peft_model

    server = servers[0]
    client = SGLangClient(server.url)
    client.sleep(level=1)
    client.wake(tags=("weights",))
    client.wake(tags=("kv_cache",))
    released = [b for p, b in server.calls if p == "/release_memory_occupation"]
    resumed = [b for p, b in server.calls if p == "/resume_memory_occupation"]
    assert released == [{"tags": ["weights", "kv_cache"]}] and resumed == [
        {"tags": ["weights"]},
        {"tags": ["kv_cache"]},
    ]
    client.pause()
    client.update_weights(
        tiny_model("llama", seed=0).state_dict().items(), version=1
    )  # released weights: re-sent
    client.resume()

    peft = get_peft_model(
        tiny_model("llama", seed=0),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    peft.save_pretrained(tmp_path / "v0")
    client.add_lora("solver", tmp_path / "v0")
    client.add_lora("solver", tmp_path / "v0")  # a new version: unload, then load
    assert [p for p in server.paths() if "lora" in p] == [
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/load_lora_adapter",
    ]
    client.lora_versions["solver"] = 5

    async def one(lora):
        return (await client.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6), lora=lora))[
            0
        ]

    base, adapted = asyncio.run(one(None)), asyncio.run(one("solver"))
    assert base.token_ids != adapted.token_ids and adapted.weight_version == 5 and base.weight_version == 1
    assert [b.get("lora_path") for p, b in server.calls if p == "/generate"][-2:] == [None, ["solver"]]
    with pytest.raises(NotImplementedError, match="allowed_token_ids"):
        asyncio.run(client.generate(PROMPTS[0], SamplingParams(allowed_token_ids=(5, 6))))
