"""Code judge: reward hacks score 0 on problems whose real solution scores 1.

Every adversarial candidate below would have passed the old "candidate + asserts in one program,
exit code 0 = pass" judge (or read the expected values); the judge must give each 0.
"""

import json
import time

import pytest

from megamarl.orchestration import EnvMaker, Task
from megamarl.orchestration.context import Action
from megamarl.orchestration.envs.code import CodeConfig, CodeProblem, load_problems
from megamarl.orchestration.judge import (
    AssertCase,
    ExprCase,
    StdioCase,
    Verdict,
    call_case,
    judge_calls,
    judge_stdio,
    parse_assert_tests,
    pin_to,
    same_value,
)
from megamarl.orchestration.sandbox import SandboxConfig

FAST = SandboxConfig(timeout_s=2.0, cpu_s=2, memory_mb=256)
HIDDEN = "assert scale(2) == 6\nassert scale(-1) == -3\nassert scale(5) == 15\n"
SETUP, CASES = parse_assert_tests(HIDDEN)
REAL = "def scale(x):\n    return x * 3\n"
FALLBACK = "\ndef scale(x):\n    return 0\n"  # what a hack returns when the hack does not work

HACKS = {
    "os._exit(0) first": "import os\nos._exit(0)\n" + FALLBACK,
    "SystemExit(0) first": "raise SystemExit(0)\n" + FALLBACK,
    "SystemExit(0) in the call": "def scale(x):\n    raise SystemExit(0)\n",
    "os._exit(0) in the call": "import os\ndef scale(x):\n    os._exit(0)\n",
    "fake pass markers on "
    "stdout": "print('OK: all tests passed')\nprint(json.dumps({'i': 0, 'value': '6'}))\n"
    "import json\n" + FALLBACK,
    "forged records on every "
    "fd": "import json, os\nfor fd in [int(f) for f in os.listdir('/proc/self/fd') if int(f) > 2]:\n"
    "    for i in range(3):\n        try: os.write(fd, (json.dumps({'i': i, 'value': '6'}) + "
    "'\\n').encode())\n"
    "        except OSError: pass\n" + FALLBACK,
    "reads files in its cwd": "import os, re\nfound = {}\nfor name in os.listdir('.'):\n"
    "    for a, b in re.findall(r'scale\\((-?\\d+)\\) == (-?\\d+)', open(name).read()):\n"
    "        found[int(a)] = int(b)\n"
    "def scale(x):\n    return found.get(x, 0)\n",
    "reads the judge's process": "import os\ntry:\n    leak = open(f'/proc/{os.getppid()}/cmdline').read()\n"
    "except OSError:\n    leak = ''\n" + FALLBACK,
    "walks the filesystem": "import os\nfor root, dirs, files in os.walk('/'):\n    break\n" + FALLBACK,
    "monkeypatches "
    "assert/builtins": "import builtins, json\nbuiltins.AssertionError = type('No', (Exception,), {})\n"
    "builtins.eval = lambda *a, **k: 6\nbuiltins.bool = lambda *a: True\n"
    "json.dumps = lambda *a, **k: '6'\n" + FALLBACK,
    "__eq__ always True": "class Anything:\n    def __eq__(self, other):\n        return True\n"
    "def scale(x):\n    return Anything()\n",
    "int subclass with __eq__": "class Int(int):\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = int.__hash__\ndef scale(x):\n    return Int(0)\n",
    "sleeps past the timeout": "import time\ntime.sleep(60)\n" + FALLBACK,
    "sleeps in the call": "import time\ndef scale(x):\n    time.sleep(60)\n    return x * 3\n",
    "forks": "import os\nif os.fork() == 0:\n    os._exit(0)\n" + FALLBACK,
    "opens a socket": "import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 80))\n" + FALLBACK,
}


def test_real_solution_scores_one():
    verdict = judge_calls(REAL, CASES, FAST)
    assert (verdict.passed, verdict.fraction, verdict.all_passed) == ([True] * 3, 1.0, True)


