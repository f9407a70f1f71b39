"""Code env: coder + unit-tester with sandboxed execution; rewards exact."""

import asyncio

import pytest
from scripted import ScriptedEngine, smollm2_tokenizer  # tests/ helper

from megamarl.orchestration import AgentConfig, EnvMaker, Task, build_agents, build_orchestra, run_episodes
from megamarl.orchestration.agents import code_block
from megamarl.orchestration.context import Action
from megamarl.orchestration.envs.code import PROBLEM_KINDS, CodeProblem
from megamarl.orchestration.sandbox import SandboxConfig

PROBLEM = CodeProblem(
    "Write `scale(x)` returning x * 3.",
    "def scale(x):\n    return x * 3\n",
    "assert scale(2) == 6\nassert scale(-1) == -3\n",
)
GOOD, BAD = "def scale(x):\n    return x * 3\n", "def scale(x):\n    return x + 3\n"


def act(agent, code):
    value, valid = code_block(f"```python\n{code}```")
    return Action(agent, code, value, valid, 0, 0)


def test_code_block_parser():
    assert code_block("Here:\n```python\nx = 1\n```\nand\n```\ny = 2\n```") == ("y = 2\n", True)
    assert code_block("def f(:\n") == ("def f(:\n", False)


def test_generated_references_pass_hidden_tests():
    maker = EnvMaker("code")
    for task in maker.tasks(len(PROBLEM_KINDS), seed=5):
        env = maker(task)
        assert env._hidden(task.payload.reference).all_passed


@pytest.mark.parametrize(
    "code, tests, hidden, tests_pass, tester_reward, done",
    [
        (GOOD, "assert scale(1) == 3", True, True, 1.0, True),  # right code, right tests
        (BAD, "assert scale(1) == 3", False, False, 1.0, False),  # tests catch the bug
        (BAD, "assert scale(0) == 3", False, True, 0.0, True),  # invalid test (fails on reference)
        (GOOD, "assert scale(1) == 4", True, False, 0.0, False),  # wrong expectation
    ],
)
def test_transitions_and_rewards(code, tests, hidden, tests_pass, tester_reward, done):
    env = EnvMaker("code")(Task("c", PROBLEM))
    coder = env.step("coder", act("coder", code))
    assert (env.hidden_pass, coder.local_reward) == (hidden, float(hidden))
    tester = env.step("tester", act("tester", tests))
    assert (tester.local_reward, env.done, env.team_reward()) == (tester_reward, done, float(hidden))
    assert (env.feedback == "") == tests_pass


def test_rollout_with_feedback_loop():
    tok = smollm2_tokenizer()
    replies = {
        "coder": iter([f"```python\n{BAD}```", f"```python\n{GOOD}```"]),
        "tester": iter(["```python\nassert scale(1) == 3\n```"] * 2),
    }

    def policy(request):
        return next(replies["tester" if "Write tests" in request.last_user else "coder"])

    maker = EnvMaker("code")
    agents = build_agents(
        {"coder": AgentConfig(policy="default"), "tester": AgentConfig(policy="default")},
        tok,
        default_kinds=maker.default_agents,
    )
    # no workers: steps run inline here (test_orch_workers.py covers the process pool)
    result = asyncio.run(
        run_episodes(
            build_orchestra("solve_verify", solver="coder", verifier="tester", max_loops=3),
            maker,
            [Task("c", PROBLEM)],
            agents=agents,
            engines={"default": ScriptedEngine(tok, policy)},
        )
    )
    assert [(s.agent, s.turn, s.local_reward) for s in result.samples] == [
        ("coder", 0, 0.0),
        ("tester", 0, 1.0),
        ("coder", 1, 1.0),
        ("tester", 1, 1.0),
    ]
    assert result.episodes[0].team_reward == 1.0 and result.episodes[0].env_done
    assert result.summary()["env/judge_errors"] == 0.0  # Env.metrics(): no case's output was unreadable


def test_judge_errors_are_counted_per_episode():
    # a generous deadline: in a loaded suite run (load ~15) the default 5 s was once spent starting the
    # sandbox, and a candidate killed at its deadline scores 0 without a judge error
    env = EnvMaker("code", sandbox=SandboxConfig(timeout_s=60.0))(Task("c", PROBLEM))
    # a forged record whose value is 20k-deep JSON: the judge's json.loads raises RecursionError. Under
    # the 64 KiB pipe buffer, so the write never waits for the judge (100k deep did: under load the
    # candidate then ran into its deadline, which scores 0 without a judge error)
    forged = (
        "import os\nfor fd in [int(f) for f in os.listdir('/proc/self/fd') if int(f) > 2]:\n    "
        'try:\n        os.write(fd, b\'{"i": 0, "value": "\' + '
        "b'[' * 20000 + b'\"}\\n')\n    except OSError:\n        pass\nos._exit(0)\n"
    )
    assert env.step("coder", act("coder", forged)).local_reward == 0.0
    assert env.metrics() == {"judge_errors": 1.0}
