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
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from megamarl.rollout.engines.base import SamplingParams
from megamarl.rollout.engines.hf import HFEngine

Handler = Callable[[dict, dict], Any]  # (json body, query) -> json reply


class _FakeServer:
    def __init__(self, engine: HFEngine, *, host: str = "127.0.0.1", port: int = 0) -> None:
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
                fake.on_call(url.path, body)
                handler = fake.routes.get((method, url.path))
                if handler is None:
                    return self._reply(404, {"error": f"no route {method} {url.path}"})
                try:
                    reply = handler(body, query)
                except Exception as exc:  # noqa: BLE001 - becomes an HTTP 500 like a real server
                    return self._reply(500, {"error": repr(exc)})
                # SGLang answers a failed weight/LoRA call with HTTP 400 and {"success": false, ...}
                failed = isinstance(reply, dict) and reply.get("success") is False
                self._reply(400 if failed else 200, reply)

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

        self._server = ThreadingHTTPServer((host, port), RequestHandler)
        self._server.daemon_threads = True
        self.url = (
            f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self._server.server_address[1]}"
        )
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def on_call(self, path: str, body: Any) -> None:
        """Hook: every call, before it is handled."""

    def serve_forever(self) -> None:
        threading.Event().wait()

    def run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]

    def kill(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._loop.call_soon_threadsafe(self._loop.stop)


class FakeSGLangServer(_FakeServer):
    """SGLang's native server (see ``megamarl.rollout.engines.sglang`` and ``sglang_sync``), backed by a real
    ``HFEngine``: ``/generate`` (greedy and seeded sampling, SGLang's reply shape and
    ``weight_version``), the weight endpoints with real effects (``/init_weights_update_group`` joins
    a gloo group through a ``tcp://`` rendezvous keyed as SGLang's ``init_custom_process_group`` keys
    it; ``/update_weights_from_distributed`` receives one broadcast per tensor in the order of
    ``names``, or one flattened broadcast with ``load_format: "flattened_bucket"``, and loads them),
    ``/update_weights_from_tensor`` (both only inside a ``/begin_weight_update`` .. ``/end_weight_update``
    session, as SGLang 0.5.23 requires), ``/update_weight_version``, memory release/resume by tag, pause
    and continue, ``/flush_cache``, LoRA load/unload through PEFT, ``/get_model_info``.

    ``log``: a callable that receives one JSON-able record per call (the subprocess launcher in
    ``tests/fake_sglang`` prints them into the server's log, where tests read the protocol used).
    Only ``tp_size == 1`` takes distributed updates (one TP worker joins the group)."""

    def __init__(
        self,
        engine: HFEngine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_path: str = "",
        tp_size: int = 1,
        log: Callable[[dict], None] | None = None,
    ) -> None:
        super().__init__(engine, host=host, port=port)
        self.weight_groups: list[dict] = []
        self.weight_version = "default"  # SGLang's server_args.weight_version before any stamp
        self.model_path, self.tp_size, self.log = model_path, tp_size, log
        self._groups: dict[str, Any] = {}
        self._stores: dict[str, Any] = {}
        self._released: set[str] = set()
        self._loras: dict[str, str] = {}
        self._update_lock = threading.Lock()  # SGLang's scheduler takes one update request at a time
        self._session = False  # SGLang 0.5.23: weight updates only between /begin_ and /end_weight_update
        # EOS ends a request unless its sampling params say ignore_eos: the engine stops on ours only
        self._eos, engine.eos_token_ids = engine.eos_token_ids, frozenset()
        ok = {"success": True, "message": "ok"}
        info = self._model_info
        self.routes.update(
            {
                ("POST", "/generate"): self._generate,
                ("GET", "/get_model_info"): info,
                ("GET", "/model_info"): info,
                ("POST", "/update_weights_from_tensor"): self._update_from_tensor,
                ("POST", "/init_weights_update_group"): self._init_group,
                ("POST", "/update_weights_from_distributed"): self._update_from_distributed,
                ("POST", "/destroy_weights_update_group"): self._destroy_group,
                ("POST", "/update_weight_version"): self._stamp,
                ("POST", "/begin_weight_update"): self._begin,
                ("POST", "/end_weight_update"): self._end,
                ("POST", "/release_memory_occupation"): self._release,
                ("POST", "/resume_memory_occupation"): self._resume,
                ("POST", "/pause_generation"): lambda b, q: (self.engine.pause(), ok)[1],
                ("POST", "/continue_generation"): lambda b, q: (self.engine.resume(), ok)[1],
                ("POST", "/flush_cache"): lambda b, q: None,
                ("GET", "/flush_cache"): lambda b, q: None,
                ("POST", "/load_lora_adapter"): self._load_lora,
                ("POST", "/unload_lora_adapter"): self._unload_lora,
            }
        )

    def on_call(self, path: str, body: Any) -> None:
        if self.log is None:
            return
        record: dict[str, Any] = {"path": path}
        if path == "/generate":
            ids, params = body.get("input_ids") or [], body.get("sampling_params") or {}
            record["num_inputs"] = 1 if ids and isinstance(ids[0], int) else len(ids)
            record["temperatures"] = sorted(
                {p.get("temperature", 1.0) for p in (params if isinstance(params, list) else [params])}
            )
            record["lora_path"] = body.get("lora_path")
        elif path in ("/update_weights_from_distributed", "/update_weights_from_tensor"):
            record.update(
                {k: body.get(k) for k in ("group_name", "load_format", "flush_cache", "weight_version")}
            )
            record["num_tensors"] = len(body.get("names") or [])
            record["dtypes"] = sorted(set(body.get("dtypes") or []))
            record["first"] = (body.get("names") or [None])[0]
        else:
            record["body"] = body
        self.log(record)

    def _model_info(self, body: dict, query: dict) -> dict:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
        }

    def _generate(self, body: dict, query: dict) -> list[dict] | dict:
        single = bool(body["input_ids"]) and isinstance(
            body["input_ids"][0], int
        )  # one request: one object back
        inputs = [body["input_ids"]] if single else body["input_ids"]
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(inputs)
        loras = body.get("lora_path")
        loras = loras if isinstance(loras, list) else [loras] * len(inputs)
        replies = []
        for ids, sp, lora in zip(inputs, params, loras):
            if lora is not None and lora not in self._loras:
                raise ValueError(f"LoRA adapter {lora!r} is not loaded; loaded: {sorted(self._loras)}")
            eos = () if sp.get("ignore_eos") else tuple(self._eos)
            sampling = SamplingParams(
                temperature=sp.get("temperature", 1.0),
                top_p=sp.get("top_p", 1.0),
                top_k=sp.get("top_k", -1),
                max_tokens=sp.get("max_new_tokens", 128),
                stop_token_ids=eos + tuple(sp.get("stop_token_ids") or ()),
                seed=sp.get("sampling_seed"),
                stop=tuple(sp.get("stop") or ()),
            )
            (gen,) = self.run(self.engine.generate(ids, sampling, lora=lora))
            finish = (
                {"type": "length", "length": len(gen.token_ids)}
                if gen.finish_reason == "length"
                else {"type": "stop", "matched": gen.token_ids[-1]}
            )
            replies.append(
                {
                    "text": "",
                    "output_ids": gen.token_ids,
                    "meta_info": {
                        "id": f"{len(self.calls)}",
                        "finish_reason": finish,
                        "prompt_tokens": len(ids),
                        "completion_tokens": len(gen.token_ids),
                        "output_token_logprobs": [
                            [lp, tok, None] for lp, tok in zip(gen.logprobs, gen.token_ids)
                        ],
                        "weight_version": self.weight_version,
                    },
                }
            )
        return replies[0] if single else replies

    # -- weights ---------------------------------------------------------------------------------

    def _load(self, named: list[tuple[str, torch.Tensor]], body: dict) -> None:
        self.engine.update_weights(named, version=self.engine.weight_version)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])

    def _begin(self, body: dict, query: dict) -> dict:
        if self._session:
            return {
                "success": False,
                "message": "a weight-update session is already open; call end_weight_update() first",
            }
        self._session = True
        return {"success": True, "message": "Success"}

    def _end(self, body: dict, query: dict) -> dict:
        if not self._session:
            return {
                "success": False,
                "message": "no weight-update session is open; call begin_weight_update() first",
            }
        self._session = False
        return {"success": True, "message": "Success"}

    def _outside_session(self, path: str) -> dict | None:
        if self._session:
            return None
        return {
            "success": False,
            "message": f"{path} must run between begin_weight_update() and end_weight_update()",
        }

    def _update_from_tensor(self, body: dict, query: dict) -> dict:
        from megamarl.rollout.engines.sglang import deserialize_named_tensors

        if refused := self._outside_session("update_weights_from_tensor"):
            return refused
        with self._update_lock:
            named = deserialize_named_tensors(body["serialized_named_tensors"][0])
            self._load(named, body)
        return {"success": True, "message": f"updated {len(named)} tensors"}

    def _init_group(self, body: dict, query: dict) -> dict:
        import datetime

        import torch.distributed as dist

        if self.tp_size != 1:
            return {"success": False, "message": "the fake server joins update groups with tp_size 1 only"}
        name, world = body.get("group_name", "weight_update_group"), int(body["world_size"])
        backend = body.get("backend", "nccl")
        if backend != "gloo":
            return {"success": False, "message": f"backend {backend!r}: the fake server runs on CPU (gloo)"}
        rank = int(body["rank_offset"]) + 0  # rank_offset + tp_rank
        timeout = datetime.timedelta(seconds=600)
        store = dist.TCPStore(
            body["master_address"], int(body["master_port"]), world, is_master=False, timeout=timeout
        )
        # SGLang: PrefixStore(group_name) over the rendezvous store; torch's group constructor adds
        # "<group_name>/" and, for gloo, "cpu/".
        keyed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
        self._groups[name] = dist.ProcessGroupGloo(keyed, rank, world, timeout)
        self._stores[name] = store
        self.weight_groups.append(body)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def _update_from_distributed(self, body: dict, query: dict) -> dict:
        import torch.distributed as dist

        if refused := self._outside_session("update_weights_from_distributed"):
            return refused
        group = self._groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            return {
                "success": False,
                "message": f"Group {body.get('group_name')} not in {list(self._groups)}. "
                "Please call `init_weights_update_group` first.",
            }
        empties = [
            torch.empty(shape, dtype=getattr(torch, dtype))
            for dtype, shape in zip(body["dtypes"], body["shapes"])
        ]
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        with self._update_lock:
            if body.get("load_format") == "flattened_bucket":
                flat = torch.cat([t.reshape(-1) for t in empties])
                group.broadcast([flat], opts).wait()
                tensors, offset = [], 0
                for t in empties:
                    tensors.append(flat[offset : offset + t.numel()].view(t.shape).to(t.dtype))
                    offset += t.numel()
            else:
                for t in empties:
                    group.broadcast([t], opts).wait()
                tensors = empties
            self._load(list(zip(body["names"], tensors)), body)
        return {"success": True, "message": "Succeeded to update parameter online."}

    def _destroy_group(self, body: dict, query: dict) -> dict:
        name = body.get("group_name", "weight_update_group")
        if self._groups.pop(name, None) is None:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        self._stores.pop(name, None)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def _stamp(self, body: dict, query: dict) -> dict:
        self.weight_version = str(body["new_version"])
        return {
            "success": True,
            "message": f"Weight version updated to {self.weight_version}",
            "new_version": self.weight_version,
        }

    # -- memory, LoRA ------------------------------------------------------------------------------

    def _release(self, body: dict, query: dict) -> dict:
        tags = set(body.get("tags") or ("weights", "kv_cache", "cuda_graph"))
        self.engine.sleep(level=2 if "weights" in tags else 1)  # released weights are gone (no CPU backup)
        self._released |= tags
        return {"success": True, "message": "released"}

    def _resume(self, body: dict, query: dict) -> dict:
        tags = set(body.get("tags") or self._released)
        self._released -= tags
        if not self._released & {"weights", "kv_cache"}:
            self.engine.wake()
        return {"success": True, "message": "resumed"}

    def _load_lora(self, body: dict, query: dict) -> dict:
        name = body["lora_name"]
        if name in self._loras:
            return {
                "success": False,
                "error_message": f"LoRA adapter {name!r} is already loaded",
                "loaded_adapters": dict(self._loras),
            }
        self.engine.add_lora(name, body["lora_path"])
        self._loras[name] = body["lora_path"]
        return {"success": True, "error_message": None, "loaded_adapters": dict(self._loras)}

    def _unload_lora(self, body: dict, query: dict) -> dict:
        name = body["lora_name"]
        if self._loras.pop(name, None) is None:
            return {
                "success": False,
                "error_message": f"LoRA adapter {name!r} is not loaded",
                "loaded_adapters": dict(self._loras),
            }
        with self.engine._model_lock:
            self.engine.model.delete_adapter(name)
            self.engine.lora_versions.pop(name, None)
        return {"success": True, "error_message": None, "loaded_adapters": dict(self._loras)}


