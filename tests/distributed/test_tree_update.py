"""``policies.<p>.prefix_tree`` (issue 43) through ``PolicyWorker`` on 2 CPU ranks over gloo: on a batch
whose rows share prefixes -- a GRPO group's prompt, an agent's earlier turn inside its later one, two
agents reading the same instructions -- the tree update equals the unshared packed update in fp32:
per-token log-probs and entropies, each sample's loss, the micro-batches' losses and every gradient,
at TP=1 (DP=2), TP=2 and PP=2 (with per-agent settings, restricted vocabularies, a KL reference and an
entropy bonus), with the GAE critic, with L2 LoRA adapters, and over ``ppo_epochs`` x mini-batches.
Tolerance: 1e-5 absolute on log-probs, entropies and losses (relative where they exceed 1), 1e-5
relative to the largest gradient (fp32 sums in another order: a shared node's gradient is the sum of
its samples').
"""

import megatron_steps  # tests/ helper: gradients by HF name
import pytest
import torch
from test_policy_update import _loss_cfg

from megamarl.parallel.launch import run_ranks

pytestmark = pytest.mark.distributed


def _tree_batch():
    """A GRPO group of 4 (one prompt), a three-turn transcript (each turn's prompt holds the turns
    before it), a verifier pair whose prompts start with the solver's instructions; sampling restricted
    on some rows."""
    from megamarl.rl.batch import collate
    from megamarl.rl.sample import Sample

    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(1, 49152, (n,), generator=g).tolist()

    instructions, question = ids(6), ids(5)
    rows = [("t0", f"g{k}", "solver", 0, instructions + question, ids(3 + k)) for k in range(4)]
    # a three-turn transcript: each turn's prompt is the previous turn's prompt, reply and observation
    reply = ids(3)
    rows.append(("t1", "m", "solver", 0, instructions + ids(4), reply))
    for turn in (1, 2):
        rows.append(("t1", "m", "solver", turn, rows[-1][4] + rows[-1][5] + ids(2), ids(4)))
    rows += [("t0", f"v{k}", "verifier", 0, instructions + ids(4), ids(2 + k)) for k in range(2)]
    samples = [
        Sample(
            task_id=t,
            episode_id=e,
            agent=a,
            policy="p",
            turn=turn,
            prompt_ids=p,
            response_ids=r,
            rollout_logprobs=(-torch.rand(len(r), generator=g) * 3).tolist(),
        )
        for t, e, a, turn, p, r in rows
    ]
    batch = collate(samples, pad_id=0)
    allowed = tuple(
        tuple(sorted(set(batch.tokens[i][batch.response_mask[i]].tolist()) | {7, 11}))
        if i in (1, 7)
        else None
        for i in range(batch.num_samples)
    )
    advantages = torch.linspace(-1.0, 1.0, batch.num_samples)
    return batch.replace(
        advantages=advantages,
        allowed=allowed,
        temperatures=tuple(0.8 + 0.1 * (i % 3) for i in range(batch.num_samples)),
    )


def _worker(name, wg, model_dir, tree, ref_dir=None, agents=None, critic=None, **keys):
    from megamarl.config import PolicyConfig
    from megamarl.rl.policy_setup import load_policy_model
    from megamarl.rl.worker import PolicyWorker

    policy = PolicyConfig(
        model=str(model_dir),
        **{
            "micro_batch_size": 8,
            "lr": 1e-3,
            "grad_clip": 0.0,
            "distributed_optimizer": False,
            "pack": True,
            "prefix_tree": tree,
            **keys,
        },
    )
    ref = load_policy_model(PolicyConfig(model=str(ref_dir)), wg, seed=0) if ref_dir else None
    return PolicyWorker(
        name,
        policy,
        wg,
        load_policy_model(policy, wg, seed=0),
        _loss_cfg(),
        agents=agents,
        ref_handle=ref,
        critic=critic,
        lora=keys.get("lora"),
        total_steps=2,
    )


def _grads(worker, wg):
    return dict(megatron_steps.export_hf_grads(worker.model, wg))


