"""One policy's worker group (WG) on this rank: the Megatron model, its optimizer, log-probability
recompute and the policy-gradient update, all through megatron-core's forward/backward schedules.

How it differs from a single-model RL trainer: several ``PolicyWorker`` objects can live on the same
rank (colocated WGs), each with its own process groups (``wg.pgs``); nothing here touches
megatron-core's global ``parallel_state`` groups.

Loss scaling, so gradients equal the unsharded full-batch gradient exactly: every micro-batch loss is
normalised by the *global* token (or sequence) count of this policy's batch (``policy_loss(num_tokens=...)``),
then multiplied by ``num_microbatches * dp`` to undo megatron-core's division by the number of
micro-batches and DDP's averaging over data-parallel ranks.

Optimizer: megatron-core's (``megamarl.rl.optimizer``): parameters in the policy's training dtype
(bf16 or fp32), fp32 main parameters, Adam moments and gradient buffers, the distributed optimizer
(``policies.<p>.distributed_optimizer``) sharding the fp32 state over the WG's DP ranks, clipping by
the global norm, and megatron-core's ``OptimizerParamScheduler`` (``policies.<p>.lr_schedule``),
advanced once per policy update. On CPU it runs through ``megamarl.parallel.cpu_compat``.

Data: the worker trains on a ``PolicyShare`` (``megamarl.rl.dispatch``), this DP rank's part of
every PPO mini-batch (``policies.<p>.mini_batch_size``, verl's ``ppo_mini_batch_size``) with each
mini-batch's global loss counts, planned on the driver by the same pure function ``train_step``
applies to a whole policy batch; each mini-batch is one optimizer step; the proximal (old) log-probs
are computed once, before the first mini-batch.

Numerical faults: a non-finite loss (any micro-batch, any rank) or gradient norm skips the update on
every rank of the WG: no optimizer step, so neither the weights nor the engines ever see NaN. It is
counted (``nonfinite_skipped``), logged with the agents/episodes of the offending micro-batches, and
the trainer stops the run after ``trainer.max_nonfinite_updates`` in a row.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megamarl.config import PolicyConfig
from megamarl.models.bridge import export_hf_weights, unwrap
from megamarl.models.lora import add_lora_adapter, export_lora_weights, set_active_adapter
from megamarl.parallel.collectives import all_reduce_sum
from megamarl.parallel.placement import WorkerGroup
from megamarl.rl.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig
from megamarl.rl.batch import SampleBatch
from megamarl.rl.dispatch import BatchSplit, PolicyShare, dp_parts, mini_batches, plan_policy, trainable_rows
from megamarl.rl.losses import (
    LOSS_AGGREGATIONS,
    LossConfig,
    masked_mean,
    policy_loss,
    value_loss,
)
from megamarl.rl.offload import TrainStateOffload
from megamarl.rl.optimizer import (
    any_rank,
    build_optimizer,
    build_scheduler,
    current_lr,
    grads_nonfinite,
    nonfinite,
)
from megamarl.rl.packing import (
    pack,
    packed_logprobs,
    padding_fraction,
    place_predictions,
    prediction_positions,
    split_by_tokens,
)
from megamarl.rl.vocab_parallel import place_window, scale_logits, vocab_parallel_logprobs

logger = logging.getLogger(__name__)


class NumericalFaultError(RuntimeError):
    """Too many non-finite updates in a row (``trainer.max_nonfinite_updates``)."""


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, T, T] bool, True = masked (megatron-core convention); right padding needs nothing more."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)


def first_logit_position(response_mask: torch.Tensor) -> int:
    """Earliest position whose logits predict a response token (one before the first response token)."""
    has_response = response_mask.any(dim=1)
    if not has_response.any():
        return 0
    first = response_mask[has_response].float().argmax(dim=1).min()
    return max(int(first) - 1, 0)


def restricted_vocab_mask(allowed, vocab_start: int, num_local: int,
                          device: torch.device | str = "cpu") -> torch.Tensor | None:
    """[B, V_local] True where a row's sampling excluded the token (rows without a set: all False)."""
    if not any(allowed):
        return None
    mask = torch.zeros(len(allowed), num_local, dtype=torch.bool, device=device)
    for row, ids in enumerate(allowed):
        if ids:
            local = torch.tensor(ids, dtype=torch.long, device=device) - vocab_start
            mask[row] = True
            mask[row, local[(local >= 0) & (local < num_local)]] = False
    return mask


