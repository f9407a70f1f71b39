"""Advantage estimators over an agent-tagged batch: pure tensor functions plus one registry.

Every sample is one agent call, tagged with index columns (task, episode, agent, policy, turn,
branch, step). Estimators differ mainly in *which samples form a group*: plain GRPO normalises over
the episodes of a task, AT-GRPO over the tree-sampled candidates of one agent step
(task, agent, turn), Dr.MAS over all calls of one agent in one task (task, agent). GiGPO adds a
step-level advantage over samples that acted on the same anchor observation.

Conventions (all estimators):
  * group statistics use the std with ``ddof`` (``algorithm.std_ddof``, default 1: the unbiased std,
    dividing by n - 1, as verl, Dr.MAS, PettingLLMs and GiGPO do): a group of 2 rewards {1, 0} gets
    advantages {+0.707, -0.707}; ``std_ddof=0`` (population std) gives {+1, -1}, larger by
    ``sqrt(n / (n - 1))`` for a group of n. A singleton group has std 0 under either convention;
  * the normaliser is ``std + eps``, so a zero-variance group yields 0, never NaN;
  * statistics are computed in float64 and cast back to the rewards' dtype.

Returns along a trajectory (GiGPO step returns, REINFORCE++ turn discounting) treat tree-sampled
siblings (samples of one trajectory at the same position) as parallel alternatives, not as
consecutive steps: each sibling continues with the mean return of the next position.

Registry contract: ``ADVANTAGE_ESTIMATORS`` maps a name to
``fn(rewards [N], index: GroupIndex, cfg: AdvantageConfig, *, response_mask=None, values=None)``
returning ``[N]`` (sample-level; ``reinforce_pp`` needs ``response_mask``). An estimator with
``needs_critic`` (``gae``) is token-level and runs on each policy's workers: it needs
``response_mask`` and ``values`` and returns ``(advantages [N, T], returns [N, T])``. The math lives
in the keyword-argument functions above each registered adapter, which only read ``cfg`` and pick
the group key. Traits the loop needs (``EstimatorTraits``: the group key its advantages are
normalised over, whether the team reward enters once per episode, whether it needs a critic) are
declared on the registry entry (``register_estimator``) and read with
``ADVANTAGE_ESTIMATORS.traits(name)`` (or ``estimator_traits(name)``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megamarl.config import AlgorithmConfig, PolicyAlgorithmConfig
from megamarl.registry import Registry
from megamarl.rl.losses import KL_ESTIMATORS, LOSS_AGGREGATIONS
from megamarl.rl.rewards import rewards_to_tokens

GROUP_KEYS = ("task", "episode", "agent", "policy", "turn", "branch", "step")

Estimator = Callable[..., Tensor]


@dataclass
class GroupIndex:
    """Integer index columns of N samples (``SampleBatch.group_index()`` builds one).

    Columns left as None are filled with zeros (convenient in tests; the batch fills them all).
    ``anchors`` holds GiGPO anchor observations (one per sample, None = no anchor) or is empty.
    """

    task: Tensor | None = None  # [N] long
    episode: Tensor | None = None
    agent: Tensor | None = None
    policy: Tensor | None = None
    turn: Tensor | None = None
    branch: Tensor | None = None
    step: Tensor | None = None
    anchors: Sequence[str | None] = ()

    def __post_init__(self) -> None:
        given = [getattr(self, k) for k in GROUP_KEYS if getattr(self, k) is not None]
        n = len(given[0]) if given else len(self.anchors)
        device = torch.as_tensor(given[0]).device if given else torch.device("cpu")  # the keys' device
        for key in GROUP_KEYS:
            col = getattr(self, key)
            col = (
                torch.zeros(n, dtype=torch.long, device=device)
                if col is None
                else torch.as_tensor(col).long()
            )
            if col.shape != (n,):
                raise ValueError(f"GroupIndex.{key} has shape {tuple(col.shape)}, expected ({n},)")
            setattr(self, key, col)
        if self.anchors and len(self.anchors) != n:
            raise ValueError(f"GroupIndex.anchors has {len(self.anchors)} entries, expected {n}")

    @property
    def num_samples(self) -> int:
        assert self.task is not None  # __post_init__ fills every key
        return len(self.task)


def group_ids(index: GroupIndex, group_by: Sequence[str]) -> Tensor:
    """Contiguous group ids ``[N]`` in 0..G-1 for the key ``group_by`` (any of ``GROUP_KEYS``).

    Ids follow the lexicographic order of the key tuples, so they are deterministic. An empty key
    puts every sample in group 0.
    """
    check_group_by(group_by, key="advantage.group_by")
    n = index.num_samples
    if not group_by or n == 0:
        return torch.zeros_like(index.task)
    cols = torch.stack([getattr(index, k) for k in group_by], dim=1)  # [N, K]
    return torch.unique(cols, dim=0, return_inverse=True)[1]


def group_stats(
    x: Tensor,
    gid: Tensor,
    *,
    ddof: int = 1,
    weights: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (mean, std, count) of ``x [N]`` over its group ``gid [N]`` (float64).

    ``std = sqrt(sum w (x - mean)^2 / (sum w - ddof))`` with the divisor floored at 1, so a singleton
    group gets std 0 for either ``ddof``. ``weights [N]`` (default 1) count a sample that many times,
    e.g. its number of response tokens; ``count`` is ``sum w``.
    """
    x = x.double()
    w = torch.ones_like(x) if weights is None else weights.double()
    zeros = x.new_zeros(int(gid.max()) + 1 if gid.numel() else 0)  # [G]
    count = zeros.index_add(0, gid, w)
    mean = zeros.index_add(0, gid, w * x) / count.clamp(min=1e-12)
    var = zeros.index_add(0, gid, w * (x - mean[gid]) ** 2) / (count - ddof).clamp(min=1)
    return mean[gid], var.sqrt()[gid], count[gid]


