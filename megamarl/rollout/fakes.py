"""Local stand-ins for disaggregated engine servers, for tests on machines that cannot run them.

Each fake is a stdlib ``ThreadingHTTPServer`` on 127.0.0.1 (random port) that speaks the documented
JSON protocol of the real server and is backed by a real ``HFEngine``: generation, weight updates
and pause/sleep have real effects, so a client test checks behaviour, not only request shapes.
Every call is logged in ``calls`` as ``(path, body)``. ``kill()`` closes the socket abruptly, which
clients observe as a dead server (connection refused).
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import torch

from megamarl.rollout.base import SamplingParams
from megamarl.rollout.hf import HFEngine

Handler = Callable[[dict, dict], Any]  # (json body, query) -> json reply


class _FakeServer:
    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[str, Any]] = []
        self.routes: dict[tuple[str, str], Handler] = {("GET", "/health"): lambda body, q: None}
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        fake = self

        class RequestHandler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _serve(self, method: str) -> None:
                url = urllib.parse.urlparse(self.path)
                query = {k: v[0] if len(v) == 1 else v for k, v in urllib.parse.parse_qs(url.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                fake.calls.append((url.path, body))
                handler = fake.routes.get((method, url.path))
                if handler is None:
                    return self._reply(404, {"error": f"no route {method} {url.path}"})
                try:
                    reply = handler(body, query)
                except Exception as exc:  # noqa: BLE001 - becomes an HTTP 500 like a real server
                    return self._reply(500, {"error": repr(exc)})
                self._reply(200, reply)

            def _reply(self, status: int, reply: Any) -> None:
                data = b"" if reply is None else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), RequestHandler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]

    def kill(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._loop.call_soon_threadsafe(self._loop.stop)


class FakeSGLangServer(_FakeServer):
    """SGLang 0.5.x native endpoints (see ``megamarl.rollout.sglang``)."""

    def __init__(self, engine: HFEngine) -> None:
        super().__init__(engine)
        self.weight_groups: list[dict] = []
        ok = {"success": True, "message": "ok"}
        self.routes.update({
            ("POST", "/generate"): self._generate,
            ("POST", "/update_weights_from_tensor"): self._update_from_tensor,
            ("POST", "/init_weights_update_group"): lambda b, q: (self.weight_groups.append(b), ok)[1],
            ("POST", "/update_weights_from_distributed"): lambda b, q: ok,
            ("POST", "/release_memory_occupation"): lambda b, q: self.engine.sleep(level=2 if not b.get("tags") else 1),
            ("POST", "/resume_memory_occupation"): lambda b, q: self.engine.wake(),
            ("POST", "/pause_generation"): lambda b, q: self.engine.pause(),
            ("POST", "/continue_generation"): lambda b, q: self.engine.resume(),
            ("POST", "/flush_cache"): lambda b, q: None,
        })

    def _generate(self, body: dict, query: dict) -> list[dict]:
        replies = []
        for ids, sp in zip(body["input_ids"], body["sampling_params"]):
            sampling = SamplingParams(
                temperature=sp["temperature"], top_p=sp["top_p"], top_k=sp["top_k"],
                max_tokens=sp["max_new_tokens"], stop_token_ids=tuple(sp["stop_token_ids"]),
                seed=sp.get("sampling_seed"),
            )
            (gen,) = self.run(self.engine.generate(ids, sampling))
            finish = {"type": "length", "length": len(gen.token_ids)} if gen.finish_reason == "length" else {
                "type": "stop", "matched": gen.token_ids[-1]}
            replies.append({
                "text": "", "output_ids": gen.token_ids,
                "meta_info": {
                    "id": f"{len(self.calls)}", "finish_reason": finish, "prompt_tokens": len(ids),
                    "completion_tokens": len(gen.token_ids),
                    "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(gen.logprobs, gen.token_ids)],
                    "weight_version": str(gen.weight_version),
                },
            })
        return replies

    def _update_from_tensor(self, body: dict, query: dict) -> dict:
        from megamarl.rollout.sglang import deserialize_named_tensors

        named = deserialize_named_tensors(body["serialized_named_tensors"][0])
        version = body.get("weight_version")
        self.engine.update_weights(named, version=int(version) if version else self.engine.weight_version)
        return {"success": True, "message": f"updated {len(named)} tensors"}


class FakeVLLMServer(_FakeServer):
    """vLLM 0.32 OpenAI server: ``/v1/completions`` plus the RL weight-transfer endpoints.

    ``transport`` stands in for the NCCL broadcast group: ``/update_weights`` receives the announced
    tensors from it, as the real server's weight-transfer engine receives them from the trainer.
    """

    def __init__(self, engine: HFEngine, transport: "QueueTransport | None" = None) -> None:
        super().__init__(engine)
        self.transport = transport
        self._staged: list[tuple[str, torch.Tensor]] = []
        msg = lambda text: (lambda b, q: {"message": text})  # noqa: E731
        self.routes.update({
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/pause"): lambda b, q: (self.engine.pause(), {"status": "paused"})[1],
            ("POST", "/resume"): lambda b, q: (self.engine.resume(), {"status": "resumed"})[1],
            ("POST", "/reset_prefix_cache"): lambda b, q: None,
            ("POST", "/sleep"): lambda b, q: (self.engine.sleep(level=int(q.get("level", 1))), {"status": "sleeping"})[1],
            ("POST", "/wake_up"): lambda b, q: (self.engine.wake(), {"status": "awake"})[1],
            ("POST", "/init_weight_transfer_engine"): msg("Weight transfer initialized"),
            ("POST", "/start_weight_update"): self._start,
            ("POST", "/update_weights"): self._receive,
            ("POST", "/finish_weight_update"): self._finish,
        })

    def _completions(self, body: dict, query: dict) -> dict:
        sampling = SamplingParams(
            temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0), top_k=body.get("top_k", -1),
            max_tokens=body["max_tokens"], stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            n=body.get("n", 1), seed=body.get("seed"),
        )
        gens = self.run(self.engine.generate(body["prompt"], sampling))
        choices = [{
            "index": i, "text": "", "token_ids": g.token_ids, "finish_reason": g.finish_reason,
            "logprobs": {"tokens": [f"token_id:{t}" for t in g.token_ids], "token_logprobs": g.logprobs},
        } for i, g in enumerate(gens)]
        return {"id": "cmpl-fake", "object": "text_completion", "model": body.get("model"), "choices": choices}

    def _start(self, body: dict, query: dict) -> dict:
        self._staged = []
        return {"message": "Weight update started"}

    def _receive(self, body: dict, query: dict) -> dict:
        info = body["update_info"]
        tensors = self.transport.receive(len(info["names"]))
        for name, dtype, shape, tensor in zip(info["names"], info["dtype_names"], info["shapes"], tensors):
            assert list(tensor.shape) == list(shape) and str(tensor.dtype).removeprefix("torch.") == dtype
            self._staged.append((name, tensor))
        return {"message": "Weights updated"}

    def _finish(self, body: dict, query: dict) -> dict:
        self.engine.update_weights(self._staged, version=int(body.get("weight_version") or 0))
        self._staged = []
        return {"message": "Weight update finished"}


class QueueTransport:
    """In-process stand-in for a broadcast group: ``send`` on the trainer side, ``receive`` on the server."""

    def __init__(self) -> None:
        import queue

        self._queue: "queue.Queue[torch.Tensor]" = queue.Queue()

    def send(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            self._queue.put(tensor.clone())

    def receive(self, count: int) -> list[torch.Tensor]:
        return [self._queue.get(timeout=60) for _ in range(count)]