class LogitWindow:
    """Runs the output layer only from position ``start`` on.

    The RL losses need logits where response tokens are predicted; prompts are most of every
    sequence in multi-agent transcripts, and the [T, V] logits (V = 49k-150k) dominate the cost of a
    small model's step. A forward pre-hook slices the decoder output before the output layer, so
    parameter names and the model are unchanged. Off (start stays 0) with sequence parallelism,
    where the decoder output is sharded along the sequence.
    """

    def __init__(self, model: torch.nn.Module):
        self.start = 0
        self.positions: torch.Tensor | None = None  # packed rows: exactly these positions
        self.hidden: torch.Tensor | None = None  # the last forward's windowed decoder output [W, B, H]
        gpt = unwrap(model)
        self.enabled = bool(getattr(gpt, "post_process", False)) and not gpt.config.sequence_parallel
        if self.enabled:
            gpt.output_layer.register_forward_pre_hook(self._slice)

    def set(self, response_mask: torch.Tensor) -> int:
        self.positions = None
        self.start = first_logit_position(response_mask) if self.enabled else 0
        return self.start

    def select(self, positions: torch.Tensor) -> bool:
        """Packed rows: run the output layer on ``positions`` [K] of the packed row only (the
        positions whose next token is a response token); False when the hook is off."""
        self.start, self.positions = 0, positions if self.enabled else None
        return self.enabled

    def _slice(self, module, args):
        # decoder output is [S, B, H]; packed: [L, 1, H] -> [K, 1, H]
        self.hidden = args[0][self.start :] if self.positions is None else args[0][self.positions]
        return (self.hidden,) + tuple(args[1:])


@dataclass
class ModelHandle:
    """What the worker needs from the model bridge for one policy."""

    model: torch.nn.Module  # GPTModel (this rank's shard)
    vocab_size: int  # true vocabulary size (padding columns beyond it are masked)


@dataclass
class CriticConfig:
    """A critic estimator (``EstimatorTraits.needs_critic``, e.g. gae) with a value head on the
    policy's own Megatron model (shared trunk). ``advantage.norm_std`` whitens the advantages over
    the policy batch's response tokens on all DP ranks."""

    advantage: AdvantageConfig = field(default_factory=lambda: AdvantageConfig(estimator="gae"))
    value_coef: float = 0.5
    value_clip: float | None = 0.2
    # ``algorithm.value_loss_agg``: a regression to returns, aggregated on its own terms, not with
    # the policy loss's ``algorithm.loss_agg`` (whose choices are about policy-gradient length bias)
    loss_agg: str = "token-mean"