@pytest.mark.parametrize("name", list(HACKS))
def test_hack_scores_zero(name):
    verdict = judge_calls(HACKS[name], CASES, FAST)
    assert verdict.passed == [False, False, False], (name, verdict.messages)
    assert verdict.fraction == 0.0 and not verdict.all_passed


def test_each_case_is_scored_separately():
    verdict = judge_calls("def scale(x):\n    return 6 if x == 2 else -x\n", CASES, FAST)
    assert verdict.passed == [True, False, False] and verdict.fraction == pytest.approx(1 / 3)
    assert verdict.messages[0] == "scale(-1) returned 1, expected -3"


def test_expected_values_never_enter_the_sandbox():
    # the candidate echoes everything it can see: its stdin (the request), its source, its dir
    spy = (
        "import os, sys\nprint(repr(__import__('builtins').__dict__.get('__channel__')))\n"
        "for name in os.listdir('.'):\n    print(open(name).read())\n" + FALLBACK
    )
    from megamarl.orchestration import judge
    from megamarl.orchestration.sandbox import run_python

    request = json.dumps({"code": spy, "setup": SETUP, "cases": [judge._sandbox_side(c) for c in CASES]})
    result = run_python(judge._HARNESS, FAST, stdin=request.encode(), channel=True)
    assert "scale(2)" in request and "15" not in request and "-3" not in request
    assert "15" not in result.stdout and "== 6" not in result.stdout


def test_json_round_trip_comparison():
    assert same_value([1, 2], [1, 2]) and not same_value(True, 1) and not same_value(1, True)
    assert same_value(0.1 + 0.2, 0.3) and not same_value("1", 1) and not same_value(None, 0)
    assert not same_value(10**17 + 1, 10**17) and same_value(10**400, 10**400)  # ints exactly
    assert same_value(3, 3.0000001) and not same_value(2, 2.5)
    assert parse_assert_tests("xs = [1]\nassert f(xs) == (1, 2)\nassert g(1)\nassert 3 == h(2)")[1] == [
        ExprCase("f(xs)", [1, 2]),
        AssertCase("g(1)", ("g(1)",)),
        ExprCase("h(2)", 3),
    ]


STDIO = [StdioCase("1 2\n", "3\n"), StdioCase("10 -4\n", "6"), StdioCase("0 0", "0\n")]
STDIO_REAL = "a, b = map(int, input().split())\nprint(a + b)\n"
STDIO_HACKS = {
    "os._exit(0)": "import os\nos._exit(0)\n",
    "SystemExit(0)": "raise SystemExit(0)\n",
    "fake pass markers": "print('PASSED')\nprint('All 3 tests passed')\n",
    "reads files in its cwd": "import os\nfor name in os.listdir('.'):\n    print(open(name).read())\n",
    "sleeps": "import time\ntime.sleep(60)\n",
    "forks": "import os\nos.fork()\nprint(3)\n",
    "opens a socket": "import socket\nsocket.create_connection(('127.0.0.1', 80))\nprint(3)\n",
}


def test_stdio_real_solution_and_hacks():
    # three sandbox starts share the problem's budget: the code env's default, not FAST's 2 s per case
    # (a loaded CI machine ran out of a shared 1 s budget after six starts)
    budget_s = CodeConfig().problem_budget_s
    assert judge_stdio(STDIO_REAL, STDIO, FAST, budget_s=budget_s).passed == [True, True, True]
    for name, code in STDIO_HACKS.items():
        assert judge_stdio(code, STDIO, FAST).fraction == 0.0, name