def discounted_returns(rewards: Tensor, seq_ids: Tensor, order: Tensor, *, gamma: float) -> Tensor:
    """``G_i = r_i + gamma * mean{G_j : j in seq(i), pos_j = pos_i + 1}`` (0 past the last position).

    ``pos`` is the rank of a sample's ``order`` value among the *distinct* values of its sequence,
    so gaps in ``order`` (global step ids shared by several agents) do not discount, and samples
    sharing a value (tree-sampled siblings: alternatives at one step, not consecutive steps) each
    get their own reward plus the same continuation. One sample per position gives the textbook
    ``G_i = sum_{k >= 0} gamma^k r_{pos_i + k}``.
    """
    seqs, keys, r = seq_ids.tolist(), order.tolist(), rewards.double().tolist()
    positions: dict[int, dict[int, list[int]]] = {}  # seq -> order value -> rows
    for i, (s, k) in enumerate(
        zip(seqs, keys, strict=False)
    ):  # strict=False: both [N] by the caller's contract
        positions.setdefault(s, {}).setdefault(k, []).append(i)
    out = [0.0] * len(r)
    for by_key in positions.values():
        continuation = 0.0
        for key in sorted(by_key, reverse=True):
            rows = by_key[key]
            for i in rows:
                out[i] = r[i] + gamma * continuation
            continuation = sum(out[i] for i in rows) / len(rows)
    return torch.tensor(out, dtype=torch.float64, device=rewards.device).to(rewards.dtype)


# --------------------------------------------------------------------------------------------
# group-normalised estimators


def grpo_advantages(
    rewards: Tensor,
    gid: Tensor,
    *,
    eps: float = 1e-6,
    norm_std: bool = True,
    ddof: int = 1,
) -> Tensor:
    """GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)``; without ``norm_std``: ``A_i = r_i - mean_g``.

    A singleton group or a zero-variance group gives 0.
    """
    mean, std, _ = group_stats(rewards, gid, ddof=ddof)
    adv = rewards.double() - mean
    if norm_std:
        adv = adv / (std + eps)
    return adv.to(rewards.dtype)


