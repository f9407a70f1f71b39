"""One policy's worker group (WG) on this rank: the Megatron model, its optimizer, log-probability
recompute and the policy-gradient update, all through megatron-core's forward/backward schedules.

How it differs from a single-model RL trainer: several ``PolicyWorker`` objects can live on the same
rank (colocated WGs), each with its own process groups (``wg.pgs``); nothing here touches
megatron-core's global ``parallel_state`` groups.

Loss scaling, so gradients equal the unsharded full-batch gradient exactly: every micro-batch loss is
normalised by the *global* token (or sequence) count of this policy's batch (``policy_loss(num_tokens=...)``),
then multiplied by ``num_microbatches * dp`` to undo megatron-core's division by the number of
micro-batches and DDP's averaging over data-parallel ranks.

Optimizer: on GPU, megatron-core's optimizer (distributed optimizer) is the intended path; on CPU its
optimizers hard-code CUDA tensors, so a torch AdamW steps the DDP main grads (``param.main_grad``).
Gradient clipping computes the global norm over the model-parallel group, counting TP-replicated
parameters once and the tied output weight only on the first pipeline stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch
import torch.distributed as dist

from megamarl.config import PolicyConfig
from megamarl.parallel.placement import WorkerGroup
from megamarl.rl.batch import SampleBatch
from megamarl.rl.losses import LossConfig, policy_loss
from megamarl.rl.vocab_parallel import vocab_parallel_logprobs


def causal_mask(seq_len: int) -> torch.Tensor:
    """[1, 1, T, T] bool, True = masked (megatron-core convention); right padding needs nothing more."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)


@dataclass
class ModelHandle:
    """What the worker needs from the model bridge for one policy."""

    model: torch.nn.Module  # GPTModel (this rank's shard)
    vocab_size: int  # true vocabulary size (padding columns beyond it are masked)


