"""SGLang and vLLM-server clients against local servers speaking their documented protocols
(``tests/fake_servers.py``, backed by a real HFEngine on a tiny model)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from fake_servers import FakeSGLangServer, FakeVLLMServer, QueueTransport  # tests/ helper

from megamarl.models.tiny import tiny_model
from megamarl.rollout import ENGINES
from megamarl.rollout.engines.base import SamplingParams
from megamarl.rollout.engines.hf import HFEngine
from megamarl.rollout.engines.sglang import (
    SGLangClient,
    SGLangEngine,
    deserialize_named_tensors,
    serialize_named_tensors,
    sglang_sampling,
)
from megamarl.rollout.engines.vllm_server import VLLMServerClient

PROMPTS = [[1, 9690, 198, 2683, 359], [1, 300, 301]]
GREEDY = {"temperature": 0.0, "max_tokens": 8}


def run(client, prompts, **sampling):
    async def main():
        return await asyncio.gather(*(client.generate(p, SamplingParams(**sampling)) for p in prompts))

    return asyncio.run(main())


class _IdsAsText:  # a tokenizer stand-in for stop strings: token i decodes to <i>
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


@pytest.fixture(scope="module")
def local():
    return HFEngine(tiny_model("llama", seed=0))


def test_registered():
    assert ENGINES.get("sglang") is SGLangClient and ENGINES.get("vllm_server") is VLLMServerClient


def test_tensor_serialization_round_trip():
    named = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.arange(5.0))]
    back = deserialize_named_tensors(serialize_named_tensors(named))
    assert [n for n, _ in back] == ["a.weight", "b.bias"] and all(
        torch.equal(x, y) for (_, x), (_, y) in zip(named, back)
    )


def test_sglang_client_generate_update_lifecycle(local):
    server = FakeSGLangServer(HFEngine(tiny_model("llama", seed=0)))
    client = SGLangClient(server.url, bucket_bytes=64 * 1024)  # several buckets for the tiny model
    try:
        expected = [g[0] for g in run(local, PROMPTS, **GREEDY)]
        got = [g[0] for g in run(client, PROMPTS, **GREEDY)]
        assert [g.token_ids for g in got] == [g.token_ids for g in expected]
        for g, e in zip(got, expected):
            assert g.logprobs == pytest.approx(e.logprobs, abs=1e-5)  # other batch padding: fp32 ulps
        body = next(b for p, b in server.calls if p == "/generate")
        assert body["return_logprob"] is True and body["sampling_params"][0]["max_new_tokens"] == 8

        n2 = run(client, PROMPTS[:1], temperature=1.0, max_tokens=6, n=2, seed=3)[0]
        assert len(n2) == 2 and n2[0].token_ids != n2[1].token_ids

        perturbed = [
            (k, v + 0.3 * torch.randn_like(v)) for k, v in tiny_model("llama", seed=0).state_dict().items()
        ]
        client.pause()
        client.update_weights(iter(perturbed), version=4)
        client.resume()
        updates = [b for p, b in server.calls if p == "/update_weights_from_tensor"]
        assert len(updates) > 1 and updates[-1]["weight_version"] == "4" and updates[-1]["flush_cache"]
        changed = [g[0] for g in run(client, PROMPTS, **GREEDY)]
        assert {g.weight_version for g in changed} == {4}
        assert [g.token_ids for g in changed] != [g.token_ids for g in expected]

        client.sleep(level=2)
        client.wake()
        client.update_weights(tiny_model("llama", seed=0).state_dict().items(), version=6)
        client.flush_cache()
        assert [g[0].token_ids for g in run(client, PROMPTS, **GREEDY)] == [g.token_ids for g in expected]
        for path in (
            "/pause_generation",
            "/continue_generation",
            "/release_memory_occupation",
            "/resume_memory_occupation",
            "/flush_cache",
        ):
            assert path in server.paths()
        assert client.health()
    finally:
        server.kill()
    assert not client.health()


def test_vllm_server_client_generate_and_weight_transfer(local):
    transport = QueueTransport()
    server = FakeVLLMServer(HFEngine(tiny_model("llama", seed=0), tokenizer=_IdsAsText()), transport)
    client = VLLMServerClient(server.url, transport=transport, bucket_bytes=64 * 1024)
    try:
        expected = [g[0] for g in run(local, PROMPTS, **GREEDY)]
        got = [g[0] for g in run(client, PROMPTS, **GREEDY)]
        assert [g.token_ids for g in got] == [g.token_ids for g in expected]
        body = next(b for p, b in server.calls if p == "/v1/completions")
        assert body["prompt"] == PROMPTS[0] or body["prompt"] == PROMPTS[1]
        assert body["logprobs"] == 0 and body["return_token_ids"] is True and "stop" not in body
        ((stopped,),) = run(client, PROMPTS[:1], temperature=0.0, max_tokens=5, stop=("never seen",))
        body = [b for p, b in server.calls if p == "/v1/completions"][-1]
        assert (body["stop"], body["include_stop_str_in_output"], body["max_tokens"]) == (
            ["never seen"],
            True,
            5,
        )
        assert stopped.token_ids == expected[0].token_ids[:5]

        state = tiny_model("llama", seed=0).state_dict()
        client.pause()
        client.update_weights(((k, v * 1.5) for k, v in state.items()), version=2)
        client.resume()
        paths = server.paths()
        assert (
            paths.index("/start_weight_update")
            < paths.index("/update_weights")
            < paths.index("/finish_weight_update")
        )
        assert paths.count("/update_weights") > 1  # bucketed
        assert [g[0].token_ids for g in run(client, PROMPTS, **GREEDY)] != [g.token_ids for g in expected]
        client.update_weights(state.items(), version=3)
        again = [g[0] for g in run(client, PROMPTS, **GREEDY)]
        assert [g.token_ids for g in again] == [g.token_ids for g in expected] and again[
            0
        ].weight_version == 3
        with pytest.raises(RuntimeError, match="transport"):
            VLLMServerClient(server.url).update_weights([], version=1)
    finally:
        server.kill()


def test_sglang_inprocess_engine_needs_sglang():
    pytest.importorskip("torch")
    try:
        import sglang  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs the 'sglang' package"):
            SGLangEngine("some/model")


def test_every_registered_engine_implements_the_protocol():
    from megamarl.rollout.engines.base import Engine

    assert {"hf", "vllm", "vllm_server", "sglang", "sglang_inprocess"} <= set(ENGINES.names())
    for name in ENGINES.names():
        assert issubclass(ENGINES.get(name), Engine), name


def test_sglang_request_carries_stop_strings():
    params = sglang_sampling(SamplingParams(max_tokens=5, stop=("</answer>",)), 0)
    assert (params["stop"], params["max_new_tokens"], params["no_stop_trim"]) == (["</answer>"], 5, True)
    assert "stop" not in sglang_sampling(SamplingParams(), 0)