def drmas_advantages(
    rewards: Tensor,
    gid: Tensor,
    *,
    eps: float = 1e-6,
    norm_std: bool = True,
    ddof: int = 1,
) -> Tensor:
    """Dr.MAS agent-wise GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)`` with g = (task, agent),
    pooling every invocation of the agent in every episode of the task.

    A singleton group (the agent acted once in the whole task) uses mean 0 and std 1 (no eps), so
    ``A_i = r_i``: it keeps its raw reward signal instead of being zeroed, as in verl's GRPO that the
    Dr.MAS code builds on. Dynamic sampling, which drops groups whose advantages are all 0, therefore
    keeps such a singleton unless its reward is 0 (docs/rl.md).
    """
    mean, std, count = group_stats(rewards, gid, ddof=ddof)
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    denom = torch.where(single, torch.ones_like(std), std + eps) if norm_std else torch.ones_like(std)
    return ((rewards.double() - mean) / denom).to(rewards.dtype)


def rloo_advantages(rewards: Tensor, gid: Tensor) -> Tensor:
    """RLOO: ``A_i = r_i - (sum_g r - r_i) / (n_g - 1)``; a singleton group gives 0."""
    mean, _, count = group_stats(rewards, gid)
    r = rewards.double()
    loo = (mean * count - r) / (count - 1).clamp(min=1)
    return torch.where(count > 1, r - loo, torch.zeros_like(r)).to(rewards.dtype)


def reinforce_pp_advantages(
    rewards: Tensor,
    seq_ids: Tensor,
    turns: Tensor,
    policy_ids: Tensor,
    num_tokens: Tensor,
    *,
    gamma: float = 1.0,
    discount_turns: bool = False,
    eps: float = 1e-6,
    norm_std: bool = True,
    ddof: int = 1,
) -> Tensor:
    """REINFORCE++: returns whitened over the response tokens of each policy,
    ``A_i = (G_i - mean_p(G)) / (std_p(G) + eps)``, where the statistics of policy p count sample i
    ``num_tokens[i]`` times (every response token carries its sample's return, as in the method and
    verl); a sample without response tokens does not enter them.

    ``G_i = r_i``, or with ``discount_turns`` the discounted return over the later turns of the same
    (task, episode, agent) sequence ``seq_ids``, ``G_i = r_i + gamma * G_{turn_i + 1}`` (tree-sampled
    siblings of one turn are parallel: see ``discounted_returns``).
    """
    returns = discounted_returns(rewards, seq_ids, turns, gamma=gamma) if discount_turns else rewards
    mean, std, _ = group_stats(returns, policy_ids, ddof=ddof, weights=num_tokens)
    adv = returns.double() - mean
    if norm_std:
        adv = adv / (std + eps)
    return adv.to(rewards.dtype)


def anchor_ids(
    prefix_ids: Tensor,
    anchors: Sequence[str | None],
    *,
    similarity: float | None = None,
) -> Tensor:
    """GiGPO anchor-state groups ``[N]``: samples with the same ``prefix_ids`` (e.g. task, agent) and
    the same anchor observation share a group; a None anchor is a group of its own.

    With ``similarity = t``, anchors are clustered greedily in first-appearance order: a new anchor
    string joins the first cluster (same prefix) whose first string has
    ``difflib.SequenceMatcher(None, a, b).ratio() >= t``, else it opens a new cluster.
    """
    clusters: dict[tuple[int, int], int] = {}  # (prefix, cluster) -> group id
    reps: dict[int, list[str]] = {}  # prefix -> representative strings of its clusters
    exact: dict[tuple[int, str], int] = {}  # (prefix, anchor) -> cluster
    out = []
    for i, (p, anchor) in enumerate(
        zip(prefix_ids.tolist(), anchors, strict=False)
    ):  # strict=False: one anchor per sample by the caller's contract
        if anchor is None:
            out.append(len(clusters))
            clusters[(p, -1 - i)] = len(clusters)
            continue
        if (p, anchor) not in exact:
            known = reps.setdefault(p, [])
            match = None
            if similarity is not None:
                match = next(
                    (
                        c
                        for c, rep in enumerate(known)
                        if difflib.SequenceMatcher(None, anchor, rep).ratio() >= similarity
                    ),
                    None,
                )
            if match is None:
                match = len(known)
                known.append(anchor)
                clusters[(p, match)] = len(clusters)
            exact[(p, anchor)] = match
        out.append(clusters[(p, exact[(p, anchor)])])
    return torch.tensor(out, dtype=torch.long, device=prefix_ids.device)


