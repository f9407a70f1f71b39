"""The recording OpenAI endpoint and the ``external`` orchestra: a program written with the official
``openai`` client drives two roles through the real HF engine; every recorded Sample is exactly what
the engine generated (prompt ids, response ids, log-probs) and carries the reward the program posted.
Bad input (unknown role, missing episode id, reward for an unknown episode, a program that crashes,
hangs or posts no reward) is a clear HTTP error or a counted failed episode, and the run goes on."""

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import aiohttp
import pytest
from external_runs import run_program, survivors
from scripted import ScriptedEngine, smollm2_tokenizer

from megamarl.errors import EXIT_ROLLOUT_FAILURE, ProgramCrashLoopError
from megamarl.orchestration import (
    AgentConfig,
    EnvMaker,
    SamplingConfig,
    build_agents,
    build_orchestra,
    run_episodes,
)
from megamarl.rollout.engines.base import Engine

pytestmark = [pytest.mark.integration]
PROGRAMS = Path(__file__).parent / "openai_programs"
# the math env's two roles, as _agents builds them
TEAM = {
    role: AgentConfig(policy="default", sampling=SamplingConfig(temperature=1.0, max_tokens=12))
    for role in ("solver", "verifier")
}


class RecordingEngine(Engine):
    """Wraps an engine; keeps every (prompt ids, [(response ids, logprobs)]) it returned. ``version``:
    the weight version its generations carry (as after that many pushes)."""

    def __init__(self, inner: Engine, version: int | None = None) -> None:
        self.inner, self.calls, self.version = inner, [], version

    async def generate(self, prompt_ids, sampling, *, lora=None):
        generations = await self.inner.generate(prompt_ids, sampling, lora=lora)
        self.calls.append((list(prompt_ids), [(list(g.token_ids), list(g.logprobs)) for g in generations]))
        if self.version is not None:
            generations = [dataclasses.replace(g, weight_version=self.version) for g in generations]
        return generations

    def update_weights(self, weights, *, version, lora=None):
        self.inner.update_weights(weights, version=version, lora=lora)


@pytest.fixture(scope="module")
def hf_engine(tmp_path_factory):
    from megamarl.models.packaged import save_tiny_model
    from megamarl.rollout.engines.hf import HFEngine

    path = save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0)
    engine = HFEngine(path, max_batch_rows=16, seed=0)
    yield engine
    engine.shutdown()


def _agents(tokenizer, max_tokens=12):
    maker = EnvMaker("math")
    configs = {
        role: AgentConfig(policy="default", sampling=SamplingConfig(temperature=1.0, max_tokens=max_tokens))
        for role in ("solver", "verifier")
    }
    return maker, build_agents(configs, tokenizer, default_kinds=maker.default_agents)


