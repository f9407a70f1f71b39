"""Log-probabilities of the trainer's worker on the GPU equal transformers' on the same GPU.

A tiny random Llama (saved locally, no tokenizer, no hub) is loaded twice on the GPU: as the HF
``LlamaForCausalLM`` and as the worker's megatron-core model (``load_policy_model``: the HF ->
Megatron weight mapping). The reference log-probs are a plain ``log_softmax`` of HF's logits, gathered
at the next token; the worker's come from ``PolicyWorker.compute_logprobs`` (windowed output layer,
vocab-parallel log-softmax), padded rows and packed rows (block-diagonal mask).

fp32: equal within ``FP32_ATOL``. bf16 parameters: at most ``BF16_FACTOR`` times as far from the fp32
reference as HF's own bf16 model is (plus ``BF16_ATOL``): the bf16 yardstick is measured, not guessed.
"""

import pytest
import torch
from gpu_common import make_batch, make_worker, one_rank_wg

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.gpu]

FP32_ATOL = 1e-3
BF16_FACTOR = 3.0
BF16_ATOL = 0.02


def _hf_logprobs(model, batch) -> torch.Tensor:
    """[B, T]: log p(token t | tokens < t) at response positions, 0 elsewhere (the worker's layout)."""
    tokens = batch.tokens.to(model.device)
    with torch.no_grad():
        logits = model(tokens, attention_mask=batch.attention_mask.long().to(model.device)).logits.float()
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    out[:, 1:] = picked
    return (out * batch.response_mask.to(out.device)).cpu()


def _body(rank, model_dir):
    from transformers import AutoModelForCausalLM

    batch = make_batch(1, lengths=((9, 7), (3, 12), (14, 2), (6, 6)))
    wg = one_rank_wg()
    out = {"device": str(wg.device)}
    for dtype in (torch.float32, torch.bfloat16):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(wg.device).eval()
        out[f"hf_{dtype}"] = _hf_logprobs(hf, batch)
        out[f"hf_device_{dtype}"] = str(hf.device)
        del hf
        out[f"worker_{dtype}"] = make_worker(model_dir, wg, dtype=dtype).compute_logprobs(batch).float().cpu()
    packed = make_worker(model_dir, wg, pack=True, max_tokens_per_micro_batch=64, micro_batch_size=4)
    out["worker_packed"] = packed.compute_logprobs(batch).float().cpu()
    out["mask"] = batch.response_mask
    return out


def test_worker_logprobs_equal_transformers_on_the_gpu(tiny_llama, record_property):
    (r,) = run_ranks(_body, 1, tiny_llama)
    fp32, bf16 = str(torch.float32), str(torch.bfloat16)
    assert r["device"].startswith("cuda") and r[f"hf_device_{fp32}"].startswith("cuda"), r["device"]
    reference = r[f"hf_{fp32}"]
    assert (
        reference[r["mask"]].le(0).all() and reference[r["mask"]].lt(0).any()
    )  # response positions are filled
    figures = {
        "fp32_padded": (r[f"worker_{fp32}"] - reference).abs().max().item(),
        "fp32_packed": (r["worker_packed"] - reference).abs().max().item(),
        "bf16_worker_vs_fp32": (r[f"worker_{bf16}"] - reference).abs().max().item(),
        "bf16_hf_vs_fp32": (r[f"hf_{bf16}"] - reference).abs().max().item(),
    }
    for key, value in figures.items():
        record_property(key, round(value, 6))
    print("\nmax |log-prob difference| vs HF fp32 on the GPU:", {k: f"{v:.2e}" for k, v in figures.items()})
    assert figures["fp32_padded"] <= FP32_ATOL and figures["fp32_packed"] <= FP32_ATOL, figures
    assert figures["bf16_worker_vs_fp32"] <= BF16_FACTOR * figures["bf16_hf_vs_fp32"] + BF16_ATOL, figures
