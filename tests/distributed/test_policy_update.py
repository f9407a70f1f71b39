"""The policy loss on a Megatron WG at TP=2 and at PP=2 (CPU ranks) gives the same gradients as a
single-process HF reference on the same batch (< 1e-5), and an optimizer step changes the weights."""

import pytest
import torch

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed


def _batch():
    from megamarl.rl.batch import collate
    from megamarl.rl.sample import Sample

    g = torch.Generator().manual_seed(0)
    samples = []
    for i, (p_len, r_len) in enumerate([(5, 4), (3, 6), (7, 2), (4, 5), (6, 3)]):
        samples.append(Sample(
            task_id=f"t{i % 2}", episode_id=f"e{i}", agent="solver" if i % 2 else "verifier", policy="p", turn=0,
            prompt_ids=torch.randint(0, 49152, (p_len,), generator=g).tolist(),
            response_ids=torch.randint(0, 49152, (r_len,), generator=g).tolist(),
            rollout_logprobs=(-torch.rand(r_len, generator=g) * 3).tolist(),
        ))
    batch = collate(samples, pad_id=0)
    return batch.replace(advantages=torch.tensor([1.0, -0.5, 0.25, -1.5, 0.75]))


def _loss_cfg():
    from megamarl.rl.losses import LossConfig

    return LossConfig(clip_low=0.2, clip_high=0.28, entropy_coef=0.01, tis_mode="token", tis_cap=2.0)


def _reference_grads(model_dir):
    from transformers import AutoModelForCausalLM

    from megamarl.rl.losses import policy_loss
    from megamarl.rl.vocab_parallel import vocab_parallel_logprobs

    batch = _batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = model(batch.tokens, attention_mask=batch.attention_mask.long()).logits
    logprobs, entropy = vocab_parallel_logprobs(logits, batch.tokens)
    loss, _ = policy_loss(
        logprobs, batch.advantages, batch.response_mask, _loss_cfg(), old_logprobs=logprobs.detach(),
        rollout_logprobs=batch.rollout_logprobs, entropy=entropy,
        num_tokens=int(batch.response_mask.sum()), num_seqs=batch.num_samples,
    )
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _ranks_body(rank, model_dir):
    from megamarl.config import PolicyConfig
    from megamarl.models.bridge import export_hf_grads
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.policy_io import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    placement = PlacementConfig({
        "tp2": WorkerGroupLayout(ranks=[0, 1], tp=2),
        "pp2": WorkerGroupLayout(ranks=[0, 1], pp=2),
        "dp2": WorkerGroupLayout(ranks=[0, 1]),
    })
    wgs = build_worker_groups(placement)
    reference = _reference_grads(model_dir)
    batch = _batch()
    counts = dict(num_tokens=int(batch.response_mask.sum()), num_seqs=batch.num_samples)
    diffs = {}
    for name, wg in wgs.items():
        policy = PolicyConfig(model=str(model_dir), micro_batch_size=2, lr=1e-3, grad_clip=0.0)
        worker = PolicyWorker(name, policy, wg, load_policy_model(policy, wg, seed=0), _loss_cfg())
        part = worker.my_part(batch)
        worker.backward(part, worker.compute_logprobs(part), counts)
        grads = dict(export_hf_grads(worker.model, wg))
        diffs[name] = max((grads[n] - reference[n]).abs().max().item() for n in grads)
        diffs[name + "_num"] = len(grads)
        before = {n: t.clone() for n, t in worker.export()}
        worker._clip_and_step()
        after = dict(worker.export())
        diffs[name + "_changed"] = all(not torch.equal(before[n], after[n]) for n in before)
    return diffs


def test_megatron_policy_gradients_equal_single_process_reference(tmp_path):
    from megamarl.models.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    results = run_ranks(_ranks_body, 2, str(model_dir))
    for rank, diffs in enumerate(results):
        for layout in ("tp2", "pp2", "dp2"):
            assert diffs[layout] < 1e-5, (rank, layout, diffs)
            assert diffs[layout + "_changed"], (rank, layout)
    # PP=2: each stage exports its own layers; together they cover every HF tensor.
    assert results[0]["pp2_num"] + results[1]["pp2_num"] >= results[0]["tp2_num"]