def test_openai_client_drives_two_roles_token_exact(hf_engine, tmp_path, monkeypatch):
    log = tmp_path / "posted.jsonl"
    monkeypatch.setenv("OAI_TEST_LOG", str(log))
    tokenizer = smollm2_tokenizer()
    maker, agents = _agents(tokenizer)
    engine = RecordingEngine(hf_engine, version=7)
    orchestra = build_orchestra(
        "external",
        command=["python", str(PROGRAMS / "two_roles.py")],
        timeout_s=60,
        pass_env=["OAI_TEST_LOG"],
    )
    result = asyncio.run(
        run_episodes(
            orchestra,
            maker,
            maker.tasks(2, seed=0),
            agents=agents,
            engines={"default": engine},
            group_size=2,
            max_concurrency=4,
            seed=1,
        )
    )
    assert result.num_failed == 0, result.first_error()
    posted = {row["episode_id"]: row for row in map(json.loads, log.read_text().splitlines())}
    assert sorted(posted) == sorted(e.episode_id for e in result.episodes) and len(posted) == 4
    assert len(result.samples) == 16 and len(engine.calls) == 16
    generated = {(tuple(p), tuple(ids), tuple(lps)) for p, gens in engine.calls for ids, lps in gens}
    for episode_id, row in posted.items():
        samples = sorted((s for s in result.samples if s.episode_id == episode_id), key=lambda s: s.step)
        assert [(s.agent, s.turn, s.step) for s in samples] == [
            ("solver", 0, 0),
            ("verifier", 0, 1),
            ("solver", 1, 2),
            ("solver", 2, 3),
        ]
        for sample, text in zip(samples, row["texts"]):
            # token in / token out: what the engine saw and returned, not a re-tokenisation
            assert (
                tuple(sample.prompt_ids),
                tuple(sample.response_ids),
                tuple(sample.rollout_logprobs),
            ) in generated
            assert sample.response_text == text  # the program received the decoded sampled ids
            assert sample.team_reward == row["reward"]["team"]
            # a role the program left out has no local reward (0.0), as a plugin task's agent without one
            expected_local = row["reward"]["agents"].get(sample.agent, 0.0)
            assert sample.local_reward == expected_local
        # the chat prompt is the template's rendering of the program's messages, encoded once
        question = maker.tasks(2, seed=0)[int(episode_id.split("-")[-1].split("/")[0])].payload.question
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": "Solve."}, {"role": "user", "content": question}],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert samples[0].prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
        assert samples[2].prompt_ids == tokenizer.encode(f"Answer: {question}")
        assert row["usage"] == [len(samples[0].response_ids), len(samples[2].response_ids)]
        # every reply names the policy and weight version that wrote it, and the samples keep them
        # (issue #46 item 4): system_fingerprint (plain, streamed, completions), the field, the headers
        assert {(s.policy, s.weight_version) for s in samples} == {("default", 7)}
        assert row["stamps"] == [
            "default@v7",
            "default@v7",
            "default@v7",
            {"policy": "default", "weight_version": 7},
            ["default", "7"],
        ]
        # a continued conversation keeps the sampled reply's ids (not its text re-encoded)
        first, later = samples[0], samples[3]
        assert (
            later.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)]
            == first.prompt_ids + first.response_ids
        )
        assert tokenizer.decode(later.prompt_ids).endswith(
            "<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
        )
    assert {e.team_reward for e in result.episodes} == {row["reward"]["team"] for row in posted.values()}


# A program that, by task index, posts a reward (ok), crashes, hangs or exits without a reward.
_MIXED = """
import json, os, sys, time, urllib.request
job = json.load(sys.stdin)
index = int(job["task_id"].rsplit("-", 1)[1])
if index == 1:
    sys.exit("boom: the program crashed")
if index == 2:
    time.sleep(60)
if index == 0:
    req = urllib.request.Request(os.environ["MEGAMARL_REWARD_URL"], data=json.dumps({"team": 1.0}).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    urllib.request.urlopen(req).read()
"""


def test_failed_programs_are_counted_and_the_run_goes_on():
    result = run_program(_MIXED, num_tasks=4, agents=TEAM, timeout_s=3, max_concurrency=4)
    by_task = {e.task_id.rsplit("-", 1)[1]: e for e in result.episodes}
    assert by_task["0"].status == "ok" and by_task["0"].team_reward == 1.0 and by_task["0"].success
    assert (by_task["1"].status, by_task["1"].reason) == ("failed", "error:ProgramExitError")
    assert "boom: the program crashed" in by_task["1"].error
    assert (by_task["2"].status, by_task["2"].reason) == ("failed", "error:ProgramTimeoutError")
    assert (by_task["3"].status, by_task["3"].reason) == ("failed", "error:NoRewardError")
    assert result.num_failed == 3 and result.summary()["rollout/num_failed"] == 3.0