def gigpo_advantages(
    rewards: Tensor,
    task_ids: Tensor,
    episode_ids: Tensor,
    steps: Tensor,
    anchor_gid: Tensor,
    *,
    gamma: float = 1.0,
    omega: float = 1.0,
    eps: float = 1e-6,
    norm_std: bool = True,
    ddof: int = 1,
) -> Tensor:
    """GiGPO: ``A_i = A_E(e(i)) + omega * A_S(i)``.

    ``rewards`` are per-step rewards: the episode's team reward belongs on its final step only (the
    estimator's ``team_reward_once`` trait; ``megamarl.rl.prepare`` places it), otherwise it would be
    counted once per agent call and long episodes would look better than short ones.
    Step level: ``G_i = r_i + gamma * G_{next step}`` along the episode (positions by ``step``;
    tree-sampled siblings of one step are parallel, see ``discounted_returns``),
    ``A_S = (G_i - mean_a G) / (std_a G + eps)`` over the anchor group ``a = anchor_gid[i]``; a
    singleton anchor group gives ``A_S = 0``.
    Episode level: ``R_e`` = the undiscounted return from the episode's first step (the same
    recursion with gamma 1, so siblings count once); ``A_E = (R_e - mean_task R) / (std_task R + eps)``,
    the statistics taken over the *episodes* of the task. ``episode_ids`` must be unique across tasks.
    """
    num_eps = int(episode_ids.max()) + 1 if episode_ids.numel() else 0
    undiscounted = discounted_returns(rewards.double(), episode_ids, steps, gamma=1.0)
    first = steps.new_full((num_eps,), torch.iinfo(steps.dtype).max).scatter_reduce(
        0, episode_ids, steps, "amin"
    )
    at_first = (steps == first[episode_ids]).double()  # [N]: the episode's first-step samples (siblings)
    ep_count = undiscounted.new_zeros(num_eps).index_add_(0, episode_ids, at_first)
    ep_return = undiscounted.new_zeros(num_eps).index_add_(0, episode_ids, undiscounted * at_first)
    ep_return = ep_return / ep_count.clamp(min=1)  # [E]
    ep_task = task_ids.new_zeros(num_eps).scatter_(0, episode_ids, task_ids)  # [E]
    present = task_ids.new_zeros(num_eps, dtype=torch.bool).index_fill_(0, episode_ids, True)
    ep_adv = torch.zeros_like(ep_return)
    ep_adv[present] = grpo_advantages(
        ep_return[present], ep_task[present], eps=eps, norm_std=norm_std, ddof=ddof
    )
    step_returns = discounted_returns(rewards.double(), episode_ids, steps, gamma=gamma)
    step_adv = grpo_advantages(step_returns, anchor_gid, eps=eps, norm_std=norm_std, ddof=ddof)
    return (ep_adv[episode_ids] + omega * step_adv).to(rewards.dtype)


# --------------------------------------------------------------------------------------------
# critic-based


def gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """GAE over tokens, returning ``(advantages [B, T], returns [B, T])``, both 0 where ``mask`` is False.

    ``delta_t = r_t + gamma * V_{t'} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t'}``, where t' is
    the next *masked* position of the row (``V = A = 0`` past the last one); unmasked positions are
    skipped, so padding and masked-out segments never enter. ``returns = A + V``.
    """
    mask = mask.bool()
    r = torch.where(mask, token_rewards, 0.0).double()  # [B, T]
    v = torch.where(mask, values, 0.0).double()  # [B, T]
    adv = torch.zeros_like(r)
    next_value = r.new_zeros(r.shape[0])  # [B]
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        m = mask[:, t]
        adv[:, t] = torch.where(m, a_t, 0.0)
        next_value = torch.where(m, v[:, t], next_value)
        next_adv = torch.where(m, a_t, next_adv)
    return adv.to(values.dtype), (adv + v).to(values.dtype)


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    *,
    eps: float = 1e-6,
    ddof: int = 1,
    all_reduce: Callable[[Tensor], None] | None = None,
) -> Tensor:
    """``(x - mean_m) / (std_m + eps)`` over positions where ``mask`` (std with ``ddof``, divisor
    floored at 1); 0 elsewhere.

    The statistics come from the float64 sums ``[sum x, sum x^2, count]``; a caller whose batch is
    sharded (a policy's DP ranks) passes ``all_reduce``, which sums that 3-vector in place over the
    shards, and every shard is whitened with the statistics of the whole batch.
    """
    mask = mask.bool()
    xm = torch.where(mask, x, 0.0).double()
    stats = torch.stack([xm.sum(), (xm * xm).sum(), mask.sum().double()])
    if all_reduce is not None:
        all_reduce(stats)
    count = stats[2].clamp(min=1)
    mean = stats[0] / count
    std = ((stats[1] - count * mean * mean) / (count - ddof).clamp(min=1)).clamp(min=0).sqrt()
    return torch.where(mask, (x.double() - mean) / (std + eps), 0.0).to(x.dtype)


# --------------------------------------------------------------------------------------------
# traits, config and registered adapters


@dataclass(frozen=True)
class EstimatorTraits:
    """What the loop needs to know about an estimator, declared where it is registered (defaults:
    a plugin that declares nothing groups by ``algorithm.group_by`` on the driver).

    ``group_key``: the index columns its advantages are normalised over (None: ``advantage.group_by``);
    dynamic sampling drops the groups of this key in which it gives every sample an advantage of 0,
    and a key naming the agent or the policy makes it policy-separable (``policy_separable``).
    ``team_reward_once``: it sums rewards along an episode (returns), so the episode's team reward
    must sit on the final step only instead of on every agent call.
    ``needs_critic``: advantages need a critic's values, so each policy's workers compute them
    (value head on the Megatron model, ``rl.critic.CriticConfig``), not the driver.
    """

    group_key: tuple[str, ...] | None = None
    team_reward_once: bool = False
    needs_critic: bool = False

    def key(self, group_by: Sequence[str]) -> tuple[str, ...]:
        return tuple(group_by) if self.group_key is None else self.group_key

    def policy_separable(self, group_by: Sequence[str]) -> bool:
        """True when no group of this estimator can hold samples of two policies."""
        return bool({"agent", "policy"} & set(self.key(group_by)))


ADVANTAGE_ESTIMATORS: Registry[Estimator] = Registry(
    "advantage estimator",
    traits=EstimatorTraits,
    signature="fn(rewards, index, cfg, *, response_mask=None, values=None) -> [N] | ([N, T], [N, T])",
    keys=("algorithm.estimator", "policies.<name>.algorithm.estimator"),
)


def register_estimator(name: str, **traits) -> Callable[[Estimator], Estimator]:
    """``@register_estimator("name", group_key=(...), team_reward_once=...)``: register ``fn`` in
    ``ADVANTAGE_ESTIMATORS`` with its ``EstimatorTraits``."""
    return ADVANTAGE_ESTIMATORS.register(name, traits=EstimatorTraits(**traits))


def estimator_traits(name: str) -> EstimatorTraits:
    """Traits of a registered estimator (plugins registered without any get the defaults)."""
    return ADVANTAGE_ESTIMATORS.traits(name, key="algorithm.estimator")


