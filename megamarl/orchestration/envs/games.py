"""Hooks for the PettingZoo games the repo ships configs for (``configs/tictactoe.yaml``).

Each game is a factory (``env.kwargs.factory``), optionally a text hook (``env.kwargs.render``;
the default rendering already lists the legal actions, a game-specific one shows the board), and a
self-play ``policy_mapping`` (``rollout.policy_mapping``). They double as examples of the three
hook signatures: ``factory(seed) -> env``, ``render(obs, agent) -> str`` and
``policy_mapping(agent_id, episode_seed) -> policy``.

Needs ``pettingzoo[classic]``'s pygame (the ``pettingzoo`` extra installs it); imported lazily so the
rest of the package does not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

TICTACTOE_POLICIES = ("alpha", "beta")


def make_tictactoe(seed: int) -> Any:
    """``pettingzoo.classic.tictactoe_v3`` (AEC; players ``player_1`` (X, moves first) and
    ``player_2`` (O); illegal moves lose, wins +1, losses -1, draws 0)."""
    from pettingzoo.classic import tictactoe_v3

    return tictactoe_v3.env()


def render_tictactoe(obs: dict, agent: str) -> str:
    """The board as three rows of marks, free cells shown by their action number.

    PettingZoo numbers the cells column by column (0 3 6 / 1 4 7 / 2 5 8) and the observation holds
    ``[3, 3, 2]`` planes indexed ``[cell // 3, cell % 3]``: plane 0 the observing player's marks,
    plane 1 the opponent's.
    """
    planes = np.asarray(obs["observation"])
    mine, theirs = ("X", "O") if agent == "player_1" else ("O", "X")
    rows = []
    for row in range(3):
        cells = []
        for col in range(3):
            cell = 3 * col + row
            if planes[cell // 3, cell % 3, 0]:
                cells.append(mine)
            elif planes[cell // 3, cell % 3, 1]:
                cells.append(theirs)
            else:
                cells.append(str(cell))
        rows.append(" | ".join(cells))
    legal = " ".join(str(a) for a in np.flatnonzero(obs["action_mask"]))
    return (
        f"Tic-tac-toe. You play {mine}.\n"
        + "\n".join(rows)
        + f"\nFree cells: {legal}. Answer with the number of the cell you take."
    )


def tictactoe_vs_pool(agent_id: str, episode_seed: int) -> str:
    """Policy ``alpha`` against the opponent pool (``rollout.opponent_pool``, alias ``opponent``):
    alpha takes X or O by the seed's parity, the pool fills the other seat."""
    seat = 0 if agent_id == "player_1" else 1
    return "alpha" if (episode_seed + seat) % 2 == 0 else "opponent"


def tictactoe_self_play(agent_id: str, episode_seed: int) -> str:
    """Policies ``alpha`` and ``beta`` swap seats from episode to episode (by the seed's parity), so
    each plays X (who moves first) in about half the games."""
    first = episode_seed % 2
    seat = 0 if agent_id == "player_1" else 1
    return TICTACTOE_POLICIES[(first + seat) % 2]
