"""dist_checkpointing (torch_dist): a WG checkpoint saved at TP=2 (after one AdamW step) loads at
TP=1 and at PP=2 with identical logits and identical optimizer state (compared by HF name)."""

from __future__ import annotations

import megatron_steps  # tests/ helper: Megatron forward/backward
import pytest

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed

MODEL = {"vocab_size": 1001, "tie_word_embeddings": True}  # tied: PP=2 holds the embedding on two stages


@pytest.fixture(autouse=True)
def _quiet_ranks(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")


def _state_by_hf_name(model, wg, optimizer):
    from megamarl.models import bridge

    out = {}
    for key in ("exp_avg", "exp_avg_sq"):
        for name, tensor in bridge.export_hf_weights(
            model, wg, source=lambda p, key=key: optimizer.state[p][key]
        ):
            out[f"{key}/{name}"] = tensor.clone()
    for name, tensor in bridge.export_hf_weights(model, wg):
        out[f"param/{name}"] = tensor.clone()
    out["step"] = {float(s["step"]) for s in optimizer.state.values()}
    return out


def _save_then_load(rank, ckpt_dir):
    import torch

    from megamarl.models import bridge, dist_checkpoint
    from megamarl.models.tiny import tiny_model
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups

    wgs = build_worker_groups(
        PlacementConfig(
            {
                "src": WorkerGroupLayout(ranks=[0, 1], tp=2),
                "tp1": WorkerGroupLayout(ranks=[0]),
                "pp2": WorkerGroupLayout(ranks=[2, 3], pp=2),
            }
        )
    )
    hf = tiny_model("llama", **MODEL)
    ids = torch.randint(0, 1001, (2, 9), generator=torch.Generator().manual_seed(5))
    result = {}

    src = wgs["src"]
    model = opt = None
    if src.is_member:
        model = bridge.build_model(hf.config, src, init_weights=False)
        bridge.load_hf_weights(model, hf.state_dict(), src)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def loss_fn(logits, microbatch):
            full = megatron_steps.gather_logits(logits, src, vocab_size=1001)
            return full.float().pow(2).mean(), {}

        megatron_steps.run_forward_backward(model, src, [{"input_ids": ids}], loss_fn)
        opt.step()
        result["src_logits"] = megatron_steps.forward_logits(model, src, ids)
        result["src_state"] = _state_by_hf_name(model, src, opt)
    dist_checkpoint.save_checkpoint(ckpt_dir, model, src, optimizer=opt)

    for name in ("tp1", "pp2"):
        wg = wgs[name]
        model = opt = None
        if wg.is_member:
            model = bridge.build_model(hf.config, wg, seed=123)  # random init: the load must overwrite it
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dist_checkpoint.load_checkpoint(ckpt_dir, model, wg, optimizer=opt)
        if wg.is_member:
            result[f"{name}_logits"] = megatron_steps.forward_logits(model, wg, ids)
            result[f"{name}_state"] = _state_by_hf_name(model, wg, opt)
    return result


def test_checkpoint_tp2_loads_at_tp1_and_pp2(tmp_path):
    import torch

    results = run_ranks(_save_then_load, 4, str(tmp_path / "ckpt"), timeout_s=300)
    src_logits, src_state = results[0]["src_logits"], results[0]["src_state"]
    assert src_state["step"] == {1.0}
    # Weights and optimizer state are bit-identical (below); logits agree to float rounding (a
    # TP=2 row-parallel matmul sums its halves in another order than TP=1).
    assert (results[0]["tp1_logits"] - src_logits).abs().max() < 1e-5
    assert (results[3]["pp2_logits"] - src_logits).abs().max() < 1e-5  # last stage of the PP=2 WG
    assert results[0]["tp1_state"].keys() == src_state.keys()
    for key, value in src_state.items():
        assert (
            results[0]["tp1_state"][key] == value
            if key == "step"
            else torch.equal(results[0]["tp1_state"][key], value)
        ), key
    pp_state = {**results[2]["pp2_state"], **results[3]["pp2_state"]}
    for key, value in src_state.items():
        if key != "step":
            assert torch.equal(pp_state[key], value), key
    assert results[2]["pp2_state"]["step"] == results[3]["pp2_state"]["step"] == {1.0}
