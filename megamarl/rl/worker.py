"""One policy's worker group (WG) on this rank: the Megatron model, its optimizer, log-probability
recompute and the policy-gradient update, all through megatron-core's forward/backward schedules.

Several ``PolicyWorker`` objects can live on one rank (colocated WGs), each with its own process
groups (``wg.pgs``); nothing here touches megatron-core's global ``parallel_state`` groups. Gradients
equal the unsharded full-batch gradient: each micro-batch loss is normalised by the policy batch's
global token (or sequence) count, then scaled by ``num_microbatches * dp``. The optimizer is
megatron-core's (``megamarl.rl.optimizer``). The worker trains on a ``PolicyShare`` (``rl.dispatch``):
one optimizer step per PPO mini-batch, old log-probs computed once before the first. A non-finite
loss or gradient norm on any rank skips the update on every rank of the WG (``nonfinite_skipped``).
The full account (loss scaling, optimizer, data, faults): docs/design-notes.md, "megamarl/rl/worker.py".
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from functools import partial
from typing import cast

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megamarl.config import PolicyConfig
from megamarl.models.bridge import export_hf_weights
from megamarl.models.lora import export_lora_weights, set_active_adapter
from megamarl.parallel.collectives import all_gather_objects
from megamarl.parallel.placement import WorkerGroup
from megamarl.rl.adapters import AdapterSteps
from megamarl.rl.batch import SampleBatch
from megamarl.rl.critic import Critic, CriticConfig
from megamarl.rl.dispatch import PolicyShare, dp_parts, mini_batches, plan_policy, trainable_rows
from megamarl.rl.forward import (
    merge_rows,
    model_shape,
    packed_forward,
    padded_forward,
    sampled_logprobs,
    split_rows,
    tree_forward,
)
from megamarl.rl.losses import LossConfig, policy_loss
from megamarl.rl.micro_batches import MicroBatcher
from megamarl.rl.optimizer import any_rank, current_lr, grads_nonfinite
from megamarl.rl.reference import ReferenceModel
from megamarl.rl.update_metrics import RESPONSE_TOKENS, AgentMismatch, average, mean_over_steps, summarise
from megamarl.rl.worker_parts import AgentTraining, ModelHandle, batch_split, wire_training

logger = logging.getLogger(__name__)


class PolicyWorker:
    def __init__(
        self,
        name: str,
        cfg: PolicyConfig,
        wg: WorkerGroup,
        handle: ModelHandle,
        loss_cfg: LossConfig,
        *,
        agents: dict[str, AgentTraining] | None = None,
        ref_handle: ModelHandle | None = None,
        critic: CriticConfig | None = None,
        lora=None,
        total_steps: int = 1,
    ):
        """``handle.model`` is built in the training dtype (its parameters' dtype; bf16 or fp32).
        ``lora`` (a ``megamarl.models.lora.LoraConfig``): L2, one adapter per agent that names one
        (``agents[a].adapter``) on a frozen base; only adapters train, each micro-batch runs with its
        agent's adapter, the reference policy is the base itself (adapters off). ``total_steps``:
        trainer steps, the default length of the learning-rate decay."""
        if wg.pgs is None:  # wg.is_member
            raise ValueError(f"rank {dist.get_rank()} holds no shard of policy '{name}'")
        self.name, self.cfg, self.wg, self.loss_cfg = name, cfg, wg, loss_cfg
        self.device = wg.device  # every tensor of this WG's schedule lives here (see on_device)
        self.compute_dtype = next(handle.model.parameters()).dtype
        self.on_micro_batch = lambda: None  # progress display: called once per micro-batch forward
        self.vocab_size = handle.vocab_size
        model = handle.model.to(self.device)  # megatron-core builds on the current device already: a no-op
        self.agents = agents or {}
        self.split = batch_split(cfg, self.agents)
        self.batcher = MicroBatcher(cfg, self.agents, loss_cfg)
        self.adapters = sorted({a.adapter for a in self.agents.values() if a.adapter})
        parts = wire_training(  # adapters, DDP, reference, optimizer, critic (rl.worker_parts)
            name,
            cfg,
            wg,
            model,
            compute_dtype=self.compute_dtype,
            lora=lora,
            critic=critic,
            total_steps=total_steps,
            adapter_lrs={adapter: self._adapter_lr(adapter) for adapter in self.adapters},
            needs_ref=self._needs_ref(),
            ref_model=ref_handle.model if ref_handle else None,
        )
        self.model, self.window, self.rotary = parts.model, parts.window, parts.rotary
        self.uses_te, self.ref = parts.uses_te, parts.ref
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.critic, self.train_state = parts.critic, parts.train_state
        self.adapter_steps = AdapterSteps(self.model, self.optimizer, self.adapters)  # L2: which step
        self.num_updates = 0
        # Numerical faults: an update whose loss or gradient norm is not finite is skipped on every
        # rank of the WG (the flag is reduced over mp and dp); ``skip_streak`` counts them in a row.
        self.num_skipped = 0
        self.skip_streak = 0
        self.last_fault = ""  # which agents/episodes gave a non-finite loss, for the error message
        self._nonfinite_rows: list[str] = []
        # rollout vs training log-probs per agent (agent/<a>/mismatch_*), over the DP ranks' rows
        self.dp_gather = partial(all_gather_objects, group=wg.pgs.dp)
        self.mismatch = AgentMismatch(gather=self.dp_gather)

    def _adapter_lr(self, adapter: str) -> float:
        """The learning rate of LoRA adapter ``adapter``: its agent's ``lr``, else the policy's."""
        lrs = [a.lr for a in self.agents.values() if a.adapter == adapter and a.lr is not None]
        return lrs[0] if lrs else self.cfg.lr

    def _adapter(self, mb: SampleBatch) -> str | None:
        agents = set(mb.names("agent"))
        adapters = {self.agents[a].adapter if a in self.agents else None for a in agents}
        if len(adapters) > 1:
            raise RuntimeError(
                f"policy '{self.name}': a micro-batch mixes LoRA adapters {sorted(map(str, adapters))}"
            )
        return adapters.pop()

    def export_adapter(self, adapter: str):
        """Stream adapter ``adapter`` of this stage as PEFT tensors (L2 weight sync)."""
        return export_lora_weights(self.model, self.wg, adapter)

    def export(self):
        """Stream this stage's weights as (HF name, full tensor) for weight sync."""
        return export_hf_weights(self.model, self.wg)

    # ---- data layout ----------------------------------------------------------------------------
    def on_device(self, batch: SampleBatch) -> SampleBatch:
        """The one place batches move to the WG's device: every entry point that takes a batch from
        the driver (which collates on the CPU) calls it first, so tokens, masks, advantages, rewards
        and rollout logprobs, and everything derived from them, are on ``self.device``."""
        return batch.to(self.device)

    def my_part(self, batch: SampleBatch) -> SampleBatch:
        """This DP rank's part of a mini-batch (``rl.dispatch.dp_parts``: identical on TP/PP peers;
        a zero-weight stand-in row when the rank has none)."""
        assert self.wg.layout.dp is not None  # set by WorkerGroupLayout.__post_init__
        return dp_parts(batch, self.wg.layout.dp)[self.wg.dp_rank]

    def plan(self, batch: SampleBatch) -> PolicyShare:
        """This rank's share of a whole policy batch, planned here exactly as the driver plans it
        (``rl.dispatch.plan_policy``)."""
        assert self.wg.layout.dp is not None  # set by WorkerGroupLayout.__post_init__
        return plan_policy(batch, self.split, num_dp=self.wg.layout.dp)[self.wg.dp_rank]

    def _micro_batches(self, part: SampleBatch) -> list[SampleBatch]:
        """This rank's part cut into the micro-batches the schedule runs (``rl.micro_batches``)."""
        return self.batcher.split(part)

    def padding_fraction(self, part: SampleBatch) -> float:
        return self.batcher.padding_fraction(part)

    # ---- forward/backward -----------------------------------------------------------------------
    def _logprobs(self, logits: torch.Tensor, mb: SampleBatch, where) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs, entropy) [B, T] of ``mb``'s tokens under the distribution the engine sampled from
        (``rl.forward.sampled_logprobs``; this rank's vocabulary shard)."""
        assert self.wg.pgs is not None  # a worker lives on its WG's ranks
        return sampled_logprobs(
            logits,
            mb,
            where,
            tp_group=self.wg.pgs.tp,
            vocab_start=self.wg.tp_rank * logits.shape[-1],
            vocab_size=self.vocab_size,
        )

    def _schedule(
        self, micro_batches: list[SampleBatch], loss_func, *, forward_only: bool, reference: bool = False
    ) -> list:
        if not micro_batches:
            return []
        pp = self.wg.layout.pp
        forward_backward = get_forward_backward_func(pp_size=pp, vp_size=None)
        use_ref = reference and self.ref is not None
        if use_ref:
            assert self.ref is not None  # use_ref
            model, window, rotary = self.ref.model, self.ref.window, self.ref.rotary
        else:  # LoRA policies: the reference is the base model (adapters off)
            model, window, rotary = self.model, self.window, self.rotary

        def forward_step(data_iterator: Iterator[SampleBatch], model):
            mb = next(data_iterator)
            self.on_micro_batch()
            if self.adapters and not use_ref:
                set_active_adapter(model, None if reference else self._adapter(mb))
            if self.cfg.prefix_tree:
                output, where = tree_forward(model, window, rotary, mb)
            elif self.cfg.pack:
                output, where = packed_forward(model, window, mb, uses_te=self.uses_te)
            else:
                output, where = padded_forward(model, window, mb)
            return output, partial(loss_func, mb, where)

        assert self.wg.pgs is not None  # a worker lives on its WG's ranks
        p2p = P2PCommunicator(self.wg.pgs.pp, self.model.config) if pp > 1 else None
        with cast(ReferenceModel, self.ref).on_device() if use_ref else contextlib.nullcontext():
            return forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=[model],
                num_microbatches=len(micro_batches),
                seq_length=max(model_shape(mb, self.cfg.pack)[1] for mb in micro_batches),
                micro_batch_size=max(model_shape(mb, self.cfg.pack)[0] for mb in micro_batches),
                forward_only=forward_only,
                p2p_communicator=p2p,
                pg_collection=self.wg.pgs,
            )

    @torch.no_grad()
    def compute_logprobs(self, part: SampleBatch, *, reference: bool = False) -> torch.Tensor | None:
        """Logprobs [B, T] of this rank's part under the current (or the reference) policy; only the
        last PP stage gets them."""
        return self._forward_only(
            part, lambda mb, offset, logits: self._logprobs(logits, mb, offset)[0], reference
        )

    @torch.no_grad()
    def compute_values(self, part: SampleBatch) -> torch.Tensor | None:
        """Critic values [B, T] aligned like logprobs (value at t from the state before token t)."""
        return self._forward_only(
            part, lambda mb, offset, logits: cast(Critic, self.critic).values(mb, offset), False
        )

    def _forward_only(self, part: SampleBatch, per_token, reference: bool) -> torch.Tensor | None:
        def loss_func(mb, offset, logits):
            return logits.new_zeros(()), {"out": per_token(mb, offset, logits) * mb.response_mask}

        micro_batches = self._micro_batches(self.on_device(part))
        self.model.eval()
        outputs = self._schedule(micro_batches, loss_func, forward_only=True, reference=reference)
        self.model.train()
        if not self.wg.is_last_stage or not outputs:
            return None
        return merge_rows([o["out"] for o in outputs], micro_batches, part, part.tokens.shape[1])

    # ---- critic ---------------------------------------------------------------------------------
    def critic_targets(
        self, part: SampleBatch
    ) -> tuple[SampleBatch, torch.Tensor | None, torch.Tensor | None]:
        """``(part with advantages, returns, values)`` from the critic's values on the last stage
        (``Critic.targets``); other stages run the forward pass only and need none of them."""
        part = self.on_device(part)
        values = self.compute_values(part)
        if values is None:
            return part, None, None
        part, returns = cast(Critic, self.critic).targets(part, values)  # values: a critic's
        return part, returns, values

    # ---- per-agent settings ---------------------------------------------------------------------
    def _needs_ref(self) -> bool:
        return self.loss_cfg.kl_coef > 0 or any(a.loss.kl_coef > 0 for a in self.agents.values())

    def trainable(self, batch: SampleBatch) -> SampleBatch:
        """Rows of agents that train (``agents.<a>.frozen`` drops an agent's samples)."""
        return trainable_rows(batch, self.split.frozen_agents)

    def _loss_cfg(self, mb: SampleBatch) -> LossConfig:
        """The loss settings of ``mb``'s agents (a micro-batch only mixes agents that train alike)."""
        losses = [
            self.agents[a].loss if a in self.agents else self.loss_cfg for a in sorted(set(mb.names("agent")))
        ]
        return losses[0] if losses and all(loss == losses[0] for loss in losses) else self.loss_cfg

    # ---- the update -----------------------------------------------------------------------------
    def mini_batches(self, batch: SampleBatch) -> list[SampleBatch]:
        """The policy batch cut into PPO mini-batches (``rl.dispatch.mini_batches``)."""
        return mini_batches(batch, self.split)

    def train_step(self, batch: SampleBatch) -> dict[str, float]:
        """One update on a whole policy batch (advantages set), planned here (``plan``): for callers
        that hold the batch; the trainer sends each rank its planned share (``train_share``)."""
        if batch.advantages is None and not self.critic.enabled:
            raise ValueError(f"policy '{self.name}': train_step needs a batch with advantages")
        return self.train_share(self.plan(batch))

    def train_share(self, share: PolicyShare) -> dict[str, float]:
        """``ppo_epochs`` passes over this rank's share, one optimizer step per mini-batch (losses
        normalised by each mini-batch's global counts); then the learning-rate schedule advances once."""
        self.adapter_steps.begin(share.stepping, share.dropped)
        if not share.minis:  # every row of the policy was a frozen agent's (or below lora.min_samples)
            return self.adapter_steps.metrics()
        if share.minis[0].rows.advantages is None and not self.critic.enabled:
            raise ValueError(f"policy '{self.name}': train_share needs parts with advantages")
        parts = [self.on_device(mini.rows) for mini in share.minis]
        counts = [mini.counts for mini in share.minis]  # of each whole mini-batch (all DP ranks)
        timings = {}
        start = time.perf_counter()
        # With one epoch and one mini-batch the proximal policy *is* the current one (ratio 1, same
        # values as a recompute), so the extra forward pass is only needed otherwise; it runs once,
        # before the first optimizer step.
        needs_old = self.cfg.ppo_epochs > 1 or len(parts) > 1
        olds = [self.compute_logprobs(part) for part in parts] if needs_old else [None] * len(parts)
        timings["timing_s/old_logprobs"] = time.perf_counter() - start
        start = time.perf_counter()
        refs = (
            [self.compute_logprobs(part, reference=True) for part in parts]
            if self._needs_ref()
            else [None] * len(parts)
        )
        timings["timing_s/ref_logprobs"] = time.perf_counter() - start
        critics: list = [None] * len(parts)
        if self.critic.enabled:
            start = time.perf_counter()
            for i, part in enumerate(parts):
                parts[i], returns, values = self.critic_targets(part)
                critics[i] = (returns, values)
            timings["timing_s/values"] = time.perf_counter() - start
        collected: list[dict[str, float]] = []
        start = time.perf_counter()
        for _ in range(self.cfg.ppo_epochs):
            collected = [
                self._update(part, old, count, ref=ref, critic=critic)
                for part, old, count, ref, critic in zip(parts, olds, counts, refs, critics, strict=True)
            ]
        timings["timing_s/update"] = time.perf_counter() - start
        metrics = mean_over_steps(collected)
        metrics["lr"] = current_lr(self.optimizer)
        metrics["optimizer_steps"] = float(len(parts) * self.cfg.ppo_epochs)
        metrics["padding_fraction"] = average([self.padding_fraction(part) for part in parts])
        if (
            self.cfg.pack
        ):  # tokens one pass forwards on this rank: sample tokens, or trie nodes with prefix_tree
            metrics["forwarded_tokens"] = float(self.batcher.forwarded_tokens(parts))
        self.scheduler.step(increment=1)
        if not any(part.response_mask.any() for part in parts):  # zero-weight stand-ins (dp_parts): no data
            metrics = {
                k: v
                for k, v in metrics.items()
                if k in ("grad_norm", "lr", "optimizer_steps", "padding_fraction", "forwarded_tokens")
            }
        return {**metrics, **timings, **self.mismatch.metrics(), **self.adapter_steps.metrics()}

    def _update(
        self, part: SampleBatch, old: torch.Tensor | None, counts: dict, *, ref=None, critic=None
    ) -> dict[str, float]:
        self._nonfinite_rows = []
        lr = current_lr(self.optimizer)
        collected = self.backward(part, old, counts, ref=ref, critic=critic)
        # every DP rank's micro-batches (collective): a loss is the sum of the ranks' shares, a mean
        # weighted by every rank's tokens, so the step's metrics are of the whole batch on each rank
        collected = [metrics for rank in self.dp_gather(collected) for metrics in rank]
        grad_norm = self._clip_and_step()
        if not math.isfinite(grad_norm):
            return self._skipped(collected)
        self.num_updates += 1
        self.skip_streak = 0
        return summarise(collected, grad_norm=grad_norm, lr=lr, nonfinite_skipped=0.0)

    def _skipped(self, collected: list[dict[str, float]]) -> dict[str, float]:
        """Bookkeeping for an update that ``_clip_and_step`` refused (weights and optimizer state
        unchanged, so the engines never receive non-finite weights)."""
        self.num_skipped += 1
        self.skip_streak += 1
        rows = self._nonfinite_rows
        where = (
            f"non-finite loss in micro-batches of {', '.join(rows[:8])}"
            if rows
            else "finite loss but non-finite gradient norm (samples not attributable)"
        )
        self.last_fault = f"policy '{self.name}' update {self.num_updates + self.num_skipped}: {where}"
        logger.warning("skipped update (%d in a row): %s", self.skip_streak, self.last_fault)
        finite = [{k: v for k, v in c.items() if math.isfinite(v)} for c in collected]
        return summarise(
            finite,
            lr=current_lr(self.optimizer),
            nonfinite_skipped=1.0,
            nonfinite_streak=float(self.skip_streak),
        )

    def backward(
        self,
        part: SampleBatch,
        old: torch.Tensor | None,
        counts: dict,
        *,
        ref: torch.Tensor | None = None,
        critic: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    ) -> list[dict[str, float]]:
        """Fresh gradients (DP-reduced into ``param.main_grad``) of the policy loss on ``part``;
        ``counts`` are the policy batch's global token/sequence counts. Returns micro-batch metrics."""
        micro_batches = self._micro_batches(self.on_device(part))
        olds, refs = split_rows(old, micro_batches, part), split_rows(ref, micro_batches, part)
        returns, old_values = (split_rows(t, micro_batches, part) for t in (critic or (None, None)))
        assert self.wg.layout.dp is not None  # set by WorkerGroupLayout.__post_init__
        scale = len(micro_batches) * self.wg.layout.dp
        collected: list[dict[str, float]] = []
        position = {id(mb): i for i, mb in enumerate(micro_batches)}

        def loss_func(mb, offset, logits):
            logprobs, entropy = self._logprobs(logits, mb, offset)
            i = position[id(mb)]
            loss, metrics = policy_loss(
                logprobs,
                mb.advantages,
                mb.response_mask,
                self._loss_cfg(mb),
                old_logprobs=olds[i] if olds is not None else None,
                rollout_logprobs=mb.rollout_logprobs,
                ref_logprobs=refs[i] if refs is not None else None,
                entropy=entropy,
                **counts,
            )
            collected.append({**metrics.as_dict(), RESPONSE_TOKENS: float(mb.response_mask.sum())})
            if metrics.mismatch_rows is not None:
                self.mismatch.add(mb.names("agent"), metrics.mismatch_rows)
            if returns is not None:
                loss = loss + self.critic.loss(mb, offset, returns[i], old_values[i], counts, collected[-1])
            if not torch.isfinite(loss.detach()):
                agents, episodes = sorted(set(mb.names("agent"))), sorted(set(mb.names("episode")))
                self._nonfinite_rows.append(f"agents {agents} episodes {episodes[:4]}")
            return loss * scale, {"loss": metrics.loss}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.critic.zero_grad()
        self._schedule(micro_batches, loss_func, forward_only=False)
        self.critic.reduce_grads()
        return collected

    def _clip_and_step(self) -> float:
        """megatron-core's clip-and-step; returns the global gradient norm, or NaN when any rank of the
        WG saw a non-finite loss or gradient, in which case no rank steps (same decision everywhere)."""
        # one device flag, read once with the WG's decision (no host sync per gradient buffer)
        fault = self.critic.grads_nonfinite(grads_nonfinite(self.model, device=self.device))
        if self._nonfinite_rows:
            fault = torch.ones_like(fault)
        assert self.wg.pgs is not None  # a worker lives on its WG's ranks
        if any_rank(fault, self.wg.pgs.intra_dist_opt, self.device):
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            self.critic.zero_grad()
            return float("nan")
        _, grad_norm, _ = self.adapter_steps.step()  # L2: the adapters that step this update
        self.critic.step()
        return float(grad_norm) if grad_norm is not None else 0.0
