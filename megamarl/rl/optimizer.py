"""A policy's optimizer: megatron-core's ``get_megatron_optimizer`` and ``OptimizerParamScheduler``
over the WG's own process groups, with a whole-WG non-finite check in front of every step.

megatron-core gives bf16 (or fp32) parameters, fp32 main parameters and Adam moments, fp32 gradient
buffers, global-norm clipping and, with ``distributed_optimizer``, ZeRO-1 sharding over the WG's DP
ranks. Unlike Megatron-LM's loop: the learning-rate schedule advances once per policy update (one
trainer step); an update is skipped on every rank of the WG when any rank saw a non-finite loss or
gradient; megatron-core's build-time gathers are scoped to the WG (``_collectives_in``); two
megatron-core 0.16 checkpoint bugs are patched (``_keep_step_on_load``,
``_index_params_as_installed``); LoRA policies optimize only the adapters, one parameter group per
adapter with its agent's learning rate. Details: docs/design-notes.md, "megamarl/rl/optimizer.py".
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megamarl.config_sections import LrScheduleConfig


@contextlib.contextmanager
def _collectives_in(group):
    """Run megatron-core's world-wide ``all_gather_object`` of parameter-group keys inside ``group``."""
    from megatron.core import optimizer as megatron_optimizer

    real = megatron_optimizer.torch
    scoped_dist = types.SimpleNamespace(
        get_world_size=lambda group_=None: dist.get_world_size(group_ or group),
        all_gather_object=lambda out, obj, group_=None: dist.all_gather_object(
            out, obj, group=group_ or group
        ),
    )
    proxy = types.SimpleNamespace(distributed=_Fallback(scoped_dist, real.distributed))
    megatron_optimizer.torch = _Fallback(proxy, real)
    try:
        yield
    finally:
        megatron_optimizer.torch = real


class _Fallback:
    """Attribute lookup in ``first``, then ``second``."""

    def __init__(self, first, second):
        self._first, self._second = first, second

    def __getattr__(self, name):
        return getattr(self._first, name) if hasattr(self._first, name) else getattr(self._second, name)


def _keep_step_on_load() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    get_states, set_states = (
        DistributedOptimizer._get_main_param_and_optimizer_states,
        DistributedOptimizer._set_main_param_and_optimizer_states,
    )
    if getattr(set_states, "megamarl_keeps_step", False):
        return

    def get_without_step(self, model_param):
        # the step is saved once, in the param groups (``state_dict``), not as a "sharded" 0-d tensor
        return {k: v for k, v in get_states(self, model_param).items() if k != "step"}

    def set_keeping_step(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:  # already restored from the param groups by load_state_dict
                tensors = {**tensors, "step": state["step"]}
        return set_states(self, model_param, tensors)

    load_state_dict = DistributedOptimizer.load_state_dict

    def load_with_own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        # megatron-core hands every parameter the *same* step tensor; torch's Adam increments it in
        # place once per parameter, so the bias correction would run ahead by the parameter count
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    set_keeping_step.megamarl_keeps_step = True  # type: ignore[attr-defined]  # a marker on the patch
    DistributedOptimizer._get_main_param_and_optimizer_states = get_without_step
    DistributedOptimizer._set_main_param_and_optimizer_states = set_keeping_step
    DistributedOptimizer.load_state_dict = load_with_own_steps


def _index_params_as_installed(optimizer) -> None:
    """Rebuild each distributed optimizer's ``model_param_group_index_map`` in the order megatron-core
    installed the groups' parameters: fp32 ones, then bf16/fp16 ones (see the module doc)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner, DistributedOptimizer):
            inner.model_param_group_index_map = {
                param: (group_index, order)
                for group_index, (fp32, half) in enumerate(
                    zip(
                        inner.model_fp32_groups, inner.model_float16_groups, strict=False
                    )  # strict=False: megatron-core's parallel group lists
                )
                for order, param in enumerate([*fp32, *half])
            }


def build_optimizer(
    ddp_model,
    wg,
    *,
    lr: float,
    weight_decay: float,
    grad_clip: float,
    dtype: torch.dtype,
    distributed: bool,
    min_lr: float = 0.0,
    adapter_lrs: dict[str, float] | None = None,
):
    """megatron-core's optimizer for ``ddp_model`` (a megatron-core ``DistributedDataParallel``).

    ``dtype``: the model parameters' dtype (bf16: fp32 main params; fp32: ``FP32Optimizer``).
    ``adapter_lrs``: LoRA adapter name -> learning rate (a parameter group each)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey

    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        clip_grad=grad_clip if grad_clip > 0 else math.inf,  # inf: norm computed, never clipped
        bf16=dtype == torch.bfloat16,
        fp16=False,
        params_dtype=dtype,
        use_distributed_optimizer=distributed,
    )
    # Weight decay on every matrix, none on norms and biases (megatron-core's and verl's convention).
    overrides = dict(get_standard_config_overrides(config))
    for adapter, adapter_lr in sorted((adapter_lrs or {}).items()):
        overrides[ParamKey(name=f"*.lora_adapters.{adapter}.*")] = {
            "max_lr": adapter_lr,
            "min_lr": min_lr * adapter_lr / lr,
        }
    _keep_step_on_load()
    with _collectives_in(wg.pgs.intra_dist_opt):
        optimizer = get_megatron_optimizer(
            config,
            [ddp_model],
            config_overrides=overrides,
            use_gloo_process_groups=False,
            pg_collection=wg.pgs,
        )
    _index_params_as_installed(optimizer)
    return optimizer


def build_scheduler(optimizer, schedule: LrScheduleConfig, *, lr: float, total_steps: int):
    """megatron-core's ``OptimizerParamScheduler``, one increment per policy update."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = max(schedule.decay_steps or total_steps, schedule.warmup_steps + 1)
    weight_decay = optimizer.config.weight_decay if hasattr(optimizer, "config") else 0.0
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if schedule.warmup_steps else lr,
        max_lr=lr,
        min_lr=schedule.min_lr,
        lr_warmup_steps=schedule.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=schedule.decay,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def current_lr(optimizer) -> float:
    """The learning rate of the first (default) parameter group."""
    return float(optimizer.param_groups[0]["lr"])


def nonfinite(tensors: Iterable[torch.Tensor], *, device: torch.device) -> torch.Tensor:
    """1.0 when any of ``tensors`` holds a NaN or an infinity, else 0.0: a 0-d tensor on ``device``, left
    there (``any_rank`` reads it with the WG's decision: one host sync per step). One fp32 sum per tensor
    instead of ``isfinite(...).all()``: a NaN or an infinity survives a sum (inf - inf is NaN), and no
    boolean copy of the whole gradient buffer is made. Finite values whose sum passes fp32's range
    (~3.4e38) read as non-finite too, and skip that update as an overflowing gradient norm would."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for tensor in tensors:
        total = total + tensor.sum(dtype=torch.float32)
    return (~torch.isfinite(total)).float()


def grads_nonfinite(ddp_model, *, device: torch.device) -> torch.Tensor:
    """``nonfinite`` over this rank's DDP gradient buffers."""
    return nonfinite((buffer.grad_data for buffer in ddp_model.buffers), device=device)


def any_rank(flag: bool | torch.Tensor, group, device) -> bool:
    """True on every rank of ``group`` when ``flag`` (a bool, or a tensor > 0) is True on any."""
    value = (
        flag.reshape(1).float()
        if isinstance(flag, torch.Tensor)
        else torch.tensor([float(flag)], device=device)
    )
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item() > 0)
