"""Search QA over a local BM25 index: router, searcher, answerer; exact rewards."""

import asyncio

import pytest
from scripted import ScriptedEngine, smollm2_tokenizer  # tests/ helper

from megamarl.orchestration import AgentConfig, EnvMaker, build_agents, build_orchestra, run_episodes
from megamarl.orchestration.envs.search import BM25Index, build_corpus, extract_answer, normalize_answer


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_corpus_is_deterministic_and_bm25_finds_gold():
    docs, items = build_corpus(40, 1234)
    assert (docs, items) == build_corpus.__wrapped__(40, 1234)
    assert len(docs) == 40 and len(items) == 120
    index = BM25Index(docs)
    hits = sum(index.search(item.question, 1)[0][0] == item.doc_id for item in items)
    assert hits >= 0.9 * len(items)


def test_answer_extraction_and_normalisation():
    assert extract_answer("I think...\nAnswer: The Marnos.") == (" The Marnos.".strip(), True)
    assert normalize_answer("The Marnos.") == "marnos"
    assert extract_answer("Marnos") == ("Marnos", True)
    assert extract_answer("   ")[1] is False


def _rollout(tok, policy, num_tasks=3):
    maker = EnvMaker("search_qa", top_k=2)
    configs = {
        "router": AgentConfig(policy="default", choices=("searcher", "answerer")),
        "searcher": AgentConfig(policy="default"),
        "answerer": AgentConfig(policy="default"),
    }
    agents = build_agents(configs, tok, default_kinds=maker.default_agents)
    tasks = maker.tasks(num_tasks, seed=0)
    result = asyncio.run(
        run_episodes(
            build_orchestra("router", router="router", max_hops=4),
            maker,
            tasks,
            agents=agents,
            engines={"default": ScriptedEngine(tok, policy)},
        )
    )
    return result, tasks


def _oracle(request):
    user = request.last_user
    question = user.split("Question: ")[1].split("\n")[0]
    if "Who acts next" in user:
        return "answerer" if "(none yet)" not in user else "searcher"
    if "search query" in user:
        return question
    item = next(i for i in build_corpus(40, 1234)[1] if i.question == question)
    return f"Answer: {item.answer}"


def test_search_then_answer_succeeds(tok):
    result, _tasks = _rollout(tok, _oracle)
    assert [s.agent for s in result.samples[:4]] == ["router", "searcher", "router", "answerer"]
    searcher = result.samples[1]
    assert searcher.local_reward == 1.0  # gold doc retrieved
    assert all(e.team_reward == 1.0 for e in result.episodes)
    assert result.samples[0].local_reward == 0.0  # router: team reward only


def test_answering_without_evidence_wrong_answer(tok):
    result, _ = _rollout(
        tok, lambda r: "answerer" if "Who acts next" in r.last_user else "Answer: Paris", num_tasks=1
    )
    assert [s.agent for s in result.samples] == ["router", "answerer"] and result.episodes[
        0
    ].team_reward == 0.0


def test_invalid_routing_ends_episode(tok):
    result, _ = _rollout(tok, lambda r: "I do not know", num_tasks=1)
    assert len(result.samples) == 1 and not result.samples[0].valid and not result.episodes[0].env_done