@dataclass
class AdvantageConfig:
    estimator: str = "grpo"
    # Group key of grpo / dr_grpo / rloo; at_grpo, drmas_grpo and gigpo fix their own key.
    group_by: list[str] = field(default_factory=lambda: ["task"])
    norm_std: bool = True  # divide by the group std (gae: whiten over response tokens)
    std_ddof: int = 1  # 1: unbiased std (n - 1, the references' convention); 0: population std
    eps: float = 1e-6
    gamma: float = 1.0  # gae, gigpo step returns, reinforce_pp with discount_turns
    lam: float = 1.0  # gae
    discount_turns: bool = False  # reinforce_pp: discounted return over an agent's later turns
    gigpo_omega: float = 1.0  # weight of the step-level advantage
    gigpo_similarity: float | None = None  # None: exact anchor match; t in (0, 1]: difflib ratio >= t

    def __post_init__(self) -> None:
        ADVANTAGE_ESTIMATORS.get(self.estimator, key="advantage.estimator")
        check_group_by(self.group_by, key="advantage.group_by")
        if not self.eps > 0:
            raise ValueError(f"advantage.eps must be > 0, got {self.eps}")
        if self.std_ddof not in (0, 1):
            raise ValueError(
                f"advantage.std_ddof must be 0 (population) or 1 (unbiased), got {self.std_ddof}"
            )
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"advantage.{key} must be in [0, 1], got {getattr(self, key)}")
        if self.gigpo_omega < 0:
            raise ValueError(f"advantage.gigpo_omega must be >= 0, got {self.gigpo_omega}")
        if self.gigpo_similarity is not None and not 0 < self.gigpo_similarity <= 1:
            raise ValueError(
                f"advantage.gigpo_similarity must be None or in (0, 1], got {self.gigpo_similarity}"
            )


def compute_advantages(rewards: Tensor, index: GroupIndex, cfg: AdvantageConfig, **kwargs) -> Tensor:
    """Run the estimator named by ``cfg.estimator`` (kwargs: ``response_mask``, ``values`` for gae)."""
    return ADVANTAGE_ESTIMATORS.get(cfg.estimator, key="advantage.estimator")(rewards, index, cfg, **kwargs)


@register_estimator("grpo")
def _grpo(rewards, index, cfg: AdvantageConfig, **_):
    return grpo_advantages(
        rewards, group_ids(index, cfg.group_by), eps=cfg.eps, norm_std=cfg.norm_std, ddof=cfg.std_ddof
    )


@register_estimator("at_grpo", group_key=("task", "agent", "turn"))
def _at_grpo(rewards, index, cfg: AdvantageConfig, **_):
    gid = group_ids(index, ("task", "agent", "turn"))
    return grpo_advantages(rewards, gid, eps=cfg.eps, norm_std=cfg.norm_std, ddof=cfg.std_ddof)


@register_estimator("drmas_grpo", group_key=("task", "agent"))
def _drmas_grpo(rewards, index, cfg: AdvantageConfig, **_):
    gid = group_ids(index, ("task", "agent"))
    return drmas_advantages(rewards, gid, eps=cfg.eps, norm_std=cfg.norm_std, ddof=cfg.std_ddof)


@register_estimator("dr_grpo")
def _dr_grpo(rewards, index, cfg: AdvantageConfig, **_):
    return grpo_advantages(rewards, group_ids(index, cfg.group_by), norm_std=False)


@register_estimator("rloo")
def _rloo(rewards, index, cfg: AdvantageConfig, **_):
    return rloo_advantages(rewards, group_ids(index, cfg.group_by))


@register_estimator("reinforce_pp", group_key=("policy",))
def _reinforce_pp(rewards, index, cfg: AdvantageConfig, *, response_mask=None, **_):
    if response_mask is None:
        raise ValueError(
            "advantage.estimator='reinforce_pp' whitens over response tokens: it needs response_mask"
        )
    seq = group_ids(index, ("task", "episode", "agent"))
    return reinforce_pp_advantages(
        rewards,
        seq,
        index.turn,
        index.policy,
        response_mask.sum(1),
        gamma=cfg.gamma,
        discount_turns=cfg.discount_turns,
        eps=cfg.eps,
        norm_std=cfg.norm_std,
        ddof=cfg.std_ddof,
    )


@register_estimator("gigpo", group_key=("task",), team_reward_once=True)
def _gigpo(rewards, index, cfg: AdvantageConfig, **_):
    episodes = group_ids(index, ("task", "episode"))
    anchors = index.anchors or [None] * index.num_samples
    # Anchor groups are per (task, agent): two roles seeing the same text are not alternatives.
    agid = anchor_ids(group_ids(index, ("task", "agent")), anchors, similarity=cfg.gigpo_similarity)
    return gigpo_advantages(
        rewards,
        index.task,
        episodes,
        index.step,
        agid,
        gamma=cfg.gamma,
        omega=cfg.gigpo_omega,
        eps=cfg.eps,
        norm_std=cfg.norm_std,
        ddof=cfg.std_ddof,
    )


