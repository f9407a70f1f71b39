"""TP-aware LoRA: two agents' adapters on one frozen base, at TP=2 and at PP=2.

Zero-initialised adapters leave logits unchanged; one optimizer step changes only adapter
parameters; the PEFT export applied to the HF model reproduces Megatron's logits; the two agents'
trained adapters give different outputs.
"""

from __future__ import annotations

import megatron_steps  # tests/ helper: Megatron forward/backward
import pytest

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed

FAMILY = ("qwen2", {})  # QKV bias + GQA: the fused-QKV split of lora_B is the interesting part
AGENTS = ("solver", "verifier")


@pytest.fixture(autouse=True)
def _quiet_ranks(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")


def _lora_case(rank, out_dir):
    import torch

    from megamarl.models import bridge, lora
    from megamarl.models.tiny import tiny_model
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups

    wgs = build_worker_groups(
        PlacementConfig(
            {
                "tp2": WorkerGroupLayout(ranks=[0, 1], tp=2),
                "pp2": WorkerGroupLayout(ranks=[2, 3], pp=2),
            }
        )
    )
    layout, wg = next((n, w) for n, w in wgs.items() if w.is_member)
    hf = tiny_model(FAMILY[0], **FAMILY[1])
    vocab = hf.config.vocab_size
    model = bridge.build_model(hf.config, wg, init_weights=False)
    bridge.load_hf_weights(model, hf.state_dict(), wg)
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(11))
    base_logits = megatron_steps.forward_logits(model, wg, ids)
    config = lora.LoraConfig(rank=4, alpha=8.0)
    for agent in AGENTS:
        lora.add_lora_adapter(model, wg, agent, config)
    out = {"layout": layout, "stage": wg.pp_rank, "tp_rank": wg.tp_rank}

    with lora.active_adapter(model, "solver"):
        zero_logits = megatron_steps.forward_logits(model, wg, ids)
    if wg.is_last_stage:
        out["zero_init_equal"] = torch.equal(zero_logits, base_logits)

    base_before = {n: t.clone() for n, t in bridge.export_hf_weights(model, wg)}
    lora_before = {id(p): p.detach().clone() for p in lora.lora_parameters(model)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    out["only_lora_trainable"] = {id(p) for p in trainable} == set(lora_before)
    optimizer = torch.optim.AdamW(trainable, lr=5e-2, weight_decay=0.0)
    for sign, agent in zip((1.0, -1.0), AGENTS):  # the two agents are pushed in opposite directions

        def loss_fn(logits, microbatch, sign=sign):
            full = megatron_steps.gather_logits(logits, wg, vocab_size=vocab)
            return sign * full[..., :50].float().mean(), {}

        optimizer.zero_grad()
        with lora.active_adapter(model, agent):
            megatron_steps.run_forward_backward(model, wg, [{"input_ids": ids}], loss_fn)
        optimizer.step()

    out["base_unchanged"] = all(
        torch.equal(t, base_before[n]) for n, t in bridge.export_hf_weights(model, wg)
    )
    changed = {
        agent: any(not torch.equal(p, lora_before[id(p)]) for p in lora.lora_parameters(model, agent))
        for agent in AGENTS
    }
    out["adapters_changed"] = changed
    for agent in AGENTS:
        with lora.active_adapter(model, agent):
            logits = megatron_steps.forward_logits(model, wg, ids)
        if wg.is_last_stage:
            out[f"logits/{agent}"] = logits
        saved = lora.save_peft_adapter(model, wg, agent, f"{out_dir}/{layout}/{agent}")
        out[f"saved/{agent}"] = None if saved is None else str(saved)
    return out


def test_lora_two_agents_tp2_and_pp2(tmp_path):
    import torch
    from peft import PeftModel

    from megamarl.models.tiny import tiny_model

    results = run_ranks(_lora_case, 4, str(tmp_path), timeout_s=300)
    last = {r["layout"]: r for r in results if "logits/solver" in r and r["tp_rank"] == 0}
    assert sorted(last) == ["pp2", "tp2"]
    for r in results:
        assert r["only_lora_trainable"] and r["base_unchanged"], r["layout"]
        assert r["adapters_changed"] == {"solver": True, "verifier": True}, r["layout"]
    ids = torch.randint(0, 49152, (2, 9), generator=torch.Generator().manual_seed(11))
    for layout, r in last.items():
        assert r["zero_init_equal"], layout
        assert (r["logits/solver"] - r["logits/verifier"]).abs().max() > 1e-2, layout
        for agent in AGENTS:
            path = tmp_path / layout / agent
            assert (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()
            peft_model = PeftModel.from_pretrained(tiny_model(FAMILY[0], **FAMILY[1]), str(path)).eval()
            with torch.no_grad():
                ref = peft_model(ids).logits
            assert (r[f"logits/{agent}"] - ref).abs().max() < 1e-4, (layout, agent)
