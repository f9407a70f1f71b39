"""How one DP rank's part of a mini-batch is cut into the micro-batches the schedule runs.

Padded: consecutive rows, ``micro_batch_size`` at a time. Packed (``policies.<p>.pack``): first-fit
decreasing by real tokens up to ``max_tokens_per_micro_batch``. Tree (``prefix_tree``): by trie nodes,
shared prefixes adjacent (``rl.tree.split_by_tree_tokens``). With per-agent settings each micro-batch
holds one agent's rows (its own size and loss settings); with ``prefix_tree`` the rows of agents that
train alike share micro-batches, so a team's common tokens are shared too.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megamarl.config import PolicyConfig
from megamarl.rl.batch import SampleBatch
from megamarl.rl.losses import LossConfig
from megamarl.rl.packing import padding_fraction, split_by_tokens
from megamarl.rl.tree import split_by_tree_tokens, tree_tokens


class MicroBatcher:
    def __init__(self, cfg: PolicyConfig, agents: Mapping, loss_cfg: LossConfig):
        self.cfg, self.agents, self.loss_cfg = cfg, agents, loss_cfg  # agents: name -> AgentTraining

    def split(self, part: SampleBatch) -> list[SampleBatch]:
        """The micro-batches of ``part``; rows keep their order within each."""
        if not part.num_samples:
            return []
        if not self.agents:
            return self._chunks(part, self.cfg.micro_batch_size)
        names = part.names("agent")
        out = []
        for agents in self._agents_together(sorted(set(names))):
            rows = torch.tensor([n in agents for n in names], dtype=torch.bool, device=part.device)
            size = (
                self.agents[agents[0]].micro_batch_size
                if agents[0] in self.agents
                else self.cfg.micro_batch_size
            )
            out.extend(self._chunks(part.select(rows), size))
        return out

    def _agents_together(self, agents: list[str]) -> list[list[str]]:
        """Agents whose rows may share a micro-batch: each alone, or with ``prefix_tree`` those with the
        same micro-batch size, LoRA adapter and loss settings (first-name order)."""
        if not self.cfg.prefix_tree:
            return [[agent] for agent in agents]
        groups: dict[tuple, list[str]] = {}
        for agent in agents:
            t = self.agents.get(agent)
            key = (t.micro_batch_size, t.adapter, repr(t.loss)) if t else (None, None, repr(self.loss_cfg))
            groups.setdefault(key, []).append(agent)
        return list(groups.values())

    def _chunks(self, rows: SampleBatch, size: int) -> list[SampleBatch]:
        if not self.cfg.pack:
            return rows.micro_batches(max_samples=size)
        budget = self.cfg.max_tokens_per_micro_batch or size * int(rows.lengths.max())
        if self.cfg.prefix_tree:  # the budget counts tree tokens (what the forward computes)
            groups = split_by_tree_tokens(rows.tokens, rows.attention_mask, budget, max_samples=size)
        else:
            groups = split_by_tokens(rows.lengths, budget, max_samples=size)
        return [rows.select(group) for group in groups]

    def padding_fraction(self, part: SampleBatch) -> float:
        """Share of the token slots of ``part``'s micro-batches that are padding (0 when packed)."""
        if self.cfg.pack or not part.num_samples:
            return 0.0
        micro_batches = self.split(part)
        shapes = [(mb.num_samples, mb.tokens.shape[1]) for mb in micro_batches]
        lengths = torch.cat([mb.lengths for mb in micro_batches])
        return padding_fraction(lengths, shapes)

    def forwarded_tokens(self, parts: list[SampleBatch]) -> int:
        """Tokens one pass over ``parts`` forwards: rows x width padded, sample tokens packed, trie nodes
        with ``prefix_tree``."""

        def tokens(mb: SampleBatch) -> int:
            if self.cfg.prefix_tree:
                return tree_tokens(mb.tokens, mb.attention_mask)
            return int(mb.lengths.sum()) if self.cfg.pack else mb.num_samples * mb.tokens.shape[1]

        return sum(tokens(mb) for part in parts for mb in self.split(part))
