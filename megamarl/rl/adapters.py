"""L2 adapter by adapter: which LoRA adapters of a policy step in an update, and a megatron-core
optimizer step that leaves the others untouched.

``adapter_plan`` is the rule (pure, on the policy batch's agent column, run by the driver when it
plans the update): an adapter steps when its agents' rows in the policy batch number at least
``policies.<p>.lora.min_samples``; the rows of an adapter below the minimum are dropped from the update
and counted (``samples_dropped``), never kept for a later step; an adapter whose agents are all
``agents.<a>.frozen`` never steps. ``min_samples: 0`` is the rule of a plain L2 update: every trained
adapter steps every optimizer step, even on no rows of its own.

``AdapterSteps.step`` is megatron-core's ``optimizer.step()`` with the main parameters of the
adapters that do not step taken out right after the gradients are prepared (``grad = None``): Adam
then skips them (no moment, no step count, no weight decay) and the global gradient norm, and so the
clipping, covers the stepping adapters only. When every adapter steps it is ``optimizer.step()``.
megatron-core checkpoints one Adam step count for all parameters: ``checkpoint_steps`` gives every
adapter the largest count (and zero moments where it has none) for the save, and ``load_steps`` puts
each adapter's own count back after a load (an adapter that never stepped starts fresh).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AdapterPlan:
    """One policy update's adapters: those that step, and the rows of those below the minimum."""

    stepping: tuple[str, ...]  # sorted
    dropped: Mapping[str, int] = field(default_factory=dict)  # adapter -> rows dropped from the update
    rows: Mapping[str, int] = field(default_factory=dict)  # adapter -> rows in the policy batch


def adapter_plan(
    agents: Sequence[str],
    agent_adapters: Mapping[str, str],
    *,
    min_samples: int,
    frozen_agents: Iterable[str] = (),
) -> AdapterPlan:
    """The rule of the module doc. ``agents``: the policy batch's agent column (trainable rows only);
    ``agent_adapters``: every L2 agent of the policy -> its adapter; ``frozen_agents``: agents that
    never train (an adapter steps unless every agent naming it is frozen)."""
    frozen = set(frozen_agents)
    trained = sorted({a for agent, a in agent_adapters.items() if agent not in frozen})
    rows = Counter(agent_adapters[a] for a in agents if a in agent_adapters)
    stepping = tuple(a for a in trained if rows[a] >= min_samples)
    dropped = {a: rows[a] for a in trained if 0 < rows[a] < min_samples}
    return AdapterPlan(stepping, dropped, {a: rows[a] for a in trained})


