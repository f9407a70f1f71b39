"""The policy loss on a Megatron WG at TP=2 and at PP=2 (CPU ranks) gives the same gradients as a
single-process HF reference on the same batch (< 1e-5), and an optimizer step changes the weights.
The three grids (TP=2, PP=2, DP=2) live in one process under a global megatron-core grid that is
wrong for two of them, and no megatron-core code looks up a global group (issue #46 item 6)."""

import math

import megatron_steps  # tests/ helper: gradients by HF name
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
    batch = collate(samples, pad_id=0)
    return batch.replace(advantages=torch.tensor([1.0, -0.5, 0.25, -1.5, 0.75]))


def _loss_cfg():
    from megamarl.rl.losses import LossConfig

    return LossConfig(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)


def _reference_grads(model_dir, batch=None):
    from transformers import AutoModelForCausalLM

    from megamarl.rl.losses import policy_loss
    from megamarl.rl.vocab_parallel import vocab_parallel_logprobs

    batch = _batch() if batch is None else batch
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = model(batch.tokens, attention_mask=batch.attention_mask.long()).logits
    logprobs, entropy = vocab_parallel_logprobs(logits, batch.tokens)
    loss, _ = policy_loss(
        logprobs,
        batch.advantages,
        batch.response_mask,
        _loss_cfg(),
        old_logprobs=logprobs.detach(),
        rollout_logprobs=batch.rollout_logprobs,
        entropy=entropy,
        num_tokens=int(batch.response_mask.sum()),
        num_seqs=batch.num_samples,
    )
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# The one global lookup megatron-core makes on this path, and why it does not matter: its
# RowParallelLinear._forward_impl passes tp_group=None with allreduce_dgrad=False and
# sequence_parallel=False, and the group is only used for one of those two (tensor_parallel/layers.py).
# The gradients of the pp2 and dp2 WGs, for which the global TP=2 group is wrong, show it unused.
UNUSED_GLOBAL_LOOKUPS = {
    (
        "get_tensor_model_parallel_group",
        (
            "megatron/core/utils.py:get_tensor_model_parallel_group_if_none",
            "megatron/core/tensor_parallel/layers.py:linear_with_grad_accumulation_and_async_allreduce",
            "megatron/core/tensor_parallel/layers.py:RowParallelLinear._forward_impl",
        ),
    )
}


def _ranks_body(rank, model_dir):
    from megatron.core import parallel_state

    # Issue #46 item 6 (Megatron-LM issue 6307: megatron-core's global accessors silently return
    # another grid's groups). A global grid is set up (TP=2 over both ranks) that is wrong for the
    # pp2 and dp2 WGs: a lookup of it there changes their gradients, and any lookup at all is recorded.
    parallel_state._GLOBAL_MEMORY_BUFFER = None  # the rank's start set it (megamarl.parallel.distributed)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        with megatron_steps.global_group_lookups() as calls:
            diffs = _three_grids(model_dir)
    finally:
        parallel_state.destroy_model_parallel()
    diffs["global_lookups"] = {k: n for k, n in calls.items() if k[0] not in megatron_steps.GROUPLESS_GLOBALS}
    diffs["groupless_lookups"] = sorted({k[0] for k in calls} & megatron_steps.GROUPLESS_GLOBALS)
    return diffs


def _three_grids(model_dir):
    from megamarl.config import PolicyConfig
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    placement = PlacementConfig(
        {
            "tp2": WorkerGroupLayout(ranks=[0, 1], tp=2),
            "pp2": WorkerGroupLayout(ranks=[0, 1], pp=2),
            "dp2": WorkerGroupLayout(ranks=[0, 1]),
        }
    )
    wgs = build_worker_groups(placement)
    reference = _reference_grads(model_dir)
    batch = _batch()
    counts = {"num_tokens": int(batch.response_mask.sum()), "num_seqs": batch.num_samples}
    diffs = {}
    for name, wg in wgs.items():
        policy = PolicyConfig(
            model=str(model_dir), micro_batch_size=2, lr=1e-3, grad_clip=0.0, distributed_optimizer=False
        )  # full grads in main_grad after backward
        worker = PolicyWorker(name, policy, wg, load_policy_model(policy, wg, seed=0), _loss_cfg())
        part = worker.my_part(batch)
        worker.backward(part, worker.compute_logprobs(part), counts)
        diffs[name + "_mismatch"] = worker.mismatch.metrics()  # what train_share reports (collective)
        grads = dict(megatron_steps.export_hf_grads(worker.model, wg))
        diffs[name] = max((grads[n] - reference[n]).abs().max().item() for n in grads)
        diffs[name + "_num"] = len(grads)
        before = {n: t.clone() for n, t in worker.export()}
        diffs[name + "_norm"] = worker._clip_and_step()
        after = dict(worker.export())
        diffs[name + "_changed"] = all(not torch.equal(before[n], after[n]) for n in before)
        # a second whole update's step metrics (what train_share reports), after the same first step
        diffs[name + "_metrics"] = worker._update(part, worker.compute_logprobs(part), counts)
    return diffs