def test_bad_requests_are_clear_http_errors():
    """Unknown role, missing episode id, unknown episode, bad reward body: OpenAI-style errors while an
    episode runs; then the episode ends normally with the reward it posted."""
    script = """
import json, os, sys, urllib.request, urllib.error
job = json.load(sys.stdin)
base = os.environ["OPENAI_BASE_URL"]
root = base.split("/episodes/")[0]
key = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
def post(url, body, headers=key):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)
chat = {"model": "solver", "messages": [{"role": "user", "content": "hi"}]}
out = {
  "unknown_role": post(base + "/chat/completions", {**chat, "model": "critic"}),
  "routed_by_key": post(root + "/v1/chat/completions", chat),
  "no_key": post(base + "/chat/completions", chat, {}),
  "another_episode": post(root + "/v1/episodes/nope/reward", {"team": 1}),
  "bad_reward": post(os.environ["MEGAMARL_REWARD_URL"], {"team": "high"}),
  "unknown_agent_reward": post(os.environ["MEGAMARL_REWARD_URL"], {"team": 1, "agents": {"critic": 1}}),
  "n2": post(base + "/chat/completions", {**chat, "n": 2}),
  "ok": post(base + "/chat/completions", chat),
  "reward": post(os.environ["MEGAMARL_REWARD_URL"], {"team": 0.5, "agents": {"solver": 0.25}}),
  "second_reward": post(os.environ["MEGAMARL_REWARD_URL"], {"team": 1.0}),
}
print(json.dumps(out), file=sys.stderr)
sys.exit(7)
"""  # noqa: E501 - the embedded program keeps its own layout
    result = run_program(script, agents=TEAM, timeout_s=30)
    [episode] = result.episodes  # exit 7 makes it failed, so its stderr (the answers) is in the error
    assert episode.reason == "error:ProgramExitError"
    out = json.loads(episode.error.splitlines()[-1])
    assert out["unknown_role"][0] == 404 and out["unknown_role"][1]["error"]["code"] == "unknown_role"
    assert "'critic'" in out["unknown_role"][1]["error"]["message"]
    # no episode named: the key names it; a key of no episode, or a URL naming another: 401
    assert out["routed_by_key"][0] == 200
    assert out["no_key"][0] == 401 and out["no_key"][1]["error"]["code"] == "invalid_api_key"
    assert out["another_episode"][0] == 401 and "'nope'" in out["another_episode"][1]["error"]["message"]
    assert out["bad_reward"][0] == 400 and out["unknown_agent_reward"][0] == 400
    assert out["n2"][0] == 400
    assert out["ok"][0] == 200 and out["ok"][1]["choices"][0]["message"]["content"] == "4"
    assert out["reward"] == [200, {"episode_id": episode.episode_id, "team": 0.5, "agents": {"solver": 0.25}}]
    assert out["second_reward"][0] == 409


def test_endpoint_serves_on_the_running_loop_and_stops():
    from megamarl.orchestration.openai_endpoint import RecordingEndpoint

    async def go():
        endpoint = RecordingEndpoint()
        base = await endpoint.start()
        assert await endpoint.start() == base  # once per loop
        async with aiohttp.ClientSession() as session, session.get(base + "/v1/models") as response:
            assert response.status == 401  # no running episode: no key opens it
        await endpoint.stop()

    asyncio.run(go())


def test_config_is_validated_naming_the_key():
    with pytest.raises(ValueError, match="exactly one of orchestra.command"):
        build_orchestra("external")
    with pytest.raises(ValueError, match="orchestra.timeout_s"):
        build_orchestra("external", module="x", timeout_s=0)
    with pytest.raises(ValueError, match="orchestra.max_concurrency"):
        build_orchestra("external", module="x", max_concurrency=0)
    # the endpoint's limits and the program's environment are keys of the orchestra, checked the same way
    for key, value in [
        ("max_body_bytes", 0),
        ("max_connections", 0),
        ("max_abs_reward", float("nan")),
        ("read_timeout_s", float("inf")),
        ("header_timeout_s", 0),
        ("idle_timeout_s", -1),
        ("max_stderr_bytes", -1),
    ]:
        with pytest.raises(ValueError, match=f"orchestra.{key} must be"):
            build_orchestra("external", module="x", **{key: value})
    with pytest.raises(ValueError, match=r"orchestra.pass_env: \['A-B', '\*'\] are not variable names"):
        build_orchestra("external", module="x", pass_env=["HF_*", "A-B", "*"])
    with pytest.raises(ValueError, match=r"orchestra.mode must be one of \['long_lived', 'per_episode'\]"):
        build_orchestra("external", module="x", mode="pooled")
    with pytest.raises(ValueError, match="orchestra.num_workers is for orchestra.mode=long_lived"):
        build_orchestra("external", module="x", num_workers=2)
    with pytest.raises(ValueError, match="orchestra.num_workers must be >= 0, got -1"):
        build_orchestra("external", module="x", mode="long_lived", num_workers=-1)
    with pytest.raises(ValueError, match="orchestra.max_start_failures is for orchestra.mode=long_lived"):
        build_orchestra("external", module="x", max_start_failures=2)
    with pytest.raises(ValueError, match="orchestra.max_start_failures must be >= 0, got -1"):
        build_orchestra("external", module="x", mode="long_lived", max_start_failures=-1)


