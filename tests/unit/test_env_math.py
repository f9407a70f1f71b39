"""Math env: seeded generation, last-number extraction, solver/verifier transitions and exact rewards."""

import asyncio
import json
import re

import pytest
import torch
from scripted import ScriptedEngine, smollm2_tokenizer  # tests/ helper

from megamarl.orchestration import AgentConfig, EnvMaker, build_agents, build_orchestra, run_episodes
from megamarl.orchestration.agents import last_number, verdict
from megamarl.orchestration.envs.math import PROBLEM_KINDS, load_jsonl
from megamarl.rl.batch import collate


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def _truth(question):
    a, op, b = re.search(r"(\d+) ([+x]) (\d+)", question).groups()
    return int(a) + int(b) if op == "+" else int(a) * int(b)


def test_generation_is_seeded_and_exact():
    maker = EnvMaker("math", kinds=("add1", "mul1", "add2", "mul12"))
    tasks = maker.tasks(40, seed=3)
    assert tasks == maker.tasks(40, seed=3) and tasks != maker.tasks(40, seed=4)
    for task in tasks:
        assert task.payload.answer == _truth(task.payload.question)
    add2 = [t for t in tasks if t.payload.kind == "add2"]
    assert all(all(10 <= int(x) <= 99 for x in re.findall(r"\d+", t.payload.question)) for t in add2)
    words = EnvMaker("math", kinds=("word",)).tasks(20, seed=0)
    assert all(t.payload.answer >= 0 and t.payload.answer == int(t.payload.answer) for t in words)
    with pytest.raises(ValueError, match="env.kinds"):
        EnvMaker("math", kinds=("calculus",))
    assert set(PROBLEM_KINDS) == {"add1", "mul1", "add2", "mul12", "word"}


def test_last_number_and_verdict_parsers():
    assert last_number("3 + 2 = 5") == (5.0, True)
    assert last_number("It is 1,234 apples") == (1234.0, True)
    assert last_number("-4.5 then -7") == (-7.0, True)
    assert last_number("no digits") == (None, False)
    assert verdict("No wait, yes it is correct") == (True, True)
    assert verdict("That is incorrect.") == (False, True)
    assert verdict("hmm") == (None, False)


def test_jsonl_loader(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"question": "2+3?", "answer": "5"})
        + "\n\n"
        + json.dumps({"question": "q", "answer": 7})
        + "\n"
    )
    assert [(p.question, p.answer) for p in load_jsonl(path)] == [("2+3?", 5.0), ("q", 7.0)]
    tasks = EnvMaker("math", dataset_path=str(path)).tasks(4, seed=0)
    assert sorted(t.payload.answer for t in tasks) == [5.0, 5.0, 7.0, 7.0]
    path.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match="question' and 'answer"):
        load_jsonl(path)


def test_file_tasks_unique_within_a_chunk_item8(tmp_path, tok):
    # issue #16 item 8: 3 problems, a chunk of 7 tasks. Each pass draws every problem once (a seeded
    # permutation); repeats get their own task ids, so their episodes form groups of their own.
    path = tmp_path / "d.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(3))
    )
    maker = EnvMaker("math", dataset_path=str(path), with_verifier=False)
    tasks = maker.tasks(7, seed=0)
    ids = [t.task_id for t in tasks]
    assert len(set(ids)) == 7, ids
    answers = [t.payload.answer for t in tasks]
    assert sorted(answers[:3]) == sorted(answers[3:6]) == [1.0, 2.0, 3.0]  # no repeat before all are drawn
    assert [i.split(".")[-1] for i in ids[3:]] == ["1", "1", "1", "2"] and "." not in "".join(ids[:3])
    assert maker.tasks(7, seed=0) == tasks and maker.tasks(3, seed=0) == tasks[:3]
    # through rollout and collate: 7 task groups of group_size episodes, 14 distinct episodes
    agents = build_agents({"solver": AgentConfig(policy="default")}, tok, default_kinds=maker.default_agents)
    result = asyncio.run(
        run_episodes(
            build_orchestra("solve_verify"),
            maker,
            tasks,
            agents=agents,
            group_size=2,
            engines={"default": ScriptedEngine(tok, _right_solver)},
        )
    )
    batch = collate(result.samples, pad_id=0)
    assert len(batch.vocab["task"]) == 7 and len(batch.vocab["episode"]) == 14
    assert torch.bincount(batch.task).tolist() == [2] * 7