@register_estimator("gae", group_key=("policy",), needs_critic=True)
def _gae(rewards, index, cfg: AdvantageConfig, *, response_mask=None, values=None, all_reduce=None, **_):
    """Returns ``(advantages [N, T], returns [N, T])``: the critic's targets come from the same
    recursion. ``all_reduce`` sums the whitening statistics over a sharded batch's shards."""
    if response_mask is None or values is None:
        raise ValueError("advantage.estimator='gae' needs response_mask and critic values")
    token_rewards = rewards_to_tokens(rewards, response_mask)  # [N, T]
    adv, returns = gae(token_rewards, values, response_mask, gamma=cfg.gamma, lam=cfg.lam)
    if cfg.norm_std:
        adv = masked_whiten(adv, response_mask, eps=cfg.eps, ddof=cfg.std_ddof, all_reduce=all_reduce)
    return adv, returns


def advantage_config(algo: AlgorithmConfig) -> AdvantageConfig:
    """The estimator's settings: ``algorithm.*`` keys plus ``estimator_kwargs``; call once plugins that
    register estimators are imported. Errors name the algorithm key."""
    try:
        return AdvantageConfig(
            estimator=algo.estimator,
            group_by=list(algo.group_by),
            norm_std=algo.normalize_std,
            std_ddof=algo.std_ddof,
            **algo.estimator_kwargs,
        )
    except TypeError as exc:  # an unknown keyword
        raise ValueError(f"algorithm.estimator_kwargs: {exc}") from exc
    except ValueError as exc:  # AdvantageConfig names its field (advantage.gamma), not where it came from
        raise ValueError(f"algorithm.estimator_kwargs: {exc}") from exc


def check_group_by(group_by: Sequence[str], *, key: str) -> None:
    bad = [k for k in group_by if k not in GROUP_KEYS]
    if bad:
        raise ValueError(f"{key} has unknown keys {bad}; allowed: {list(GROUP_KEYS)}")


def check_algorithm(algo: AlgorithmConfig) -> None:
    """Load time, after plugins are imported: the run's ``algorithm`` section against the estimator,
    loss-aggregation and KL registries (errors name ``algorithm.<key>``)."""
    check_group_by(algo.group_by, key="algorithm.group_by")
    LOSS_AGGREGATIONS.get(algo.loss_agg, key="algorithm.loss_agg")
    LOSS_AGGREGATIONS.get(algo.value_loss_agg, key="algorithm.value_loss_agg")
    KL_ESTIMATORS.get(algo.kl_type, key="algorithm.kl_type")
    ADVANTAGE_ESTIMATORS.get(algo.estimator, key="algorithm.estimator")
    check_estimator(algo)


def check_policy_algorithm(override: PolicyAlgorithmConfig, *, key: str) -> None:
    """``policies.<p>.algorithm``'s own keys (``key`` is that section's full name)."""
    check_group_by(override.group_by or [], key=f"{key}.group_by")
    for name in ("loss_agg", "value_loss_agg"):
        if getattr(override, name) is not None:
            LOSS_AGGREGATIONS.get(getattr(override, name), key=f"{key}.{name}")
    if override.estimator is not None:
        ADVANTAGE_ESTIMATORS.get(override.estimator, key=f"{key}.estimator")


def check_estimator(algo: AlgorithmConfig) -> None:
    """The estimator's settings build, and dynamic sampling is not asked of a critic estimator."""
    advantage_config(algo)
    if (
        algo.dynamic_sampling
        and ADVANTAGE_ESTIMATORS.traits(algo.estimator, key="algorithm.estimator").needs_critic
    ):
        raise ValueError(
            f"algorithm.dynamic_sampling filters on advantages computed on the driver; "
            f"algorithm.estimator={algo.estimator!r} computes them from a critic on the workers"
        )
