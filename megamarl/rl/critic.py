"""The critic of a critic estimator (``EstimatorTraits.needs_critic``, e.g. gae): a value head on the
policy's own Megatron model (shared trunk) with its own optimizer, its targets and its loss.

The head sits on the last pipeline stage, on the final hidden states the policy's ``LogitWindow``
keeps. It lives outside DDP and the model's checkpoint: its gradients are averaged over DP here and
clipped on their own; it is saved by ``megamarl.runtime.checkpoint`` (replicated, layout-free). On
the other stages a ``Critic`` holds no head and every call is a no-op, so the worker never asks
which stage it is on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megamarl.parallel.collectives import all_reduce_sum
from megamarl.parallel.placement import WorkerGroup
from megamarl.rl.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig
from megamarl.rl.batch import SampleBatch
from megamarl.rl.forward import LogitWindow
from megamarl.rl.losses import LOSS_AGGREGATIONS, masked_mean, value_loss
from megamarl.rl.optimizer import nonfinite
from megamarl.rl.packing import place_predictions
from megamarl.rl.tree import TreeView, place_tree
from megamarl.rl.vocab_parallel import place_window


@dataclass
class CriticConfig:
    """A critic estimator with a value head on the policy's model. ``advantage.norm_std`` whitens the
    advantages over the policy batch's response tokens on all DP ranks."""

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


class Critic:
    enabled = True

    def __init__(
        self,
        name: str,
        cfg: CriticConfig,
        wg: WorkerGroup,
        window: LogitWindow,
        *,
        hidden_size: int,
        lr: float,
        grad_clip: float,
    ):
        self.cfg, self.wg, self.window, self.grad_clip = cfg, wg, window, grad_clip
        self.head: ValueHead | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        if wg.is_last_stage:
            if not window.enabled:
                raise ValueError(
                    f"policies.{name}: the critic needs the output-layer hook (no sequence parallelism)"
                )
            self.head = ValueHead(hidden_size).to(wg.device)
            self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8)

    # what moves with the training state (``policies.<p>.offload_train_state``)
    @property
    def modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.head,) if self.head is not None else ()

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        return (self.optimizer,) if self.optimizer is not None else ()

    @property
    def has_state(self) -> bool:
        """This rank holds the head (the last stage): it saves and loads ``state``."""
        return self.head is not None

    def values(self, mb: SampleBatch, where) -> torch.Tensor:
        """[B, T] values of the last forward's windowed hidden states (``where``: the window offset,
        ``(packed, positions)`` for a packed row, or a ``TreeView``)."""
        assert self.head is not None  # values are read on the last stage, which holds the head
        values = self.head(self.window.hidden)  # [B, W] (packed, tree: [1, K])
        if isinstance(where, TreeView):
            return place_tree(
                where.rows(values.unsqueeze(-1)).squeeze(-1),
                where.predictions,
                mb.num_samples,
                mb.tokens.shape[1],
            )
        if isinstance(where, tuple):
            packed, positions = where
            return place_predictions(values, packed, positions, seq_len=mb.tokens.shape[1])
        return place_window(values, mb.tokens.shape[1], where)

    def targets(self, part: SampleBatch, values: torch.Tensor) -> tuple[SampleBatch, torch.Tensor]:
        """The registered critic estimator's ``[B, T]`` advantages (set on ``part``) and returns;
        whitening statistics span every DP rank's part."""
        assert self.wg.pgs is not None  # a worker lives on its WG's ranks
        estimator = ADVANTAGE_ESTIMATORS.get(self.cfg.advantage.estimator, key="algorithm.estimator")
        adv, returns = estimator(
            part.rewards,
            part.group_index(),
            self.cfg.advantage,
            response_mask=part.response_mask,
            values=values,
            all_reduce=all_reduce_sum(self.wg.pgs.dp),
        )
        return part.replace(advantages=adv), returns

    def loss(self, mb: SampleBatch, offset, returns, old_values, counts: dict, metrics: dict) -> torch.Tensor:
        """``value_coef`` x the clipped value loss, aggregated by ``loss_agg``; metrics into ``metrics``."""
        values = self.values(mb, offset)
        per_token, clipped = value_loss(
            values, old_values, returns, mb.response_mask, clip=self.cfg.value_clip
        )
        vf_loss = LOSS_AGGREGATIONS.get(self.cfg.loss_agg, key="algorithm.value_loss_agg")(
            per_token, mb.response_mask, **counts
        )
        metrics["vf_loss"] = float(vf_loss.detach())
        metrics["vf_clip_frac"] = float(masked_mean(clipped.float(), mb.response_mask))
        metrics["value_mean"] = float(masked_mean(values.detach(), mb.response_mask))
        return self.cfg.value_coef * vf_loss

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def reduce_grads(self) -> None:
        """Average the head's gradients over DP, as DDP does for the model's."""
        if self.head is None or self.wg.layout.dp == 1:
            return
        assert self.wg.pgs is not None  # a worker lives on its WG's ranks
        for p in self.head.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.wg.pgs.dp)
                p.grad.div_(self.wg.layout.dp)

    def grads_nonfinite(self, fault: torch.Tensor) -> torch.Tensor:
        """``fault`` (the model's device flag) raised where the head's gradients are not finite."""
        if self.head is None:
            return fault
        grads = [p.grad for p in self.head.parameters() if p.grad is not None]
        return torch.maximum(fault, nonfinite(grads, device=fault.device))

    def step(self) -> None:
        if self.head is None:
            return
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.grad_clip)
        assert self.optimizer is not None  # built with the head
        self.optimizer.step()

    def state(self) -> dict | None:
        """Value head and its optimizer (identical on every last-stage rank), for checkpoints."""
        if self.head is None:
            return None
        assert self.optimizer is not None  # built with the head
        return {"value_head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state(self, state: dict) -> None:
        if self.head is not None:
            self.head.load_state_dict(state["value_head"])
            assert self.optimizer is not None  # built with the head
            self.optimizer.load_state_dict(state["optimizer"])


class NoCritic:
    """A policy without a critic estimator: the worker calls the same hooks, and they do nothing."""

    enabled = False
    has_state = False
    modules: tuple[torch.nn.Module, ...] = ()
    optimizers: tuple[torch.optim.Optimizer, ...] = ()

    def zero_grad(self) -> None:
        pass

    def reduce_grads(self) -> None:
        pass

    def grads_nonfinite(self, fault: torch.Tensor) -> torch.Tensor:
        return fault

    def step(self) -> None:
        pass

    def state(self) -> None:
        return None

    def load_state(self, state: dict) -> None:
        pass