@pytest.mark.parametrize("forced", [False, True])
def test_tool_calls_through_the_endpoint(forced, monkeypatch):
    """``tools`` reach the prompt (a tool block: SmolLM2's template ignores them); the model's Hermes
    block comes back as OpenAI ``tool_calls`` (streamed); the program's tool result is the next turn.
    Forced (``tool_choice`` names the function): the call's opening ends the prompt, the model writes
    the arguments, and the program's next request continues that conversation token-exactly."""
    tokenizer = smollm2_tokenizer()
    maker, agents = _agents(tokenizer, max_tokens=64)
    opening = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
    if forced:
        monkeypatch.setenv("OAI_FORCE_TOOL", "1")

    def policy(request):
        if "<|im_start|>tool\n" in request.prompt_text:
            return "So it is " + request.prompt_text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
        question = request.prompt_text.rsplit("What is ", 1)[1].split("?")[0]
        if forced:
            assert request.prompt_text.endswith(opening)
            return question + '"}} and more'  # the reply ends at its first quote (a stop string)
        return (
            "<tool_call>"
            + json.dumps({"name": "calculator", "arguments": {"expression": question}})
            + "</tool_call>"
        )

    engine = ScriptedEngine(tokenizer, policy)
    orchestra = build_orchestra(
        "external",
        command=["python", str(PROGRAMS / "tool_user.py")],
        timeout_s=60,
        pass_env=["OAI_FORCE_TOOL"],
    )
    tasks = EnvMaker("math", kinds=["mul12"]).tasks(2, seed=0)
    result = asyncio.run(run_episodes(orchestra, maker, tasks, agents=agents, engines={"default": engine}))
    assert result.num_failed == 0, result.first_error()
    assert [e.team_reward for e in result.episodes] == [1.0, 1.0]
    for first, second in zip(result.samples[::2], result.samples[1::2]):
        assert "You may call functions" in tokenizer.decode(first.prompt_ids)  # the tool block, system turn
        # the call, as the model wrote it, and the tool's result are in the second prompt
        assert '<tool_call>{"name": "calculator"' in tokenizer.decode(second.prompt_ids)
        assert second.response_text.startswith("So it is ")
        if forced:  # the opening: prompt tokens; the continuation kept the first prompt and reply verbatim
            assert tokenizer.decode(first.prompt_ids).endswith(opening)
            assert (
                second.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)]
                == first.prompt_ids + first.response_ids
            )


