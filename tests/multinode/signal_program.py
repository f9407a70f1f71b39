"""The signalling game as a program for the ``external`` orchestra, over the OpenAI HTTP API (stdlib only:
an interpreter start per episode, no client import). The sender sees the secret bit, the receiver the
sender's reply; the team reward is 1 when the parity of the receiver's first character is the secret (a
game a random tiny model wins half the time, so advantages and losses are not all zero). Appends the endpoint
URL it used and the hostname it ran on to ``$SIGNAL_LOG`` (one line per episode) for the tests."""

import json
import os
import socket
import sys
import urllib.request


def post(url: str, body: dict) -> dict:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read() or b"null")


def ask(base: str, role: str, text: str) -> str:
    reply = post(f"{base}/chat/completions", {"model": role, "messages": [{"role": "user", "content": text}]})
    return reply["choices"][0]["message"]["content"] or ""


def main() -> None:
    job = json.load(sys.stdin)
    base = os.environ["OPENAI_BASE_URL"]
    secret = int(job["task"])
    symbol = ask(base, "sender", str(secret)).strip()[:1] or "?"
    guess = ask(base, "receiver", symbol)[:1]
    post(os.environ["MEGAMARL_REWARD_URL"], {"team": float(ord(guess or "\0") % 2 == secret % 2)})
    if os.environ.get("SIGNAL_LOG"):
        with open(os.environ["SIGNAL_LOG"], "a") as log:
            log.write(
                json.dumps({"host": socket.gethostname(), "base": base, "episode": job["episode_id"]}) + "\n"
            )


if __name__ == "__main__":
    main()
