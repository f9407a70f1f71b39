"""Foundation: two worker groups with different models on 4 CPU ranks, disaggregated and colocated.

For each WG: megatron-core DDP-wrapped forward + backward over a fixed batch (DP ranks take
different halves), grads DP-averaged into ``param.main_grad`` by ``finalize_model_grads``; logits
and gradients (exported through the Megatron -> HF mapping) must equal the same HF model run
unsharded in one process.
"""

from __future__ import annotations

import megatron_steps  # tests/ helper: Megatron forward/backward
import pytest

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed

BATCH, SEQ = 4, 8
# Two different tiny llamas: A untied (lm_head split over TP), B tied with an odd vocab (padded at TP=2).
MODELS = {
    "a": {"seed": 1},
    "b": {
        "seed": 2,
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1001,
        "tie_word_embeddings": True,
    },
}
MODELS["a"].update(tie_word_embeddings=False)


@pytest.fixture(autouse=True)
def _quiet_ranks(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")  # megatron's import-time "Apex/TE missing" warnings


def _hf_reference(hf, ids, labels):
    import torch

    hf.zero_grad()
    logits = hf(ids).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    return logits.detach(), {n: p.grad for n, p in hf.named_parameters()}


def _run_wg(wg, overrides):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megamarl.models import bridge
    from megamarl.models.tiny import tiny_model

    overrides = dict(overrides)
    hf = tiny_model("llama", seed=overrides.pop("seed"), **overrides).float()
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    ids, labels = ids[:, :-1], ids[:, 1:]
    ref_logits, ref_grads = _hf_reference(hf, ids, labels)

    model = bridge.build_model(hf.config, wg, init_weights=False)
    bridge.load_hf_weights(model, hf.state_dict(), wg)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model, pg_collection=wg.pgs
    )
    rows = slice(wg.dp_rank * BATCH // wg.layout.dp, (wg.dp_rank + 1) * BATCH // wg.layout.dp)

    def loss_fn(logits, microbatch):
        full = megatron_steps.gather_logits(logits, wg, vocab_size=vocab)
        loss = torch.nn.functional.cross_entropy(full.flatten(0, 1), microbatch["labels"].flatten())
        return loss, {"logits": full.detach()}

    ddp.zero_grad_buffer()
    out = megatron_steps.run_forward_backward(
        ddp, wg, [{"input_ids": ids[rows], "labels": labels[rows]}], loss_fn
    )
    finalize_model_grads([ddp], pg_collection=wg.pgs)
    result = {"logits_diff": None, "grad_diff": {}}
    if wg.is_last_stage:
        result["logits_diff"] = (out[0]["logits"] - ref_logits[rows]).abs().max().item()
    for name, grad in megatron_steps.export_hf_grads(ddp, wg):
        result["grad_diff"][name] = (grad - ref_grads[name]).abs().max().item()
    result["grad_scale"] = max(g.abs().max().item() for g in ref_grads.values())
    result["hf_names"] = sorted(ref_grads)  # tied: lm_head is not a separate HF parameter
    return result


def _placement_case(rank, mode):
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups

    if mode == "disaggregated":
        layouts = {"a": WorkerGroupLayout(ranks=[0, 1], tp=2), "b": WorkerGroupLayout(ranks=[2, 3], tp=2)}
    else:
        layouts = {
            "a": WorkerGroupLayout(ranks=[0, 1, 2, 3], tp=2, dp=2),
            "b": WorkerGroupLayout(ranks=[0, 1, 2, 3], pp=2, dp=2),
        }
    wgs = build_worker_groups(PlacementConfig(layouts, mode=mode))
    return {
        name: {**_run_wg(wg, MODELS[name]), "coords": dict(wg.coords)}
        for name, wg in wgs.items()
        if wg.is_member
    }


def _check(results, expected_members):
    for name, ranks in expected_members.items():
        per_rank = [results[r][name] for r in ranks]
        assert all(r["logits_diff"] is None or r["logits_diff"] < 1e-5 for r in per_rank), per_rank
        assert sum(r["logits_diff"] is not None for r in per_rank) >= 1
        covered = set()
        for r in per_rank:
            assert r["grad_diff"], f"{name}: a rank exported no gradients"
            worst = max(r["grad_diff"].values())
            assert worst < 1e-5, (
                name,
                r["coords"],
                worst,
                sorted(r["grad_diff"].items(), key=lambda x: -x[1])[:3],
            )
            covered |= set(r["grad_diff"])
        assert covered == set(per_rank[0]["hf_names"]), (name, set(per_rank[0]["hf_names"]) ^ covered)


def test_two_worker_groups_disaggregated_match_hf():
    results = run_ranks(_placement_case, 4, "disaggregated")
    assert [sorted(r) for r in results] == [["a"], ["a"], ["b"], ["b"]]
    _check(results, {"a": [0, 1], "b": [2, 3]})


def test_two_worker_groups_colocated_match_hf():
    results = run_ranks(_placement_case, 4, "colocated")
    assert all(sorted(r) == ["a", "b"] for r in results)
    _check(results, {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]})
