"""Per-GPU bytes of one policy's training state and activations, on paper: the arithmetic of what
``megamarl.rl.policy_setup.build_workers`` makes megatron-core allocate on one rank of a worker group.

Unlike the usual "16 bytes per parameter" rule this follows the trainer's own construction, so a CPU
test (``tests/distributed/test_dryrun_measured.py``) compares it with the storages tiny workers
really allocate. Per rank of a WG with layout ``tp x pp x dp`` and pipeline stage ``s``:
``rank_parameters`` (the ``GPTModel`` shard, LoRA adapters included), ``train_memory`` (weights,
DDP grads, fp32 main parameters and Adam state per dtype buffer, the reference model, adapters) and
``activation_bytes`` (what autograd keeps per token and layer for the ``te`` or ``local`` layer spec
and ``recompute`` setting, times the 1F1B micro-batches in flight, plus the log-prob peak on the last
stage). Frozen policies cost nothing (no worker). A mixture-of-experts policy adds an expert buffer
sharded over the expert-data-parallel ranks and an fp32 router (``planning.expert_plan``). The formulas, term
by term: docs/design-notes.md, "megamarl/planning/memory.py", and docs/moe.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megamarl.config import PolicyConfig
from megamarl.models.spec import TREE_ATTENTIONS
from megamarl.models.tree_attention import block_mask_bytes
from megamarl.parallel.placement import WorkerGroupLayout
from megamarl.planning.expert_plan import ROUTER_BYTES, dispatcher_bytes, expert_layout, moe_saved_bytes
from megamarl.planning.model_presets import ModelShape

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# megamarl.models.spec.layer_spec: Transformer Engine (GPUs with TE) | megatron-core's local spec
LAYER_SPECS = ("te", "local")


@dataclass(frozen=True)
class TrainingSetup:
    """What ``build_workers`` decides for a policy beyond its config section (``dryrun.training_setup``)."""

    dtype: str = "bf16"  # training dtype (DTYPE_BYTES key)
    num_adapters: int = 0  # LoRA adapters on this policy (agents naming one); 0 without LoRA
    reference: bool = False  # a KL reference model is built (kl_coef > 0 on the policy or an agent; no LoRA)
    micro_batch_size: int = 1  # the largest micro-batch (rows) of the policy and its agents
    spec: str = "te"  # LAYER_SPECS
    # prefix_tree: models.spec.tree_attention_choice ("mask" | "flex"); None: no tree
    tree_attention: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"training dtype '{self.dtype}' unknown; allowed: {list(DTYPE_BYTES)}")
        if self.spec not in LAYER_SPECS:
            raise ValueError(f"layer spec '{self.spec}' unknown; allowed: {list(LAYER_SPECS)}")
        if self.tree_attention is not None and self.tree_attention not in TREE_ATTENTIONS:
            raise ValueError(
                f"tree attention '{self.tree_attention}' unknown; allowed: {list(TREE_ATTENTIONS)}"
            )

    @property
    def norm_bytes(self) -> int:
        """Bytes per norm weight: the local spec's torch norms are built in fp32, TE's in params_dtype."""
        return 4 if self.spec == "local" else DTYPE_BYTES[self.dtype]


@dataclass
class Memory:
    """Bytes per GPU, by kind (what each holds: docs/design-notes.md, "megamarl/planning/memory.py")."""

    weights: float = 0.0
    grads: float = 0.0
    main_params: float = 0.0
    optimizer: float = 0.0
    reference: float = 0.0
    lora: float = 0.0
    activations: float = 0.0
    reference_visit: float = 0.0  # ref_offload: the reference model on the device for its forward pass
    kv_cache: float = 0.0

    @property
    def train_state(self) -> float:
        """What ``PolicyWorker.train_state`` offloads while colocated engines generate."""
        return self.weights + self.grads + self.main_params + self.optimizer + self.lora

    @property
    def static(self) -> float:
        """Everything that stays allocated between steps."""
        return self.train_state + self.reference + self.kv_cache

    @property
    def peak(self) -> float:
        """What comes on top of ``static`` at the worst moment of a step."""
        return max(self.activations, self.reference_visit)

    @property
    def total(self) -> float:
        return self.static + self.peak


@dataclass(frozen=True)
class RankParameters:
    """Element counts of the parameter tensors one rank holds (one entry per tensor)."""

    matrices: tuple[int, ...]  # linear weights and biases, embedding / output layer: the training dtype
    norms: tuple[int, ...]  # RMSNorm and QK-norm weights: fp32 in the local spec, else the training dtype
    shared_embedding: int = 0  # tied embedding (first stage) or its copy (last stage) when pp > 1
    adapters: tuple[int, ...] = ()  # LoRA A and B of every adapter (the training dtype)
    # MoE: this rank's experts (fc1, fc2 of num_experts / ep experts per layer; the training dtype, a DDP
    # buffer of their own over the expert-dp group) and the routers (fp32, replicated)
    experts: tuple[int, ...] = ()
    routers: tuple[int, ...] = ()

    @property
    def num_base(self) -> int:
        return (
            sum(self.matrices)
            + sum(self.norms)
            + self.shared_embedding
            + sum(self.experts)
            + sum(self.routers)
        )


def rank_parameters(
    shape: ModelShape, *, tp: int, pp: int, stage: int, lora=None, num_adapters: int = 0, ep: int = 1
) -> RankParameters:
    """The parameter tensors of pipeline stage ``stage`` on one TP rank (the formulas: design-notes);
    an MoE model's layers hold ``num_experts / ep`` experts split over expert TP (= ``tp``) instead of
    the MLP, the router replicated and the shared expert split over ``tp`` (docs/moe.md)."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    layer = [h * (q + 2 * kv) // tp, q * h // tp]
    layer_experts: list[int] = []
    layer_routers: list[int] = []
    if shape.moe is None:
        layer += [2 * f * h // tp, f * h // tp]
    else:
        f_e, f_s = shape.moe.ffn_hidden_size, shape.moe.shared_ffn_hidden_size
        layer_experts = [2 * f_e * h // tp, f_e * h // tp] * (shape.moe.num_experts // ep)
        layer_routers = [shape.router_params]
        if f_s:
            layer += [2 * f_s * h // tp, f_s * h // tp]
        if shape.moe.shared_expert_gate:
            layer.append(h)  # [1, h], replicated
    layer_norms = [h, h]  # replicated over TP
    if shape.qkv_bias:
        layer.append((q + 2 * kv) // tp)
    if shape.qk_norm:
        layer_norms += [shape.head_dim, shape.head_dim]
    num_layers = shape.num_layers // pp
    matrices, norms = layer * num_layers, layer_norms * num_layers
    embedding = shape.padded_vocab_size(tp) * h // tp
    shared = 0
    if stage == 0:
        if shape.tied_embeddings and pp > 1:
            shared = embedding
        else:
            matrices.append(embedding)
    if stage == pp - 1:
        norms.append(h)  # final norm
        if shape.tied_embeddings and pp > 1:
            shared = embedding  # the last stage's copy of the tied embedding
        elif not shape.tied_embeddings:
            matrices.append(embedding)  # output layer
    adapters = []
    if lora is not None:
        dims = {
            "qkv": (h, q + 2 * kv, "column"),
            "proj": (q, h, "row"),
            "fc1": (h, 2 * f, "column"),
            "fc2": (f, h, "row"),
        }
        for target in lora.targets:
            d_in, d_out, kind = dims[target]
            if kind == "column":  # A [r, in] whole, B [out/tp, r]
                adapters += [lora.rank * d_in, d_out // tp * lora.rank]
            else:  # A [r, in/tp], B [out, r] whole
                adapters += [lora.rank * d_in // tp, d_out * lora.rank]
        adapters = adapters * (num_layers * num_adapters)
    return RankParameters(
        tuple(matrices),
        tuple(norms),
        shared,
        tuple(adapters),
        tuple(layer_experts * num_layers),
        tuple(layer_routers * num_layers),
    )


def ddp_buffer_numel(numels, *, dp: int, distributed: bool, own_bucket: int = 0) -> int:
    """Elements of megatron-core's DDP param/grad buffer for parameters of ``numels`` (one bucket),
    plus ``own_bucket`` (a shared embedding: a bucket of its own under the distributed optimizer).

    Without the distributed optimizer the buffer is exactly their sum. With it
    (``_ParamAndGradBuffer``), each parameter starts at a multiple of 64 and each bucket ends at a
    multiple of ``lcm(dp, 128)``; both paddings are independent of the parameter order because the
    bucket multiple is itself a multiple of 64."""
    numels = list(numels)
    if not distributed:
        return sum(numels) + own_bucket
    multiple = math.lcm(dp, 128)
    total = _round_up(sum(_round_up(n, 64) for n in numels), multiple) if numels else 0
    return total + (_round_up(own_bucket, multiple) if own_bucket else 0)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def train_memory(
    shape: ModelShape,
    policy: PolicyConfig,
    layout: WorkerGroupLayout,
    setup: TrainingSetup,
    *,
    stage: int,
    num_micro_batches: int | None = None,
) -> Memory:
    """Bytes on one rank of pipeline stage ``stage`` (the formulas: design-notes). ``num_micro_batches``: per
    optimizer step and DP rank, when known (caps the micro-batches in flight)."""
    if policy.frozen:
        return Memory()
    params = rank_parameters(
        shape,
        tp=layout.tp,
        pp=layout.pp,
        stage=stage,
        lora=policy.lora,
        num_adapters=setup.num_adapters,
        ep=policy.ep,
    )
    width, norm_width = DTYPE_BYTES[setup.dtype], setup.norm_bytes
    base_bytes = (
        width * (sum(params.matrices) + params.shared_embedding + sum(params.experts))
        + norm_width * sum(params.norms)
        + ROUTER_BYTES * sum(params.routers)
    )
    memory = Memory(
        activations=activation_bytes(
            shape, policy, layout, setup, stage=stage, num_micro_batches=num_micro_batches
        )
    )
    if policy.lora is not None:  # only the adapters train: the base is frozen, and is the reference
        memory.weights = base_bytes
        _add_trainable(memory, {width: (params.adapters, 0)}, policy, setup, dp=layout.dp, into="lora")
        return memory
    for part in trainable_buffers(params, policy, layout, setup).values():
        for kind in ("weights", "grads", "main_params", "optimizer"):
            setattr(memory, kind, getattr(memory, kind) + getattr(part, kind))
    if setup.reference:
        if policy.ref_offload:
            logits = logits_peak_bytes(shape, policy, layout, setup) if stage == layout.pp - 1 else 0.0
            memory.reference_visit = base_bytes + logits
        else:
            memory.reference = base_bytes
    return memory


def buffer_elements(params: RankParameters, setup: TrainingSetup) -> dict[str, tuple[int, list[int], int]]:
    """megatron-core's DDP buffers of one rank's trainable base parameters, by name: (element width,
    tensor sizes, shared-embedding size). The dense parameters go by dtype ("dense bf16"; "dense fp32":
    the local spec's norms and an MoE model's routers); an MoE model's "experts" are a buffer of their
    own (DDP's expert-parallel buffers)."""
    width, norm_width = DTYPE_BYTES[setup.dtype], setup.norm_bytes
    names = {width: f"dense {setup.dtype}", 4: "dense fp32"}
    dense: dict[int, list[int]] = {width: list(params.matrices)}
    dense.setdefault(norm_width, []).extend(params.norms)
    if params.routers:
        dense.setdefault(ROUTER_BYTES, []).extend(params.routers)
    out = {names[w]: (w, numels, params.shared_embedding if w == width else 0) for w, numels in dense.items()}
    if params.experts:
        out["experts"] = (width, list(params.experts), 0)
    return out


def trainable_buffers(
    params: RankParameters, policy: PolicyConfig, layout: WorkerGroupLayout, setup: TrainingSetup
) -> dict[str, Memory]:
    """The trainable state of one rank (weights, grads, main params, Adam) per ``buffer_elements``
    buffer: the dense ones reduced and sharded over ``dp``, the "experts" over the expert-data-parallel
    group (``planning.expert_plan.expert_layout``)."""
    out: dict[str, Memory] = {}
    for name, (width, numels, shared) in buffer_elements(params, setup).items():
        dp = expert_layout(layout, ep=policy.ep).edp if name == "experts" else layout.dp
        out[name] = Memory()
        _add_trainable(out[name], {width: (numels, shared)}, policy, setup, dp=dp, into="weights")
    return out


def _add_trainable(
    memory: Memory,
    groups: dict,
    policy: PolicyConfig,
    setup: TrainingSetup,
    *,
    dp: int | None,
    into: str,
) -> None:
    """Weights (into ``memory.<into>``), DDP grads, main params and Adam state of trainable
    parameters, ``groups``: element width -> (tensor sizes, shared-embedding size), reduced over ``dp``
    ranks. megatron-core's DDP keeps one buffer per (param dtype, grad dtype), each padded on its own."""
    distributed = policy.distributed_optimizer
    assert dp is not None  # set by WorkerGroupLayout.__post_init__
    for width, (numels, shared) in groups.items():
        if not numels and not shared:
            continue
        buffer = ddp_buffer_numel(numels, dp=dp, distributed=distributed, own_bucket=shared)
        count = sum(numels) + shared
        stepped = buffer / dp if distributed else count  # elements the optimizer keeps state for
        # fp32 main copies of 16-bit parameters: the distributed optimizer always, otherwise
        # megatron-core's Float16Optimizer (build_optimizer asks for it with bf16; fp16 runs as
        # FP32Optimizer, Adam moments then in fp16); fp32 parameters are stepped in place
        has_main = width < 4 and (distributed or setup.dtype == "bf16")
        moment_width = 4 if has_main else width
        setattr(memory, into, getattr(memory, into) + width * (buffer if distributed else count))
        memory.grads += 4 * buffer
        memory.main_params += 4 * stepped if has_main else 0.0
        memory.optimizer += 2 * moment_width * stepped


def tokens_per_micro_batch(policy: PolicyConfig, setup: TrainingSetup) -> int:
    """Tokens of the largest micro-batch (``PolicyWorker._chunks``): ``micro_batch_size`` right-padded
    rows of up to ``seq_len``; packed (``pack``), at most ``max_tokens_per_micro_batch`` real tokens
    (a longer sample alone) and still at most ``micro_batch_size`` rows."""
    rows = setup.micro_batch_size * policy.seq_len
    if policy.pack and policy.max_tokens_per_micro_batch is not None:
        return min(rows, max(policy.max_tokens_per_micro_batch, policy.seq_len))
    return rows


def attention_row(policy: PolicyConfig, setup: TrainingSetup) -> int:
    """Length of the rows attention sees: ``seq_len`` padded; the whole micro-batch packed (one row
    with a block-diagonal mask in the local spec; TE's THD attention has no [row, row] tensors)."""
    return tokens_per_micro_batch(policy, setup) if policy.pack else policy.seq_len


def prediction_rows(policy: PolicyConfig, setup: TrainingSetup) -> int:
    """Rows the output layer and the log-prob function run on, at most: every token of the micro-batch;
    with ``prefix_tree`` one row per predicted (sample, column) (``rl.tree.TreePredictions``), which
    the node budget does not bound (a node shared by k samples predicts k times): at most
    ``micro_batch_size x seq_len``."""
    if setup.tree_attention is not None:
        return setup.micro_batch_size * policy.seq_len
    return tokens_per_micro_batch(policy, setup)


@dataclass(frozen=True)
class TreeAttentionCost:
    """What a prefix-tree micro-batch's layout costs (``tree_attention_cost``), per micro-batch."""

    kind: str  # "mask" (the local spec's dense mask) | "flex" (models.tree_attention)
    nodes: int  # N: nodes of the largest micro-batch (its token budget)
    prediction_rows: int  # K: output-layer rows (``prediction_rows``)
    mask_bytes: int  # mask: the [N, N] bool mask; flex: the block mask (``block_mask_bytes``)
    scores_bytes_per_layer: float  # mask: fp32 scores [heads/tp, N, N] (+ probabilities cast back); flex: 0


def tree_attention_cost(
    shape: ModelShape, policy: PolicyConfig, layout: WorkerGroupLayout, setup: TrainingSetup
) -> TreeAttentionCost | None:
    """The tree layout's terms of ``activation_bytes`` (None without ``prefix_tree``): the ones that
    grow with ``N^2`` under the dense mask and are O(N) (block metadata) under flex attention."""
    if setup.tree_attention is None:
        return None
    nodes = tokens_per_micro_batch(policy, setup)
    flex = setup.tree_attention == "flex"
    scores = 0.0 if flex else _scores_bytes(shape.num_heads / layout.tp, nodes, DTYPE_BYTES[setup.dtype])
    return TreeAttentionCost(
        kind=setup.tree_attention,
        nodes=nodes,
        prediction_rows=prediction_rows(policy, setup),
        mask_bytes=block_mask_bytes(nodes) if flex else nodes**2,
        scores_bytes_per_layer=scores * nodes,
    )


def _scores_bytes(heads: float, seq_len: int, b: int) -> float:
    """Per token and layer, the local spec's unfused attention scores: fp32 softmax over ``seq_len``
    keys per head, plus the probabilities cast back when the dtype is 16-bit."""
    return 4 * heads * seq_len + (b * heads * seq_len if b < 4 else 0)


def layer_activation_bytes(
    shape: ModelShape,
    *,
    tp: int,
    tokens: int,
    seq_len: int,
    dtype_bytes: int,
    recompute: str,
    spec: str,
    tree_attention: str | None = None,
    capacity_factor: float | None = None,
) -> float:
    """Bytes one decoder layer keeps for backward for one micro-batch of ``tokens`` in rows of
    ``seq_len`` (design-notes, memory.py); with ``recompute='full'``: its input only. Flex tree
    attention replaces the spec's core attention (its scores are never materialised). An MoE layer's
    MLP keeps its router's and routed experts' tensors (``planning.expert_plan.moe_saved_bytes``)."""
    b, h = dtype_bytes, shape.hidden_size
    q, kv = shape.num_heads * shape.head_dim / tp, shape.num_kv_heads * shape.head_dim / tp
    f, heads = shape.ffn_hidden_size / tp, shape.num_heads / tp
    if recompute == "full":
        return b * h * tokens
    rope = 4 * seq_len * shape.head_dim * b if spec == "local" else 0.0
    norms = 2 * (_norm_bytes(h, b, spec))
    mlp = 5 * b * f
    flex = tree_attention == "flex"
    if recompute == "selective" or spec == "te" or flex:
        attn = (
            b * (q + kv) + b * (q + 2 * kv) + b * q
        )  # rotated q and k, the QKV output (held by v), the output
        if recompute == "none" and (spec == "te" or flex):
            attn += 4 * heads  # softmax statistics (flex: its logsumexp)
        if recompute == "none" and flex:
            attn += b * q  # flex keeps its [heads, N, d] output, the projection the [N, heads d] copy
    else:
        attn = 3 * b * q + _scores_bytes(heads, seq_len, b) + b * q
    if shape.moe is None:
        return (norms + attn + mlp) * tokens + rope
    experts = moe_saved_bytes(shape, tokens=tokens, dtype_bytes=b, tp=tp, capacity_factor=capacity_factor)
    return (norms + attn) * tokens + experts + rope


def _norm_bytes(h: int, b: int, spec: str) -> float:
    """Per token: what an RMSNorm and the linear after it keep (TE: fused; local: fp32 inside)."""
    return 2 * b * h + 4 if spec == "te" else 8 * h + b * h + 4


def logits_peak_bytes(
    shape: ModelShape, policy: PolicyConfig, layout: WorkerGroupLayout, setup: TrainingSetup
) -> float:
    """The log-prob/entropy peak on the last stage: ``(b + 24) * K * V_p / tp`` over its ``K``
    prediction rows (``prediction_rows``)."""
    rows = prediction_rows(policy, setup)
    return (DTYPE_BYTES[setup.dtype] + 24) * rows * shape.padded_vocab_size(layout.tp) / layout.tp


def activation_bytes(
    shape: ModelShape,
    policy: PolicyConfig,
    layout: WorkerGroupLayout,
    setup: TrainingSetup,
    *,
    stage: int,
    num_micro_batches: int | None = None,
) -> float:
    """Bytes of activations stage ``stage`` holds at its peak: what the micro-batches in flight keep
    for backward, plus the transients (a layer being rebuilt under full recompute; on the last
    stage the log-prob peak)."""
    in_flight = layout.pp - stage  # 1F1B: stage s holds pp - s micro-batches' activations
    if num_micro_batches is not None:
        in_flight = max(1, min(in_flight, num_micro_batches))
    peak = in_flight * saved_activation_bytes(shape, policy, layout, setup, stage=stage)
    kwargs = _layer_kwargs(policy, layout, setup)
    if policy.recompute == "full":  # the layer being rebuilt
        peak += layer_activation_bytes(shape, recompute="none", **kwargs)
    if shape.moe is not None:  # the running layer's all-to-all buffers
        peak += dispatcher_bytes(
            shape,
            tokens=kwargs["tokens"],
            dtype_bytes=kwargs["dtype_bytes"],
            capacity_factor=kwargs["capacity_factor"],
        )
    if stage == layout.pp - 1:
        peak += logits_peak_bytes(shape, policy, layout, setup)
    return peak


def saved_activation_bytes(
    shape: ModelShape, policy: PolicyConfig, layout: WorkerGroupLayout, setup: TrainingSetup, *, stage: int
) -> float:
    """What one micro-batch's forward through stage ``stage`` leaves for its backward (without the
    log-prob function's own tensors): its layers, the token ids (first stage), the final norm and
    the output layer's input on its prediction rows (last stage); the attention mask (dense, or flex's
    block mask: ``tree_attention_cost``)."""
    kwargs = _layer_kwargs(policy, layout, setup)
    saved = (
        shape.num_layers // layout.pp * layer_activation_bytes(shape, recompute=policy.recompute, **kwargs)
    )
    b, h, tokens = kwargs["dtype_bytes"], shape.hidden_size, kwargs["tokens"]
    if stage == 0:
        saved += 8 * tokens  # token ids
    if stage == layout.pp - 1:  # the norm on every token, the output layer's input on its rows
        saved += (_norm_bytes(h, b, setup.spec) - b * h) * tokens + b * h * prediction_rows(policy, setup)
    tree = tree_attention_cost(shape, policy, layout, setup)
    row = kwargs["seq_len"]
    if tree is not None:
        saved += tree.mask_bytes
    elif setup.spec == "local":  # the [S, S] bool causal mask
        saved += row**2
    if setup.spec == "local" and policy.recompute == "full":  # the fp32 rotary table
        saved += 4 * row * shape.head_dim
    return saved


def _layer_kwargs(policy: PolicyConfig, layout: WorkerGroupLayout, setup: TrainingSetup) -> dict:
    return {
        "tp": layout.tp,
        "tokens": tokens_per_micro_batch(policy, setup),
        "seq_len": attention_row(policy, setup),
        "dtype_bytes": DTYPE_BYTES[setup.dtype],
        "spec": setup.spec,
        "tree_attention": setup.tree_attention,
        "capacity_factor": policy.moe.capacity_factor,
    }


def num_micro_batches(policy: PolicyConfig, dp: int) -> int:
    """Micro-batches per optimizer step on one DP rank when ``mini_batch_size`` fixes it: the rows
    of a mini-batch split over ``dp`` (``balance_across_dp``), in micro-batches of ``micro_batch_size``."""
    assert policy.mini_batch_size is not None  # called when it fixes the count (above)
    rows = -(-policy.mini_batch_size // dp)
    return -(-rows // policy.micro_batch_size)


def relay_buffer_bytes(
    shape: ModelShape, *, width: int, bucket_bytes: int, forwards: bool, feeds: bool
) -> float:
    """Device bytes a relayed PP>1 push (``rollout.weights.stage_gather.relay_roles``) adds on one rank
    while it runs: a forwarding rank holds a bucket of its export until the bucket is sent
    (``bucket_bytes``, overshot by at most one tensor), a leader receives the other stages one tensor at
    a time (the largest: the embedding or output layer, ``V h``, in the engine's ``width``); the two
    happen in different stages' turns, so a rank needs the larger."""
    largest = (
        width
        * shape.hidden_size
        * max(shape.vocab_size, shape.ffn_hidden_size, shape.num_heads * shape.head_dim)
    )
    return max(bucket_bytes + largest if forwards else 0.0, largest if feeds else 0.0)
