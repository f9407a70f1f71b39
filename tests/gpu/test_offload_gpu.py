"""``offload_train_state`` on a GPU (needs CUDA; skipped elsewhere): a worker group's weights,
gradient buffers and optimizer state leave the GPU between updates and come back unchanged.

Two identical workers take two updates each on the same batches; one offloads and restores its
training state between them. Their weights must stay bit-identical, and the offload must free at
least 3/4 of what the worker held on the GPU."""

import pytest
import torch

from megamarl.parallel.launch import run_ranks

pytestmark = [pytest.mark.gpu]


def _batch(seed):
    from megamarl.rl.batch import collate
    from megamarl.rl.sample import Sample

    g = torch.Generator().manual_seed(seed)
    samples = [Sample(task_id=f"t{i % 2}", episode_id=f"e{i}", agent="a", policy="p", turn=0,
                      prompt_ids=torch.randint(0, 500, (6,), generator=g).tolist(),
                      response_ids=torch.randint(0, 500, (5,), generator=g).tolist(),
                      rollout_logprobs=(-torch.rand(5, generator=g)).tolist(), temperature=1.0)
               for i in range(4)]
    return collate(samples, pad_id=0).replace(advantages=torch.tensor([1.0, -0.5, 0.25, -0.75]))


def _body(rank, model_dir):
    from megamarl.config import PolicyConfig
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.losses import LossConfig
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    policy = PolicyConfig(model=str(model_dir), micro_batch_size=2, lr=1e-3)
    workers = [PolicyWorker("p", policy, wg, load_policy_model(policy, wg, seed=0), LossConfig()) for _ in range(2)]
    plain, offloading = workers
    plain.train_step(_batch(0))
    offloading.train_step(_batch(0))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    stats = offloading.train_state.offload()
    freed = before - torch.cuda.memory_allocated()
    on_host = all(p.device.type == "cpu" for p in offloading.model.parameters())
    offloading.train_state.restore()
    plain.train_step(_batch(1))
    offloading.train_step(_batch(1))
    same = all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), offloading.model.parameters()))
    held = sum(p.numel() * p.element_size() for p in offloading.model.parameters())
    return dict(device=str(wg.device), moved=stats.num_bytes, freed=freed, held=held, on_host=on_host, same=same)


def test_offload_frees_the_gpu_and_restores_the_exact_state(tmp_path):
    from megamarl.models.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    (r,) = run_ranks(_body, 1, str(model_dir))
    assert r["device"].startswith("cuda"), r
    assert r["on_host"] and r["same"], r
    # weights + fp32 grad buffer + two Adam moments: at least weights + moments leave the GPU
    assert r["moved"] >= 3 * r["held"] * 0.99 and r["freed"] >= 0.75 * r["moved"], r