def _rollout(tok, policy, *, num_tasks=4, max_loops=3, with_verifier=True):
    maker = EnvMaker("math", kinds=("add1", "mul12"), with_verifier=with_verifier)
    agents = build_agents(
        {"solver": AgentConfig(policy="default"), "verifier": AgentConfig(policy="default")},
        tok,
        default_kinds=maker.default_agents,
    )
    tasks = maker.tasks(num_tasks, seed=1)
    result = asyncio.run(
        run_episodes(
            build_orchestra("solve_verify", max_loops=max_loops),
            maker,
            tasks,
            agents=agents,
            engines={"default": ScriptedEngine(tok, policy)},
        )
    )
    return result, tasks


def _right_solver(request):
    if "Proposed solution" in request.last_user:
        return None
    return f"{request.last_user.split('?')[0]} = {_truth(request.last_user)}"


def test_correct_solver_approving_verifier(tok):
    result, _ = _rollout(tok, lambda r: "yes" if "Proposed solution" in r.last_user else _right_solver(r))
    assert all(e.team_reward == 1.0 and e.success and e.env_done for e in result.episodes)
    assert [(s.agent, s.local_reward) for s in result.samples[:2]] == [("solver", 1.0), ("verifier", 1.0)]
    assert len(result.samples) == 8


def test_wrong_solver_rejecting_verifier_loops_to_budget(tok):
    result, _ = _rollout(
        tok, lambda r: "no" if "Proposed solution" in r.last_user else "It is 1000", max_loops=2
    )
    episode = result.samples[:4]
    assert [(s.agent, s.turn) for s in episode] == [
        ("solver", 0),
        ("verifier", 0),
        ("solver", 1),
        ("verifier", 1),
    ]
    assert [s.local_reward for s in episode] == [0.0, 1.0, 0.0, 1.0]  # verifier right to reject
    assert all(s.team_reward == 0.0 for s in result.samples) and not result.episodes[0].env_done


def test_wrong_answer_approved_scores_verifier_zero(tok):
    result, _ = _rollout(
        tok, lambda r: "yes" if "Proposed solution" in r.last_user else "3 + 4 = 1000", num_tasks=1
    )
    solver, verifier = result.samples
    assert (solver.team_reward, verifier.local_reward, result.episodes[0].env_done) == (0.0, 0.0, True)


def test_rejected_answer_shown_to_solver_and_unparseable_verdict(tok):
    seen = []

    def policy(request):
        seen.append(request.last_user)
        return "maybe" if "Proposed solution" in request.last_user else "8"

    result, _ = _rollout(tok, policy, num_tasks=1, max_loops=2)
    assert [s.valid for s in result.samples] == [True, False, True, False]
    assert result.samples[1].local_reward == 0.0  # unparseable verdict scores 0
    assert "rejected" not in seen[2]  # an invalid verdict is not a rejection


def test_solver_only_mode(tok):
    result, _tasks = _rollout(tok, _right_solver, num_tasks=3, with_verifier=False)
    assert [s.agent for s in result.samples] == ["solver"] * 3
    assert all(e.team_reward == 1.0 and e.env_done for e in result.episodes)


def test_verifier_own_success_is_its_verdicts_being_right():
    from types import SimpleNamespace

    from megamarl.orchestration.env import Task
    from megamarl.orchestration.envs.math import MathConfig, MathEnv, MathProblem

    def run(answer, verdict):
        env = MathEnv(Task("t", MathProblem("What is 2 + 3?", 5.0, "add1")), MathConfig())
        env.step("solver", SimpleNamespace(valid=True, value=answer, text=str(answer)))
        env.step("verifier", SimpleNamespace(valid=True, value=verdict, text="yes" if verdict else "no"))
        return env.success(), env.agent_success("verifier"), env.agent_success("solver")

    assert run(5.0, True) == (True, True, None)  # right answer, approved
    assert run(4.0, False) == (False, True, None)  # wrong answer, rightly rejected: the verifier did its job
    assert run(4.0, True) == (False, False, None)  # wrong answer approved
