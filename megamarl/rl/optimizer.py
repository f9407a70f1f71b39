"""A policy's optimizer: megatron-core's ``get_megatron_optimizer`` and ``OptimizerParamScheduler``
over the WG's own process groups, with a whole-WG non-finite check in front of every step.

What megatron-core gives: bf16 (or fp32) model parameters, fp32 main parameters and Adam moments,
gradients accumulated in fp32 in the DDP buffers, clipping by the global norm over the model-parallel
(or, with the distributed optimizer, the whole WG) group, and with ``distributed_optimizer`` the main
parameters and Adam moments sharded over the WG's DP ranks (ZeRO-1).

How it differs from Megatron-LM's training loop:

- The learning-rate schedule advances once per *policy update* (one trainer step: all mini-batches
  and PPO epochs of that step), as verl's actor does, so ``warmup_steps``/``decay_steps`` are counted
  in trainer steps whatever the batch size.
- An update is skipped on every rank of the WG when any rank saw a non-finite loss or gradient: the
  fault flag is reduced over the WG before megatron-core's step (megatron-core's bf16 path has no
  loss scaler and would apply a NaN update).
- megatron-core 0.16 gathers parameter-group keys over the *world* while it builds the optimizer
  (``_get_param_groups``); with several WGs on different ranks that gather must stay inside the WG,
  so it is scoped to the WG's group here (``_collectives_in``).
- megatron-core 0.16 with torch's Adam (no Transformer Engine or apex, e.g. on CPU) keeps a per-parameter
  ``step`` in the inner state, which its distributed-optimizer checkpoint then saves as if it were a
  parameter-shaped tensor (a garbage step after loading) and looks for among the loaded tensors
  (``KeyError: 'step'``), and on load gives every parameter one shared step tensor that torch's Adam
  then increments once per parameter; ``_keep_step_on_load`` keeps ``step`` out of the per-parameter
  state and gives each parameter its own copy of the restored step.
- megatron-core 0.16's distributed optimizer records each parameter's place in its parameter group
  (``model_param_group_index_map``, which checkpoint save and load go by) in grad-buffer order, then
  installs each group as fp32 parameters first, then the fp32 copies of bf16 ones. A group that
  mixes both (bf16 training: the no-weight-decay group holds bf16 biases and the fp32 norm weights
  of megatron-core's local layers) has its state saved under the wrong parameters: a size-mismatch
  error, or silently swapped state when sizes agree (NVIDIA/Megatron-LM#2777).
  ``_index_params_as_installed`` rebuilds the map in the installed order.
- LoRA policies: only the adapters require grad, so DDP buffers and optimizer state exist for them
  alone; each adapter is a parameter group with its agent's learning rate (``ParamKey`` overrides).
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
