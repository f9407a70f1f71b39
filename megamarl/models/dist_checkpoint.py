"""Save and load a worker group's model (and optimizer state) with megatron-core ``dist_checkpointing``
in the ``torch_dist`` format, so a checkpoint written at one TP x PP x DP layout loads at any other.

Model: ``GPTModel.sharded_state_dict`` (global keys, TP slices as offsets). Optimizer: megatron-core's
own ``sharded_state_dict`` in model space (``fully_reshardable`` for the distributed optimizer), so it
reloads at another DP, TP or PP; saved without gathering (each DP rank writes its own share of each
parameter as blocks of the global tensor). A plain torch optimizer is saved the same way by hand
(state tensors as ``ShardedTensor``, ``step`` as a ``ShardedObject``; ``param_groups`` come from the
loading run).
Invariant for callers: ``save_checkpoint``/``load_checkpoint`` are collective over the whole world;
ranks outside the WG call them with ``model=None``. The WG's common part is one ``ShardedObject``
(``COMMON_KEY``) written by the WG's first rank, so a WG without global rank 0 keeps it; older
checkpoints (common part in ``common.pt``) still load.
Why each of these: docs/design-notes.md, "megamarl/models/dist_checkpoint.py".
"""

from __future__ import annotations

# megatron-core (and transformers/safetensors) are imported inside the functions that build, load or run
# models: importing megatron.core costs ~3 s of CPU (9.7 s wall measured on the loaded 2-core box,
# 2026-11-23), and config loading and --dry-run import this module without building a model.
import contextlib
import math
import queue
from pathlib import Path

import torch

from megamarl.models.bridge import unwrap

STEP_KEY = "optimizer.step"
COMMON_KEY = "common"  # the WG's non-sharded state (see the module doc)


def model_sharded_state_dict(model, wg) -> dict:
    from megatron.core import parallel_state

    # megatron-core 0.16 gap: with tied embeddings on a last stage that is not also the first
    # (PP>1), LanguageModule.tie_embeddings_and_output_weights_state_dict asks the *global*
    # parallel_state for the DP rank, which per-WG process groups never initialise. Answer from
    # the WG's group for the duration of the call.
    saved = parallel_state.get_data_parallel_rank
    parallel_state.get_data_parallel_rank = lambda *args, **kwargs: wg.pgs.dp_cp.rank()
    try:
        return unwrap(model).sharded_state_dict(metadata={"dp_cp_group": wg.pgs.dp_cp})
    finally:
        parallel_state.get_data_parallel_rank = saved


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter Adam(W) state (zeros, step 0) so it can serve as a load template."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _optimizer_step(optimizer) -> float:
    steps = {float(s["step"]) for s in optimizer.state.values() if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"parameters are at different optimizer steps {sorted(steps)}: cannot save one step")
    return steps.pop() if steps else 0.0


def _is_megatron(optimizer) -> bool:
    return not isinstance(optimizer, torch.optim.Optimizer)


def optimizer_sharded_state_dict(model_ssd: dict, optimizer, wg, *, is_loading: bool = False) -> dict:
    if _is_megatron(optimizer):
        # megatron-core 0.16 with torch's Adam (no TE/apex) reads one ``step`` from the inner state:
        # a checkpoint before the first update (or a load template) needs the zero state first
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            init_optimizer_state(inner.optimizer)
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
        with contextlib.ExitStack() as stack:
            if not is_loading:
                stack.enter_context(_saved_in_pieces(optimizer))
            return {
                "optimizer": optimizer.sharded_state_dict(model_ssd, is_loading=is_loading, metadata=metadata)
            }
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    params = [p for group in optimizer.param_groups for p in group["params"]]
    id_map = get_param_id_to_sharded_param_map(model_ssd, params)
    state = optimizer.state_dict()
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    step = ShardedObject(STEP_KEY, _optimizer_step(optimizer), (1,), (0,), replica_id=_replica_id(wg))
    return {"optimizer": state, "step": step}


