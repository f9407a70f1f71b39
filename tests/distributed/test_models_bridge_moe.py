"""HF <-> Megatron bridge for MoE families on 2 CPU ranks: logits equal transformers' for Qwen3-MoE and
Qwen2-MoE at EP=1, EP=2, TP=2 (expert TP 2), TP=2 x EP=2 (expert TP 1) and PP=2; HF -> Megatron -> HF is
bit-exact at every layout (experts gathered over EP under their global names); at EP=2 the gradients
through the alltoall dispatcher equal transformers' (training mode; experts see both ranks' tokens).

One ``run_ranks`` call runs every layout and family (process start-up dominates).
"""

from __future__ import annotations

import megatron_steps  # tests/ helper: Megatron forward/backward
import pytest

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed

FAMILIES = ("qwen3_moe", "qwen2_moe")
LAYOUTS = {
    "ep1": {"ranks": [0]},
    "ep2": {"ranks": [0, 1], "ep": 2},
    "tp2": {"ranks": [0, 1], "tp": 2},  # experts sharded over expert TP = TP = 2
    "tp2ep2": {"ranks": [0, 1], "tp": 2, "ep": 2, "etp": 1},  # experts split over the TP ranks
    "pp2": {"ranks": [0, 1], "pp": 2},
}


@pytest.fixture(autouse=True)
def _quiet_ranks(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")


def _hf_grads(hf, ids, weights) -> dict:
    """transformers' gradients of ``(logits * weights).sum()`` under checkpoint names (per expert)."""
    hf.zero_grad()
    (hf(ids).logits * weights).sum().backward()
    grads = {}
    for name, param in hf.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e, (gate, up) in enumerate(g.chunk(2, dim=0) for g in param.grad):
                grads[f"{prefix}{e}.gate_proj.weight"], grads[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            grads.update({f"{prefix}{e}.down_proj.weight": g for e, g in enumerate(param.grad)})
        else:
            grads[name] = param.grad
    return grads


def _ep2_gradients(model, wg, hf, ids, weights) -> dict:
    """Megatron's gradients at EP=2 (training mode) against transformers'."""
    vocab = hf.config.vocab_size

    def loss_fn(logits, microbatch):
        return (megatron_steps.gather_logits(logits, wg, vocab_size=vocab) * weights).sum(), {}  # [B, T, V]

    model.train()
    megatron_steps.run_forward_backward(model, wg, [{"input_ids": ids}], loss_fn)
    want = _hf_grads(hf.train(), ids, weights)
    got = dict(megatron_steps.export_hf_grads(model, wg))
    # Both ranks feed the same batch (EP over what would be DP ranks): each expert receives the tokens
    # of both, so its gradient is twice HF's until megatron-core's DDP scales it by 1/dp.
    scale = {n: 2.0 if ".experts." in n else 1.0 for n in got}
    return {
        "grad_names": sorted(got) == sorted(want),
        "grad_diff": max((got[n] - scale[n] * want[n]).abs().max().item() for n in got),
        "grad_scale": max(want[n].abs().max().item() for n in got),
    }


def _moe_cases(rank, paths):
    import torch
    from transformers import AutoModelForCausalLM

    from megamarl.models import bridge
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups

    wgs = build_worker_groups(PlacementConfig({k: WorkerGroupLayout(**v) for k, v in LAYOUTS.items()}))
    pgs = wgs["tp2"].pgs  # ep 1, etp = tp: megatron's expert groups are the dense group objects
    out = {
        "dense_expert_groups": [
            pgs.expt_tp is pgs.tp,
            pgs.tp_ep is pgs.tp,
            pgs.expt_dp is pgs.dp,
            pgs.intra_expt_dp is pgs.dp,
            pgs.tp_ep_pp is pgs.mp,
        ]
    }
    for family, path in paths.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        on_disk = bridge.HFTensorSource(path)
        state = {name: on_disk.get(name) for name in on_disk.names()}
        ids = torch.randint(0, hf.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
        weights = torch.randn(2, 9, hf.config.vocab_size, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            ref = hf.eval()(ids).logits
        for layout, wg in wgs.items():
            if not wg.is_member:
                continue
            model = bridge.build_model(path, wg, init_weights=False)
            bridge.load_hf_weights(model, path, wg)
            model.eval()  # megatron-core refuses MoE + TP > 1 in training without sequence parallelism
            logits = megatron_steps.forward_logits(model, wg, ids)
            if logits is not None:
                out[(family, layout, "logits_diff")] = (logits - ref).abs().max().item()
            exported = dict(bridge.export_hf_weights(model, wg))
            out[(family, layout, "exported")] = sorted(exported)
            mismatch = [n for n, t in exported.items() if not torch.equal(t, state[n])]
            out[(family, layout, "mismatch")] = mismatch
            if layout == "ep2":
                grads = _ep2_gradients(model, wg, hf, ids, weights)
                out.update({(family, "ep2", key): value for key, value in grads.items()})
        out[(family, "hf_names")] = sorted(state)
    return out


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory):
    from megamarl.models.tiny import tiny_model

    paths = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        # odd vocab: zero-row vocab padding at TP=2; the checkpoint holds one tensor per expert
        tiny_model(family, vocab_size=1001).save_pretrained(path)
        paths[family] = str(path)
    return run_ranks(_moe_cases, 2, paths, timeout_s=400)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_logits_match_hf(moe_results, family, layout):
    diffs = [r[(family, layout, "logits_diff")] for r in moe_results if (family, layout, "logits_diff") in r]
    assert diffs, "no last-stage rank reported logits"
    assert max(diffs) < 1e-4, diffs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_roundtrip_bit_exact(moe_results, family, layout):
    members = [r for r in moe_results if (family, layout, "exported") in r]
    for result in members:
        assert result[(family, layout, "mismatch")] == [], result[(family, layout, "mismatch")]
    hf_names = set(moe_results[0][(family, "hf_names")])
    if layout == "pp2":  # each stage its own layers, together every tensor exactly once
        first, last = (set(r[(family, layout, "exported")]) for r in members)
        assert not first & last and first | last == hf_names
    else:  # every rank yields every tensor: TP-gathered, experts gathered over EP
        assert all(set(r[(family, layout, "exported")]) == hf_names for r in members)


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_ep2_gradients_match_hf(moe_results, family):
    for result in moe_results:
        assert result[(family, "ep2", "grad_names")]
        assert result[(family, "ep2", "grad_diff")] < 1e-4 * max(1.0, result[(family, "ep2", "grad_scale")])


def test_without_experts_megatron_expert_groups_are_the_dense_groups(moe_results):
    assert [r["dense_expert_groups"] for r in moe_results] == [[True] * 5] * 2
