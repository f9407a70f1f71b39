"""L2 adapter by adapter on a Megatron WG (2 CPU ranks, tiny Llama, LoRA on both agents), through
``PolicyWorker.train_step``, on megatron-core's optimizers: fp32 at TP=2 (``FP32Optimizer``), bf16
at PP=2 and at DP=2 with the distributed optimizer (fp32 main-parameter shards).

* An adapter below ``lora.min_samples`` (the verifier: 2 rows of 5, minimum 3) gets no update: its
  weights are bit-identical and its optimizer state empty, while the solver's adapter steps; and the
  solver's weights are bit-identical to a plain L2 update on the solver's rows only, where the
  verifier has no gradient (the rule is the same there: clipping over the stepping adapters'
  gradients); so is the clipped gradient norm at TP=2 (fp32), within 1e-6 with the distributed
  optimizer (its norm's sum includes the verifier's zeros in another order). A checkpoint taken then
  (megatron-core saves one step count for all parameters; each adapter's own goes beside it) resumes
  into a worker whose next update (the verifier's first step) equals the original's, bit for bit
  (distributed optimizer).
* With every adapter above the minimum (``min_samples: 1``) two updates are bit-identical to the plain
  L2 rule (``min_samples: 0``): weights, losses and gradient norms.
"""

from __future__ import annotations

import pytest

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed

AGENTS = ("solver", "verifier")
CLIP = 1e-4  # below the gradient norms here (2e-4 and 1e-2 at TP=2), so every step is clipped


def _batch():
    import torch

    from megamarl.rl.batch import collate
    from megamarl.rl.sample import Sample

    g = torch.Generator().manual_seed(0)
    rows = [("solver", 5, 4), ("verifier", 3, 6), ("solver", 7, 2), ("verifier", 4, 5), ("solver", 6, 3)]
    samples = [
        Sample(
            task_id=f"t{i % 2}",
            episode_id=f"e{i}",
            agent=agent,
            policy="p",
            turn=0,
            prompt_ids=torch.randint(0, 49152, (p_len,), generator=g).tolist(),
            response_ids=torch.randint(0, 49152, (r_len,), generator=g).tolist(),
            rollout_logprobs=(-torch.rand(r_len, generator=g) * 3).tolist(),
        )
        for i, (agent, p_len, r_len) in enumerate(rows)
    ]
    return collate(samples, pad_id=0).replace(advantages=torch.tensor([1.0, -0.5, 0.25, -1.5, 0.75]))


def _worker(model_dir, wg, *, min_samples: int, dtype, distributed: bool):
    from megamarl.config import PolicyConfig
    from megamarl.config_sections import LoraConfig
    from megamarl.rl.losses import LossConfig
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker
    from megamarl.rl.worker_parts import AgentTraining

    lora = LoraConfig(rank=4, alpha=8.0, min_samples=min_samples)
    policy = PolicyConfig(
        model=str(model_dir),
        micro_batch_size=2,
        lr=5e-2,
        grad_clip=CLIP,
        weight_decay=0.1,  # a plain step would decay an adapter even without gradient: this one may not
        distributed_optimizer=distributed,
        lora=lora,
    )
    loss = LossConfig(clip_low=0.2, clip_high=0.28)
    agents = {a: AgentTraining(loss=loss, micro_batch_size=2, adapter=a) for a in AGENTS}
    handle = load_policy_model(policy, wg, seed=0, dtype=dtype)
    return PolicyWorker("p", policy, wg, handle, loss, agents=agents, lora=lora)


def _adapter_weights(worker, adapter):
    return {
        n: p.detach().clone() for n, p in worker.model.named_parameters() if f".lora_adapters.{adapter}." in n
    }


def _equal(a, b):
    import torch

    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _optimizer_state(worker, adapter) -> int:
    """Entries of the optimizer state (moments, step) this rank holds for ``adapter``'s parameters."""
    optimizer = worker.adapter_steps.optimizer
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    params = worker.adapter_steps.main_params[adapter]
    return sum(len(inner.optimizer.state.get(p, {})) for k, inner in enumerate(inners) for p in params[k])


def _case(model_dir, wg, *, dtype, distributed, ckpt):
    batch = _batch()
    solver_rows = batch.select([i for i, a in enumerate(batch.names("agent")) if a == "solver"])
    out = {}
    # (1) the verifier (2 rows) below the minimum (3) vs a plain update on the solver's rows alone
    rule = _worker(model_dir, wg, min_samples=3, dtype=dtype, distributed=distributed)
    plain = _worker(model_dir, wg, min_samples=0, dtype=dtype, distributed=distributed)
    before = {a: _adapter_weights(rule, a) for a in AGENTS}
    rule_metrics = [rule.train_step(batch) for _ in range(2)]
    plain_metrics = [plain.train_step(solver_rows) for _ in range(2)]
    out["verifier_untouched"] = _equal(_adapter_weights(rule, "verifier"), before["verifier"])
    out["verifier_state"] = _optimizer_state(rule, "verifier")
    out["solver_state"] = _optimizer_state(rule, "solver")
    out["solver_changed"] = not _equal(_adapter_weights(rule, "solver"), before["solver"])
    out["solver_equal_plain"] = _equal(_adapter_weights(rule, "solver"), _adapter_weights(plain, "solver"))
    out["plain_decayed_verifier"] = not _equal(_adapter_weights(plain, "verifier"), before["verifier"])
    out["rule_metrics"] = rule_metrics
    out["plain_norms"] = [m["grad_norm"] for m in plain_metrics]
    # (2) every adapter above the minimum: the plain rule's updates, bit for bit
    ones = _worker(model_dir, wg, min_samples=1, dtype=dtype, distributed=distributed)
    zeros = _worker(model_dir, wg, min_samples=0, dtype=dtype, distributed=distributed)
    ones_metrics = [ones.train_step(batch) for _ in range(2)]
    zeros_metrics = [zeros.train_step(batch) for _ in range(2)]
    out["all_equal"] = all(_equal(_adapter_weights(ones, a), _adapter_weights(zeros, a)) for a in AGENTS)
    out["all_changed"] = all(not _equal(_adapter_weights(ones, a), before[a]) for a in AGENTS)
    keys = ("loss", "grad_norm", "pg_loss")
    out["all_metrics"] = [[m.get(k) for k in keys] for m in ones_metrics]
    out["plain_all_metrics"] = [[m.get(k) for k in keys] for m in zeros_metrics]
    out["ones_steps"] = [m["adapter/verifier/steps"] for m in ones_metrics]
    # megatron-core's FP32Optimizer (no distributed optimizer) does not load a dist checkpoint here
    # (LocalNonpersistentObject param groups), adapters or not
    if distributed:
        _resume(model_dir, wg, rule, batch, out, dtype=dtype, distributed=distributed, ckpt=ckpt)
    return out