def test_megatron_policy_gradients_equal_single_process_reference(tmp_path):
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    results = run_ranks(_ranks_body, 2, str(model_dir))
    reference_norm = float(
        torch.sqrt(sum(g.double().pow(2).sum() for g in _reference_grads(model_dir).values()))
    )
    for rank, diffs in enumerate(results):
        for layout in ("tp2", "pp2", "dp2"):
            assert diffs[layout] < 1e-5, (rank, layout, diffs)
            assert diffs[layout + "_changed"], (rank, layout)
            # megatron-core's norm sums fp32 per-tensor norms (torch.norm over ~1.5M embedding grads):
            # ~6e-5 relative from the float64 reference here
            assert abs(diffs[layout + "_norm"] - reference_norm) < 2e-4 * reference_norm, (
                layout,
                diffs,
                reference_norm,
            )
    # agent/<a>/mismatch_*: each DP rank holds some rows of the batch; the metrics are of all of them,
    # on every rank, as at TP=2 (one DP rank holding the whole batch)
    whole = results[0]["tp2_mismatch"]
    assert sorted(whole) == [
        f"agent/{agent}/mismatch_{key}"
        for agent in ("solver", "verifier")
        for key in ("kl", "masked_frac", "ppl_ratio", "rejected_frac")
    ]
    for rank, diffs in enumerate(results):
        assert diffs["dp2_mismatch"] == pytest.approx(whole, rel=1e-6), rank
    # the step's metrics are of the whole batch on every DP rank: a loss is the sum of the DP ranks'
    # shares (each normalised by the global counts), a mean is weighted by every rank's tokens
    whole = results[0]["tp2_metrics"]
    assert {"loss", "pg_loss", "grad_norm"} <= set(whole)
    for rank, diffs in enumerate(results):
        assert diffs["dp2_metrics"] == pytest.approx(whole, rel=1e-4, abs=1e-7), rank
    # PP=2: each stage exports its own layers; together they cover every HF tensor.
    assert results[0]["pp2_num"] + results[1]["pp2_num"] >= results[0]["tp2_num"]
    # building, log-probs, backward, clipping, the optimizer step and the export of three grids in
    # one process looked up no global group it uses (besides the process-wide memory buffer and
    # whether the global state is set); the hook did see calls, so it was installed
    for diffs in results:
        assert set(diffs["global_lookups"]) <= UNUSED_GLOBAL_LOOKUPS, diffs["global_lookups"]
        assert "get_global_memory_buffer" in diffs["groupless_lookups"], diffs["groupless_lookups"]


# ---- per-agent settings, reference-model KL and restricted sampling vocabularies -----------------


def _agent_cfgs():
    from megamarl.rl.losses import LossConfig
    from megamarl.rl.worker import AgentTraining

    solver = LossConfig(clip_low=0.1, clip_high=0.5, kl_coef=0.3, kl_type="k3")
    return {"solver": AgentTraining(loss=solver, micro_batch_size=1)}


def _restricted_batch():
    batch = _batch()
    allowed = []
    for row in range(batch.num_samples):
        response = batch.tokens[row][batch.response_mask[row]].tolist()
        allowed.append(tuple(sorted(set(response) | {7, 11, 40000})) if row % 2 == 0 else None)
    return batch.replace(allowed=tuple(allowed), temperatures=(0.7, 1.0, 1.3, 1.0, 0.9))


