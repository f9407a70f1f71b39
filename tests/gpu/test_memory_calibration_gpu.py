"""The dry-run's per-layer activation bytes against the GPU allocator, at 70B width.

Llama-3-70B's layer shape (hidden 8192, SwiGLU 28672, 64 heads, 8 KV heads, head dim 128) with 1 and
then 2 decoder layers (random weights, bf16, built by ``megamarl.models.bridge.build_model``, the
worker's builder, which picks the layer spec from this node), one micro-batch of T = 4096 tokens. For each
depth, after a warm-up forward (one-time buffers: megatron-core's global attention buffer, cuBLAS workspaces),
the peak of ``torch.cuda.max_memory_allocated`` over a forward with autograd on, minus what was allocated
before. The two depths share every constant (embedding, output layer, logits, the transients of the last
layer's attention), so their difference is what one more layer keeps for backward. That difference must be
within ``TOLERANCE`` of ``megamarl.planning.memory.layer_activation_bytes`` at the spec the *plan* counts for
a GPU cluster (``models.spec.planned_layer_spec``; the figure the dry-run multiplies by layers and
micro-batches in flight): a node that builds another spec than the plan counted (the local spec's fp32
attention scores where the plan said Transformer Engine) fails here. Printed and recorded beside it: the same
difference read from the allocation after the forward and from autograd's saved tensors, and the peaks
themselves."""

from functools import partial

import pytest
import torch
from saved_storage import record_saved_storage  # tests/ helper

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.gpu]

SEQ_LEN = 4096
VOCAB_SIZE = 32768
WIDTH_70B = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}
TOLERANCE = 0.10  # relative, per layer
NEEDS_GIB = (
    48  # two 70B-width layers at T=4096 in the local spec: ~4.5 GB weights + ~17 GB kept + ~12 GB transient
)


def _body(rank):
    from transformers import LlamaConfig

    from megamarl.models.bridge import build_model
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.forward import causal_mask

    free, total = torch.cuda.mem_get_info()
    if free < NEEDS_GIB * 2**30:
        return {
            "skip": f"needs {NEEDS_GIB} GiB free on the GPU, {free / 2**30:.1f} of {total / 2**30:.1f} GiB "
            "are"
        }
    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB_SIZE, (1, SEQ_LEN), generator=g).to(wg.device)
    positions = torch.arange(SEQ_LEN, device=wg.device)[None]
    out = {"device_name": torch.cuda.get_device_name()}
    for num_layers in (1, 2):
        config = LlamaConfig(
            **WIDTH_70B,
            num_hidden_layers=num_layers,
            vocab_size=VOCAB_SIZE,
            max_position_embeddings=SEQ_LEN,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        )
        model = build_model(config, wg, seed=0, dtype=torch.bfloat16, init_weights=True)
        out["spec"] = model.layer_spec  # what this node builds (models.spec.node_layer_spec)
        mask = (
            None if model.layer_spec == "te" else causal_mask(SEQ_LEN, wg.device)
        )  # TE: its own causal kernel
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        with torch.no_grad():
            model(tokens, positions, mask)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        storages: dict[int, int] = {}
        with torch.autograd.graph.saved_tensors_hooks(
            partial(record_saved_storage, params, storages), lambda tensor: tensor
        ):
            logits = model(tokens, positions, mask)
        torch.cuda.synchronize()
        peak, kept = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
        logits.float().sum().backward()  # what was kept is what backward uses
        torch.cuda.synchronize()
        out[num_layers] = {
            "peak": peak,
            "kept": kept,
            "saved": sum(storages.values()),
            "peak_with_backward": torch.cuda.max_memory_allocated() - base,
            "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
        }
        del model, logits, params, storages
        torch.cuda.empty_cache()
    return out


def test_per_layer_activations_match_the_dry_run_at_70b_width(record_property):
    from megamarl.models.spec import planned_layer_spec
    from megamarl.planning.memory import layer_activation_bytes
    from megamarl.planning.model_presets import ModelShape

    (r,) = run_ranks(_body, 1, timeout_s=600)
    if "skip" in r:
        pytest.skip(r["skip"])
    shape = ModelShape(
        num_layers=1,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        ffn_hidden_size=28672,
        vocab_size=VOCAB_SIZE,
    )
    plan_spec = planned_layer_spec(lora=False, on_gpus=True)  # what the dry-run counts on a GPU cluster
    planned = layer_activation_bytes(
        shape, tp=1, tokens=SEQ_LEN, seq_len=SEQ_LEN, dtype_bytes=2, recompute="none", spec=plan_spec
    )
    per_layer = {kind: r[2][kind] - r[1][kind] for kind in ("peak", "kept", "saved")}
    gib = 2**30
    print(
        f"\n{r['device_name']}, built on the {r['spec']} spec (the plan counts {plan_spec}), bf16, "
        f"T={SEQ_LEN}, 70B width: one decoder layer keeps "
        f"{planned / gib:.3f} GiB planned (layer_activation_bytes); measured {per_layer['peak'] / gib:.3f} "
        "GiB "
        f"(max_memory_allocated, 2 layers - 1 layer), {per_layer['kept'] / gib:.3f} (allocated after the "
        "forward), "
        f"{per_layer['saved'] / gib:.3f} (autograd's saved tensors)"
    )
    for layers in (1, 2):
        print(
            f"  {layers} layer(s): forward peak {r[layers]['peak'] / gib:.2f} GiB above "
            f"{r[layers]['weights'] / gib:.2f} "
            f"GiB of weights; with backward {r[layers]['peak_with_backward'] / gib:.2f} GiB"
        )
    record_property("spec", r["spec"])
    record_property("plan_spec", plan_spec)
    record_property("planned_layer_bytes", int(planned))
    for kind, value in per_layer.items():
        record_property(f"measured_layer_bytes_{kind}", int(value))
    record_property("ratio_measured_peak_over_planned", round(per_layer["peak"] / planned, 4))
    assert abs(per_layer["peak"] - planned) <= TOLERANCE * planned, (
        f"one layer keeps {per_layer['peak'] / gib:.3f} GiB, the plan counts {planned / gib:.3f} GiB at the "
        f"{plan_spec} "
        f"spec; this node built the {r['spec']} spec"
        + (" (install megamarl[gpu]: docs/install.md)" if r["spec"] != plan_spec else "")
    )