class PolicyWorker:
    def __init__(self, name: str, cfg: PolicyConfig, wg: WorkerGroup, handle: ModelHandle, loss_cfg: LossConfig):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        if not wg.is_member:
            raise ValueError(f"rank {dist.get_rank()} holds no shard of policy '{name}'")
        self.name, self.cfg, self.wg, self.loss_cfg = name, cfg, wg, loss_cfg
        self.vocab_size = handle.vocab_size
        model = handle.model
        config = model.config
        config.finalize_model_grads_func = finalize_model_grads
        config.variable_seq_lengths = True  # micro-batches differ in length; PP communicates shapes
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        self.model = DistributedDataParallel(config, ddp_config, model, pg_collection=wg.pgs)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), eps=1e-8
        )
        self.num_updates = 0

    def export(self):
        """Stream this stage's weights as (HF name, full tensor) for weight sync."""
        from megamarl.models.bridge import export_hf_weights

        return export_hf_weights(self.model, self.wg)

    # ---- data layout ----------------------------------------------------------------------------
    def my_part(self, batch: SampleBatch) -> SampleBatch:
        """This DP rank's share (identical on TP/PP peers: the split is deterministic)."""
        return batch.balance_across_dp(self.wg.layout.dp)[self.wg.dp_rank]

    def _micro_batches(self, part: SampleBatch) -> list[SampleBatch]:
        return part.micro_batches(max_samples=self.cfg.micro_batch_size) if part.num_samples else []

    # ---- forward/backward -----------------------------------------------------------------------
    def _vocab_start(self, logits: torch.Tensor) -> int:
        return self.wg.tp_rank * logits.shape[-1]

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab_parallel_logprobs(
            logits, tokens, tp_group=self.wg.pgs.tp, vocab_start=self._vocab_start(logits), vocab_size=self.vocab_size
        )

    def _schedule(self, micro_batches: list[SampleBatch], loss_func, *, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        if not micro_batches:
            return []
        pp = self.wg.layout.pp
        forward_backward = get_forward_backward_func(pp_size=pp, vp_size=None)

        def forward_step(data_iterator: Iterator[SampleBatch], model):
            mb = next(data_iterator)
            seq_len = mb.tokens.shape[1]
            positions = torch.arange(seq_len).expand_as(mb.tokens)
            output = model(mb.tokens, positions, causal_mask(seq_len))
            return output, partial(loss_func, mb)

        p2p = P2PCommunicator(self.wg.pgs.pp, self.model.config) if pp > 1 else None
        return forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
            micro_batch_size=max(mb.num_samples for mb in micro_batches),
            forward_only=forward_only,
            p2p_communicator=p2p,
            pg_collection=self.wg.pgs,
        )

    @torch.no_grad()
    def compute_logprobs(self, part: SampleBatch) -> torch.Tensor | None:
        """Current-policy logprobs [B, T] of this rank's part; only the last PP stage gets them."""
        def loss_func(mb, logits):
            logprobs, _ = self._logprobs(logits, mb.tokens)
            return logits.new_zeros(()), {"logprobs": logprobs * mb.response_mask}

        self.model.eval()
        outputs = self._schedule(self._micro_batches(part), loss_func, forward_only=True)
        self.model.train()
        if not self.wg.is_last_stage or not outputs:
            return None
        width = part.tokens.shape[1]
        return torch.cat([torch.nn.functional.pad(o["logprobs"], (0, width - o["logprobs"].shape[1])) for o in outputs])

    def train_step(self, batch: SampleBatch) -> dict[str, float]:
        """One optimizer step per ``ppo_epochs`` on this policy's whole batch (advantages set)."""
        if batch.advantages is None:
            raise ValueError(f"policy '{self.name}': train_step needs a batch with advantages")
        part = self.my_part(batch)
        old = self.compute_logprobs(part)
        counts = dict(num_tokens=int(batch.response_mask.sum()), num_seqs=batch.num_samples)
        metrics: dict[str, float] = {}
        for _ in range(self.cfg.ppo_epochs):
            metrics = self._update(part, old, counts)
        return metrics

    def _update(self, part: SampleBatch, old: torch.Tensor | None, counts: dict) -> dict[str, float]:
        collected = self.backward(part, old, counts)
        grad_norm = self._clip_and_step()
        self.num_updates += 1
        return _summarise(collected, grad_norm=grad_norm, lr=self.cfg.lr)

    def backward(self, part: SampleBatch, old: torch.Tensor | None, counts: dict) -> list[dict[str, float]]:
        """Fresh gradients (DP-reduced into ``param.main_grad``) of the policy loss on ``part``;
        ``counts`` are the policy batch's global token/sequence counts. Returns micro-batch metrics."""
        micro_batches = self._micro_batches(part)
        olds = _split_rows(old, micro_batches)
        scale = len(micro_batches) * self.wg.layout.dp
        collected: list[dict[str, float]] = []
        position = {id(mb): i for i, mb in enumerate(micro_batches)}

        def loss_func(mb, logits):
            logprobs, entropy = self._logprobs(logits, mb.tokens)
            old_lp = olds[position[id(mb)]] if olds is not None else None
            loss, metrics = policy_loss(
                logprobs, mb.advantages, mb.response_mask, self.loss_cfg,
                old_logprobs=old_lp, rollout_logprobs=mb.rollout_logprobs, entropy=entropy, **counts,
            )
            collected.append(metrics.as_dict())
            return loss * scale, {"loss": metrics.loss}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)
        self._schedule(micro_batches, loss_func, forward_only=False)
        return collected

    def _clip_and_step(self) -> float:
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype) if hasattr(p, "main_grad") else p.grad
        squares = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if p.grad is None or not self._counts_for_norm(p):
                continue
            squares += p.grad.double().pow(2).sum()
        dist.all_reduce(squares, group=self.wg.pgs.mp)
        norm = math.sqrt(float(squares))
        if self.cfg.grad_clip > 0 and norm > self.cfg.grad_clip:
            factor = self.cfg.grad_clip / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(factor)
        self.optimizer.step()
        return norm

    def _counts_for_norm(self, p: torch.nn.Parameter) -> bool:
        if getattr(p, "shared", False) and not self.wg.is_first_stage:
            return False  # tied output weight copy on the last stage
        return bool(getattr(p, "tensor_model_parallel", False)) or self.wg.tp_rank == 0


def _split_rows(full: torch.Tensor | None, micro_batches: list[SampleBatch]) -> list[torch.Tensor] | None:
    if full is None:
        return None
    out, start = [], 0
    for mb in micro_batches:
        rows, width = mb.tokens.shape
        out.append(full[start : start + rows, :width])
        start += rows
    return out


def _summarise(collected: list[dict[str, float]], **extra: float) -> dict[str, float]:
    """Micro-batch metrics -> sums for losses (they are already globally normalised), means otherwise."""
    if not collected:
        return dict(extra)
    keys = collected[0].keys()
    summed = {"loss", "pg_loss", "kl_loss"}
    out = {k: (sum if k in summed else _mean)([c[k] for c in collected if k in c]) for k in keys}
    out.update(extra)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