def _reference_grads_per_agent(model_dir, ref_dir):
    from transformers import AutoModelForCausalLM

    from megamarl.rl.forward import restricted_vocab_mask
    from megamarl.rl.losses import policy_loss
    from megamarl.rl.vocab_parallel import vocab_parallel_logprobs

    batch = _restricted_batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)

    def logprobs_of(m):
        logits = m(batch.tokens, attention_mask=batch.attention_mask.long()).logits
        logits = logits / torch.tensor(batch.temperatures).view(-1, 1, 1)
        logits = logits.masked_fill(
            restricted_vocab_mask(batch.allowed, 0, logits.shape[-1]).unsqueeze(1), float("-inf")
        )
        return vocab_parallel_logprobs(logits, batch.tokens)

    logprobs, entropy = logprobs_of(model)
    with torch.no_grad():
        ref_logprobs, _ = logprobs_of(ref_model)
    counts = {"num_tokens": int(batch.response_mask.sum()), "num_seqs": batch.num_samples}
    cfgs = {"solver": _agent_cfgs()["solver"].loss, "verifier": _loss_cfg()}
    total = 0.0
    for agent, cfg in cfgs.items():
        rows = torch.tensor([a == agent for a in batch.names("agent")])
        loss, _ = policy_loss(
            logprobs[rows],
            batch.advantages[rows],
            batch.response_mask[rows],
            cfg,
            rollout_logprobs=batch.rollout_logprobs[rows],
            entropy=entropy[rows],
            ref_logprobs=ref_logprobs[rows] if cfg.kl_coef > 0 else None,
            **counts,
        )
        total = total + loss
    total.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _per_agent_body(rank, model_dir, ref_dir):
    from megamarl.config import PolicyConfig
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    placement = PlacementConfig(
        {
            "tp2": WorkerGroupLayout(ranks=[0, 1], tp=2),
            "pp2": WorkerGroupLayout(ranks=[0, 1], pp=2),
        }
    )
    wgs = build_worker_groups(placement)
    reference = _reference_grads_per_agent(model_dir, ref_dir)
    batch = _restricted_batch()
    counts = {"num_tokens": int(batch.response_mask.sum()), "num_seqs": batch.num_samples}
    diffs = {}
    for name, wg in wgs.items():
        policy = PolicyConfig(
            model=str(model_dir), micro_batch_size=2, lr=1e-3, grad_clip=0.0, distributed_optimizer=False
        )  # full grads in main_grad after backward
        ref = load_policy_model(PolicyConfig(model=str(ref_dir)), wg, seed=0)
        worker = PolicyWorker(
            name,
            policy,
            wg,
            load_policy_model(policy, wg, seed=0),
            _loss_cfg(),
            agents=_agent_cfgs(),
            ref_handle=ref,
        )
        part = worker.my_part(batch)
        ref_logprobs = worker.compute_logprobs(part, reference=True)
        worker.backward(part, None, counts, ref=ref_logprobs)
        grads = dict(megatron_steps.export_hf_grads(worker.model, wg))
        diffs[name] = max((grads[n] - reference[n]).abs().max().item() for n in grads)
        diffs[name + "_mbs"] = [mb.names("agent") for mb in worker._micro_batches(part)]
    return diffs


def test_per_agent_losses_reference_kl_and_restricted_vocab_match_reference(tmp_path):
    """Per-agent clip/KL settings (solver: own clip range, k3 KL to a reference model, micro-batches of 1),
    a reference model with other weights, rows sampled from restricted vocabularies and at other
    temperatures: the Megatron
    gradients at TP=2 and PP=2 equal the single-process sum of per-agent losses."""
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    ref_dir = save_tiny_model(tmp_path / "ref", "llama", seed=1)
    results = run_ranks(_per_agent_body, 2, str(model_dir), str(ref_dir))
    for rank, diffs in enumerate(results):
        for layout in ("tp2", "pp2"):
            assert diffs[layout] < 1e-5, (rank, layout, diffs[layout])
            mbs = diffs[layout + "_mbs"]
            assert all(len(set(agents)) == 1 for agents in mbs), mbs  # one agent per micro-batch
            assert all(len(agents) == 1 for agents in mbs if agents[0] == "solver"), mbs


# ---- GAE with a critic (value head on the Megatron model) ---------------------------------------


def _critic_cfg():
    from megamarl.rl.advantages import AdvantageConfig
    from megamarl.rl.critic import CriticConfig

    return CriticConfig(
        AdvantageConfig(estimator="gae", gamma=0.9, lam=0.8, norm_std=True), value_coef=0.5, value_clip=0.2
    )