def _diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _tree_body(rank, model_dir, ref_dir):
    from megamarl.models.lora import LoraConfig
    from megamarl.parallel.placement import PlacementConfig, WorkerGroupLayout, build_worker_groups
    from megamarl.rl.advantages import AdvantageConfig
    from megamarl.rl.critic import CriticConfig
    from megamarl.rl.losses import LossConfig, loss_counts, policy_loss
    from megamarl.rl.tree import tree_tokens
    from megamarl.rl.worker import AgentTraining

    wgs = build_worker_groups(
        PlacementConfig(
            {
                "tp2": WorkerGroupLayout(ranks=[0, 1], tp=2),
                "pp2": WorkerGroupLayout(ranks=[0, 1], pp=2),
                "dp2": WorkerGroupLayout(ranks=[0, 1]),
            }
        )
    )
    batch = _tree_batch()
    counts = loss_counts(batch.response_mask)
    out = {}

    # TP=1 (DP=2), TP=2 and PP=2: per-agent settings (solver: own clip, KL to a reference, an entropy
    # bonus), restricted vocabularies; per token (log-probs, entropies) and per sample (losses)
    solver = LossConfig(
        clip_low=0.1,
        clip_high=0.5,
        kl_coef=0.3,
        kl_type="k3",
        entropy_coef=0.01,
    )
    per_agent = {"solver": AgentTraining(loss=solver, micro_batch_size=8)}
    for layout in ("dp2", "tp2", "pp2"):
        wg, grads, lps, ents, refs = wgs[layout], {}, {}, {}, {}
        for tree in (False, True):
            worker = _worker(layout, wg, model_dir, tree, ref_dir=ref_dir, agents=per_agent)
            part = worker.my_part(batch)
            lps[tree] = worker.compute_logprobs(part)
            ents[tree] = worker._forward_only(  # the entropies the loss reads, by the same schedule
                part, lambda mb, offset, logits, w=worker: w._logprobs(logits, mb, offset)[1], False
            )
            ref = refs[tree] = worker.compute_logprobs(part, reference=True)
            collected = worker.backward(part, lps[tree], counts, ref=ref)
            grads[tree] = _grads(worker, wg)
            out[f"{layout}_{tree}_loss"] = sum(c["loss"] for c in collected)
            out[f"{layout}_{tree}_forwarded"] = sum(
                (tree_tokens(mb.tokens, mb.attention_mask) if tree else int(mb.lengths.sum()))
                for mb in worker._micro_batches(part)
            )
        if wg.is_last_stage:
            out[f"{layout}_logprobs"] = (lps[True] - lps[False]).abs().max().item()
            out[f"{layout}_entropy"] = (ents[True] - ents[False]).abs().max().item()
            out[f"{layout}_entropy_scale"] = ents[False].abs().max().item()
            # each sample's own loss (the solver's settings) from each path's per-token values
            mask = part.response_mask
            losses = {
                tree: torch.stack(
                    [
                        policy_loss(
                            lps[tree][i : i + 1],
                            part.advantages[i : i + 1],
                            mask[i : i + 1],
                            solver,
                            old_logprobs=lps[False][i : i + 1],  # the same proximal policy for both
                            rollout_logprobs=part.rollout_logprobs[i : i + 1],
                            ref_logprobs=refs[tree][i : i + 1],
                            entropy=ents[tree][i : i + 1],
                        )[0]
                        for i in range(part.num_samples)
                    ]
                )
                for tree in (False, True)
            }
            out[f"{layout}_sample_losses"] = (losses[True] - losses[False]).abs().max().item()
            out[f"{layout}_sample_loss_scale"] = losses[False].abs().max().item()
            out[f"{layout}_samples"] = part.num_samples
        out[f"{layout}_grads"] = _diff(grads[True], grads[False])
        out[f"{layout}_scale"] = max(g.abs().max().item() for g in grads[False].values())

    # DP=2: the GAE critic (value head and its gradients too)
    wg, grads = wgs["dp2"], {}
    critic = CriticConfig(AdvantageConfig(estimator="gae", gamma=0.9, lam=0.8, norm_std=True))
    heads = {}
    for tree in (False, True):
        worker = _worker("dp2", wg, model_dir, tree, critic=critic)
        part, returns, values = worker.critic_targets(worker.my_part(batch))
        worker.backward(part, None, counts, critic=(returns, values))
        grads[tree] = _grads(worker, wg)
        heads[tree] = {n: p.grad.clone() for n, p in worker.critic.head.named_parameters()}
        out[f"gae_{tree}_values"] = values
    out["gae_values"] = (out.pop("gae_True_values") - out.pop("gae_False_values")).abs().max().item()
    out["gae_grads"] = _diff(grads[True], grads[False])
    out["gae_head"] = _diff(heads[True], heads[False])
    out["gae_scale"] = max(g.abs().max().item() for g in grads[False].values())

    # DP=2: L2, one LoRA adapter per agent (the base frozen; only adapter gradients)
    grads = {}
    lora = LoraConfig(rank=4, alpha=8.0)
    agents = {
        a: AgentTraining(loss=_loss_cfg(), micro_batch_size=8, adapter=a) for a in ("solver", "verifier")
    }
    for tree in (False, True):
        worker = _worker("dp2", wg, model_dir, tree, agents=agents, lora=lora)
        part = worker.my_part(batch)
        worker.backward(part, worker.compute_logprobs(part), counts)
        grads[tree] = {n: p.main_grad.clone() for n, p in worker.model.named_parameters() if p.requires_grad}
    out["lora_grads"] = _diff(grads[True], grads[False])
    out["lora_scale"] = max(g.abs().max().item() for g in grads[False].values())

    # DP=2: ppo_epochs=2 x mini-batches of 4 (six optimizer steps on moving weights), KL to the reference
    metrics = {}
    kl = LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_type="k3")
    for tree in (False, True):
        worker = _worker("dp2", wg, model_dir, tree, ref_dir=ref_dir, ppo_epochs=2, mini_batch_size=4)
        worker.loss_cfg = kl
        metrics[tree] = worker.train_step(batch)
    out["epochs"] = {
        k: (metrics[False][k], metrics[True][k])
        for k in ("loss", "pg_loss", "kl_loss", "grad_norm", "optimizer_steps")
    }
    return out


