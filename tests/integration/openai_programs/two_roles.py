"""Test program for the recording endpoint: two roles through the official ``openai`` client.

Calls the solver (chat, plain), the verifier (chat, streamed), the solver again through
``/v1/completions`` routed by header, and the solver's first conversation continued (reading each reply's
weight stamp: system_fingerprint, the ``megamarl`` field, the headers); posts a reward derived
from the replies and appends what it received and posted to ``$OAI_TEST_LOG`` (one JSON line per episode) for
the test to compare.
"""

import json
import os
import sys

from openai import OpenAI


def main() -> None:
    job = json.load(sys.stdin)
    client = OpenAI()
    question = job["task"]["question"]
    solver = client.chat.completions.create(
        model="solver",
        messages=[{"role": "system", "content": "Solve."}, {"role": "user", "content": question}],
        max_tokens=8,
    )
    stream = client.chat.completions.create(
        model="verifier",
        messages=[{"role": "user", "content": f"{question} {solver.choices[0].message.content}?"}],
        stream=True,
    )
    chunks = list(stream)
    verifier = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # routed by header instead of the base URL's episode prefix
    plain = OpenAI(base_url=os.environ["OPENAI_BASE_URL"].split("/episodes/")[0] + "/v1")
    again = plain.completions.create(
        model="ignored",
        prompt=f"Answer: {question}",
        max_tokens=4,
        extra_headers={"X-Episode-Id": os.environ["MEGAMARL_EPISODE_ID"], "X-Megamarl-Agent": "solver"},
    )
    # the solver's conversation continued: its earlier reply comes back as text
    history = [
        {"role": "system", "content": "Solve."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": solver.choices[0].message.content},
        {"role": "user", "content": "Sure?"},
    ]
    raw = client.chat.completions.with_raw_response.create(model="solver", messages=history, max_tokens=4)
    sure = raw.parse()
    # which weights wrote each reply, as an OpenAI client reads it
    stamps = [
        solver.system_fingerprint,
        chunks[0].system_fingerprint,
        again.system_fingerprint,
        (sure.model_extra or {}).get("megamarl"),
        [raw.headers.get("X-Megamarl-Policy"), raw.headers.get("X-Megamarl-Weight-Version")],
    ]
    texts = [
        solver.choices[0].message.content,
        verifier,
        again.choices[0].text,
        sure.choices[0].message.content,
    ]
    team = (len(texts[0]) % 5) / 4
    reward = {"team": team, "agents": {"verifier": len(verifier) % 2 * 0.5}}
    client.post(f"{os.environ['OPENAI_BASE_URL']}/reward", body=reward, cast_to=object)
    with open(os.environ["OAI_TEST_LOG"], "a") as f:
        f.write(
            json.dumps(
                {
                    "episode_id": os.environ["MEGAMARL_EPISODE_ID"],
                    "texts": texts,
                    "reward": reward,
                    "usage": [solver.usage.completion_tokens, again.usage.completion_tokens],
                    "stamps": stamps,
                }
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