def _main_params(inner, model_params: set[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The parameters ``inner`` (one megatron-core optimizer of a chain) steps for ``model_params``:
    the model parameters themselves (``FP32Optimizer``), their fp32 copies (the float16 optimizer)
    or this rank's shards of them (the distributed optimizer)."""
    index = getattr(inner, "model_param_group_index_map", None)
    if index is not None:  # distributed optimizer: (group, position) of each shard's main parameter
        groups = inner.optimizer.param_groups
        return [groups[g]["params"][i] for p, (g, i) in index.items() if p in model_params]
    if hasattr(inner, "float16_groups"):  # float16 optimizer: fp32 copies beside the bf16 params
        pairs = [
            (model, main)
            for halves, mains in zip(inner.float16_groups, inner.fp32_from_float16_groups, strict=True)
            for model, main in zip(halves, mains, strict=True)
        ]
        pairs += [(p, p) for group in inner.fp32_from_fp32_groups for p in group]
        return [main for model, main in pairs if model in model_params]
    return [p for group in inner.optimizer.param_groups for p in group["params"] if p in model_params]


class AdapterSteps:
    """A policy's adapters in its optimizer: ``step`` them selectively, count steps and dropped rows."""

    def __init__(self, model, optimizer, adapters: Sequence[str]) -> None:
        """``model``: the DDP-wrapped shard whose adapters are ``adapters``; ``optimizer``: its
        megatron-core optimizer (plain or chained)."""
        self.optimizer, self.adapters = optimizer, list(adapters)
        named = list(model.named_parameters())
        inners = getattr(optimizer, "chained_optimizers", [optimizer])
        self.main_params = {}  # adapter -> per inner optimizer, its main parameters
        for adapter in self.adapters:
            own = {p for n, p in named if f".lora_adapters.{adapter}." in n}
            self.main_params[adapter] = [_main_params(inner, own) for inner in inners]
        self.stepping: tuple[str, ...] | None = None  # this update's (None: every parameter)
        self.steps = dict.fromkeys(self.adapters, 0)  # optimizer steps this update
        self.dropped: dict[str, int] = {}
        self.total_steps = dict.fromkeys(self.adapters, 0)  # Adam's step count of each adapter

    def begin(self, stepping: tuple[str, ...] | None, dropped: Mapping[str, int]) -> None:
        """An update's plan (``PolicyShare.stepping``/``dropped``); None: not L2, every parameter."""
        self.stepping, self.dropped = stepping, dict(dropped)
        self.steps = dict.fromkeys(self.adapters, 0)

    def step(self):
        """megatron-core's ``optimizer.step()`` over the stepping adapters only (see the module doc)."""
        skipped = [a for a in self.adapters if self.stepping is not None and a not in self.stepping]
        if not skipped:
            result = self.optimizer.step()
        else:
            inners = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
            for k, inner in enumerate(inners):
                held = [p for a in skipped for p in self.main_params[a][k]]
                inner.prepare_grads = _dropping_grads(inner.prepare_grads, held)
            try:
                result = self.optimizer.step()
            finally:
                for inner in inners:
                    del inner.prepare_grads  # the class's method again
        if result[0]:
            for adapter in self.adapters:
                self.steps[adapter] += adapter not in skipped
                self.total_steps[adapter] += adapter not in skipped
        return result

    def _states(self, adapter: str) -> Iterator[tuple[dict, torch.Tensor]]:
        """(optimizer state, main parameter) of each of ``adapter``'s parameters on this rank."""
        inners = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for inner, params in zip(inners, self.main_params[adapter], strict=True):
            for param in params:
                yield inner.optimizer.state[param], param

    @contextmanager
    def checkpoint_steps(self) -> Iterator[dict[str, int]]:
        """While saving: every adapter's parameters carry the largest step count (zero moments where an
        adapter never stepped); yields each adapter's own count, to save beside the checkpoint."""
        own = dict(self.total_steps)
        if len(set(own.values())) <= 1:  # one count already: the plain checkpoint
            yield own
            return
        common = max(own.values())
        for adapter in self.adapters:
            for state, param in self._states(adapter):
                if not state:
                    state.update(exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
                state["step"] = torch.tensor(float(common))
        try:
            yield own
        finally:
            self.load_steps(own)

    def local_step(self) -> int:
        """The largest step count in this rank's adapter state (a checkpoint without per-adapter counts
        holds one count for all; a rank without a shard of any adapter reads 0)."""
        steps = [int(state["step"]) for a in self.adapters for state, _ in self._states(a) if "step" in state]
        return max(steps, default=0)

    def load_steps(self, steps: Mapping[str, int]) -> None:
        """Each adapter's own step count into its parameters' optimizer state (after a load, which
        gave them all the saved common one); an adapter at 0 gets an empty state (Adam starts it)."""
        for adapter in self.adapters:
            count = int(steps.get(adapter, 0))
            self.total_steps[adapter] = count
            for state, _ in self._states(adapter):
                if count == 0:
                    state.clear()
                elif state:
                    state["step"] = torch.tensor(float(count))

    def metrics(self) -> dict[str, float]:
        """``adapter/<a>/steps`` (optimizer steps this update) and ``adapter/<a>/samples_dropped``."""
        if self.stepping is None:
            return {}
        out = {f"adapter/{a}/steps": float(n) for a, n in self.steps.items()}
        out.update({f"adapter/{a}/samples_dropped": float(self.dropped.get(a, 0)) for a in self.adapters})
        return out


def _dropping_grads(prepare, params: list[torch.Tensor]):
    """``prepare`` (a megatron-core optimizer's ``prepare_grads``), then ``params``' gradients unset."""

    def prepare_then_drop() -> bool:
        found_inf = prepare()
        for param in params:
            param.grad = None
        return found_inf

    return prepare_then_drop