class ValueHead(torch.nn.Module):
    """``V(s_t) = w . h_t + b`` on the final hidden states (after the final norm), TP-replicated,
    on the last pipeline stage. Zero-initialised: values start at 0."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [W, B, H] -> [B, W]
        return self.linear(hidden.float()).squeeze(-1).transpose(0, 1)


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
    return BatchSplit(mini_batch_size=cfg.mini_batch_size,
                      agent_mini_batch_sizes={a: t.mini_batch_size for a, t in agents.items() if t.mini_batch_size},
                      frozen_agents=frozenset(a for a, t in agents.items() if t.frozen))


class PolicyWorker:
    def __init__(
        self, name: str, cfg: PolicyConfig, wg: WorkerGroup, handle: ModelHandle, loss_cfg: LossConfig, *,
        agents: dict[str, AgentTraining] | None = None, ref_handle: ModelHandle | None = None,
        critic: CriticConfig | None = None, lora=None, total_steps: int = 1,
    ):
        """``handle.model`` is built in the training dtype (its parameters' dtype; bf16 or fp32).
        ``lora`` (a ``megamarl.models.lora.LoraConfig``): L2, one adapter per agent that names one
        (``agents[a].adapter``) on a frozen base; only adapters train, each micro-batch runs with its
        agent's adapter, the reference policy is the base itself (adapters off). ``total_steps``:
        trainer steps, the default length of the learning-rate decay."""
        if not wg.is_member:
            raise ValueError(f"rank {dist.get_rank()} holds no shard of policy '{name}'")
        self.name, self.cfg, self.wg, self.loss_cfg = name, cfg, wg, loss_cfg
        self.device = wg.device  # every tensor of this WG's schedule lives here (see on_device)
        self.compute_dtype = next(handle.model.parameters()).dtype
        self.on_micro_batch = lambda: None  # progress display: called once per micro-batch forward
        self.vocab_size = handle.vocab_size
        model = handle.model.to(self.device)  # megatron-core builds on the current device already: a no-op
        config = model.config
        self.agents = agents or {}
        self.split = batch_split(cfg, self.agents)
        self.adapters = sorted({a.adapter for a in self.agents.values() if a.adapter})
        if self.adapters:
            if lora is None:
                raise ValueError(f"policies.{name}: agents name LoRA adapters {self.adapters} but policies.{name}.lora is not set")
            for adapter in self.adapters:  # before DDP: it allocates grad buffers for what requires grad
                add_lora_adapter(model, wg, adapter, lora)
        config.finalize_model_grads_func = finalize_model_grads
        config.variable_seq_lengths = True  # micro-batches differ in length; PP communicates shapes
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=cfg.distributed_optimizer
        )
        self.model = DistributedDataParallel(config, ddp_config, model, pg_collection=wg.pgs)
        self.window = LogitWindow(model)
        self.uses_te = model.layer_spec == "te"  # the spec it was built with (bridge.build_model)
        # Reference policy for the KL term: a frozen copy of the initial weights in the same layout and
        # dtype, without gradients or optimizer state; ``ref_offload`` keeps it in host memory between uses.
        self.ref_model = ref_handle.model.eval() if ref_handle is not None else None
        self.ref_offload = None
        if self.ref_model is not None:
            self.ref_model.requires_grad_(False)
            self.ref_window = LogitWindow(self.ref_model)
            self.ref_offload = TrainStateOffload(self.device, [self.ref_model]) if cfg.ref_offload else None
            if self.ref_offload is not None:
                self.ref_offload.offload()
            else:
                self.ref_model.to(self.device)
        if self._needs_ref() and self.ref_model is None and not self.adapters:
            raise ValueError(f"policies.{name}: kl_coef > 0 needs a reference model (ref_handle)")
        self.critic, self.value_head = critic, None
        if critic is not None and wg.is_last_stage and not self.window.enabled:
            raise ValueError(f"policies.{name}: the critic needs the output-layer hook (no sequence parallelism)")
        adapter_lrs = {adapter: self._adapter_lr(adapter) for adapter in self.adapters}
        self.optimizer = build_optimizer(
            self.model, wg, lr=cfg.lr, min_lr=cfg.lr_schedule.min_lr, weight_decay=cfg.weight_decay,
            grad_clip=cfg.grad_clip, dtype=self.compute_dtype, distributed=cfg.distributed_optimizer,
            adapter_lrs=adapter_lrs,
        )
        self.scheduler = build_scheduler(self.optimizer, cfg.lr_schedule, lr=cfg.lr, total_steps=total_steps)
        self.value_optimizer = None
        if critic is not None and wg.is_last_stage:
            # Outside DDP and the model's checkpoint: gradients are averaged over DP in
            # _reduce_value_head, clipped on their own; it is saved by megamarl.runtime.checkpoint
            # (replicated, layout-free).
            self.value_head = ValueHead(config.hidden_size).to(self.device)
            self.value_optimizer = torch.optim.AdamW(self.value_head.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8)
        # ``policies.<p>.offload_train_state``: moved to host memory while colocated engines generate
        self.train_state = TrainStateOffload(
            self.device, [m for m in (self.model, self.value_head) if m is not None],
            [o for o in (self.optimizer, self.value_optimizer) if o is not None],
        )
        self.num_updates = 0
        # Numerical faults: an update whose loss or gradient norm is not finite is skipped on every
        # rank of the WG (the flag is reduced over mp and dp); ``skip_streak`` counts them in a row.
        self.num_skipped = 0
        self.skip_streak = 0
        self.last_fault = ""  # which agents/episodes gave a non-finite loss, for the error message
        self._nonfinite_rows: list[str] = []

    def _adapter_lr(self, adapter: str) -> float:
        """The learning rate of LoRA adapter ``adapter``: its agent's ``lr``, else the policy's."""
        lrs = [a.lr for a in self.agents.values() if a.adapter == adapter and a.lr is not None]
        return lrs[0] if lrs else self.cfg.lr

    def _adapter(self, mb: SampleBatch) -> str | None:
        agents = set(mb.names("agent"))
        adapters = {self.agents[a].adapter if a in self.agents else None for a in agents}
        if len(adapters) > 1:
            raise RuntimeError(f"policy '{self.name}': a micro-batch mixes LoRA adapters {sorted(map(str, adapters))}")
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
        return dp_parts(batch, self.wg.layout.dp)[self.wg.dp_rank]

    def plan(self, batch: SampleBatch) -> PolicyShare:
        """This rank's share of a whole policy batch, planned here exactly as the driver plans it
        (``rl.dispatch.plan_policy``)."""
        return plan_policy(batch, self.split, num_dp=self.wg.layout.dp)[self.wg.dp_rank]

    def _micro_batches(self, part: SampleBatch) -> list[SampleBatch]:
        """Micro-batches of ``cfg.micro_batch_size`` rows; with per-agent settings, each micro-batch
        holds one agent's rows (its own size and loss settings). Rows keep their order within an agent."""
        if not part.num_samples:
            return []
        if not self.agents:
            return self._chunks(part, self.cfg.micro_batch_size)
        names = part.names("agent")
        out = []
        for agent in sorted(set(names)):
            rows = torch.tensor([n == agent for n in names], dtype=torch.bool, device=part.device)
            size = self.agents[agent].micro_batch_size if agent in self.agents else self.cfg.micro_batch_size
            out.extend(self._chunks(part.select(rows), size))
        return out

    def _chunks(self, rows: SampleBatch, size: int) -> list[SampleBatch]:
        """Padded: consecutive rows, ``size`` at a time. Packed (``policies.<p>.pack``): at most
        ``max_tokens_per_micro_batch`` real tokens (and ``size`` rows) per micro-batch, first-fit
        decreasing, so a micro-batch costs what its tokens cost."""
        if not self.cfg.pack:
            return rows.micro_batches(max_samples=size)
        budget = self.cfg.max_tokens_per_micro_batch or size * int(rows.lengths.max())
        return [rows.select(group) for group in split_by_tokens(rows.lengths, budget, max_samples=size)]

    def padding_fraction(self, part: SampleBatch) -> float:
        """Share of the token slots of this rank's micro-batches that are padding (0 when packed)."""
        if self.cfg.pack or not part.num_samples:
            return 0.0
        micro_batches = self._micro_batches(part)
        shapes = [(mb.num_samples, mb.tokens.shape[1]) for mb in micro_batches]
        lengths = torch.cat([mb.lengths for mb in micro_batches])
        return padding_fraction(lengths, shapes)

    # ---- forward/backward -----------------------------------------------------------------------
    def _vocab_start(self, logits: torch.Tensor) -> int:
        return self.wg.tp_rank * logits.shape[-1]

    def _logprobs(self, logits: torch.Tensor, mb: SampleBatch, where) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs, entropy) [B, T] of ``mb``'s tokens. ``where``: the window offset of padded
        rows, or ``(packed, positions)`` for a packed row (logits [1, K, V_local] at ``positions``)."""
        vocab_start = self._vocab_start(logits)
        packed = None
        if isinstance(where, tuple):  # one packed row: per-position sampling settings of its sample
            packed, positions = where
            rows = packed.sample_ids[positions].tolist()
            logits = logits.transpose(0, 1)  # [K, 1, V]: each position its own "row"
            temperatures = [mb.temperatures[r] for r in rows] if mb.temperatures else ()
            allowed = [mb.allowed[r] for r in rows] if mb.allowed else ()
        else:
            temperatures, allowed = mb.temperatures, mb.allowed
        # the distribution the engine sampled from; temperature scaling and log-softmax in fp32 whatever
        # the compute dtype
        logits = scale_logits(logits, temperatures)
        disallowed = restricted_vocab_mask(allowed, vocab_start, logits.shape[-1], logits.device)
        if disallowed is not None:  # renormalise over the set the engine sampled from
            logits = logits.masked_fill(disallowed.unsqueeze(1), float("-inf"))
        if packed is not None:
            return packed_logprobs(logits.transpose(0, 1), packed, positions=positions, tp_group=self.wg.pgs.tp,
                                   vocab_start=vocab_start, vocab_size=self.vocab_size, seq_len=mb.tokens.shape[1])
        return vocab_parallel_logprobs(
            logits, mb.tokens, tp_group=self.wg.pgs.tp, vocab_start=vocab_start,
            vocab_size=self.vocab_size, offset=where,
        )

    def _schedule(
        self, micro_batches: list[SampleBatch], loss_func, *, forward_only: bool, reference: bool = False
    ) -> list:
        if not micro_batches:
            return []
        pp = self.wg.layout.pp
        forward_backward = get_forward_backward_func(pp_size=pp, vp_size=None)
        if reference and self.ref_model is not None:
            model, window = self.ref_model, self.ref_window
        else:  # LoRA policies: the reference is the base model (adapters off)
            model, window = self.model, self.window

        def forward_step(data_iterator: Iterator[SampleBatch], model):
            mb = next(data_iterator)
            self.on_micro_batch()
            if self.adapters and model is not self.ref_model:
                set_active_adapter(model, None if reference else self._adapter(mb))
            if self.cfg.pack:
                return self._packed_forward(model, window, mb, loss_func)
            seq_len = mb.tokens.shape[1]
            positions = torch.arange(seq_len, device=mb.device).expand_as(mb.tokens)
            offset = window.set(mb.response_mask)
            output = model(mb.tokens, positions, causal_mask(seq_len, mb.device))
            return output, partial(loss_func, mb, offset)

        p2p = P2PCommunicator(self.wg.pgs.pp, self.model.config) if pp > 1 else None
        with self._reference_on_device(reference and self.ref_model is not None):
            return forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=[model],
                num_microbatches=len(micro_batches),
                seq_length=max(_model_shape(mb, self.cfg.pack)[1] for mb in micro_batches),
                micro_batch_size=max(_model_shape(mb, self.cfg.pack)[0] for mb in micro_batches),
                forward_only=forward_only,
                p2p_communicator=p2p,
                pg_collection=self.wg.pgs,
            )

    def _packed_forward(self, model, window: LogitWindow, mb: SampleBatch, loss_func):
        """``mb``'s rows as one packed row [1, L]: block-diagonal causal attention (the local spec's
        explicit mask on CPU; megatron-core's ``PackedSeqParams`` (THD) with Transformer Engine),
        positions restarting per sample, the output layer only where a response token is predicted."""
        packed = pack(mb.tokens, mb.attention_mask)
        positions = prediction_positions(packed, mb.response_mask)
        if not positions.numel():  # a zero-weight stand-in row: any position keeps the graph connected
            positions = prediction_positions(packed)[:1]
        if not window.select(positions):
            positions = torch.arange(packed.num_tokens, device=mb.device)  # sequence parallel: whole row
        if self.uses_te:
            output = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.seq_params())
        else:
            output = model(packed.tokens, packed.position_ids, packed.causal_mask())
        return output, partial(loss_func, mb, (packed, positions))

    @torch.no_grad()
    def compute_logprobs(self, part: SampleBatch, *, reference: bool = False) -> torch.Tensor | None:
        """Logprobs [B, T] of this rank's part under the current (or the reference) policy; only the
        last PP stage gets them."""
        return self._forward_only(part, lambda mb, offset, logits: self._logprobs(logits, mb, offset)[0], reference)

    @torch.no_grad()
    def compute_values(self, part: SampleBatch) -> torch.Tensor | None:
        """Critic values [B, T] aligned like logprobs (value at t from the state before token t)."""
        return self._forward_only(part, lambda mb, offset, logits: self._values(mb, offset), False)

    def _forward_only(self, part: SampleBatch, per_token, reference: bool) -> torch.Tensor | None:
        def loss_func(mb, offset, logits):
            return logits.new_zeros(()), {"out": per_token(mb, offset, logits) * mb.response_mask}

        micro_batches = self._micro_batches(self.on_device(part))
        self.model.eval()
        outputs = self._schedule(micro_batches, loss_func, forward_only=True, reference=reference)
        self.model.train()
        if not self.wg.is_last_stage or not outputs:
            return None
        return _merge_rows([o["out"] for o in outputs], micro_batches, part, part.tokens.shape[1])

    def _values(self, mb: SampleBatch, where) -> torch.Tensor:
        values = self.value_head(self.window.hidden)  # [B, W] (packed: [1, K])
        if isinstance(where, tuple):
            packed, positions = where
            return place_predictions(values, packed, positions, seq_len=mb.tokens.shape[1])
        return place_window(values, mb.tokens.shape[1], where)

    # ---- critic ---------------------------------------------------------------------------------
    def critic_targets(self, part: SampleBatch) -> tuple[SampleBatch, torch.Tensor | None, torch.Tensor | None]:
        """The registered critic estimator's ``[B, T]`` advantages and returns from the critic's
        values: ``(part with advantages, returns, values)`` on the last stage (other stages do not
        need them). Whitening statistics span every DP rank's part."""
        part = self.on_device(part)
        values = self.compute_values(part)
        if values is None:
            return part, None, None
        estimator = ADVANTAGE_ESTIMATORS.get(self.critic.advantage.estimator, key="algorithm.estimator")
        adv, returns = estimator(part.rewards, part.group_index(), self.critic.advantage, response_mask=part.response_mask,
                                 values=values, all_reduce=all_reduce_sum(self.wg.pgs.dp))
        return part.replace(advantages=adv), returns, values

    def critic_state(self) -> dict | None:
        """Value head and its optimizer (identical on every last-stage rank), for checkpoints."""
        if self.value_head is None:
            return None
        return {"value_head": self.value_head.state_dict(), "optimizer": self.value_optimizer.state_dict()}

    def load_critic_state(self, state: dict) -> None:
        if self.value_head is not None:
            self.value_head.load_state_dict(state["value_head"])
            self.value_optimizer.load_state_dict(state["optimizer"])

    def _reduce_value_head(self) -> None:
        """Average the value head's gradients over DP, as DDP does for the model's."""
        if self.value_head is None or self.wg.layout.dp == 1:
            return
        for p in self.value_head.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.wg.pgs.dp)
                p.grad.div_(self.wg.layout.dp)

    # ---- per-agent settings ---------------------------------------------------------------------
    def _needs_ref(self) -> bool:
        return self.loss_cfg.kl_coef > 0 or any(a.loss.kl_coef > 0 for a in self.agents.values())

    def trainable(self, batch: SampleBatch) -> SampleBatch:
        """Rows of agents that train (``agents.<a>.frozen`` drops an agent's samples)."""
        return trainable_rows(batch, self.split.frozen_agents)

    def _loss_cfg(self, mb: SampleBatch) -> LossConfig:
        agents = set(mb.names("agent"))
        if len(agents) == 1 and (agent := agents.pop()) in self.agents:
            return self.agents[agent].loss
        return self.loss_cfg

    # ---- the update -----------------------------------------------------------------------------
    def mini_batches(self, batch: SampleBatch) -> list[SampleBatch]:
        """The policy batch cut into PPO mini-batches (``rl.dispatch.mini_batches``)."""
        return mini_batches(batch, self.split)

    def train_step(self, batch: SampleBatch) -> dict[str, float]:
        """One update on a whole policy batch (advantages set), planned here (``plan``): for callers
        that hold the batch; the trainer sends each rank its planned share (``train_share``)."""
        if batch.advantages is None and self.critic is None:
            raise ValueError(f"policy '{self.name}': train_step needs a batch with advantages")
        return self.train_share(self.plan(batch))

    def train_share(self, share: PolicyShare) -> dict[str, float]:
        """``ppo_epochs`` passes over this rank's share, one optimizer step per mini-batch (losses
        normalised by each mini-batch's global counts); then the learning-rate schedule advances once."""
        if not share.minis:  # every row of the policy was a frozen agent's
            return {}
        if share.minis[0].rows.advantages is None and self.critic is None:
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
        refs = [self.compute_logprobs(part, reference=True) for part in parts] if self._needs_ref() else [None] * len(parts)
        timings["timing_s/ref_logprobs"] = time.perf_counter() - start
        critics: list = [None] * len(parts)
        if self.critic is not None:
            start = time.perf_counter()
            for i, part in enumerate(parts):
                parts[i], returns, values = self.critic_targets(part)
                critics[i] = (returns, values)
            timings["timing_s/values"] = time.perf_counter() - start
        collected: list[dict[str, float]] = []
        start = time.perf_counter()
        for _ in range(self.cfg.ppo_epochs):
            collected = [self._update(part, old, count, ref=ref, critic=critic)
                         for part, old, count, ref, critic in zip(parts, olds, counts, refs, critics)]
        timings["timing_s/update"] = time.perf_counter() - start
        metrics = _mean_over_steps(collected)
        metrics["lr"] = current_lr(self.optimizer)
        metrics["optimizer_steps"] = float(len(parts) * self.cfg.ppo_epochs)
        metrics["padding_fraction"] = _mean([self.padding_fraction(part) for part in parts])
        self.scheduler.step(increment=1)
        if not any(part.response_mask.any() for part in parts):  # zero-weight stand-ins (dp_parts): no data
            metrics = {k: v for k, v in metrics.items() if k in ("grad_norm", "lr", "optimizer_steps", "padding_fraction")}
        return {**metrics, **timings}

    def _update(self, part: SampleBatch, old: torch.Tensor | None, counts: dict, *, ref=None, critic=None) -> dict[str, float]:
        self._nonfinite_rows = []
        lr = current_lr(self.optimizer)
        collected = self.backward(part, old, counts, ref=ref, critic=critic)
        grad_norm = self._clip_and_step()
        if not math.isfinite(grad_norm):
            return self._skipped(collected)
        self.num_updates += 1
        self.skip_streak = 0
        return _summarise(collected, grad_norm=grad_norm, lr=lr, nonfinite_skipped=0.0)

    def _skipped(self, collected: list[dict[str, float]]) -> dict[str, float]:
        """Bookkeeping for an update that ``_clip_and_step`` refused (weights and optimizer state
        unchanged, so the engines never receive non-finite weights)."""
        self.num_skipped += 1
        self.skip_streak += 1
        rows = self._nonfinite_rows
        where = (f"non-finite loss in micro-batches of {', '.join(rows[:8])}" if rows
                 else "finite loss but non-finite gradient norm (samples not attributable)")
        self.last_fault = f"policy '{self.name}' update {self.num_updates + self.num_skipped}: {where}"
        logger.warning("skipped update (%d in a row): %s", self.skip_streak, self.last_fault)
        finite = [{k: v for k, v in c.items() if math.isfinite(v)} for c in collected]
        return _summarise(finite, lr=current_lr(self.optimizer), nonfinite_skipped=1.0,
                          nonfinite_streak=float(self.skip_streak))

    def backward(
        self, part: SampleBatch, old: torch.Tensor | None, counts: dict, *, ref: torch.Tensor | None = None,
        critic: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    ) -> list[dict[str, float]]:
        """Fresh gradients (DP-reduced into ``param.main_grad``) of the policy loss on ``part``;
        ``counts`` are the policy batch's global token/sequence counts. Returns micro-batch metrics."""
        micro_batches = self._micro_batches(self.on_device(part))
        olds, refs = _split_rows(old, micro_batches, part), _split_rows(ref, micro_batches, part)
        returns, old_values = (_split_rows(t, micro_batches, part) for t in (critic or (None, None)))
        scale = len(micro_batches) * self.wg.layout.dp
        collected: list[dict[str, float]] = []
        position = {id(mb): i for i, mb in enumerate(micro_batches)}

        def loss_func(mb, offset, logits):
            logprobs, entropy = self._logprobs(logits, mb, offset)
            i = position[id(mb)]
            loss, metrics = policy_loss(
                logprobs, mb.advantages, mb.response_mask, self._loss_cfg(mb),
                old_logprobs=olds[i] if olds is not None else None, rollout_logprobs=mb.rollout_logprobs,
                ref_logprobs=refs[i] if refs is not None else None, entropy=entropy, **counts,
            )
            collected.append(metrics.as_dict())
            if returns is not None:
                loss = loss + self._value_loss(mb, offset, returns[i], old_values[i], counts, collected[-1])
            if not torch.isfinite(loss.detach()):
                agents, episodes = sorted(set(mb.names("agent"))), sorted(set(mb.names("episode")))
                self._nonfinite_rows.append(f"agents {agents} episodes {episodes[:4]}")
            return loss * scale, {"loss": metrics.loss}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.value_optimizer is not None:
            self.value_optimizer.zero_grad(set_to_none=True)
        self._schedule(micro_batches, loss_func, forward_only=False)
        self._reduce_value_head()
        return collected

    def _value_loss(self, mb, offset, returns, old_values, counts, metrics: dict) -> torch.Tensor:
        values = self._values(mb, offset)
        per_token, clipped = value_loss(values, old_values, returns, mb.response_mask, clip=self.critic.value_clip)
        vf_loss = LOSS_AGGREGATIONS.get(self.critic.loss_agg, key="algorithm.value_loss_agg")(
            per_token, mb.response_mask, **counts)
        metrics["vf_loss"] = float(vf_loss.detach())
        metrics["vf_clip_frac"] = float(masked_mean(clipped.float(), mb.response_mask))
        metrics["value_mean"] = float(masked_mean(values.detach(), mb.response_mask))
        return self.critic.value_coef * vf_loss

    def _clip_and_step(self) -> float:
        """megatron-core's clip-and-step; returns the global gradient norm, or NaN when any rank of the
        WG saw a non-finite loss or gradient, in which case no rank steps (same decision everywhere)."""
        # one device flag, read once with the WG's decision (no host sync per gradient buffer)
        fault = grads_nonfinite(self.model, device=self.device)
        if self.value_head is not None:
            grads = [p.grad for p in self.value_head.parameters() if p.grad is not None]
            fault = torch.maximum(fault, nonfinite(grads, device=self.device))
        if self._nonfinite_rows:
            fault = torch.ones_like(fault)
        if any_rank(fault, self.wg.pgs.intra_dist_opt, self.device):
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            if self.value_optimizer is not None:
                self.value_optimizer.zero_grad(set_to_none=True)
            return float("nan")
        _, grad_norm, _ = self.optimizer.step()
        if self.value_optimizer is not None:
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.value_head.parameters(), self.cfg.grad_clip)
            self.value_optimizer.step()
        return float(grad_norm) if grad_norm is not None else 0.0

    @contextlib.contextmanager
    def _reference_on_device(self, active: bool):
        """``policies.<p>.ref_offload``: the reference model visits the device only while it is used."""
        if not active or self.ref_offload is None:
            yield
            return
        self.ref_offload.restore()
        try:
            yield
        finally:
            self.ref_offload.offload()


