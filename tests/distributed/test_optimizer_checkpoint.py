"""megatron-core's optimizer in bf16 (fp32 main parameters) saved by a WG that global rank 0 is not in,
then loaded: the optimizer state comes back exactly (step, hyper-parameters, main parameters, Adam
moments), and in the checkpoint each parameter's state is stored under its own name.

Three gloo ranks: rank 0 holds no shard (the driver of a disaggregated run), the WG is ranks 1-2 at
DP=2. The model is a tiny Qwen2: in bf16 its no-weight-decay parameter group mixes bf16 biases and
the fp32 norm weights of megatron-core's local layers (megamarl.rl.optimizer's module doc). bf16 is
forced, so this runs the GPU path on any CPU (``dtype: auto`` picks fp32 on CPUs without native bf16).
"""

from __future__ import annotations

import pytest
import torch

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(autouse=True)
def _quiet_ranks(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")


def _batch():
    from megamarl.rl.batch import collate
    from megamarl.rl.sample import Sample

    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            task_id=f"t{i % 2}",
            episode_id=f"e{i}",
            agent="a",
            policy="p",
            turn=0,
            prompt_ids=torch.randint(0, 49152, (p_len,), generator=g).tolist(),
            response_ids=torch.randint(0, 49152, (r_len,), generator=g).tolist(),
            rollout_logprobs=(-torch.rand(r_len, generator=g) * 3).tolist(),
        )
        for i, (p_len, r_len) in enumerate([(5, 4), (3, 6), (7, 2), (4, 5)])
    ]
    return collate(samples, pad_id=0).replace(advantages=torch.tensor([1.0, -0.5, 0.25, -1.5]))


def _optimizer_state(worker) -> dict:
    """The inner torch optimizers' state by position (parameter group, place in it), and hyper-parameters."""
    out = {}
    for c, inner in enumerate(worker.optimizer.chained_optimizers):
        for g, group in enumerate(inner.optimizer.param_groups):
            # megatron-core's load also puts the step into each group (unused by torch's Adam); the
            # step is compared per parameter below
            out[f"{c}/{g}/hyper"] = {k: v for k, v in group.items() if k not in ("params", "step")}
            for i, param in enumerate(group["params"]):
                out[f"{c}/{g}/{i}/param"] = param.detach().clone()
                for key, value in inner.optimizer.state[param].items():
                    out[f"{c}/{g}/{i}/{key}"] = value.detach().clone()
    return out


def _save_then_load(rank, model_dir, ckpt_dir):
    from megamarl.config import PolicyConfig
    from megamarl.models import dist_checkpoint
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.losses import LossConfig
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[1, 2])}))["p"]
    policy = PolicyConfig(model=str(model_dir), micro_batch_size=1, lr=1e-2, grad_clip=1.0)
    result = {}
    worker = None
    if wg.is_member:
        worker = PolicyWorker(
            "p", policy, wg, load_policy_model(policy, wg, seed=0, dtype=torch.bfloat16), LossConfig()
        )
        assert worker.compute_dtype == torch.bfloat16
        worker.train_step(_batch())
        worker.scheduler.step(increment=1)  # hyper-parameters the checkpoint must carry
        result["saved"] = _optimizer_state(worker)
    dist_checkpoint.save_checkpoint(
        ckpt_dir, worker.model if worker else None, wg, optimizer=worker.optimizer if worker else None
    )
    fresh = None
    if wg.is_member:
        fresh = PolicyWorker(
            "p", policy, wg, load_policy_model(policy, wg, seed=1, dtype=torch.bfloat16), LossConfig()
        )
    dist_checkpoint.load_checkpoint(
        ckpt_dir, fresh.model if fresh else None, wg, optimizer=fresh.optimizer if fresh else None
    )
    if fresh is not None:
        result["loaded"] = _optimizer_state(fresh)
    return result


def test_bf16_optimizer_round_trip_when_rank0_is_outside_the_wg(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "qwen2", seed=0)
    results = run_ranks(_save_then_load, 3, str(model_dir), str(tmp_path / "ckpt"))
    assert results[0] == {}
    for rank in (1, 2):
        saved, loaded = results[rank]["saved"], results[rank]["loaded"]
        assert saved.keys() == loaded.keys()
        for key, value in saved.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, loaded[key]), (rank, key)
            else:
                assert value == loaded[key], (rank, key)
    # in the checkpoint, each parameter's fp32 main copy is stored under its own name: rounded to
    # bf16 it is the saved model weight (state filed under another parameter of its size would not be)
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "flat.pt")
    flat = torch.load(tmp_path / "flat.pt", weights_only=False)
    prefix = "optimizer.state.param."
    mains = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
    assert mains and all(k in flat for k in mains), sorted(flat)[:20]
    for name, main in mains.items():
        assert torch.equal(main.to(torch.bfloat16), flat[name].to(torch.bfloat16)), name
    # the save gathers nothing: each DP rank writes its own share of the optimizer state (the first
    # wrote all of it when megatron-core's fully_reshardable gathered every parameter's state there)
    written = {rank: _optimizer_bytes_written_by(tmp_path / "ckpt", rank) for rank in (1, 2)}
    total = sum(written.values())
    assert total >= 3 * 4 * sum(v.numel() for v in mains.values())  # fp32 main copy + two moments
    assert all(0.4 * total <= n <= 0.6 * total for n in written.values()), written


def _optimizer_bytes_written_by(ckpt, rank: int) -> int:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(ckpt)).read_metadata()
    return sum(
        info.length
        for index, info in metadata.storage_data.items()
        if index.fqn.startswith("optimizer.state.") and info.relative_path.startswith(f"__{rank}_")
    )