def _resume(model_dir, wg, rule, batch, out, *, dtype, distributed, ckpt):
    # a checkpoint holding the verifier's never-stepped adapter saves and resumes: the next update of
    # the resumed worker equals the original's
    from megamarl.models import dist_checkpoint

    with rule.adapter_steps.checkpoint_steps() as steps:  # as runtime.checkpoint.save_policies
        dist_checkpoint.save_checkpoint(ckpt, rule.model, wg, optimizer=rule.optimizer)
    out["saved_steps"] = steps
    out["verifier_state_after_save"] = _optimizer_state(rule, "verifier")
    resumed = _worker(model_dir, wg, min_samples=3, dtype=dtype, distributed=distributed)
    dist_checkpoint.load_checkpoint(ckpt, resumed.model, wg, optimizer=resumed.optimizer)
    resumed.adapter_steps.load_steps(steps)
    # the next update steps both adapters (minimum 0): the verifier's first step, fresh on both sides
    # (its Adam step count 1, not the solver's 3)
    from dataclasses import replace

    from megamarl.rl.dispatch import plan_policy

    before = _adapter_weights(rule, "verifier")
    for worker in (rule, resumed):
        split = replace(worker.split, min_samples=0)
        worker.train_share(plan_policy(batch, split, num_dp=wg.layout.dp)[wg.dp_rank])
    out["verifier_stepped"] = not _equal(_adapter_weights(rule, "verifier"), before)
    out["resumed_equal"] = all(
        _equal(_adapter_weights(rule, a), _adapter_weights(resumed, a)) for a in AGENTS
    )


def _ranks_body(rank, model_dir, out_dir):
    import torch

    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups

    wgs = build_worker_groups(
        PlacementConfig(
            {
                "tp2": WorkerGroupLayout(ranks=[0, 1], tp=2),
                "pp2": WorkerGroupLayout(ranks=[0, 1], pp=2),
                "dp2": WorkerGroupLayout(ranks=[0, 1]),
            }
        )
    )
    kinds = {"tp2": (torch.float32, False), "pp2": (torch.bfloat16, True), "dp2": (torch.bfloat16, True)}
    return {
        name: _case(model_dir, wg, dtype=kinds[name][0], distributed=kinds[name][1], ckpt=f"{out_dir}/{name}")
        for name, wg in wgs.items()
    }


def test_an_adapter_below_the_minimum_gets_no_update_and_the_rule_equals_plain_l2(tmp_path):
    from megamarl.models.packaged import resolve_model_path

    results = run_ranks(
        _ranks_body, 2, str(resolve_model_path("tiny-random-llama")), str(tmp_path), timeout_s=400
    )
    for rank, by_layout in enumerate(results):
        for layout, out in by_layout.items():
            where = f"rank {rank} {layout}"
            assert out["verifier_untouched"] and out["verifier_state"] == 0, where
            assert out["solver_changed"], where
            assert out["solver_equal_plain"], where
            assert out["plain_decayed_verifier"], where  # what the rule prevents: weight decay without data
            for m in out["rule_metrics"]:
                assert m["adapter/solver/steps"] == 1 and m["adapter/verifier/steps"] == 0, (where, m)
                assert m["adapter/verifier/samples_dropped"] == 2 and m["adapter/solver/samples_dropped"] == 0
            norms = [m["grad_norm"] for m in out["rule_metrics"]]
            assert min(norms) > CLIP, (where, norms)  # every step clipped
            if layout == "tp2":  # one fp32 sum of squares: the verifier's zero gradients add exact zeros
                assert norms == out["plain_norms"], (where, norms)
            else:  # the distributed optimizer's norm sums a buffer holding them: rounding of the norm only
                assert norms == pytest.approx(out["plain_norms"], rel=1e-6), (where, norms)
            assert out["all_equal"] and out["all_changed"], where
            assert out["all_metrics"] == out["plain_all_metrics"], where
            assert out["ones_steps"] == [1, 1], where
            if layout != "tp2":  # the distributed optimizer's checkpoint (see _case)
                assert out["saved_steps"] == {"solver": 2, "verifier": 0}, where
                assert out["verifier_state_after_save"] == 0 and out["resumed_equal"], where
                assert out["verifier_stepped"], where
        # the distributed optimizer shards the state over DP: some rank holds the solver's
    assert all(any(r[layout]["solver_state"] > 0 for r in results) for layout in results[0])
