"""Mixture-of-experts policies on paper: the expert grid of a worker group, the load-time checks of
``policies.<p>.ep`` and ``policies.<p>.moe``, and the bytes only MoE layers have.

megatron-core re-divides the ``tp x dp`` ranks of each pipeline stage as ``etp x ep x edp`` for the
expert layers (``initialize_model_parallel``'s expert ``RankGenerator``, order tp-cp-ep-dp-pp): each
rank holds ``num_experts / ep`` experts, split over ``etp`` (= tp, megatron-core's default), and the
experts' gradients and distributed-optimizer state are reduced and sharded over the ``edp`` ranks
holding the same experts, while the dense parameters (attention, embeddings, norms, the fp32 router)
use the ``dp`` group as before. Routed activations are priced for balanced routing when dropless
(no ``moe.capacity_factor``); with a capacity factor every expert's rows are capped and padded, an
exact bound. Until the MoE training path lands, MoE policies are planned only: ``check_moe_training``
stops a training launch at its front door. Formulas term by term: docs/moe.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megamarl.config import PolicyConfig, RunConfig
from megamarl.parallel.placement import WorkerGroupLayout, expert_coords, group_enumeration
from megamarl.planning.model_presets import ModelShape, MoeShape, declared_moe

ROUTER_BYTES = 4  # megatron-core's TopKRouter keeps its weight in fp32 (and computes logits in fp32)


@dataclass(frozen=True)
class ExpertLayout:
    """A WG's expert grid: ``etp x ep x edp`` ranks per pipeline stage (the stage's ``tp x dp``)."""

    ranks: tuple[int, ...]  # the WG's global ranks, in its logical order
    etp: int
    ep: int
    edp: int
    pp: int

    def _worker_group(self) -> WorkerGroupLayout:
        return WorkerGroupLayout(
            ranks=list(self.ranks), tp=self.etp, pp=self.pp, ep=self.ep, key="expert grid"
        )

    def groups(self, axis: str) -> list[list[int]]:
        """Global-rank lists of every ``axis`` group ("etp", "ep", "edp"): the groups the worker group
        builds (``parallel.placement.group_enumeration`` on its experts' grid; one source for both)."""
        return group_enumeration(self._worker_group(), [axis], experts=True)

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each expert axis."""
        return expert_coords(self._worker_group(), rank)


def expert_layout(layout: WorkerGroupLayout, *, ep: int) -> ExpertLayout:
    """The expert grid of ``layout`` with ``ep``-way expert parallelism (expert TP = ``layout.tp``)."""
    assert layout.dp is not None  # set by WorkerGroupLayout.__post_init__
    per_stage = layout.tp * layout.dp
    if per_stage % (layout.tp * ep):
        raise ValueError(
            f"{layout.key}.ep={ep} must divide the tp*dp = {layout.tp}*{layout.dp} ranks of each pipeline "
            f"stage together with the expert tp ({layout.tp}): {per_stage} is not a multiple of "
            f"{layout.tp * ep}"
        )
    return ExpertLayout(tuple(layout.ranks), layout.tp, ep, per_stage // (layout.tp * ep), layout.pp)


def check_expert_parallel(policy: PolicyConfig, moe: MoeShape | None, *, num_ranks: int | None) -> None:
    """Load-time checks of ``policies.<p>.ep`` and ``policies.<p>.moe`` against the model's experts
    (``moe``; None: a dense model) and, when known, the WG's ``num_ranks``. Keys use the ``<p>``
    placeholder ``load_config`` fills in."""
    if moe is None:
        if policy.ep != 1:
            raise ValueError(
                f"policies.<p>.ep={policy.ep}: policies.<p>.model='{policy.model}' is a dense model (no "
                "experts to split); expert parallelism is for mixture-of-experts models: set ep: 1"
            )
        if policy.moe.capacity_factor is not None:
            raise ValueError(
                f"policies.<p>.moe.capacity_factor is set but policies.<p>.model='{policy.model}' is a "
                "dense model (no experts): remove policies.<p>.moe"
            )
        return
    if policy.lora is not None:
        raise ValueError(
            f"policies.<p>.lora: policies.<p>.model='{policy.model}' is a mixture-of-experts model; LoRA "
            "adapters on experts are not supported: remove policies.<p>.lora"
        )
    if policy.tp != 1:
        raise ValueError(
            f"policies.<p>.tp={policy.tp}: megatron-core trains MoE layers with tp > 1 only under "
            "sequence parallelism, which megamarl does not use; shard the experts with policies.<p>.ep "
            "and set tp: 1"
        )
    if moe.num_experts % policy.ep:
        raise ValueError(
            f"policies.<p>.ep={policy.ep} must divide the {moe.num_experts} experts of "
            f"policies.<p>.model='{policy.model}'"
        )
    if num_ranks is not None and num_ranks % (policy.tp * policy.pp) == 0:
        per_stage = num_ranks // policy.pp  # tp * dp
        if per_stage % (policy.tp * policy.ep):
            raise ValueError(
                f"policies.<p>.ep={policy.ep} must divide the tp*dp = {per_stage} ranks of each pipeline "
                f"stage ({num_ranks} ranks / pp={policy.pp})"
            )


def check_moe_training(cfg: RunConfig) -> None:
    """A training launch (``scripts/train.py``, ``--check``) on an MoE policy stops here, before any
    model loads: MoE policies are planned (``--dry-run``, ``--show-placement``) but not yet trained."""
    for name, policy in cfg.policies.items():
        if declared_moe(policy.model) is not None:
            raise ValueError(
                f"policies.{name}.model='{policy.model}' is a mixture-of-experts model: MoE policies are "
                "--dry-run / --show-placement only for now (the Megatron MoE bridge, expert-parallel "
                "weight sync and routing replay are not in this build); plan it with scripts/train.py "
                "--config ... --dry-run, train a dense model meanwhile"
            )


# ----------------------------------------------------------------------------------- bytes


def routed_rows(moe: MoeShape, *, tokens: int, capacity_factor: float | None) -> int:
    """Rows the experts of one rank take for ``tokens`` tokens of a micro-batch: ``tokens x top_k``
    with balanced routing (dropless); with a capacity factor every expert is padded to its capacity
    ``ceil(tokens * top_k / num_experts * capacity_factor)`` (megatron-core's ``get_capacity``), the
    same per rank after the all-to-all (``ep`` sources x ``num_experts / ep`` local experts)."""
    if capacity_factor is None:
        return tokens * moe.top_k
    return moe.num_experts * math.ceil(tokens * moe.top_k / moe.num_experts * capacity_factor)


def router_bytes_per_token(moe: MoeShape) -> int:
    """What the router keeps for backward per token: fp32 logits and probabilities ``[T, E]`` and the
    boolean routing map ``[T, E]``."""
    return (2 * ROUTER_BYTES + 1) * moe.num_experts


def moe_saved_bytes(
    shape: ModelShape, *, tokens: int, dtype_bytes: int, tp: int, capacity_factor: float | None
) -> float:
    """Bytes one MoE layer's MLP keeps for backward for ``tokens`` tokens (replacing the dense MLP's
    ``5 b f`` per token): the router's tensors per token; per routed row the permuted input that fc1
    keeps ``b h``, the SwiGLU tensors ``5 b f_e / etp``, the expert output and probability the
    combine keeps ``b h + 4``; the shared expert like a dense MLP."""
    moe = shape.moe
    assert moe is not None  # called for MoE shapes
    b, h = dtype_bytes, shape.hidden_size
    rows = routed_rows(moe, tokens=tokens, capacity_factor=capacity_factor)
    per_row = 2 * b * h + 5 * b * moe.ffn_hidden_size / tp + 4
    shared = 5 * b * moe.shared_ffn_hidden_size / tp
    return tokens * (router_bytes_per_token(moe) + shared) + rows * per_row


def dispatcher_bytes(
    shape: ModelShape, *, tokens: int, dtype_bytes: int, capacity_factor: float | None
) -> float:
    """The all-to-all dispatcher's transient buffers of the layer running: the permuted tokens sent and
    those received, ``2 x rows x h x b`` (one layer at a time, forward and backward alike)."""
    assert shape.moe is not None  # called for MoE shapes
    rows = routed_rows(shape.moe, tokens=tokens, capacity_factor=capacity_factor)
    return 2 * rows * shape.hidden_size * dtype_bytes


def expert_gather_bytes(shape: ModelShape, *, width: int) -> float:
    """A push's expert buffer on the ranks of a sender's EP group: one layer's experts, all of them,
    gathered over EP in the engine's dtype (``width`` bytes) before they are handed to the engine."""
    assert shape.moe is not None  # called for MoE shapes
    return width * shape.moe.num_experts * shape.expert_params
