"""Planning games (grid, Sokoban, Sudoku): seeded generation, exact transitions, rewards, tree check fn."""

import asyncio
from collections import deque

import pytest
from scripted import ScriptedEngine, smollm2_tokenizer  # tests/ helper

from megamarl.orchestration import AgentConfig, EnvMaker, Task, build_agents, build_orchestra, run_episodes
from megamarl.orchestration.context import Action
from megamarl.orchestration.envs.planning import MOVES, GridLevel, SokobanLevel, parse_moves
from megamarl.orchestration.envs.sudoku import is_valid_solution, parse_placements


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def act(value, text=""):
    return Action("executor", text, value, bool(value), 0, 0)


def test_move_and_placement_parsers():
    assert parse_moves("Go RRD then up, left") == (["R", "R", "D", "U", "L"], True)
    assert parse_moves("I will think") == ([], False)  # "I" is not a move letter
    assert parse_placements("1 2 3\nrow 4, 4: 1\nnope") == ([(1, 2, 3), (4, 4, 1)], True)


def test_grid_transitions_exact():
    level = GridLevel(3, frozenset({(1, 1)}), (0, 0), (2, 2))
    env = EnvMaker("grid", size=3, max_actions=10)(Task("g", level))
    assert env.render() == "A..\n.#.\n..G"
    env.step("executor", act(["D", "R", "U"]))  # D ok, R into wall blocked, U ok
    assert (env.pos, env.num_actions, env.num_blocked, env.done) == ((0, 0), 3, 1, False)
    assert env.score("executor", act(["R", "R", "D", "D"])) == 1.0 and env.pos == (
        0,
        0,
    )  # score does not mutate
    env.step("executor", act(["R", "R", "D", "D", "L"]))  # stops at the goal, "L" unused
    assert (env.pos, env.done, env.team_reward(), env.num_actions) == ((2, 2), True, 1.0, 7)


def test_grid_budget_ends_episode_unsolved():
    level = GridLevel(3, frozenset(), (0, 0), (2, 2))
    env = EnvMaker("grid", size=3, max_actions=2)(Task("g", level))
    result = env.step("executor", act(["R", "L", "R"]))
    assert (env.done, env.team_reward(), env.num_actions, result.local_reward) == (True, 0.0, 2, 0.0)


def _bfs_moves(level):
    prev, queue = {level.start: None}, deque([level.start])
    while queue:
        cell = queue.popleft()
        for name, (dr, dc) in MOVES.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if (
                0 <= nxt[0] < level.size
                and 0 <= nxt[1] < level.size
                and nxt not in level.walls
                and nxt not in prev
            ):
                prev[nxt] = (cell, name)
                queue.append(nxt)
    moves, cell = [], level.goal
    while prev[cell] is not None:
        cell, name = prev[cell]
        moves.append(name)
    return "".join(reversed(moves))


def test_grid_rollout_with_planner_and_tree_sampled_executor(tok):
    maker = EnvMaker("grid", size=5, max_actions=40)
    tasks = maker.tasks(3, seed=7)
    assert tasks == maker.tasks(3, seed=7)
    plans = {t.payload: _bfs_moves(t.payload) for t in tasks}
    levels_by_render = {maker(t).render(): t.payload for t in tasks}

    def policy(request):
        grid = "\n".join(line for line in request.last_user.splitlines() if set(line) <= set("A.#G") and line)
        level = levels_by_render[grid]
        if "Write a short plan" in request.last_user:
            return f"Follow {plans[level]}"
        return plans[level] if request.index == 2 else "U"  # only branch 2 is the real path

    configs = {"planner": AgentConfig(policy="default"), "executor": AgentConfig(policy="default", tree_k=3)}
    agents = build_agents(configs, tok, default_kinds=maker.default_agents)
    result = asyncio.run(
        run_episodes(
            build_orchestra("sequential", max_steps=4),
            maker,
            tasks,
            agents=agents,
            engines={"default": ScriptedEngine(tok, policy)},
        )
    )
    assert all(e.team_reward == 1.0 and e.env_done for e in result.episodes)
    executor = [s for s in result.samples if s.agent == "executor"]
    assert [(s.turn, s.branch) for s in executor] == [(0, 0), (0, 1), (0, 2)] * 3
    assert [s.local_reward for s in executor[:3]][2] == 1.0


def test_sokoban_push_rules_exact():
    walls = frozenset((r, c) for r in range(5) for c in range(5) if r in (0, 4) or c in (0, 4))
    level = SokobanLevel(5, 5, walls, frozenset({(1, 3)}), frozenset({(2, 2)}), (3, 2))
    env = EnvMaker("sokoban", size=5)(Task("s", level))
    assert env.render() == "#####\n#__.#\n#_$_#\n#_@_#\n#####"
    env.step("executor", act(["U"]))  # push the box up
    assert (env.player, env.boxes) == ((2, 2), {(1, 2)})
    env.step("executor", act(["U"]))  # box against the wall: blocked
    assert (env.player, env.num_blocked) == ((2, 2), 1)
    assert env.score("executor", act(["L", "U", "R"])) == 1.0 and not env.done
    env.step("executor", act(["L", "U", "R"]))
    assert (env.done, env.team_reward(), env.render().splitlines()[1]) == (True, 1.0, "#_@*#")


def test_sokoban_levels_are_seeded_and_unsolved_at_start():
    maker = EnvMaker("sokoban", size=6, num_boxes=2)
    tasks = maker.tasks(10, seed=0)
    assert tasks == maker.tasks(10, seed=0)
    for task in tasks:
        level = task.payload
        assert level.boxes != level.goals and len(level.boxes) == 2 and level.player not in level.boxes


def test_sudoku_generation_and_transitions():
    for size in (4, 9):
        maker = EnvMaker("sudoku", size=size, num_holes=5)
        for task in maker.tasks(5, seed=size):
            solution = [list(r) for r in task.payload.solution]
            assert is_valid_solution(solution)
            assert sum(v == 0 for row in task.payload.givens for v in row) == 5
    task = EnvMaker("sudoku", size=4, num_holes=2).tasks(1, seed=0)[0]
    env = EnvMaker("sudoku", size=4, num_holes=2, max_actions=10)(task)
    blanks = [(r, c) for r in range(4) for c in range(4) if task.payload.givens[r][c] == 0]
    given = next((r, c) for r in range(4) for c in range(4) if task.payload.givens[r][c])
    (r0, c0), (r1, c1) = blanks
    wrong = task.payload.solution[r0][c0] % 4 + 1
    env.step("executor", act([(given[0] + 1, given[1] + 1, 1), (r0 + 1, c0 + 1, wrong)]))
    assert (env.num_blocked, env.progress(), env.done) == (1, 0.0, False)
    fix = [(r0 + 1, c0 + 1, task.payload.solution[r0][c0]), (r1 + 1, c1 + 1, task.payload.solution[r1][c1])]
    assert env.score("executor", act(fix)) == 1.0
    env.step("executor", act(fix))
    assert (env.done, env.team_reward(), env.num_actions) == (True, 1.0, 4)