@contextlib.contextmanager
def _saved_in_pieces(optimizer):
    """While a save builds its state dict, each distributed optimizer answers megatron-core's
    ``fully_reshardable`` parameter state with its own DP share (``_param_state_in_pieces``) instead of
    gathering every parameter's fp32 main copy and Adam moments on every DP rank."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inners = [
        o
        for o in getattr(optimizer, "chained_optimizers", [optimizer])
        if isinstance(o, DistributedOptimizer)
    ]
    for inner in inners:
        inner.sharded_param_state_fully_reshardable = (
            lambda model_ssd, is_loading=False, metadata=None, inner=inner: _param_state_in_pieces(
                inner, model_ssd
            )
        )
    try:
        yield
    finally:
        for inner in inners:
            del inner.sharded_param_state_fully_reshardable


def _param_state_in_pieces(dist_optimizer, model_ssd: dict) -> dict:
    """The ``fully_reshardable`` parameter state (each parameter's ``param``, ``exp_avg``, ``exp_avg_sq``
    under ``optimizer.state.<state>.<model key>``, in the model tensor's global shape) written as this
    rank's flat share of each parameter, cut into rectangular blocks of the global tensor (uneven
    shards, which torch_dist stores as they are). Loading (megatron-core's own template) reads any
    layout from the blocks; a save allocates only the writer's copies of this rank's share."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors_and_factories, _ = extract_sharded_tensors_and_factories(model_ssd)
    meta_of = {sh.data: sh for sh in nested_values(tensors_and_factories)}
    index_of = {  # megatron-core's numbering of the parameters (its fully_reshardable order)
        param: i
        for i, param in enumerate(p for buffer in dist_optimizer.buffers for p in buffer.param_index_map)
    }
    state = {}
    for gbuf_range_maps in dist_optimizer.gbuf_ranges:
        for bucket_maps in gbuf_range_maps.values():
            for bucket_map in bucket_maps:
                for model_param, ranges in bucket_map["param_map"].items():
                    span = ranges["param"]
                    flat_states = dist_optimizer._get_main_param_and_optimizer_states(model_param)
                    state[index_of[model_param]] = {
                        name: _blocks_of_share(
                            f"optimizer.state.{name}.{meta_of[model_param].key}",
                            meta_of[model_param],
                            flat,
                            span.start,
                        )
                        for name, flat in flat_states.items()
                        if name != "step"
                    }
    return state


def _blocks_of_share(key: str, meta, flat: torch.Tensor, start: int) -> list:
    """``flat`` (this rank's share of a parameter's local tensor, from flat index ``start``) as
    ShardedTensors of the global tensor that ``meta`` (the model's ShardedTensor or factory) maps the
    local tensor to. A factory (swiglu's fused gate/up) is applied to the local tensor's flat indices to
    learn where each of its parts lands."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    replica_id = (*meta.replica_id[:2], 0)  # every DP rank writes its own share
    if isinstance(meta, ShardedTensorFactory):
        local_index = torch.arange(meta.data.numel()).view(meta.data.shape)
        parts = list(nested_values(meta.build_fn(key, local_index, replica_id, None)))
    else:
        parts = [ShardedTensor(**{**vars(meta), "key": key, "data": None, "dtype": flat.dtype})]
    out = []
    stop = start + flat.numel()
    for i, part in enumerate(parts):
        numel = math.prod(part.local_shape)
        base = int(part.data.flatten()[0]) if part.data is not None else 0
        if part.data is not None and not torch.equal(part.data.flatten(), torch.arange(base, base + numel)):
            raise ValueError(f"{key}: part {i} of the model's sharding is not one contiguous flat range")
        lo, hi = max(start, base), min(stop, base + numel)
        if lo >= hi:
            continue
        lead = part.global_offset[: part.prepend_axis_num]
        for offset, shape in flat_range_blocks(lo - base, hi - base, part.local_shape):
            first = base + _flat_index(offset, part.local_shape) - start
            out.append(
                ShardedTensor(
                    key=key,
                    data=flat[first : first + math.prod(shape)].view((1,) * len(lead) + shape),
                    dtype=flat.dtype,
                    local_shape=(1,) * len(lead) + shape,
                    global_shape=part.global_shape,
                    global_offset=(
                        *lead,
                        *(o + g for o, g in zip(offset, part.global_offset[len(lead) :], strict=True)),
                    ),
                    axis_fragmentations=None,  # uneven blocks
                    replica_id=replica_id,
                )
            )
    return out


def _flat_index(offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    index = 0
    for o, size in zip(offset, shape, strict=True):
        index = index * size + o
    return index


def flat_range_blocks(
    start: int, stop: int, shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Flat (row-major) indices ``[start, stop)`` of a tensor of ``shape`` as ``(offset, size)`` blocks
    in order: a partial leading row, whole rows, a partial trailing row (each recursively), so that
    every block is contiguous in memory and there are at most ``2 * len(shape) - 1``."""
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(
            f"flat range [{start}, {stop}) is outside a tensor of shape {shape} ({total} elements)"
        )
    if start == stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    blocks = []
    if start % inner:
        row, head_stop = start // inner, min(stop, (start // inner + 1) * inner)
        for off, size in flat_range_blocks(start - row * inner, head_stop - row * inner, shape[1:]):
            blocks.append(((row, *off), (1, *size)))
        start = head_stop
    num_rows = (stop - start) // inner
    if num_rows:
        blocks.append(((start // inner,) + (0,) * (len(shape) - 1), (num_rows, *shape[1:])))
        start += num_rows * inner
    if start < stop:
        row = start // inner
        for off, size in flat_range_blocks(0, stop - start, shape[1:]):
            blocks.append(((row, *off), (1, *size)))
    return blocks


def save_checkpoint(path: str | Path, model, wg, *, optimizer=None) -> None:
    """Write this WG's model (+ optimizer) shards to ``path``. Collective over all ranks (see module doc)."""
    from megatron.core import dist_checkpointing

    Path(path).mkdir(parents=True, exist_ok=True)
    _in_process_results_queue()
    state = {}
    try:
        if model is not None:
            state["model"] = model_sharded_state_dict(model, wg)
            if optimizer is not None:
                state.update(optimizer_sharded_state_dict(state["model"], optimizer, wg))
            state = _with_common_as_object(state, wg)
    except Exception:
        # the save below is collective over the world: take part (contributing nothing) so the other
        # ranks' collectives stay in step, then raise; the caller agrees on the outcome
        dist_checkpointing.save({}, str(path))
        raise
    dist_checkpointing.save(state, str(path))


def _with_common_as_object(state: dict, wg) -> dict:
    """``state`` with its non-sharded leaves moved into one ``ShardedObject`` that the WG's first
    rank writes (megatron-core writes ``common.pt`` from global rank 0 only: see the module doc)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    sharded, common = extract_sharded_base(state)
    return {**sharded, COMMON_KEY: ShardedObject(COMMON_KEY, common, (1,), (0,), replica_id=_replica_id(wg))}


def _replica_id(wg) -> int:
    """A WG-wide object's replica id: 0 (the copy that is written) on the WG's first rank only."""
    return 0 if wg.tp_rank == 0 and wg.pp_rank == 0 and wg.dp_rank == 0 else 1


def _has_common_object(path: Path) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    return any(
        key.split("/")[0] == COMMON_KEY
        for key in FileSystemReader(str(path)).read_metadata().state_dict_metadata
    )


def _in_process_results_queue() -> None:
    """megatron-core's torch_dist writer collects its write results through a ``multiprocessing``
    Manager queue that it starts, on a process's first save, with the *spawn* context: a fresh
    interpreter that re-imports the entry script (``scripts/train.py``: megamarl, hydra, torch),
    ~2.7 s of wall time and as many CPU-seconds, paid by every saving rank of every run, and a
    server process that outlives a SIGKILLed rank. Saves here are synchronous (``dist_checkpointing.save``
    runs the write in this process: it forks its writer processes, collects their results and
    puts them on that queue, then reads them back), so a plain in-process ``queue.Queue`` carries
    them as well, at no cost. (An asynchronous save, whose writer runs in another process, would
    need megatron-core's own queue back: its results would not arrive and the save would fail with
    "results_queue should not be empty", not silently.) The queue is a module global of
    megatron-core's (0.16: ``filesystem_async._results_queue``); if a release renames it, this does
    nothing and megatron-core starts its own as before."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", ...) is None:
        filesystem_async._results_queue = queue.Queue()


def load_checkpoint(path: str | Path, model, wg, *, optimizer=None) -> None:
    """Load ``path`` into this rank's shards (any layout). Collective over all ranks (see module doc)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import merge

    template = {}
    if model is not None:
        template["model"] = model_sharded_state_dict(model, wg)
        if optimizer is not None:
            if not _is_megatron(optimizer):  # megatron-core's builds its template state itself
                init_optimizer_state(optimizer)
            template.update(optimizer_sharded_state_dict(template["model"], optimizer, wg, is_loading=True))
        if _has_common_object(Path(path)):  # else a checkpoint from before: its common part is in common.pt
            template = _with_common_as_object(template, wg)
    loaded = dist_checkpointing.load(template, str(path))
    if model is None:
        return
    if COMMON_KEY in loaded:
        merge(loaded, loaded.pop(COMMON_KEY))
    result = unwrap(model).load_state_dict(loaded["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"checkpoint {path}: missing {missing}, unexpected {result.unexpected_keys}")
    if optimizer is not None and _is_megatron(optimizer):
        optimizer.load_state_dict(loaded["optimizer"])
    elif optimizer is not None:
        optim_state = loaded["optimizer"]
        optim_state["param_groups"] = optimizer.state_dict()["param_groups"]
        for param_state in optim_state["state"].values():
            param_state["step"] = torch.tensor(float(loaded["step"]))
        optimizer.load_state_dict(optim_state)
