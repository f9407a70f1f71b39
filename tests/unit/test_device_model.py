"""Device model (issue 15): a WG's schedule keeps every tensor on ``WorkerGroup.device``.

``SampleBatch.to`` moves every tensor field (checked with ``meta``, a device other than the default);
one real PolicyWorker update (ppo_epochs=2, KL to a reference model, a restricted vocabulary row)
runs under ``DeviceRecorder`` + ``FactoryAudit`` (tests/device_checker.py): every op's tensors are on
the WG's device and no megamarl code creates a tensor without naming its device."""

import dataclasses

import torch

from megamarl.parallel.launch import run_ranks
from megamarl.rl.batch import collate
from megamarl.rl.sample import Sample


def _batch():
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            task_id=f"t{i % 2}",
            episode_id=f"e{i}",
            agent="a",
            policy="p",
            turn=0,
            prompt_ids=torch.randint(0, 500, (p,), generator=g).tolist(),
            response_ids=torch.randint(0, 500, (r,), generator=g).tolist(),
            rollout_logprobs=(-torch.rand(r, generator=g)).tolist(),
            allowed_token_ids=tuple(range(500)) if i == 1 else None,
            temperature=0.7,
        )
        for i, (p, r) in enumerate([(5, 4), (3, 6), (7, 2)])
    ]
    return collate(samples, pad_id=0).replace(advantages=torch.tensor([1.0, -0.5, 0.25]))


def test_batch_to_moves_every_tensor_field():
    batch = _batch()
    meta = batch.to("meta")
    tensors = [f.name for f in dataclasses.fields(meta) if isinstance(getattr(meta, f.name), torch.Tensor)]
    assert len(tensors) == 18 and all(getattr(meta, n).device.type == "meta" for n in tensors)
    assert batch.to("cpu") is batch  # already there: no copy (CPU runs stay bit-identical)


def _body(rank, model_dir):
    from megamarl.config import PolicyConfig
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.losses import LossConfig
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker
    from tests.device_checker import DeviceRecorder, FactoryAudit

    wg = build_worker_groups(PlacementConfig({"p": WorkerGroupLayout(ranks=[0])}))["p"]
    policy = PolicyConfig(model=str(model_dir), micro_batch_size=2, lr=1e-3, ppo_epochs=2, kl_coef=0.1)
    worker = PolicyWorker(
        "p",
        policy,
        wg,
        load_policy_model(policy, wg, seed=0),
        LossConfig(kl_coef=0.1),
        ref_handle=load_policy_model(policy, wg, seed=0),
    )
    batch, recorder, audit = _batch(), DeviceRecorder(), FactoryAudit()  # the driver collates on the CPU
    with audit, recorder:
        metrics = worker.train_step(batch)
    return {
        "device": str(wg.device),
        "devices": sorted(recorder.devices()),
        "off": recorder.off(wg.device),
        "ops": sum(recorder.seen.values()),
        "factories": sorted(audit.calls),
        "total": audit.total,
        "grad_norm": metrics["grad_norm"],
    }


def test_policy_update_keeps_every_tensor_on_the_wg_device(tmp_path):
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    (r,) = run_ranks(_body, 1, str(model_dir))
    assert r["device"] == "cpu" and r["devices"] == ["cpu"] and r["off"] == [], r
    assert r["ops"] > 1000 and r["total"] > 0, r  # the recorders saw the whole update
    assert r["factories"] == [], r["factories"]  # tensors created without device= in megamarl code
    assert r["grad_norm"] > 0
