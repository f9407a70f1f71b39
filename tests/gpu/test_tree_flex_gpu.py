"""``prefix_tree`` on CUDA: flex tree attention (``models.tree_attention``, compiled) through the trainer's
``PolicyWorker`` equals the unshared packed update on the same GPU.

One rank, a tiny random Llama (GQA); a batch whose rows share prefixes (a GRPO group's prompt, an
earlier turn inside a later one, a repeated reply). The tree worker builds this node's layer spec
(Transformer Engine's where it is importable, keeping TE's linears) with ``FlexTreeAttention`` as core
attention; the packed worker the same spec with its own attention (TE's THD or the local mask). fp32:
log-probs within ``FP32_ATOL``, gradients within ``FP32_GRAD_RTOL`` of the largest; bf16: the tree's
log-probs at most ``BF16_FACTOR`` times as far from the fp32 packed ones as the bf16 packed ones are
(plus ``BF16_ATOL``). Also run with ``recompute: selective`` (core attention rebuilt in backward).
"""

import megatron_steps  # tests/ helper: gradients by HF name
import pytest
import torch
from gpu_common import VOCAB_SIZE, make_worker, max_abs_diff, one_rank_wg

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.gpu]

FP32_ATOL = 1e-4
FP32_GRAD_RTOL = 1e-4
BF16_FACTOR = 3.0
BF16_ATOL = 0.02


def _shared_batch():
    from megamarl.rl.batch import collate
    from megamarl.rl.sample import Sample

    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(1, VOCAB_SIZE, (n,), generator=g).tolist()

    prompt = ids(40)
    rows = [(f"g{k}", 0, prompt, ids(6 + k)) for k in range(4)]  # a GRPO group of 4
    rows.append(("g0", 1, prompt + rows[0][3] + ids(5), ids(7)))  # turn 2 holds turn 1
    rows.append(("g5", 0, prompt, rows[1][3]))  # a repeated reply
    rows.append(("u", 0, ids(9), ids(5)))  # unrelated
    samples = [
        Sample(
            task_id="t",
            episode_id=e,
            agent="solver",
            policy="p",
            turn=turn,
            branch=i,
            prompt_ids=p,
            response_ids=r,
            rollout_logprobs=(-torch.rand(len(r), generator=g) * 3).tolist(),
        )
        for i, (e, turn, p, r) in enumerate(rows)
    ]
    batch = collate(samples, pad_id=0)
    return batch.replace(advantages=torch.linspace(-1.0, 1.0, batch.num_samples))


def _body(rank, model_dir):
    from megamarl.models.bridge import unwrap
    from megamarl.rl.losses import loss_counts

    batch = _shared_batch()
    counts = loss_counts(batch.response_mask)
    wg = one_rank_wg()
    out = {"device": str(wg.device)}
    for dtype in (torch.float32, torch.bfloat16):
        for recompute in ("none", "selective") if dtype == torch.float32 else ("none",):
            for tree in (False, True):
                worker = make_worker(
                    model_dir,
                    wg,
                    dtype=dtype,
                    micro_batch_size=8,
                    pack=True,
                    prefix_tree=tree,
                    recompute=recompute,
                    grad_clip=0.0,
                )
                gpt = unwrap(worker.model)
                key = f"{dtype}_{recompute}_{tree}"
                out[f"{key}_built"] = (
                    gpt.layer_spec,
                    gpt.tree_attention,
                    type(gpt.decoder.layers[0].self_attention.core_attention).__name__,
                )
                part = worker.my_part(batch)
                logprobs = worker.compute_logprobs(part)
                out[f"{key}_logprobs"] = logprobs.float().cpu()
                if dtype == torch.float32:
                    worker.backward(part, logprobs, counts)
                    out[f"{key}_grads"] = {
                        n: g.float().cpu() for n, g in megatron_steps.export_hf_grads(worker.model, wg)
                    }
                del worker
                torch.cuda.empty_cache()
    out["mask"] = batch.response_mask
    return out


def test_flex_tree_update_equals_the_packed_update_on_the_gpu(tiny_llama, record_property):
    (r,) = run_ranks(_body, 1, tiny_llama, timeout_s=600)
    fp32, bf16 = str(torch.float32), str(torch.bfloat16)
    assert r["device"].startswith("cuda"), r["device"]
    spec, tree_attention, core = r[f"{fp32}_none_True_built"]
    assert (tree_attention, core) == ("flex", "FlexTreeAttention"), r[f"{fp32}_none_True_built"]
    assert r[f"{fp32}_none_False_built"][1] is None
    record_property("layer_spec", spec)
    figures = {}
    reference = r[f"{fp32}_none_False_logprobs"]
    for recompute in ("none", "selective"):
        tree, packed = (r[f"{fp32}_{recompute}_{t}_logprobs"] for t in (True, False))
        figures[f"fp32_{recompute}_logprobs"] = (tree - packed).abs().max().item()
        grads = {t: r[f"{fp32}_{recompute}_{t}_grads"] for t in (True, False)}
        scale = max(g.abs().max().item() for g in grads[False].values())
        figures[f"fp32_{recompute}_grads_rel"] = max_abs_diff(grads[True], grads[False]) / scale
    figures["bf16_tree_vs_fp32"] = (r[f"{bf16}_none_True_logprobs"] - reference).abs().max().item()
    figures["bf16_packed_vs_fp32"] = (r[f"{bf16}_none_False_logprobs"] - reference).abs().max().item()
    for name, value in figures.items():
        record_property(name, float(f"{value:.3g}"))
    print(f"\nflex tree vs packed on the GPU ({spec} spec):", {k: f"{v:.2e}" for k, v in figures.items()})
    assert reference[r["mask"]].lt(0).any()  # response positions are filled
    for recompute in ("none", "selective"):
        assert figures[f"fp32_{recompute}_logprobs"] <= FP32_ATOL, figures
        assert figures[f"fp32_{recompute}_grads_rel"] <= FP32_GRAD_RTOL, figures
    assert figures["bf16_tree_vs_fp32"] <= BF16_FACTOR * figures["bf16_packed_vs_fp32"] + BF16_ATOL, figures
