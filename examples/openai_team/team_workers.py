"""The solver/verifier team of ``team.py`` as a long-lived program: started once, it plays episode
after episode (``orchestra.kwargs.mode: long_lived``), so the interpreter and the ``openai`` client
are loaded once per worker instead of once per episode.

The protocol: each line of stdin is one episode's job, a JSON object with ``episode_id``, ``task``,
``base_url`` and ``api_key`` (the episode's own endpoint and key) among others; for each, the program
plays the episode with a client of that URL and key and prints one *done line*, a JSON object with the
``episode_id`` and the reward (``team``, ``agents``). It ends when stdin ends. Other lines it prints
are ignored; a crash or a hang costs only the episode it was playing, and megamarl starts it again.
"""

import json
import sys

from openai import OpenAI
from team import play  # the same team, in this directory


def main() -> None:
    for line in sys.stdin:  # one episode per line, until megamarl closes stdin
        job = json.loads(line)
        with OpenAI(base_url=job["base_url"], api_key=job["api_key"]) as client:
            reward = play(client, job["task"])
        print(json.dumps({"episode_id": job["episode_id"], **reward}), flush=True)


if __name__ == "__main__":
    main()
