"""Numerical faults: a non-finite loss on one rank's samples skips the update on every rank of the
WG (DP=2, TP=2, PP=2 on 2 CPU ranks): weights and optimizer state stay bit-identical, the skip is
counted and names the offending agent/episode, and a clean batch afterwards trains normally."""

import math

import pytest
import torch

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed


def _batch(nan_row: int | None):
    from megamarl.rl.batch import collate
    from megamarl.rl.sample import Sample

    g = torch.Generator().manual_seed(0)
    samples = []
    for i, (p_len, r_len) in enumerate([(5, 4), (3, 6), (7, 2), (4, 5)]):
        samples.append(
            Sample(
                task_id=f"t{i % 2}",
                episode_id=f"e{i}",
                agent="solver" if i % 2 else "verifier",
                policy="p",
                turn=0,
                prompt_ids=torch.randint(0, 49152, (p_len,), generator=g).tolist(),
                response_ids=torch.randint(0, 49152, (r_len,), generator=g).tolist(),
                rollout_logprobs=(-torch.rand(r_len, generator=g) * 3).tolist(),
            )
        )
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.5])
    if nan_row is not None:
        advantages[nan_row] = float("nan")
    return collate(samples, pad_id=0).replace(advantages=advantages)


def _body(rank, model_dir):
    from megamarl.config import PolicyConfig
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.losses import LossConfig
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    placement = PlacementConfig(
        {
            "dp2": WorkerGroupLayout(ranks=[0, 1]),
            "tp2": WorkerGroupLayout(ranks=[0, 1], tp=2),
            "pp2": WorkerGroupLayout(ranks=[0, 1], pp=2),
        }
    )
    out = {}
    for name, wg in build_worker_groups(placement).items():
        policy = PolicyConfig(model=str(model_dir), micro_batch_size=1, lr=1e-3, grad_clip=1.0)
        worker = PolicyWorker(name, policy, wg, load_policy_model(policy, wg, seed=0), LossConfig())
        before = {n: t.clone() for n, t in worker.export()}
        # the last row lands on DP rank 1 only (DP=2); under PP only the last stage sees the loss
        skipped = [worker.train_step(_batch(nan_row=3)) for _ in range(2)]
        same = all(torch.equal(before[n], t) for n, t in worker.export())
        state_empty = len(worker.optimizer.state) == 0
        streak, fault = worker.skip_streak, worker.last_fault
        clean = worker.train_step(_batch(nan_row=None))
        changed = any(not torch.equal(before[n], t) for n, t in worker.export())
        finite = all(torch.isfinite(t).all() for _, t in worker.export())
        out[name] = {
            "skipped": [m["nonfinite_skipped"] for m in skipped],
            "same": same,
            "state_empty": state_empty,
            "streak": streak,
            "fault": fault,
            "clean": clean["nonfinite_skipped"],
            "grad_norm": clean["grad_norm"],
            "changed": changed,
            "finite": finite,
            "after": (worker.skip_streak, worker.num_skipped, worker.num_updates),
        }
    return out


def test_nonfinite_loss_skips_the_update_on_every_rank(tmp_path):
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    results = run_ranks(_body, 2, str(model_dir))
    for rank, result in enumerate(results):
        for layout, r in result.items():
            where = (rank, layout, r)
            assert r["skipped"] == [1.0, 1.0] and r["same"] and r["state_empty"] and r["streak"] == 2, where
            assert r["clean"] == 0.0 and math.isfinite(r["grad_norm"]) and r["changed"] and r["finite"], where
            assert r["after"] == (0, 2, 1), where
            # the rank that computed the NaN loss names it; the others know only that the WG skipped
            if r["fault"].endswith("(samples not attributable)"):
                continue
            assert "non-finite loss in micro-batches of agents ['solver'] episodes ['e3']" in r["fault"], (
                where
            )
    for layout in results[0]:  # some rank of every WG saw the NaN loss and names its samples
        assert any("episodes ['e3']" in res[layout]["fault"] for res in results), layout