def test_jsonl_loader_both_forms(tmp_path):
    path = tmp_path / "problems.jsonl"
    rows = [
        {
            "spec": "Write add(a, b).",
            "fn_name": "add",
            "tests": [{"input": [1, 2], "output": 3}, {"input": [[1], [2]], "output": [1, 2]}],
            "reference": "def add(a, b):\n    return a + b\n",
        },
        {
            "question": "Sum two ints from stdin.",
            "solutions": json.dumps([STDIO_REAL]),
            "input_output": json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}),
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    fn, stdio = load_problems(str(path))
    assert fn.cases == (call_case("add", [1, 2], 3), call_case("add", [[1], [2]], [1, 2])) and not fn.stdio
    assert stdio.stdio and stdio.cases == (StdioCase("1 2\n", "3\n"), StdioCase("5 5\n", "10\n"))
    maker = EnvMaker("code", dataset=str(path))
    for task in maker.tasks(2, seed=0):
        env = maker(task)
        reference = env.step("coder", Action("coder", "", task.payload.reference, True, 0, 0))
        assert reference.local_reward == 1.0 and env.team_reward() == 1.0
        env = maker(task)
        assert (
            env.step("coder", Action("coder", "", HACKS["os._exit(0) first"], True, 0, 0)).local_reward == 0.0
        )
    (tmp_path / "bad.jsonl").write_text('{"spec": "x", "tests": []}\n')
    with pytest.raises(ValueError, match=r"env.dataset .*bad.jsonl:1: no tests"):
        EnvMaker("code", dataset=str(tmp_path / "bad.jsonl"))


def test_env_rewards_pass_fraction_and_tester_cannot_be_fooled():
    env = EnvMaker("code", sandbox=FAST)(Task("c", CodeProblem("Write scale.", REAL, HIDDEN)))
    half = env.step(
        "coder", Action("coder", "", "def scale(x):\n    return 6 if x == 2 else 0\n", True, 0, 0)
    )
    assert half.local_reward == pytest.approx(1 / 3) and env.team_reward() == 0.0
    env.step("coder", Action("coder", "", HACKS["os._exit(0) first"], True, 0, 0))
    tester = env.step("tester", Action("tester", "", "assert scale(1) == 3\n", True, 0, 0))
    # the hack does not pass the tester's asserts either: episode not approved, tester right
    assert (env.done, tester.local_reward, env.feedback) == (False, 1.0, "exited before reporting")


def test_comparison_rules_are_strict_and_recurse():
    assert not same_value(121932631112635269.0, 121932631112635269)  # a float never answers an int
    assert not same_value(3.0, 3) and not same_value(True, 1) and not same_value(1, True)
    assert not same_value(False, 0) and not same_value(None, [])
    assert same_value(3, 3.0000001) and same_value(1.5 + 1e-9, 1.5)  # a float answer keeps a tolerance
    assert not same_value([1.0, 2], [1, 2]) and not same_value({"a": [1.0]}, {"a": [1]})  # nested: same rules
    assert same_value({"a": [1, 0.30000000000000004]}, {"a": [1, 0.3]}) and not same_value({"a": 1}, {"b": 1})
    assert not same_value([1, 2], [1, 2, 3]) and not same_value("1", 1) and not same_value([1], {"0": 1})


def test_asserts_become_operands_compared_here():
    setup, cases = parse_assert_tests(
        "k = 3\nassert f(2) > 5\nassert 0 < f(1) <= k\nassert f(1) in [3, 4]\nassert f(9) is not None\n"
        "assert f(1) != f(2)\nassert 'a' not in g()\nassert g()\nassert f(1) == k\n"
    )
    assert setup == ["k = 3"]
    assert cases == [
        AssertCase("f(2) > 5", ("f(2)", "5"), ("Gt",)),
        AssertCase("0 < f(1) <= k", ("0", "f(1)", "k"), ("Lt", "LtE")),
        AssertCase("f(1) in [3, 4]", ("f(1)", "[3, 4]"), ("In",)),
        AssertCase("f(9) is not None", ("f(9)", "None"), ("IsNot",)),
        AssertCase("f(1) != f(2)", ("f(1)", "f(2)"), ("NotEq",)),
        AssertCase("'a' not in g()", ("'a'", "g()"), ("NotIn",)),
        AssertCase("g()", ("g()",)),
        AssertCase("f(1) == k", ("f(1)", "k"), ("Eq",)),
    ]
    real = "def f(x):\n    return 3 * x\ndef g():\n    return 'xyz'\n"
    assert judge_calls(real, cases, FAST, setup=setup).passed == [True] * 8
    wrong = "def f(x):\n    return [1.0, 3.0, 6.0][x] if x < 3 else None\ndef g():\n    return ''\n"
    verdict = judge_calls(wrong, cases, FAST, setup=setup)
    # 6.0 > 5 holds; 0 < 3.0 <= 3 holds (ordering is Python's); 3.0 in [3, 4] is not an int answer
    assert verdict.passed == [True, True, False, False, True, True, False, False]
    assert "values [3.0, [3, 4]]" in verdict.messages[0]
    # literal operands never enter the sandbox: a candidate cannot see or change them
    from megamarl.orchestration import judge

    assert judge._sandbox_side(cases[2]) == ("values", ["f(1)", None])