def test_tree_update_equals_the_unshared_packed_update(tmp_path):
    from megamarl.models.packaged import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    ref_dir = save_tiny_model(tmp_path / "ref", "llama", seed=1)
    results = run_ranks(_tree_body, 2, str(model_dir), str(ref_dir), timeout_s=600)
    for r in results:
        for layout in ("dp2", "tp2", "pp2"):
            assert r[f"{layout}_True_loss"] == pytest.approx(r[f"{layout}_False_loss"], rel=1e-5, abs=1e-7), r
            assert r[f"{layout}_grads"] <= 1e-5 * r[f"{layout}_scale"], (layout, r)
            # TP=2 / PP=2: every rank holds the whole batch; DP=2: half of it, so less is shared
            shared = 0.75 if layout != "dp2" else 1.0
            assert r[f"{layout}_True_forwarded"] < shared * r[f"{layout}_False_forwarded"], (layout, r)
            if f"{layout}_logprobs" in r:  # the last PP stage (every rank at TP=2 or DP=2)
                assert r[f"{layout}_samples"] > 0, (layout, r)
                assert r[f"{layout}_logprobs"] <= 1e-5, (layout, r)
                assert r[f"{layout}_entropy"] <= 1e-5 * max(1.0, r[f"{layout}_entropy_scale"]), (layout, r)
                assert r[f"{layout}_sample_losses"] <= 1e-5 * max(1.0, r[f"{layout}_sample_loss_scale"]), (
                    layout,
                    r,
                )
        assert sum("pp2_logprobs" in r for r in results) == 1  # PP=2: the last stage alone holds them
        assert r["gae_values"] <= 1e-5 and r["gae_grads"] <= 1e-5 * r["gae_scale"], r
        assert r["gae_head"] <= 1e-5 * r["gae_scale"], r
        assert r["lora_grads"] <= 1e-5 * r["lora_scale"] and r["lora_scale"] > 0, r
        for key, (packed, tree) in r["epochs"].items():
            assert tree == pytest.approx(packed, rel=1e-4, abs=1e-7), (key, r["epochs"])
