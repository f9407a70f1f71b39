"""``SampleBatch``: the padded, agent-tagged training batch collated from ``Sample`` records.

One row per agent call. Index columns are integer tensors; the string-valued ones (task, episode,
agent, policy) index into ``vocab`` in first-appearance order, so ``batch.names("agent")`` maps
back. Token layout per row: ``prompt + response`` right-padded with its policy's pad id
(``pad_ids``: each policy's own tokenizer's, so an L3 team of several tokenizer families trains every
policy on ids of its own vocabulary);
``rollout_logprobs[b, t]`` is the engine's logprob of ``tokens[b, t]`` (0 off the response), the
same alignment as ``losses.token_logprobs``.

Selection keeps the vocabularies (ids stay comparable across the parts of one batch) and trims the
token dim to the longest selected row. Nothing here touches ``torch.distributed``: the driver cuts
the batch into each rank's share (``megamarl.rl.dispatch``) and the trainer sends the shares.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megamarl.rl.advantages import GroupIndex
from megamarl.rl.sample import Sample

VOCAB_COLUMNS = ("task", "episode", "agent", "policy")
INT_COLUMNS = ("turn", "branch", "weight_version", "step")
BOOL_COLUMNS = ("valid", "truncated")
SAMPLE_FIELDS = {"task": "task_id", "episode": "episode_id"}  # batch column -> Sample attribute
ROW_TENSORS = VOCAB_COLUMNS + INT_COLUMNS + BOOL_COLUMNS + ("team_rewards", "local_rewards", "rewards")
TOKEN_TENSORS = ("tokens", "attention_mask", "response_mask", "rollout_logprobs")


@dataclass
class SampleBatch:
    task: Tensor  # [B] long, index into vocab["task"]
    episode: Tensor  # [B] long, index into vocab["episode"]
    agent: Tensor  # [B] long, index into vocab["agent"]
    policy: Tensor  # [B] long, index into vocab["policy"]
    turn: Tensor  # [B] long
    branch: Tensor  # [B] long
    weight_version: Tensor  # [B] long
    step: Tensor  # [B] long
    valid: Tensor  # [B] bool
    truncated: Tensor  # [B] bool
    team_rewards: Tensor  # [B] float32
    local_rewards: Tensor  # [B] float32
    rewards: Tensor  # [B] float32: team + local at collate; the trainer overwrites with shape_rewards
    tokens: Tensor  # [B, T] long
    attention_mask: Tensor  # [B, T] bool
    response_mask: Tensor  # [B, T] bool
    rollout_logprobs: Tensor  # [B, T] float32
    vocab: dict[str, tuple[str, ...]]
    anchors: tuple[str | None, ...]  # GiGPO anchor observation per row
    allowed: tuple[tuple[int, ...] | None, ...] = ()  # per row: restricted sampling vocabulary, or None
    temperatures: tuple[float, ...] = ()  # per row: sampling temperature (empty: all 1.0)
    pad_ids: dict[str, int] = field(default_factory=dict)  # policy -> its tokenizer's pad id
    advantages: Tensor | None = None  # [B] or [B, T] once computed

    def __post_init__(self) -> None:
        b, t = self.tokens.shape
        expected: dict[str, list[tuple[int, ...]]] = {
            **{name: [(b,)] for name in ROW_TENSORS},
            **{name: [(b, t)] for name in TOKEN_TENSORS},
        }
        if self.advantages is not None:
            expected["advantages"] = [(b,), (b, t)]
        for name, shapes in expected.items():
            shape = tuple(getattr(self, name).shape)
            if shape not in shapes:
                raise ValueError(f"SampleBatch.{name} has shape {shape}, expected one of {shapes}")
        if len(self.anchors) != b:
            raise ValueError(f"SampleBatch.anchors has {len(self.anchors)} entries, expected {b}")
        if not self.allowed:
            self.allowed = (None,) * b
        if len(self.allowed) != b:
            raise ValueError(f"SampleBatch.allowed has {len(self.allowed)} entries, expected {b}")
        if not self.temperatures:
            self.temperatures = (1.0,) * b
        if len(self.temperatures) != b:
            raise ValueError(f"SampleBatch.temperatures has {len(self.temperatures)} entries, expected {b}")
        for policy in self.vocab["policy"]:
            if policy not in self.pad_ids:
                raise ValueError(f"SampleBatch: policy '{policy}' has no pad id; have {self.pad_ids}")

    # ---- views ------------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return self.tokens.shape[0]

    @property
    def lengths(self) -> Tensor:
        return self.attention_mask.sum(1)  # [B]

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def names(self, column: str) -> list[str]:
        """Per-row strings of a vocab column (task, episode, agent, policy)."""
        return [self.vocab[column][i] for i in getattr(self, column).tolist()]

    def group_sizes(self, key: Sequence[str]) -> dict[tuple[str | int, ...], int]:
        """Rows per group of the index columns ``key`` (vocab columns as names, the others as ints),
        groups in first-appearance order: ``{("3@1", "sender", 0): 8, ...}``. An empty key is one group."""
        columns = [self.names(k) if k in VOCAB_COLUMNS else getattr(self, k).tolist() for k in key]
        rows = zip(*columns, strict=True) if columns else [()] * self.num_samples
        return dict(Counter(rows))  # a Counter keeps first-insertion order

    def group_index(self) -> GroupIndex:
        return GroupIndex(
            task=self.task,
            episode=self.episode,
            agent=self.agent,
            policy=self.policy,
            turn=self.turn,
            branch=self.branch,
            step=self.step,
            anchors=self.anchors,
        )

    def replace(self, **changes) -> SampleBatch:
        return dataclasses.replace(self, **changes)

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def to(self, device: torch.device | str) -> SampleBatch:
        """Every tensor field on ``device`` (the batch itself when all already are: no copy).

        Walks the dataclass fields, so a tensor column added later moves too."""
        device = torch.device(device)
        moved = {
            f.name: value.to(device)
            for f in dataclasses.fields(self)
            if isinstance(value := getattr(self, f.name), Tensor) and value.device != device
        }
        return self.replace(**moved) if moved else self

    # ---- selection --------------------------------------------------------------------------
    def select(self, rows: Tensor | Sequence[int]) -> SampleBatch:
        """Rows by boolean mask ``[B]`` or integer indices (in the given order); the token dim is
        trimmed to the longest selected row."""
        rows = torch.as_tensor(rows, device=self.device)
        idx = torch.nonzero(rows).squeeze(1) if rows.dtype == torch.bool else rows.long().reshape(-1)
        width = int(self.lengths[idx].max()) if idx.numel() else 0
        changes = {name: getattr(self, name)[idx] for name in ROW_TENSORS}
        changes.update({name: getattr(self, name)[idx, :width] for name in TOKEN_TENSORS})
        if self.advantages is not None:
            adv = self.advantages[idx]
            changes["advantages"] = adv[:, :width] if adv.dim() == 2 else adv
        changes["anchors"] = tuple(self.anchors[i] for i in idx.tolist())
        changes["allowed"] = tuple(self.allowed[i] for i in idx.tolist())
        changes["temperatures"] = tuple(self.temperatures[i] for i in idx.tolist())
        return self.replace(**changes)

    def split_by_policy(self) -> dict[str, SampleBatch]:
        """One batch per policy present, in vocab order."""
        present = set(self.policy.tolist())
        names = self.vocab["policy"]
        return {name: self.select(self.policy == i) for i, name in enumerate(names) if i in present}

    def balance_across_dp(self, num_ranks: int) -> list[SampleBatch]:
        """Greedy longest-processing-time split by token count into ``num_ranks`` parts.

        Rows in decreasing length (ties: lower index first) go to the rank with the fewest tokens so
        far (ties: fewer rows, then lower rank), so every rank gets a row while rows last; each part
        keeps the original row order. Deterministic.
        """
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        lengths = self.lengths.tolist()
        loads = [(0, 0, r) for r in range(num_ranks)]  # (tokens, rows, rank)
        parts: list[list[int]] = [[] for _ in range(num_ranks)]
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            tokens, count, rank = min(loads)
            parts[rank].append(i)
            loads[rank] = (tokens + lengths[i], count + 1, rank)
        return [self.select(sorted(p)) for p in parts]

    def micro_batches(
        self,
        *,
        max_samples: int | None = None,
        max_tokens: int | None = None,
    ) -> list[SampleBatch]:
        """Consecutive chunks with at most ``max_samples`` rows and at most ``max_tokens`` *padded*
        tokens (rows x longest row); a single row longer than ``max_tokens`` forms its own chunk."""
        if max_samples is None and max_tokens is None:
            raise ValueError("micro_batches needs max_samples or max_tokens")
        if (max_samples is not None and max_samples < 1) or (max_tokens is not None and max_tokens < 1):
            raise ValueError(f"max_samples/max_tokens must be >= 1, got {max_samples}/{max_tokens}")
        chunks: list[list[int]] = []
        width = 0
        for i, length in enumerate(self.lengths.tolist()):
            new_width = max(width, length)
            if (
                chunks
                and (max_samples is None or len(chunks[-1]) < max_samples)
                and (max_tokens is None or new_width * (len(chunks[-1]) + 1) <= max_tokens)
            ):
                chunks[-1].append(i)
                width = new_width
            else:
                chunks.append([i])
                width = length
        return [self.select(c) for c in chunks]


def collate(samples: Sequence[Sample], pad_id: int | Mapping[str, int]) -> SampleBatch:
    """Pad and tag a list of samples (one row each, in order). ``pad_id``: one id for every policy, or
    policy -> its own tokenizer's pad id (each row is padded with its policy's)."""
    vocab: dict[str, dict[str, int]] = {c: {} for c in VOCAB_COLUMNS}
    cols: dict[str, list] = {c: [] for c in VOCAB_COLUMNS + INT_COLUMNS + BOOL_COLUMNS}
    for s in samples:
        for c in VOCAB_COLUMNS:
            cols[c].append(vocab[c].setdefault(getattr(s, SAMPLE_FIELDS.get(c, c)), len(vocab[c])))
        for c in INT_COLUMNS + BOOL_COLUMNS:
            cols[c].append(getattr(s, c))
    policies = tuple(vocab["policy"])
    pad_ids = {p: pad_id for p in policies} if isinstance(pad_id, int) else dict(pad_id)
    width = max((len(s.prompt_ids) + len(s.response_ids) for s in samples), default=0)
    tokens = torch.zeros((len(samples), width), dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.bool)
    response = torch.zeros_like(attention)
    logprobs = torch.zeros((len(samples), width), dtype=torch.float32)
    for b, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)
        tokens[b, :n] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention[b, :n] = True
        response[b, p:n] = True
        if s.rollout_logprobs:
            logprobs[b, p:n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    team = torch.tensor([s.team_reward for s in samples], dtype=torch.float32)
    local = torch.tensor([s.local_reward for s in samples], dtype=torch.float32)
    policy = torch.tensor(cols["policy"], dtype=torch.long)
    return SampleBatch(
        **{c: torch.tensor(cols[c], dtype=torch.long) for c in VOCAB_COLUMNS + INT_COLUMNS},
        **{c: torch.tensor(cols[c], dtype=torch.bool) for c in BOOL_COLUMNS},
        team_rewards=team,
        local_rewards=local,
        rewards=team + local,
        tokens=padded_rows(tokens, attention, policy, policies, pad_ids),
        attention_mask=attention,
        response_mask=response,
        rollout_logprobs=logprobs,
        vocab={c: tuple(vocab[c]) for c in VOCAB_COLUMNS},
        anchors=tuple(s.anchor for s in samples),
        allowed=tuple(s.allowed_token_ids for s in samples),
        temperatures=tuple(s.temperature for s in samples),
        pad_ids={p: pad_ids[p] for p in policies if p in pad_ids},  # a missing one: __post_init__ names it
    )


def padded_rows(
    tokens: Tensor, attention_mask: Tensor, policy: Tensor, names: Sequence[str], pad_ids: Mapping[str, int]
) -> Tensor:
    """``tokens`` [B, T] with every slot outside ``attention_mask`` set to its row's policy's pad id
    (``policy`` [B] indexes ``names``); a policy without one is left to ``SampleBatch`` to report."""
    table = torch.tensor([pad_ids.get(name, 0) for name in names], dtype=torch.long, device=tokens.device)
    row_pads = table[policy]  # [B]
    return torch.where(attention_mask, tokens, row_pads[:, None])


def concat(batches: Sequence[SampleBatch]) -> SampleBatch:
    """Rows of all batches in order; vocabularies merged in first-appearance order, tokens re-padded.
    Advantages are kept only if every batch has them with the same rank ([B] or [B, T])."""
    if not batches:
        raise ValueError("concat needs at least one batch")
    pad_ids: dict[str, int] = {}
    for b in batches:
        for policy, pad_id in b.pad_ids.items():
            if pad_ids.setdefault(policy, pad_id) != pad_id:
                raise ValueError(
                    f"concat: policy '{policy}' is padded with {pad_ids[policy]} in one batch "
                    f"and {pad_id} in another"
                )
    vocab: dict[str, dict[str, int]] = {c: {} for c in VOCAB_COLUMNS}
    remapped: dict[str, list[Tensor]] = {c: [] for c in VOCAB_COLUMNS}
    for b in batches:
        for c in VOCAB_COLUMNS:
            new_ids = [vocab[c].setdefault(name, len(vocab[c])) for name in b.vocab[c]]
            table = torch.tensor(new_ids, dtype=torch.long)
            remapped[c].append(table[getattr(b, c)] if len(table) else getattr(b, c))
    width = max(b.tokens.shape[1] for b in batches)

    def pad(x: Tensor, value) -> Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    changes = {c: torch.cat(remapped[c]) for c in VOCAB_COLUMNS}
    for c in ROW_TENSORS[len(VOCAB_COLUMNS) :]:
        changes[c] = torch.cat([getattr(b, c) for b in batches])
    for c in ("attention_mask", "response_mask", "rollout_logprobs"):
        changes[c] = torch.cat([pad(getattr(b, c), False if c.endswith("mask") else 0.0) for b in batches])
    tokens = torch.cat([pad(b.tokens, 0) for b in batches])
    names = tuple(vocab["policy"])
    changes["tokens"] = padded_rows(tokens, changes["attention_mask"], changes["policy"], names, pad_ids)
    advs = [b.advantages for b in batches]
    ranks = {a.dim() if a is not None else None for a in advs}
    adv = None
    if ranks == {1}:
        adv = torch.cat(advs)
    elif ranks == {2}:
        adv = torch.cat([pad(a, 0.0) for a in advs])
    return batches[0].replace(
        **changes,
        advantages=adv,
        anchors=sum((b.anchors for b in batches), ()),
        allowed=sum((b.allowed for b in batches), ()),
        temperatures=sum((b.temperatures for b in batches), ()),
        vocab={c: tuple(vocab[c]) for c in VOCAB_COLUMNS},
        pad_ids=pad_ids,
    )
