"""Run a command on another node, as ``srun -w NODE`` or ``ssh NODE`` would on a cluster (the test nodes
have neither): ``remote_exec.py serve ADDR PORT`` listens on a node; ``remote_exec.py HOST PORT -- ARGV``
runs ARGV there with this process's stdin, its ``OPENAI_*``/``MEGAMARL_*``/``SIGNAL_LOG`` environment and
working directory, prints the remote stdout/stderr and exits with the remote exit code. ``python`` as
ARGV[0] is the server's interpreter. One JSON object each way per connection; tests only."""

import json
import os
import socket
import socketserver
import subprocess
import sys

FORWARD = ("OPENAI_", "MEGAMARL_", "SIGNAL_LOG")


class Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        job = json.loads(self.rfile.readline())
        argv = [sys.executable, *job["argv"][1:]] if job["argv"][0] == "python" else job["argv"]
        done = subprocess.run(
            argv,
            input=job["stdin"],
            capture_output=True,
            text=True,
            cwd=job["cwd"],
            env={**os.environ, **job["env"]},
            check=False,
        )
        self.wfile.write(
            json.dumps({"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr}).encode()
        )


def serve(addr: str, port: int) -> None:
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    with socketserver.ThreadingTCPServer((addr, port), Handler) as server:
        print(f"serving on {addr}:{port}", flush=True)
        server.serve_forever()


def run(host: str, port: int, argv: list[str]) -> int:
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARD)}
    job = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdin": sys.stdin.read()}
    with socket.create_connection((host, port), timeout=300) as conn:
        conn.sendall(json.dumps(job).encode() + b"\n")
        conn.shutdown(socket.SHUT_WR)
        reply = json.loads(conn.makefile().read())
    sys.stdout.write(reply["stdout"])
    sys.stderr.write(reply["stderr"])
    return reply["rc"]


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(run(sys.argv[1], int(sys.argv[2]), sys.argv[sys.argv.index("--") + 1 :]))