class FakeVLLMServer(_FakeServer):
    """vLLM 0.32 OpenAI server: ``/v1/completions`` plus the RL weight-transfer endpoints.

    ``transport`` stands in for the NCCL broadcast group: ``/update_weights`` receives the announced
    tensors from it, as the real server's weight-transfer engine receives them from the trainer.

    ``weight_transfer`` ("nccl" or "ipc"): the server was started with that vLLM backend, and the
    init and update bodies are parsed with vLLM's own worker-side dataclasses
    (``NCCLWeightTransferInitInfo``/``UpdateInfo``, ``IPCWeightTransferInitInfo``/``UpdateInfo``, which
    unpickle the IPC handles), so a payload vLLM would refuse fails here too. For "ipc" the fake plays
    the GPU whose UUID is ``gpu_uuid``, and ``rebuild`` turns that GPU's entry of a handle dict into
    the tensor (on a GPU: ``rebuild_cuda_tensor``).
    """

    def __init__(
        self,
        engine: HFEngine,
        transport: QueueTransport | None = None,
        *,
        weight_transfer: str | None = None,
        gpu_uuid: str = "GPU-fake-0",
        rebuild: Callable[[tuple], torch.Tensor] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        super().__init__(engine, host=host, port=port)
        self.transport = transport
        self.weight_transfer, self.gpu_uuid, self.rebuild = weight_transfer, gpu_uuid, rebuild
        self.init_info: Any = None
        self._staged: list[tuple[str, torch.Tensor]] = []
        self.routes.update(
            {
                ("POST", "/v1/completions"): self._completions,
                ("POST", "/pause"): lambda b, q: (self.engine.pause(), {"status": "paused"})[1],
                ("POST", "/resume"): lambda b, q: (self.engine.resume(), {"status": "resumed"})[1],
                ("POST", "/reset_prefix_cache"): lambda b, q: None,
                ("POST", "/sleep"): lambda b, q: (
                    self.engine.sleep(level=int(q.get("level", 1))),
                    {"status": "sleeping"},
                )[1],
                ("POST", "/wake_up"): lambda b, q: (self.engine.wake(), {"status": "awake"})[1],
                ("POST", "/init_weight_transfer_engine"): self._init,
                ("POST", "/start_weight_update"): self._start,
                ("POST", "/update_weights"): self._receive,
                ("POST", "/finish_weight_update"): self._finish,
                ("POST", "/shutdown_weight_transfer_engine"): lambda b, q: {
                    "message": "Weight transfer shut down"
                },
            }
        )

    def _completions(self, body: dict, query: dict) -> dict:
        sampling = SamplingParams(
            temperature=body.get("temperature", 1.0),
            top_p=body.get("top_p", 1.0),
            top_k=body.get("top_k", -1),
            max_tokens=body["max_tokens"],
            stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            n=body.get("n", 1),
            seed=body.get("seed"),
            stop=tuple(body.get("stop") or ()),
        )
        gens = self.run(self.engine.generate(body["prompt"], sampling))
        choices = [
            {
                "index": i,
                "text": "",
                "token_ids": g.token_ids,
                "finish_reason": g.finish_reason,
                "logprobs": {"tokens": [f"token_id:{t}" for t in g.token_ids], "token_logprobs": g.logprobs},
            }
            for i, g in enumerate(gens)
        ]
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "model": body.get("model"),
            "choices": choices,
        }

    def _start(self, body: dict, query: dict) -> dict:
        self._staged = []
        return {"message": "Weight update started"}

    def _init(self, body: dict, query: dict) -> dict:
        if self.weight_transfer == "nccl":
            from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

            self.init_info = NCCLWeightTransferInitInfo(**body["init_info"])
        elif self.weight_transfer == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo

            self.init_info = IPCWeightTransferInitInfo(**body["init_info"])
        return {"message": "Weight transfer initialized"}

    def _receive(self, body: dict, query: dict) -> dict:
        info = body["update_info"]
        if self.weight_transfer == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

            parsed = IPCWeightTransferUpdateInfo(**info)
            assert not self.init_info.packed and isinstance(parsed.ipc_handles, list)
            tensors = [self.rebuild(handle[self.gpu_uuid]) for handle in parsed.ipc_handles]
        else:
            if self.weight_transfer == "nccl":
                from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

                NCCLWeightTransferUpdateInfo(**info)
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

        self._queue: queue.Queue[torch.Tensor] = queue.Queue()

    def send(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            self._queue.put(tensor.clone())

    def receive(self, count: int) -> list[torch.Tensor]:
        return [self._queue.get(timeout=60) for _ in range(count)]
