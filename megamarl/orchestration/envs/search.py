"""Search QA: a router decides who acts, a searcher queries a local BM25 index, an answerer answers.

Corpus: fictional countries generated in code from a fixed seed (``build_corpus``), so answers
cannot come from pretraining; each document states a country's capital, river and founding year,
e.g. "Velorin is a country. Its capital is Marnos. ..." (or a user JSONL corpus of
``{"doc_id", "text"}`` plus questions of ``{"question", "answer", "doc_id"}``). The index is
``rank_bm25.BM25Okapi`` over lower-cased word tokens, built once per corpus.

Use the ``router`` orchestra with router agent ``router`` (choices: searcher, answerer):
* searcher step: its reply is the query; the top ``top_k`` documents are added to the evidence
  every agent sees. Local reward = 1 if the gold document was retrieved by this query.
* answerer step: its reply (text after the last "answer:" if present, else the last non-empty
  line) is the answer; the episode ends. Team reward = 1 if the normalised answer equals the
  normalised truth (lower-case, punctuation and articles removed).
The router gets the team reward only (no local reward).
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from megamarl.orchestration.agents import AGENTS, Agent
from megamarl.orchestration.env import ENVS, Env, EnvConfig, StepResult, Task, draw_from_dataset

_SYLLABLES = (
    "ve",
    "lo",
    "ri",
    "ma",
    "nos",
    "ta",
    "ke",
    "dru",
    "sa",
    "lin",
    "mor",
    "ga",
    "thi",
    "bel",
    "qua",
    "zen",
)
Corpus = tuple[tuple[str, str], ...]  # (doc_id, text)


@dataclass(frozen=True)
class QAItem:
    question: str
    answer: str
    doc_id: str


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


@functools.lru_cache(maxsize=4)
def build_corpus(num_countries: int = 40, seed: int = 1234) -> tuple[Corpus, tuple[QAItem, ...]]:
    """(documents as (doc_id, text), questions); deterministic for (num_countries, seed)."""
    docs: list[tuple[str, str]]
    items: list[QAItem]
    used: set[str]
    rng, docs, items, used = random.Random(seed), [], [], set()
    while len(docs) < num_countries:
        country, capital, river = _name(rng, 3), _name(rng, 2), _name(rng, 2)
        if country in used:
            continue
        used.add(country)
        year = rng.randint(1100, 1900)
        doc_id = f"doc{len(docs)}"
        text = (
            f"{country} is a country. Its capital is {capital}. "
            f"The longest river of {country} is the {river}. {country} was founded in {year}."
        )
        docs.append((doc_id, text))
        items += [
            QAItem(f"What is the capital of {country}?", capital, doc_id),
            QAItem(f"What is the longest river of {country}?", river, doc_id),
            QAItem(f"In which year was {country} founded?", str(year), doc_id),
        ]
    return tuple(docs), tuple(items)


def _tokens(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class BM25Index:
    def __init__(self, docs: tuple[tuple[str, str], ...]) -> None:
        from rank_bm25 import BM25Okapi

        self.docs = docs
        self.bm25 = BM25Okapi([_tokens(text) for _, text in docs])

    def search(self, query: str, top_k: int) -> list[tuple[str, str]]:
        tokens = _tokens(query)
        if not tokens:
            return []
        scores = self.bm25.get_scores(tokens)
        ranked = sorted(range(len(self.docs)), key=lambda i: (-scores[i], i))
        return [self.docs[i] for i in ranked[:top_k] if scores[i] > 0]


@functools.lru_cache(maxsize=4)
def _index(docs: tuple[tuple[str, str], ...]) -> BM25Index:
    return BM25Index(docs)


def normalize_answer(text: str) -> str:
    words = [w for w in _tokens(text) if w not in ("a", "an", "the")]
    return " ".join(words)


def extract_answer(text: str) -> tuple[str, bool]:
    found = re.split(r"(?i)answer\s*:", text)
    lines = [line for line in text.splitlines() if line.strip()]
    candidate = found[-1] if len(found) > 1 else (lines[-1] if lines else "")
    candidate = candidate.strip().splitlines()[0] if candidate.strip() else ""
    return candidate, bool(normalize_answer(candidate))


@AGENTS.register("searcher")
class Searcher(Agent):
    system_prompt = "You write short search queries."
    prompt_template = "{observation}\nReply with a search query only."


@AGENTS.register("answerer")
class Answerer(Agent):
    system_prompt = "You answer questions using the evidence given."
    prompt_template = "{observation}\nEnd with 'Answer: <answer>'."

    def parse(self, text: str):
        return extract_answer(text)


@dataclass
class SearchConfig(EnvConfig):
    top_k: int = 2
    num_countries: int = 40
    corpus_seed: int = 1234
    corpus_path: str | None = None  # JSONL {"doc_id","text"}
    questions_path: str | None = None  # JSONL {"question","answer","doc_id"}

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"env.top_k must be >= 1, got {self.top_k}")
        if (self.corpus_path is None) != (self.questions_path is None):
            raise ValueError("env.corpus_path and env.questions_path must be given together")

    def corpus(self) -> tuple[tuple[tuple[str, str], ...], tuple[QAItem, ...]]:
        if self.corpus_path is None:
            return build_corpus(self.num_countries, self.corpus_seed)
        docs = tuple((r["doc_id"], r["text"]) for r in _read_jsonl(self.corpus_path))
        assert self.questions_path is not None  # given together with corpus_path (__post_init__)
        questions = _read_jsonl(self.questions_path)
        items = tuple(QAItem(r["question"], str(r["answer"]), r["doc_id"]) for r in questions)
        return docs, items


def _read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@ENVS.register("search_qa")
class SearchQAEnv(Env[SearchConfig]):
    Config = SearchConfig
    agents = ("router", "searcher", "answerer")
    default_agents: ClassVar[dict[str, str]] = {
        "router": "router",
        "searcher": "searcher",
        "answerer": "answerer",
    }

    def __init__(self, task: Task, config: SearchConfig) -> None:
        super().__init__(task, config)
        self.item: QAItem = task.payload
        self.docs, _ = config.corpus()
        self.evidence: list[tuple[str, str]] = []
        self.queries: list[str] = []
        self.answer: str | None = None

    @classmethod
    def generate_tasks(cls, config: SearchConfig, *, num_tasks: int, seed: int) -> list[Task]:
        _, items = config.corpus()
        picks = draw_from_dataset(len(items), num_tasks, seed=seed, prefix="search")
        return [Task(task_id, items[j]) for j, task_id in picks]

    def _evidence_text(self) -> str:
        if not self.evidence:
            return "Evidence: (none yet)"
        return "Evidence:\n" + "\n".join(f"- {text}" for _, text in self.evidence)

    def observe(self, agent: str) -> str:
        question = f"Question: {self.item.question}\n{self._evidence_text()}"
        if agent == "router":
            return f"{question}\nWho acts next: searcher (to find more evidence) or answerer (to answer now)?"
        if agent == "searcher":
            tried = f"\nQueries tried: {'; '.join(self.queries)}" if self.queries else ""
            return question + tried
        return question

    def step(self, agent: str, action) -> StepResult:
        if agent == "router":
            return StepResult()
        if agent == "searcher":
            query = action.text.strip()
            self.queries.append(query)
            hits = _index(self.docs).search(query, self.config.top_k)
            self.evidence += [hit for hit in hits if hit not in self.evidence]
            return StepResult(local_reward=float(any(doc_id == self.item.doc_id for doc_id, _ in hits)))
        self.answer = action.value if action.valid else ""
        self.done = True
        return StepResult()

    def team_reward(self) -> float:
        if self.answer is None:
            return 0.0
        return float(normalize_answer(self.answer) == normalize_answer(self.item.answer))
