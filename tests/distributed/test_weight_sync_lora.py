"""L2 adapter-only weight sync over gloo: a frozen Megatron base at TP=2 on ranks 1-2 carries one LoRA
adapter per agent; one agent's adapter trains a step and only its PEFT tensors travel to the HF engine
on rank 0 (multi-LoRA serving through PEFT).

Checked: the bytes moved are the adapter's (a small fraction of the model); the engine's adapter equals
the WG's PEFT export bit for bit and carries the new version while the base and the other agent's
adapter keep theirs; generation with the adapter differs from the base and is the greedy decode of
transformers + PEFT on the same weights, with logprobs within fp32 rounding.
"""

from __future__ import annotations

import megatron_steps  # tests/ helper
import pytest
import torch

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed

AGENTS = ("solver", "verifier")
PROMPTS = [[1, 9690, 198, 2683, 359], [1, 300, 301, 302], [1, 77, 88, 99, 1000]]
TARGET_TOKEN = 4242  # the solver's adapter is trained towards it, so its greedy tokens change
MAX_TOKENS = 6
LOGPROB_TOL = 1e-4  # same fp32 math (transformers + PEFT); the engine batches with left padding


def _l2_sync(rank, model_dir, out_dir):
    import torch.distributed as dist

    from megamarl.models import bridge, lora
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rollout.engines.hf import HFEngine
    from megamarl.rollout.weights.weight_sync import sync_weights

    wg = build_worker_groups(PlacementConfig({"base": WorkerGroupLayout(ranks=[1, 2], tp=2)}))["base"]
    out: dict = {}
    engine = HFEngine(model_dir, max_wait_ms=1) if rank == 0 else None
    model = None
    if wg.is_member:
        model = bridge.build_model(bridge.load_hf_config(model_dir), wg, init_weights=False)
        bridge.load_hf_weights(model, model_dir, wg)
        for agent in AGENTS:
            lora.add_lora_adapter(model, wg, agent, lora.LoraConfig(rank=4, alpha=8.0))
            lora.save_peft_adapter(model, wg, agent, f"{out_dir}/initial/{agent}")
    dist.barrier()
    if engine is not None:
        for agent in AGENTS:
            engine.add_lora(agent, f"{out_dir}/initial/{agent}")
        out["before"] = _greedy(engine, None)

    if model is not None:  # one step on the solver's adapter only
        params = lora.lora_parameters(model, "solver")
        optimizer = torch.optim.AdamW(params, lr=5e-2, weight_decay=0.0)
        ids = torch.tensor([p + [TARGET_TOKEN] * (8 - len(p)) for p in (PROMPTS[0], PROMPTS[2])])

        def loss_fn(logits, microbatch):
            full = megatron_steps.gather_logits(logits, wg, vocab_size=49152)
            return -torch.log_softmax(full.float(), -1)[..., TARGET_TOKEN].mean(), {}

        with lora.active_adapter(model, "solver"):
            megatron_steps.run_forward_backward(model, wg, [{"input_ids": ids}], loss_fn)
        optimizer.step()

    stats = sync_weights(
        wg,
        (lambda: lora.export_lora_weights(model, wg, "solver")) if model is not None else None,
        [engine] if engine else None,
        version=1,
        engine_rank=0,
        bucket_mb=0.01,
        lora="solver",
    )
    if model is not None:
        lora.save_peft_adapter(model, wg, "solver", f"{out_dir}/synced/solver")  # the reference
    dist.barrier()
    if engine is not None:
        from safetensors.torch import load_file

        exported = load_file(f"{out_dir}/synced/solver/adapter_model.safetensors")
        served = engine._lora_targets("solver")
        out["adapter_equal"] = set(served) == set(exported) and all(
            torch.equal(served[k], exported[k]) for k in exported
        )
        out["num_adapter_tensors"] = len(exported)
        out["stats"] = (stats.num_tensors, stats.num_bytes, stats.num_buckets)
        out["full_bytes"] = sum(p.numel() * p.element_size() for p in engine.base_model.parameters())
        out["after"] = {agent: _greedy(engine, agent) for agent in (None, *AGENTS)}
        out["versions"] = (engine.weight_version, dict(engine.lora_versions))
    return out


def _greedy(engine, lora):
    import asyncio

    from megamarl.rollout.engines.base import SamplingParams

    async def main():
        sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        return await asyncio.gather(*(engine.generate(p, sampling, lora=lora) for p in PROMPTS))

    return [(g[0].token_ids, g[0].logprobs, g[0].weight_version) for g in asyncio.run(main())]


def _peft_reference(model_dir, adapter_dir, responses):
    """Teacher-forced transformers + PEFT: argmax tokens and logprobs along each response."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    out = []
    for prompt, response in zip(PROMPTS, responses):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]
        out.append((logits.argmax(-1).tolist(), logprobs))
    return out


def test_l2_adapter_only_sync_moves_adapter_bytes_and_matches_peft(tmp_path):
    from megamarl.models.packaged import resolve_model_path

    model_dir = resolve_model_path("tiny-random-llama")
    engine = run_ranks(_l2_sync, 3, str(model_dir), str(tmp_path), timeout_s=300)[0]

    num_tensors, num_bytes, num_buckets = engine["stats"]
    assert num_tensors == engine["num_adapter_tensors"] and num_buckets > 1
    assert 0 < num_bytes < engine["full_bytes"] / 50, (num_bytes, engine["full_bytes"])  # adapter bytes only
    assert engine["adapter_equal"]
    assert engine["versions"] == (0, {"solver": 1, "verifier": 0})

    before, after = engine["before"], engine["after"]
    assert [t for t, _, _ in after[None]] == [t for t, _, _ in before]  # the frozen base is untouched
    assert [t for t, _, _ in after["verifier"]] == [t for t, _, _ in before]  # zero-B adapter: the base
    solver = after["solver"]
    assert {v for _, _, v in solver} == {1} and {v for _, _, v in after[None]} == {0}
    assert [t for t, _, _ in solver] != [t for t, _, _ in before]  # the trained adapter changes generation

    reference = _peft_reference(model_dir, tmp_path / "synced" / "solver", [t for t, _, _ in solver])
    for (tokens, logprobs, _), (argmax, ref_logprobs) in zip(solver, reference):
        assert tokens == argmax  # greedy decode of transformers + PEFT on the synced adapter
        assert (torch.tensor(logprobs) - ref_logprobs).abs().max() < LOGPROB_TOL
