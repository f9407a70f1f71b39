"""One SGLang suite, two servers behind it: the fake (``tests/fake_sglang``: SGLang's HTTP protocol
from transformers, always) and the real SGLang 0.5.23 on CPU (where ``scripts/setup.sh --extras
sglang-cpu`` built ``.venv-sglang``; skipped otherwise). Both are started the production way
(``ServerProcess`` -> ``python -m sglang.launch_server`` with the flags megamarl emits), two
replicas per module, shared by the module's tests (a real server takes ~80 s to start on 2 cores).

What each test checks is the server's behaviour, never the fake's log: greedy ``/generate`` equal
to transformers, a gloo weight push into one and into two replicas verified greedily
(``sync_check``), version stamping, ``/update_weights_from_tensor`` (same-node push), release /
resume of memory, kill / restart on the same URL / re-sync. LoRA: an SGLang server on CPU with
adapters is refused before it starts (``ServerSpec``; tests/unit/test_server_launch.py), so only the
fake's LoRA protocol is tested (tests/unit/test_sglang_sync.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from megamarl.models.packaged import resolve_model_path
from megamarl.parallel.network import free_port
from megamarl.rollout.engines.base import SamplingParams
from megamarl.rollout.engines.sglang import SGLangClient
from megamarl.rollout.servers.server_launch import ServerProcess, ServerSpec, sglang_venv_python
from megamarl.rollout.weights.sglang_sync import SGLangWeightSender
from megamarl.rollout.weights.sync_check import reference_tokens, served_tokens

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-plain-llama"
REAL = os.access(sglang_venv_python(), os.X_OK)
KINDS = [
    "fake",
    pytest.param(
        "real",
        marks=[
            pytest.mark.slow,
            pytest.mark.timeout(1200),
            pytest.mark.skipif(
                not REAL,
                reason=f"no real SGLang: {sglang_venv_python()} missing (bash scripts/setup.sh --extras "
                "sglang-cpu)",
            ),
        ],
    ),
]


@pytest.fixture(scope="module", params=KINDS)
def sglang(request, tmp_path_factory):
    """``(kind, [ServerProcess x 2], model_path, base_weights)``."""
    kind = request.param
    path = resolve_model_path(MODEL, key="test")
    saved = os.environ.get("PYTHONPATH")
    if kind == "fake":  # `python -m sglang.launch_server` finds the fake first
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT / "tests" / "fake_sglang"), str(ROOT), saved) if p
        )
    logs = tmp_path_factory.mktemp(f"sglang_{kind}")
    procs = [
        ServerProcess(
            ServerSpec(
                policy="p",
                replica=i,
                rank=0,
                backend="sglang",
                model_path=str(path),
                dtype="fp32",
                max_num_seqs=8,
                max_model_len=256,
                num_threads=1,
                seed=0,
                log_path=logs / f"replica{i}.log",
                python=str(sglang_venv_python()) if kind == "real" else sys.executable,
            )
        )
        for i in range(2)
    ]
    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.start(timeout_s=480), procs))
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
        yield kind, procs, path, base
    finally:
        for proc in procs:
            proc.stop()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def _perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
    if (
        "lm_head.weight" in out
        and base["lm_head.weight"].data_ptr() == base["model.embed_tokens.weight"].data_ptr()
    ):
        # tied: one tensor (SGLang loads the embedding and skips lm_head, transformers keeps the last loaded)
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _push(urls: list[str], weights: dict[str, torch.Tensor], *, version: int) -> None:
    sender = SGLangWeightSender(urls, transport="gloo", master_port=free_port("127.0.0.1"), timeout_s=120)
    try:
        sender.connect()
        stats = sender.push(weights.items(), version=version, bucket_bytes=256 * 1024)
        assert stats.num_buckets > 1 and stats.num_tensors == len(weights)
    finally:
        sender.close()


def _generate(url: str, prompt: list[int], **sampling):
    return asyncio.run(SGLangClient(url).generate(prompt, SamplingParams(**sampling)))


def test_greedy_generation_equals_transformers(sglang):
    _, procs, path, base = sglang
    expected = reference_tokens(path, base)
    for proc in procs:
        assert served_tokens(proc.url, "default", backend="sglang") == expected
    (gen,) = _generate(procs[0].url, [1, 17, 42, 99, 7], temperature=0.0, max_tokens=8)
    assert gen.token_ids[:8] == expected[0][: len(gen.token_ids)] and len(gen.logprobs) == len(gen.token_ids)
    assert all(lp <= 0 for lp in gen.logprobs) and gen.finish_reason in ("stop", "length")
    two = _generate(procs[0].url, [2, 300, 5], temperature=1.0, max_tokens=6, n=2, seed=3)
    assert len(two) == 2 and all(len(g.token_ids) > 0 for g in two)


def test_gloo_push_into_two_then_one_replica_is_verified_and_stamped(sglang):
    _, procs, path, base = sglang
    urls = [p.url for p in procs]
    both = _perturbed(base, 1)
    _push(urls, both, version=3)
    expected = reference_tokens(path, both)
    assert expected != reference_tokens(path, base)  # the push changes what is decoded
    for url in urls:
        assert served_tokens(url, "default", backend="sglang") == expected
        assert SGLangClient(url).server_weight_version() == "3"
        assert {g.weight_version for g in _generate(url, [1, 2, 3], temperature=0.0, max_tokens=2)} == {3}
    one = _perturbed(base, 2)
    _push(urls[:1], one, version=4)
    assert served_tokens(urls[0], "default", backend="sglang") == reference_tokens(path, one)
    assert served_tokens(urls[1], "default", backend="sglang") == expected  # untouched
    assert [SGLangClient(u).server_weight_version() for u in urls] == ["4", "3"]


def test_release_resume_and_a_same_node_tensor_push(sglang):
    _, procs, path, base = sglang
    client = SGLangClient(procs[1].url, bucket_bytes=256 * 1024)
    client.sleep(level=1)  # the hand-over to training: weights and KV cache
    client.wake(tags=("weights",))
    weights = _perturbed(base, 5)
    client.pause()
    client.update_weights(weights.items(), version=6)  # /update_weights_from_tensor, file_system sharing
    client.resume()
    client.wake(tags=("kv_cache",))
    assert client.health()
    assert served_tokens(procs[1].url, "default", backend="sglang") == reference_tokens(path, weights)
    assert client.server_weight_version() == "6"


def test_killed_server_restarts_on_its_url_and_is_resynced(sglang):
    _, procs, path, base = sglang
    proc = procs[0]
    url = proc.url
    os.killpg(proc.proc.pid, signal.SIGKILL)
    proc.proc.wait(timeout=30)
    assert not proc.alive()
    assert proc.restart(timeout_s=480) == url and proc.alive()
    assert served_tokens(url, "default", backend="sglang") == reference_tokens(path, base)  # fresh from disk
    weights = _perturbed(base, 7)
    _push([url], weights, version=8)
    assert served_tokens(url, "default", backend="sglang") == reference_tokens(path, weights)
    assert SGLangClient(url).server_weight_version() == "8"
