"""Each policy's training side from its config: the Megatron shard with HF weights loaded
(``load_policy_model``) and the ``PolicyWorker`` with its loss, per-agent settings, reference model
and critic (``build_workers``), and every trained policy's ``BatchSplit`` (``batch_splits``: how the
driver cuts each policy's rows, for every WG, including those it holds no shard of). The glue between
``policies.<p>`` / ``agents.<a>`` / ``algorithm`` and the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from megamarl.config import AlgorithmConfig
from megamarl.models.bridge import build_model, load_hf_config, load_hf_weights
from megamarl.models.packaged import resolve_model_path
from megamarl.models.spec import NodeKernels
from megamarl.parallel.placement import WorkerGroup
from megamarl.rl.advantages import ADVANTAGE_ESTIMATORS, advantage_config
from megamarl.rl.critic import CriticConfig
from megamarl.rl.dispatch import BatchSplit
from megamarl.rl.losses import LossConfig
from megamarl.rl.worker import PolicyWorker
from megamarl.rl.worker_parts import AgentTraining, ModelHandle, batch_split

if TYPE_CHECKING:
    from megamarl.config import PolicyConfig

RECOMPUTE: dict[str, dict[str, Any]] = {  # policies.<p>.recompute -> megatron-core TransformerConfig fields
    "none": {},
    # core attention only (megatron-core's default selective module): the [B, heads, T, T] scores
    "selective": {"recompute_granularity": "selective"},
    # every layer keeps only its input and is rebuilt in the backward pass
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def load_policy_model(
    policy: PolicyConfig,
    wg: WorkerGroup,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    training: bool = True,
    node: NodeKernels | None = None,
) -> ModelHandle:
    """``policies.<p>``'s model as this rank's shard of ``wg`` in ``dtype``, with the HF weights
    loaded; ``training`` applies ``policies.<p>.recompute`` (a reference model has no backward).
    Layer spec, tree attention and fused kernels: ``bridge.build_model`` for this policy's LoRA,
    packing and prefix trees on ``node`` (this node unless given)."""
    path = resolve_model_path(policy.model, key="policies.<p>.model")
    hf_config = load_hf_config(path)
    model = build_model(
        hf_config,
        wg,
        seed=seed,
        dtype=dtype,
        init_weights=False,
        lora=policy.lora is not None,
        packed=policy.pack,
        prefix_tree=policy.prefix_tree,
        node=node,
        **(RECOMPUTE[policy.recompute] if training else {}),
    )
    load_hf_weights(model, path, wg)
    return ModelHandle(model=model, vocab_size=hf_config.vocab_size)


def build_workers(
    policies: Mapping,
    agents: Mapping,
    algos: Mapping[str, AlgorithmConfig],
    wgs: Mapping[str, WorkerGroup],
    *,
    seed: int,
    dtypes: Mapping[str, torch.dtype] | None = None,
    total_steps: int = 1,
    on_policy: Callable[[], None] = lambda: None,
) -> dict[str, PolicyWorker]:
    """A worker for every trainable policy whose WG this rank belongs to; ``algos``: each policy's
    algorithm settings (``RunConfig.policy_algorithms``: a critic for a critic estimator). ``dtypes``: each
    policy's training dtype (its parameters'; default fp32); ``total_steps``: the run's trainer steps (the
    default learning-rate decay length); ``on_policy`` is called once per policy (progress)."""
    workers = {}
    for name, policy in policies.items():
        wg = wgs[name]
        if not wg.is_member or policy.frozen:
            on_policy()
            continue
        lora = policy.lora is not None
        algo = algos[name]
        trainings = agent_trainings(name, policy, agents, algo)
        dtype = (dtypes or {}).get(name, torch.float32)
        handle = load_policy_model(policy, wg, seed=seed, dtype=dtype)
        needs_ref = policy.kl_coef > 0 or any(a.loss.kl_coef > 0 for a in trainings.values())
        # LoRA policies use their frozen base as the reference (adapters off): no second model
        ref = (
            load_policy_model(policy, wg, seed=seed, dtype=dtype, training=False)
            if needs_ref and not lora
            else None
        )
        workers[name] = PolicyWorker(
            name,
            policy,
            wg,
            handle,
            loss_config(policy, algo),
            agents=trainings,
            ref_handle=ref,
            critic=critic_config(policy, algo),
            lora=policy.lora,
            total_steps=total_steps,
        )
        on_policy()
    return workers


def agent_trainings(
    name: str, policy: PolicyConfig, agents: Mapping, algo: AlgorithmConfig
) -> dict[str, AgentTraining]:
    """The settings of policy ``name``'s agents that differ from the policy's (overrides, frozen, LoRA)."""
    lora = policy.lora is not None
    return {
        role: AgentTraining(
            loss=loss_config(policy, algo, **agent.train_overrides()),
            micro_batch_size=agent.micro_batch_size or policy.micro_batch_size,
            mini_batch_size=agent.mini_batch_size,
            # an agent of a LoRA policy without an adapter acts with the frozen base
            frozen=agent.frozen or (lora and agent.lora is None),
            adapter=agent.lora,
            lr=agent.lr,
        )
        for role, agent in agents.items()
        if agent.policy == name and (agent.train_overrides() or agent.frozen or lora)
    }


def batch_splits(
    policies: Mapping, agents: Mapping, algos: Mapping[str, AlgorithmConfig]
) -> dict[str, BatchSplit]:
    """Every trained (non-frozen) policy's ``BatchSplit``, built from the same settings as its workers."""
    return {
        name: batch_split(policy, agent_trainings(name, policy, agents, algos[name]))
        for name, policy in policies.items()
        if not policy.frozen
    }


def loss_config(policy: PolicyConfig, algo: AlgorithmConfig, **overrides) -> LossConfig:
    """The policy's loss settings, with an agent's overrides (``agents.<a>.clip_high``, ...) applied."""
    values: dict[str, Any] = {
        "clip_low": policy.clip_low,
        "clip_high": policy.clip_high,
        "kl_coef": policy.kl_coef,
        "entropy_coef": policy.entropy_coef,
    }
    values.update({k: v for k, v in overrides.items() if k in values})
    return LossConfig(
        **values,
        kl_type=algo.kl_type,
        agg_mode=algo.loss_agg,
        mismatch=algo.mismatch,
    )


def critic_config(policy: PolicyConfig, algo: AlgorithmConfig) -> CriticConfig | None:
    """The policy's critic when the estimator needs one (its registered traits say so)."""
    if not ADVANTAGE_ESTIMATORS.traits(algo.estimator, key="algorithm.estimator").needs_critic:
        return None
    return CriticConfig(
        advantage_config(algo),
        value_coef=policy.value_coef,
        value_clip=policy.value_clip,
        loss_agg=algo.value_loss_agg,
    )