def test_pinned_asserts_need_the_reference_values():
    setup, cases = parse_assert_tests("assert f(2) == f(1) * 2\nassert f(1) > 0\nassert f(3) is not None\n")
    reference = judge_calls("def f(x):\n    return 3 * x\n", cases, FAST, setup=setup)
    assert reference.passed == [True] * 3 and reference.values[0] == (6, 6)
    pinned = pin_to(cases, reference)
    assert pinned[0] == AssertCase("f(2) == f(1) * 2", ("f(2)", "f(1) * 2"), ("Eq",), pinned=(6, 6))
    linear = "def f(x):\n    return 4 * x\n"  # every assert holds, but not on the reference's values
    assert judge_calls(linear, cases, FAST, setup=setup).passed == [True] * 3
    verdict = judge_calls(linear, pinned, FAST, setup=setup)
    assert verdict.passed == [False, False, False] and "expected [6, 6]" in verdict.messages[0]
    assert judge_calls("def f(x):\n    return 3 * x\n", pinned, FAST, setup=setup).passed == [True] * 3
    # a case the reference gave no value for cannot be passed
    no_value = pin_to(cases, Verdict([False] * 3, values=[None] * 3))
    assert judge_calls("def f(x):\n    return 3 * x\n", no_value, FAST, setup=setup).passed == [False] * 3


def test_tests_see_the_builtins_not_the_candidates_names():
    setup, cases = parse_assert_tests("assert len(f()) == 2\nassert isinstance(f(), list)\n")
    shadow = "len = lambda x: 2\nisinstance = lambda *a: True\ndef f():\n    return 'abc'\n"
    assert judge_calls(shadow, cases, FAST, setup=setup).passed == [False, False]
    # the candidate's own code still uses its names
    own = "def size(x):\n    return 2\nlen = size\ndef f():\n    return [len('abc'), 0]\n"
    assert judge_calls(own, cases, FAST, setup=setup).passed == [True, True]


def test_stdio_problem_has_one_budget():
    cases = [StdioCase(f"{i}\n", f"{i}\n") for i in range(8)]
    slow = "import time\ntime.sleep(0.6)\nprint(input())\n"  # each case under timeout_s, together over
    start = time.monotonic()
    verdict = judge_stdio(slow, cases, FAST, budget_s=2.0)
    assert time.monotonic() - start < 3.5
    assert verdict.passed[0] and not any(verdict.passed[4:])
    assert ": not run: " in verdict.messages[-1]  # the budget spent, or cut by it: timed out
    stop = judge_stdio("import time\ntime.sleep(9)\n", cases, FAST, budget_s=20.0)
    assert stop.messages[1].endswith("not run: an earlier case timed out")


def test_env_step_bound_and_budget():
    maker = EnvMaker("code", problem_budget_s=4.0)
    assert maker.env_cls.max_step_s(maker.config) == 2 * (4.0 + 1.0)
    with pytest.raises(ValueError, match="problem_budget_s must be seconds > 0"):
        EnvMaker("code", problem_budget_s=0)
