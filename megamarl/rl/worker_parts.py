"""What one ``PolicyWorker`` is made of: its inputs (``ModelHandle``, each agent's ``AgentTraining``,
the ``batch_split`` they give) and the training side wired around its model shard (``wire_training``):
LoRA adapters, megatron-core's ``DistributedDataParallel``, the logit window and RoPE positions, the KL
reference, the optimizer and its learning-rate scheduler, the critic and the train-state offload.

The order of the steps is the contract: adapters exist before DDP allocates gradient buffers for what
requires grad, and the optimizer sees the DDP-wrapped parameters. ``PolicyWorker`` keeps the parts as
its own attributes; nothing here holds state after it returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from megamarl.config import PolicyConfig
from megamarl.models.lora import add_lora_adapter
from megamarl.parallel.hardware import trim_c_heap
from megamarl.parallel.placement import WorkerGroup
from megamarl.rl.critic import Critic, CriticConfig, NoCritic
from megamarl.rl.dispatch import BatchSplit
from megamarl.rl.forward import LogitWindow
from megamarl.rl.losses import LossConfig
from megamarl.rl.offload import TrainStateOffload
from megamarl.rl.optimizer import build_optimizer, build_scheduler
from megamarl.rl.reference import ReferenceModel
from megamarl.rl.tree import RotaryPositions


def finalize_grads_on_trimmed_heap(
    model, num_tokens=None, *, pg_collection=None, force_all_reduce=False, in_place: bool = False
):
    """megatron-core's ``finalize_model_grads`` (the DP gradient reduce-scatter or all-reduce) once the
    C heap has handed back what backward freed (on CPU the activations are small tensors in glibc's
    heaps, whose pages free() keeps). ``in_place`` (gloo): the distributed optimizer's gradients are
    all-reduced in place rather than reduce-scattered; gloo's ``reduce_scatter_tensor`` copies the
    whole fp32 gradient buffer first (+0.5 GiB for 135M parameters) and is slower than its in-place
    all-reduce. Each rank's shard holds the same sums either way."""
    trim_c_heap()
    return finalize_model_grads(
        model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce or in_place
    )


@dataclass
class ModelHandle:
    """What the worker needs from the model bridge for one policy."""

    model: torch.nn.Module  # GPTModel (this rank's shard)
    vocab_size: int  # true vocabulary size (padding columns beyond it are masked)


@dataclass
class AgentTraining:
    """One agent's training settings on a shared policy (``agents.<a>.*`` overrides applied)."""

    loss: LossConfig
    micro_batch_size: int
    frozen: bool = False
    mini_batch_size: int | None = None  # samples per optimizer step (None: the policy's)
    adapter: str | None = None  # L2: the agent's LoRA adapter on the policy's frozen base
    lr: float | None = None  # the adapter's learning rate (None: the policy's)


def batch_split(cfg: PolicyConfig, agents: Mapping[str, AgentTraining]) -> BatchSplit:
    """How the policy's rows are cut for an update (``rl.dispatch``): trainable agents, mini-batch sizes."""
    return BatchSplit(
        mini_batch_size=cfg.mini_batch_size,
        agent_mini_batch_sizes={a: t.mini_batch_size for a, t in agents.items() if t.mini_batch_size},
        frozen_agents=frozenset(a for a, t in agents.items() if t.frozen),
        adapters={a: t.adapter for a, t in agents.items() if t.adapter},
        min_samples=cfg.lora.min_samples if cfg.lora is not None else 0,
    )


@dataclass
class TrainingParts:
    """What ``wire_training`` builds; ``PolicyWorker`` copies each onto itself under the same name."""

    model: DistributedDataParallel
    window: LogitWindow
    rotary: RotaryPositions  # prefix_tree: RoPE by node depth (rl.tree)
    uses_te: bool  # the layer spec the model was built with is Transformer Engine's
    ref: ReferenceModel | None
    optimizer: Any  # megatron-core's MegatronOptimizer (or its chained form)
    scheduler: Any  # megatron-core's OptimizerParamScheduler
    critic: Critic | NoCritic
    train_state: TrainStateOffload


def wire_training(
    name: str,
    cfg: PolicyConfig,
    wg: WorkerGroup,
    model: torch.nn.Module,
    *,
    compute_dtype: torch.dtype,
    lora,
    critic: CriticConfig | None,
    total_steps: int,
    adapter_lrs: dict[str, float],
    needs_ref: bool,
    ref_model: torch.nn.Module | None,
) -> TrainingParts:
    """Policy ``name``'s training parts around ``model`` (this rank's shard, on ``wg.device``).
    ``adapter_lrs``: the L2 LoRA adapters to add, in order (``lora``: their ``LoraConfig``), with their
    learning rates; ``needs_ref``: a KL term is set, so a reference is required (LoRA: the base)."""
    device, adapters = wg.device, list(adapter_lrs)
    config = model.config
    if adapters:
        if lora is None:
            raise ValueError(
                f"policies.{name}: agents name LoRA adapters {adapters} but policies.{name}.lora is not set"
            )
        for adapter in adapters:  # before DDP: it allocates grad buffers for what requires grad
            add_lora_adapter(model, wg, adapter, lora)
    config.finalize_model_grads_func = partial(finalize_grads_on_trimmed_heap, in_place=device.type == "cpu")
    config.variable_seq_lengths = True  # micro-batches differ in length; PP communicates shapes
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.distributed_optimizer,
    )
    ddp_model = DistributedDataParallel(config, ddp_config, model, pg_collection=wg.pgs)
    window = LogitWindow(model)
    rotary = RotaryPositions(model)
    uses_te = model.layer_spec == "te"  # the spec it was built with (bridge.build_model)
    # the KL term's frozen reference (``rl.reference``); LoRA policies use the base (adapters off)
    ref = ReferenceModel(ref_model, device, offload=cfg.ref_offload) if ref_model is not None else None
    if needs_ref and ref is None and not adapters:
        raise ValueError(f"policies.{name}: kl_coef > 0 needs a reference model (ref_handle)")
    optimizer = build_optimizer(
        ddp_model,
        wg,
        lr=cfg.lr,
        min_lr=cfg.lr_schedule.min_lr,
        weight_decay=cfg.weight_decay,
        grad_clip=cfg.grad_clip,
        dtype=compute_dtype,
        distributed=cfg.distributed_optimizer,
        adapter_lrs=adapter_lrs,
    )
    scheduler = build_scheduler(optimizer, cfg.lr_schedule, lr=cfg.lr, total_steps=total_steps)
    critic_part = (
        NoCritic()
        if critic is None
        else Critic(
            name, critic, wg, window, hidden_size=config.hidden_size, lr=cfg.lr, grad_clip=cfg.grad_clip
        )
    )
    # ``policies.<p>.offload_train_state``: moved to host memory while colocated engines generate
    train_state = TrainStateOffload(
        device, [ddp_model, *critic_part.modules], [optimizer, *critic_part.optimizers]
    )
    return TrainingParts(
        model=ddp_model,
        window=window,
        rotary=rotary,
        uses_te=uses_te,
        ref=ref,
        optimizer=optimizer,
        scheduler=scheduler,
        critic=critic_part,
        train_state=train_state,
    )
