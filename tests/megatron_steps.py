"""Megatron forward/backward helpers for the distributed tests (not used by the package: the
training path is ``megamarl.rl.worker.PolicyWorker``, which runs its own schedule with windowed
logprobs). Moved out of ``megamarl/models/bridge.py``, where they were test-only code."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from functools import partial

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from megamarl.models.bridge import attention_mask_for, default_position_ids, export_hf_weights, unwrap


def export_hf_grads(model, wg) -> Iterator[tuple[str, torch.Tensor]]:
    """``export_hf_weights`` over ``param.main_grad`` (DDP) or ``param.grad``."""

    def grad(p):
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        return torch.zeros_like(p) if g is None else g

    return export_hf_weights(model, wg, source=grad)


def model_forward(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One stage's forward: logits [B, T, V_padded/TP] (vocab-parallel) on the last stage, hidden
    states [T, B, H] elsewhere (for PP>1 use ``run_forward_backward``)."""
    if position_ids is None:
        position_ids = default_position_ids(input_ids, attention_mask)
    return model(input_ids, position_ids, attention_mask_for(input_ids, attention_mask))


def gather_logits(logits: torch.Tensor, wg, *, vocab_size: int) -> torch.Tensor:
    """Full-vocab logits [..., vocab_size] from vocab-parallel ones (differentiable; padding stripped)."""
    if wg.layout.tp > 1:
        logits = gather_from_tensor_model_parallel_region(logits, group=wg.pgs.tp)
    return logits[..., :vocab_size]


def run_forward_backward(
    model, wg, microbatches: list[dict], loss_fn: Callable, *, forward_only: bool = False
):
    """megatron-core's schedule over ``microbatches`` (dicts with ``input_ids`` [B, T] and optional
    ``position_ids``/``attention_mask``; same shape each); works for PP=1 and PP>1.

    ``loss_fn(logits, microbatch) -> (loss, info_dict)`` runs on the last stage with vocab-parallel
    logits; the loss is divided by the number of microbatches (megatron-core's convention) before
    backward. Returns the list of ``info_dict`` per microbatch on the last stage, [] elsewhere.
    """
    inner = unwrap(model)
    batch_size, seq_len = microbatches[0]["input_ids"].shape

    def forward_step(data_iterator, module):
        batch = next(data_iterator)
        output = model_forward(
            module, batch["input_ids"], batch.get("position_ids"), batch.get("attention_mask")
        )
        return output, partial(loss_fn, microbatch=batch)

    kwargs = {"pg_collection": wg.pgs}
    if wg.layout.pp > 1:
        kwargs["p2p_communicator"] = P2PCommunicator(wg.pgs.pp, inner.config)
    schedule = get_forward_backward_func(pp_size=wg.layout.pp, vp_size=None)
    return schedule(
        forward_step_func=lambda it, m: forward_step(it, m),
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=seq_len,
        micro_batch_size=batch_size,
        forward_only=forward_only,
        **kwargs,
    )


def forward_logits(
    model,
    wg,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Full-vocab logits [B, T, V] for any TP/PP (no grad): on last-stage ranks; None elsewhere."""
    vocab = unwrap(model).hf_arch.vocab_size

    def collect(logits, microbatch):
        return logits.sum() * 0.0, {"logits": gather_logits(logits, wg, vocab_size=vocab).detach()}

    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    with torch.no_grad():
        out = run_forward_backward(model, wg, [batch], collect, forward_only=True)
    return out[0]["logits"] if wg.is_last_stage else None


# Calls into megatron-core's global ``parallel_state`` that carry no process group: the memory
# buffer is process-wide by design, and ``is_initialized`` is how ``get_*_if_none`` decide to fall back.
GROUPLESS_GLOBALS = frozenset({"get_global_memory_buffer", "_set_global_memory_buffer", "is_initialized"})


@contextlib.contextmanager
def global_group_lookups() -> Iterator[dict[tuple[str, tuple[str, ...]], int]]:
    """Record every call into megatron-core's ``parallel_state`` made from outside it, as
    ``(function, its three nearest callers) -> count``. A profile hook, not a patch of the module's names:
    megatron-core binds many of them with ``from megatron.core.parallel_state import ...``."""
    from megatron.core import parallel_state

    target = parallel_state.__file__
    root = os.path.dirname(os.path.dirname(os.path.dirname(target)))
    calls: dict[tuple[str, tuple[str, ...]], int] = {}

    def profile(frame, event, arg):
        caller = frame.f_back
        inward = event == "call" and frame.f_code.co_filename == target
        if inward and caller is not None and caller.f_code.co_filename != target:
            key = (frame.f_code.co_name, _callers(caller, root))
            calls[key] = calls.get(key, 0) + 1

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


def _callers(frame, root: str, depth: int = 3) -> tuple[str, ...]:
    """``file:Class.function`` of ``frame`` and the frames above it."""
    out = []
    while frame is not None and len(out) < depth:
        owner = frame.f_locals.get("self")
        name = f"{type(owner).__name__}.{frame.f_code.co_name}" if owner is not None else frame.f_code.co_name
        out.append(f"{os.path.relpath(frame.f_code.co_filename, root)}:{name}")
        frame = frame.f_back
    return tuple(out)
