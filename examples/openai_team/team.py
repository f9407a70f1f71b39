"""A solver/verifier team written for the OpenAI API, with the official ``openai`` client only.

Nothing here knows about megamarl: ``OpenAI()`` reads ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``
from the environment, the task arrives as JSON on stdin, and the reward goes to
``MEGAMARL_REWARD_URL``. Run by megamarl's ``external`` orchestra (one process per episode), every
completion is recorded and trained; pointed at any OpenAI-compatible server it runs as is.
``team_workers.py`` runs the same ``play`` long-lived (``orchestra.kwargs.mode: long_lived``).

Protocol: the solver answers; the verifier says yes or no; on "no" the solver tries once more.
Reward: team = the final answer is right; solver = the same; verifier = its verdicts were right.
"""

import json
import os
import re
import sys
import urllib.request

from openai import OpenAI

SOLVER_SYSTEM = "You are a careful math solver. Answer with the final number."
VERIFIER_SYSTEM = "You check answers to math problems. Reply yes or no."
MAX_TOKENS = int(os.environ.get("TEAM_MAX_TOKENS", "64"))


def last_number(text: str) -> float | None:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def verdict(text: str) -> bool | None:
    words = re.findall(r"\b(yes|no|correct|incorrect|wrong)\b", text.lower())
    return None if not words else words[-1] in ("yes", "correct")


def ask(client: OpenAI, role: str, system: str, user: str, *, stream: bool = False) -> str:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    if not stream:
        reply = client.chat.completions.create(model=role, messages=messages, max_tokens=MAX_TOKENS)
        return reply.choices[0].message.content or ""
    chunks = client.chat.completions.create(model=role, messages=messages, max_tokens=MAX_TOKENS, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


def play(client: OpenAI, task: dict) -> dict:
    """One episode of the team on ``task`` (``{"question", "answer"}``): the reward body."""
    question, truth = task["question"], float(task["answer"])
    verdicts_right = []
    answer = None
    for attempt in range(2):
        prompt = question if attempt == 0 else f"{question}\nA reviewer rejected {answer}. Try again."
        answer = last_number(ask(client, "solver", SOLVER_SYSTEM, prompt))
        correct = answer is not None and abs(answer - truth) < 1e-6
        judged = verdict(
            ask(
                client,
                "verifier",
                VERIFIER_SYSTEM,
                f"Problem: {question}\nProposed answer: {answer}\nIs it correct? Reply yes or no.",
                stream=True,
            )
        )
        verdicts_right.append(judged is not None and judged == correct)
        if judged is not False:  # approved (or no verdict): done
            break
    team = float(correct)
    return {"team": team, "agents": {"solver": team, "verifier": float(all(verdicts_right))}}


def main() -> None:
    job = json.load(sys.stdin)
    body = play(OpenAI(), job["task"])
    request = urllib.request.Request(
        os.environ["MEGAMARL_REWARD_URL"],
        data=json.dumps(body).encode(),
        # the episode's key, as the client sends it: the endpoint answers nothing without it
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
        },
    )
    urllib.request.urlopen(request, timeout=30).read()


if __name__ == "__main__":
    main()