def test_tool_choice_that_cannot_be_honoured_is_a_400():
    from megamarl.orchestration.openai_endpoint import EndpointError, _forced_call

    calc = {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
    other = {"type": "function", "function": {"name": "lookup"}}
    assert _forced_call({"tools": [calc], "tool_choice": "auto"}) is None
    assert _forced_call({"tools": [calc], "tool_choice": "required"}).opening.endswith(
        '"arguments": {"expression": "'
    )
    assert _forced_call({"tools": [other], "tool_choice": "required"}).opening.endswith(
        '"lookup", "arguments": '
    )
    with pytest.raises(EndpointError, match="needs exactly one tool") as exc:
        _forced_call({"tools": [calc, other], "tool_choice": "required"})
    assert (exc.value.status, exc.value.code) == (400, "unsupported_tool_choice")
    with pytest.raises(EndpointError, match="names no tool") as exc:
        _forced_call({"tools": [calc], "tool_choice": {"type": "function", "function": {"name": "abacus"}}})
    assert exc.value.code == "invalid_tool_choice"


def test_prompt_over_budget_answers_400_and_drops_the_episode():
    script = """
import json, os, sys, urllib.request, urllib.error
json.load(sys.stdin)
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
                             data=json.dumps({"model": "solver", "messages": [{"role": "user", "content": "hi"}]}).encode())
try:
    urllib.request.urlopen(req)
except urllib.error.HTTPError as e:
    assert e.code == 400 and json.load(e)["error"]["code"] == "context_length_exceeded"
else:
    sys.exit("no error")
"""  # noqa: E501 - the embedded program keeps its own layout
    result = run_program(script, agents={"solver": AgentConfig(policy="default", max_prompt_tokens=5)})
    [episode] = result.episodes
    assert (episode.status, episode.reason) == ("dropped", "prompt_too_long") and result.samples == []


# -- long-lived programs (orchestra.mode=long_lived) --------------------------------------------------

# A worker: started once, it reads episodes from stdin (one JSON line each) and answers each with a done
# line on stdout. It asks the solver once per episode with the episode's own key, tries the previous
# episode's key (refused: a finished episode's key opens nothing), and reports its reward in the done
# line or, on odd tasks, by POSTing it to the episode's reward_url first. By task index (TASK_FATE):
# "crash" dies mid-episode, "hang" never answers, "silent" says done without a reward.
_WORKER = """
import json, os, sys, time, urllib.error, urllib.request
with open(os.environ["STARTS"], "a") as f:
    f.write(f"{os.getpid()}\\n")
fates = json.loads(os.environ.get("TASK_FATE", "{}"))

def post(url, body, key):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)

previous = None
for line in sys.stdin:
    job = json.loads(line)
    index = int(job["task_id"].rsplit("-", 1)[1])
    chat = {"model": "solver", "messages": [{"role": "user", "content": job["task"]["question"]}]}
    status, reply = post(job["base_url"] + "/chat/completions", chat, job["api_key"])
    assert status == 200, reply
    if previous is not None:
        assert post(job["base_url"] + "/chat/completions", chat, previous)[0] == 401
    previous = job["api_key"]
    fate = fates.get(str(index))
    if fate == "crash":
        sys.stderr.write("boom: the worker crashed\\n")
        os._exit(3)
    if fate == "hang":
        time.sleep(60)
    done = {"episode_id": job["episode_id"], "pid": os.getpid()}
    team = float(reply["choices"][0]["message"]["content"] == "4") / (index + 1)
    if fate == "silent":
        pass
    elif index % 2:
        assert post(job["reward_url"], {"team": team}, job["api_key"])[0] == 200
    else:
        done.update(team=team, agents={"solver": team / 2})
    print("a line that is not a done line")
    print(json.dumps(done), flush=True)
"""


def _starts(path: Path) -> list[int]:
    return [int(pid) for pid in path.read_text().split()] if path.exists() else []


def test_long_lived_workers_serve_many_episodes(tmp_path, monkeypatch):
    """Two programs, started once each, serve six episodes: every episode has its own key and reward
    (in the done line or posted), and nothing of the workers outlives the rollout."""
    starts = tmp_path / "starts"
    monkeypatch.setenv("STARTS", str(starts))
    result = run_program(
        _WORKER, num_tasks=6, mode="long_lived", num_workers=2, pass_env=["STARTS"], timeout_s=30
    )
    assert result.num_failed == 0, result.first_error()
    pids = _starts(starts)
    assert len(pids) == 2  # once per worker, not per episode
    by_task = {int(e.task_id.rsplit("-", 1)[1]): e for e in result.episodes}
    assert sorted(by_task) == list(range(6)) and all(e.status == "ok" for e in by_task.values())
    for index, episode in by_task.items():
        assert episode.team_reward == 1.0 / (index + 1)
        [sample] = [s for s in result.samples if s.episode_id == episode.episode_id]
        assert sample.team_reward == 1.0 / (index + 1) and sample.response_text == "4"
        assert sample.local_reward == (0.0 if index % 2 else 0.5 / (index + 1))
    assert survivors(pids) == [], "a worker outlived the rollout"


def test_a_crashed_or_hung_worker_loses_only_its_episode(tmp_path, monkeypatch):
    """One worker serves four episodes in turn: the one it crashes in and the one it hangs in fail
    (counted, the stderr tail kept) and the worker is restarted after each; an episode answered without
    a reward fails without a restart; the others are rewarded."""
    starts = tmp_path / "starts"
    monkeypatch.setenv("STARTS", str(starts))
    monkeypatch.setenv("TASK_FATE", json.dumps({"1": "crash", "2": "hang", "3": "silent"}))
    result = run_program(
        _WORKER,
        num_tasks=5,
        mode="long_lived",
        num_workers=1,
        pass_env=["STARTS", "TASK_FATE"],
        timeout_s=3,
    )
    by_task = {int(e.task_id.rsplit("-", 1)[1]): e for e in result.episodes}
    assert (by_task[0].status, by_task[0].team_reward) == ("ok", 1.0)
    assert (by_task[1].status, by_task[1].reason) == ("failed", "error:ProgramExitError")
    assert "boom: the worker crashed" in by_task[1].error
    assert (by_task[2].status, by_task[2].reason) == ("failed", "error:ProgramTimeoutError")
    assert (by_task[3].status, by_task[3].reason) == ("failed", "error:NoRewardError")
    assert (by_task[4].status, by_task[4].team_reward) == ("ok", 1.0 / 5)
    assert result.num_failed == 3 and result.summary()["rollout/num_failed"] == 3.0
    assert len(_starts(starts)) == 3  # the first start, a restart after the crash and after the hang


def test_a_cancelled_episode_restarts_its_worker_and_a_missing_command_fails_episodes(tmp_path, monkeypatch):
    """An episode cancelled mid-way (rollout's episode timeout) takes its worker's program with it and
    the next episode gets a fresh one; a command that cannot start fails each episode (never hangs)."""
    starts = tmp_path / "starts"
    monkeypatch.setenv("STARTS", str(starts))
    monkeypatch.setenv("TASK_FATE", json.dumps({"0": "hang"}))
    result = run_program(
        _WORKER,
        num_tasks=2,
        mode="long_lived",
        num_workers=1,
        pass_env=["STARTS", "TASK_FATE"],
        episode_timeout_s=2,
        episodes_at_once=1,
    )
    first, second = result.episodes
    assert (first.status, first.reason) == ("failed", "episode_timeout")
    assert (second.status, second.team_reward) == ("ok", 0.5)
    assert len(_starts(starts)) == 2
    result = run_program([str(tmp_path / "no-such-program")], num_tasks=2, mode="long_lived", num_workers=1)
    assert [e.reason for e in result.episodes] == ["error:FileNotFoundError"] * 2


# A program that exits at once, every time (a missing import in the user's team, say).
_CRASH_AT_START = """
import os, sys
with open(os.environ["STARTS"], "a") as f:
    f.write(f"{os.getpid()}\\n")
sys.stderr.write("ModuleNotFoundError: No module named 'team'\\n")
sys.exit(1)
"""


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_crash_looping_worker_stops_the_run(tmp_path, monkeypatch, num_workers):
    """Long-lived programs that exit before finishing an episode, ``max_start_failures`` (2) of them in
    a row: the run stops (a rollout failure, exit code 5) with an error naming the program and its
    stderr, after 2 starts (1 worker: the first start and one restart; 2 workers: one start each), not
    one start per episode of the step."""
    starts = tmp_path / "starts"
    monkeypatch.setenv("STARTS", str(starts))
    with pytest.raises(ProgramCrashLoopError) as caught:
        run_program(
            _CRASH_AT_START,
            num_tasks=6,
            mode="long_lived",
            num_workers=num_workers,
            pass_env=["STARTS"],
            max_start_failures=2,
        )
    message = str(caught.value)
    assert "exited before finishing an episode 2 times in a row" in message, message
    assert "orchestra.kwargs.max_start_failures=2" in message and "exited with 1" in message
    assert "ModuleNotFoundError: No module named 'team'" in message and sys.executable in message
    assert caught.value.exit_code == EXIT_ROLLOUT_FAILURE
    # 1 worker: its first start and one restart. 2 workers: one start each, or a third when one worker
    # restarts (its own failure counted) before the other's failure makes the second in a row:
    # concurrent workers start at most max_start_failures + num_workers - 1 programs
    assert 2 <= len(_starts(starts)) <= 2 + num_workers - 1