def _model_shape(mb: SampleBatch, packed: bool) -> tuple[int, int]:
    """(rows, tokens) the model sees for ``mb``: [B, T] padded, [1, sum of lengths] packed."""
    return (1, int(mb.lengths.sum())) if packed else (mb.num_samples, mb.tokens.shape[1])


def _row_ids(mb: SampleBatch) -> list[tuple[int, int, int, int]]:
    return list(zip(mb.episode.tolist(), mb.agent.tolist(), mb.turn.tolist(), mb.branch.tolist()))


def _split_rows(
    full: torch.Tensor | None, micro_batches: list[SampleBatch], part: SampleBatch
) -> list[torch.Tensor] | None:
    """Cut per-row tensors of ``part`` ([B, T]) into the rows and width of each micro-batch (which may
    regroup rows, e.g. by agent)."""
    if full is None:
        return None
    index = {key: i for i, key in enumerate(_row_ids(part))}
    return [full[[index[k] for k in _row_ids(mb)], : mb.tokens.shape[1]] for mb in micro_batches]


def _merge_rows(
    pieces: list[torch.Tensor], micro_batches: list[SampleBatch], part: SampleBatch, width: int
) -> torch.Tensor:
    """Inverse of ``_split_rows``: micro-batch rows back into ``part``'s row order, padded to ``width``."""
    index = {key: i for i, key in enumerate(_row_ids(part))}
    out = pieces[0].new_zeros(part.num_samples, width)
    for piece, mb in zip(pieces, micro_batches):
        out[[index[k] for k in _row_ids(mb)], : piece.shape[1]] = piece
    return out


def _summarise(collected: list[dict[str, float]], **extra: float) -> dict[str, float]:
    """Micro-batch metrics -> sums for losses (they are already globally normalised), means otherwise."""
    if not collected:
        return dict(extra)
    keys = collected[0].keys()
    summed = {"loss", "pg_loss", "kl_loss", "vf_loss"}
    out = {k: (sum if k in summed else _mean)([c[k] for c in collected if k in c]) for k in keys}
    out.update(extra)
    return out


def _mean_over_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """Per-optimizer-step metrics (the last epoch's) -> their mean; ``nonfinite_*`` summed."""
    if not steps:
        return {}
    keys = {k for step in steps for k in step}
    out = {k: _mean([step[k] for step in steps if k in step]) for k in keys}
    for key in ("nonfinite_skipped",):
        if key in out:
            out[key] = sum(step.get(key, 0.0) for step in steps)
    if "nonfinite_streak" in out:
        out["nonfinite_streak"] = max(step.get("nonfinite_streak", 0.0) for step in steps)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