def _critic_reference(model_dir):
    """Single process: HF trunk + a zero-initialised linear value head, GAE, whitening, PPO + value loss."""
    from transformers import AutoModelForCausalLM

    from megamarl.rl.advantages import gae, masked_whiten
    from megamarl.rl.losses import LOSS_AGGREGATIONS, policy_loss, value_loss
    from megamarl.rl.rewards import rewards_to_tokens
    from megamarl.rl.vocab_parallel import vocab_parallel_logprobs

    cfg = _critic_cfg()
    batch = _batch()
    batch = batch.replace(rewards=torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0]))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    torch.nn.init.zeros_(head.weight), torch.nn.init.zeros_(head.bias)
    hidden = model.model(
        batch.tokens, attention_mask=batch.attention_mask.long()
    ).last_hidden_state  # [B, T, H]
    logits = model.lm_head(hidden)
    logprobs, entropy = vocab_parallel_logprobs(logits, batch.tokens)
    values = torch.cat([torch.zeros(batch.num_samples, 1), head(hidden).squeeze(-1)[:, :-1]], dim=1)
    mask = batch.response_mask
    adv, returns = gae(
        rewards_to_tokens(batch.rewards, mask),
        values.detach(),
        mask,
        gamma=cfg.advantage.gamma,
        lam=cfg.advantage.lam,
    )
    adv = masked_whiten(adv, mask)
    counts = {"num_tokens": int(mask.sum()), "num_seqs": batch.num_samples}
    loss, _ = policy_loss(
        logprobs, adv, mask, _loss_cfg(), rollout_logprobs=batch.rollout_logprobs, entropy=entropy, **counts
    )
    per_token, _ = value_loss(values, values.detach(), returns, mask, clip=cfg.value_clip)
    loss = loss + cfg.value_coef * LOSS_AGGREGATIONS.get("token-mean")(per_token, mask, **counts)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, {n: p.grad.clone() for n, p in head.named_parameters()}


def _critic_body(rank, model_dir):
    from megamarl.config import PolicyConfig
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    placement = PlacementConfig(
        {
            "tp2": WorkerGroupLayout(ranks=[0, 1], tp=2),
            "pp2": WorkerGroupLayout(ranks=[0, 1], pp=2),
            "dp2": WorkerGroupLayout(ranks=[0, 1]),
        }
    )
    wgs = build_worker_groups(placement)
    reference, reference_head = _critic_reference(model_dir)
    batch = _batch().replace(rewards=torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0]), advantages=None)
    counts = {"num_tokens": int(batch.response_mask.sum()), "num_seqs": batch.num_samples}
    diffs = {}
    for name, wg in wgs.items():
        policy = PolicyConfig(
            model=str(model_dir), micro_batch_size=2, lr=1e-3, grad_clip=0.0, distributed_optimizer=False
        )  # full grads in main_grad after backward
        worker = PolicyWorker(
            name, policy, wg, load_policy_model(policy, wg, seed=0), _loss_cfg(), critic=_critic_cfg()
        )
        part, returns, values = worker.critic_targets(worker.my_part(batch))
        worker.backward(part, None, counts, critic=(returns, values))
        grads = dict(megatron_steps.export_hf_grads(worker.model, wg))
        diffs[name] = max((grads[n] - reference[n]).abs().max().item() for n in grads)
        if worker.critic.head is not None:
            head = {n.removeprefix("linear."): p.grad for n, p in worker.critic.head.named_parameters()}
            diffs[name + "_head"] = max((head[n] - reference_head[n]).abs().max().item() for n in head)
    return diffs


def test_gae_critic_gradients_equal_single_process_reference(tmp_path):
    """GAE advantages from the value head, whitened over every DP rank's tokens, PPO + clipped value
    loss: Megatron gradients (trunk and value head) at TP=2, PP=2 and DP=2 equal the single-process ones."""
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    results = run_ranks(_critic_body, 2, str(model_dir))
    for rank, diffs in enumerate(results):
        for layout in ("tp2", "pp2", "dp2"):
            assert diffs[layout] < 1e-5, (rank, layout, diffs)
    assert results[1]["pp2_head"] < 1e-6 and "pp2_head" not in results[0]  # head lives on the last stage
    for layout in ("tp2", "dp2"):
        assert max(r[layout + "_head"] for r in results) < 1e-6, results


# ---- a policy batch with fewer rows than DP ranks (issue #16 item 7) -------------------------------


def _one_row_body(rank, model_dir):
    from megamarl.config import PolicyConfig
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.losses import loss_counts
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    wg = build_worker_groups(PlacementConfig({"dp2": WorkerGroupLayout(ranks=[0, 1])}))["dp2"]
    batch = _batch().select([1])  # one row for two DP ranks
    policy = PolicyConfig(
        model=str(model_dir), micro_batch_size=2, lr=1e-3, grad_clip=0.0, distributed_optimizer=False
    )  # full grads in main_grad after backward
    worker = PolicyWorker("dp2", policy, wg, load_policy_model(policy, wg, seed=0), _loss_cfg())
    part = worker.my_part(batch)
    worker.backward(part, None, loss_counts(batch.response_mask))  # rank 1 used to skip this and hang rank 0
    grads = dict(megatron_steps.export_hf_grads(worker.model, wg))
    reference = _reference_grads(model_dir, batch)
    metrics = worker.train_step(batch)  # the whole update, optimizer step included
    return {
        "rows": part.num_samples,
        "response_tokens": int(part.response_mask.sum()),
        "diff": max((grads[n] - reference[n]).abs().max().item() for n in grads),
        "metrics": sorted(metrics),
        "weights": float(sum(t.double().sum() for _, t in worker.export())),
    }


def test_one_row_batch_at_dp2_every_rank_takes_part(tmp_path):
    """Rank 1's share is empty: it runs a zero-weight stand-in row (no response tokens), joins the DP
    gradient all-reduce, and both ranks end with the 1-row batch's exact gradient and the same weights."""
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    results = run_ranks(_one_row_body, 2, str(model_dir), timeout_s=120)
    assert [(r["rows"], r["response_tokens"] > 0) for r in results] == [(1, True), (1, False)]
    assert all(r["diff"] < 1e-5 for r in results), [r["diff"] for r in results]
    assert results[0]["weights"] == results[1]["weights"]
    assert (
        "pg_loss" in results[0]["metrics"] and "pg_loss" not in results[1]["metrics"]
    )  # stand-in: no loss terms
    assert "grad_norm" in results[1]["metrics"]


def _mismatch_sums_body(rank):
    import torch.distributed as dist

    from megamarl.parallel.collectives import all_gather_objects
    from megamarl.rl.update_metrics import AgentMismatch

    mismatch = AgentMismatch(gather=lambda obj: all_gather_objects(obj, dist.group.WORLD))
    # mismatch_row_sums columns: tokens, sum d, sum k3, tokens not kept, rows with tokens, rows rejected
    if rank == 0:  # two rows of "a"
        mismatch.add(
            ["a", "a"], torch.tensor([[2.0, -0.25, 0.5, 0.0, 1.0, 0.0], [2.0, 0.5, 0.25, 2.0, 1.0, 1.0]])
        )
    else:  # one row of "a", one of "b" (an agent rank 0 never saw)
        mismatch.add(
            ["a", "b"], torch.tensor([[4.0, 1.75, 0.25, 2.0, 1.0, 0.0], [5.0, -2.5, 1.0, 0.0, 1.0, 0.0]])
        )
    return mismatch.metrics(), mismatch.metrics()


def test_per_agent_mismatch_is_summed_over_the_dp_ranks():
    """``AgentMismatch`` with its DP gather: every rank reports the mismatch of all ranks' rows
    (token-weighted: the sums are added, then divided), also of an agent that only one rank holds."""
    results = run_ranks(_mismatch_sums_body, 2)
    expected = {  # a: 8 tokens, sum d 2.0, sum k3 1.0, 4 not kept, 3 rows, 1 rejected; b: rank 1's row
        "agent/a/mismatch_kl": 1.0 / 8,
        "agent/a/mismatch_ppl_ratio": math.exp(-2.0 / 8),
        "agent/a/mismatch_masked_frac": 4.0 / 8,
        "agent/a/mismatch_rejected_frac": 1.0 / 3,
        "agent/b/mismatch_kl": 1.0 / 5,
        "agent/b/mismatch_ppl_ratio": math.exp(2.5 / 5),
        "agent/b/mismatch_masked_frac": 0.0,
        "agent/b/mismatch_rejected_frac": 0.0,
    }
    for first, second in results:
        assert first == expected and second == {}  # then empty until the next add
