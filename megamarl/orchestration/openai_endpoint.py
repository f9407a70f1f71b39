"""A recording OpenAI-compatible endpoint: programs written for the OpenAI API act as megamarl agents.

The driver serves ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` and
``/v1/episodes/{episode_id}/reward`` (aiohttp, on the rollout's event loop) while the external
orchestra (``external.py``) runs a program per episode. Each call is routed to an *episode* (URL
prefix ``/episodes/{id}/v1/...``, header, ``metadata`` or ``user``) and an *agent role* (header or
``model``), rendered with the role's chat template and sampled by ``EpisodeContext.complete`` exactly
as ``ctx.act`` (the role's policy, sampling config and seed), and recorded as a Sample; the request's
``temperature``/``top_p`` are ignored. Tools and tool calls round-trip in OpenAI's shape; ``POST
.../reward`` reports the episode's rewards. Errors use OpenAI's body, so the official client raises
its usual exceptions. Routing, continuation, streaming and tools in full: docs/design-notes.md,
"megamarl/orchestration/openai_endpoint.py".
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import quote

from aiohttp import web

from megamarl.orchestration.chat import ChatTranscript, TemplateDeltaError
from megamarl.orchestration.context import EpisodeContext, EpisodeDone, EpisodeDropped
from megamarl.orchestration.tools import (
    ForcedCall,
    ToolCall,
    forced_call,
    parse_tool_calls,
    template_supports_tools,
    with_tools,
)
from megamarl.parallel.network import listen_address

EPISODE_HEADER = "X-Episode-Id"
AGENT_HEADER = "X-Megamarl-Agent"


class EndpointError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class EpisodeHandle:
    """What the endpoint knows about one running episode."""

    ctx: EpisodeContext
    reward: tuple[float, dict[str, float]] | None = None
    error: BaseException | None = None  # e.g. EpisodeDropped from a request: re-raised by the orchestra
    num_requests: int = 0
    # role -> its conversations so far (each ends with a sampled reply): a request that continues one
    # reuses its ids, so the replies in a multi-turn prompt are the sampled tokens, not re-encoded text
    transcripts: dict[str, list[ChatTranscript]] = field(default_factory=dict)


def _error(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": code, "param": None}}, status=status
    )


def _content_text(content: Any) -> str:
    """OpenAI message content: a string or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise EndpointError(
        400,
        f"message content must be a string or a list of text parts, got {type(content).__name__}",
        "invalid_content",
    )


class RecordingEndpoint:
    """The aiohttp app and the table of running episodes. ``start`` binds it on the running loop."""

    def __init__(self, *, host: str = "", port: int = 0) -> None:
        """``host``: the bind address, "" for auto; bound and advertised at ``start`` by the one rule
        (``parallel.network.listen_address``: loopback on one node; every interface of a multi-node run,
        its URLs carrying this node's address). ``port`` 0: a free one."""
        self.host, self.port = host, port
        self.episodes: dict[str, EpisodeHandle] = {}
        self._runner: web.AppRunner | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.base_url = ""

    # -- lifecycle -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        # episode ids contain "/" (``task/index``): the path parameter matches across segments
        for prefix in ("", "/episodes/{episode_id:.+}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
            app.router.add_get(prefix + "/v1/models", self._models)
        app.router.add_post("/v1/episodes/{episode_id:.+}/reward", self._reward)
        app.router.add_post("/episodes/{episode_id:.+}/v1/reward", self._reward)
        return app

    async def start(self) -> str:
        """Serve on the running loop (once per loop); return the base URL (no ``/v1``)."""
        loop = asyncio.get_running_loop()
        if self._runner is not None and self.loop is loop:
            return self.base_url
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        bind, advertise = listen_address(self.host)
        site = web.TCPSite(self._runner, bind, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # port 0: the OS's pick
        self.loop, self.base_url = loop, f"http://{advertise}:{port}"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self.loop, self.base_url = None, None, ""

    def open(self, ctx: EpisodeContext) -> EpisodeHandle:
        if ctx.episode_id in self.episodes:
            raise ValueError(f"episode {ctx.episode_id} is already running on the endpoint")
        handle = self.episodes[ctx.episode_id] = EpisodeHandle(ctx)
        return handle

    def close(self, episode_id: str) -> None:
        self.episodes.pop(episode_id, None)

    def episode_url(self, episode_id: str) -> str:
        """The ``OPENAI_BASE_URL`` of one episode (it names the episode; ends in ``/v1``)."""
        return f"{self.base_url}/episodes/{quote(episode_id, safe='/')}/v1"

    # -- routing ---------------------------------------------------------------------------------

    def _handle(self, request: web.Request, body: dict) -> EpisodeHandle:
        metadata = cast(dict, body.get("metadata")) if isinstance(body.get("metadata"), dict) else {}
        episode_id = (
            request.match_info.get("episode_id")
            or request.headers.get(EPISODE_HEADER)
            or metadata.get("episode_id")
            or body.get("user")
        )
        if not episode_id:
            raise EndpointError(
                400,
                f"no episode id: use the base URL /episodes/<id>/v1, the {EPISODE_HEADER} "
                "header, metadata.episode_id or the user field (MEGAMARL_EPISODE_ID holds it)",
                "missing_episode_id",
            )
        handle = self.episodes.get(str(episode_id))
        if handle is None:
            raise EndpointError(
                404,
                f"episode '{episode_id}' is not running (finished, timed out, or never "
                f"started); running: {len(self.episodes)}",
                "unknown_episode",
            )
        return handle

    def _role(self, request: web.Request, body: dict, handle: EpisodeHandle) -> str:
        role = request.headers.get(AGENT_HEADER) or body.get("model")
        if not role:
            raise EndpointError(
                400,
                f"no agent role: set model to one of {sorted(handle.ctx.agents)} "
                f"(or the {AGENT_HEADER} header)",
                "missing_role",
            )
        if role not in handle.ctx.agents:
            raise EndpointError(
                404,
                f"unknown agent role '{role}'; this run's agents: {sorted(handle.ctx.agents)}",
                "unknown_role",
            )
        return role

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EndpointError(400, f"request body is not JSON: {exc}", "invalid_json") from exc
        if not isinstance(body, dict):
            raise EndpointError(400, "request body must be a JSON object", "invalid_json")
        return body

    # -- handlers --------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        roles = sorted({role for h in self.episodes.values() for role in h.ctx.agents})
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": role, "object": "model", "created": 0, "owned_by": "megamarl"} for role in roles
                ],
            }
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await self._body(request)
            handle = self._handle(request, body)
            role = self._role(request, body, handle)
            prompt_ids, anchor, transcript = self._prompt(handle, role, body, chat=chat)
            if int(body.get("n") or 1) != 1:
                raise EndpointError(400, "n must be 1 (one recorded sample per call)", "unsupported_n")
            stop = body.get("stop") or ()
            stop = (stop,) if isinstance(stop, str) else tuple(stop)
            forced = _forced_call(body) if chat else None
            if forced is not None:  # tool_choice names a tool: the reply opens with its call (prompt tokens)
                prompt_ids = prompt_ids + handle.ctx.agents[role].tokenizer.encode(
                    forced.opening, add_special_tokens=False
                )
                stop = (*stop, *forced.stop)
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
            handle.num_requests += 1
            try:
                sample = await handle.ctx.complete(
                    role, prompt_ids, max_tokens=max_tokens, stop=stop, anchor=anchor
                )
            except EpisodeDropped as exc:
                handle.error = exc
                raise EndpointError(
                    400,
                    f"episode dropped: {exc.reason} (prompt of {len(prompt_ids)} tokens > "
                    f"agents.{role}.max_prompt_tokens)",
                    "context_length_exceeded",
                ) from exc
            except EpisodeDone as exc:
                raise EndpointError(409, "the episode's env is done", "episode_done") from exc
        except EndpointError as exc:
            return _error(exc.status, exc.message, exc.code)
        text = (
            forced.turn_text(sample.response_text) if forced is not None else sample.response_text
        )  # the turn
        if transcript is not None:
            self._remember(handle, role, transcript, sample, text)
        finish = "length" if sample.truncated else "stop"
        calls = []
        if forced is not None:
            calls = forced.calls(sample.response_text)
        elif chat and body.get("tools") and body.get("tool_choice") != "none":
            _, calls = parse_tool_calls(text)
        reply = _reply(
            sample,
            text,
            role=role,
            chat=chat,
            finish=finish,
            logprobs=bool(body.get("logprobs")),
            tokenizer=handle.ctx.agents[role].tokenizer,
            calls=calls,
        )
        if not body.get("stream"):
            return web.json_response(reply)
        return await _stream(request, reply, chat=chat)

    def _prompt(
        self, handle: EpisodeHandle, role: str, body: dict, *, chat: bool
    ) -> tuple[list[int], str, ChatTranscript | None]:
        """(prompt ids, anchor text, the chat transcript the ids belong to)."""
        tokenizer = handle.ctx.agents[role].tokenizer
        if not chat:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt), tokenizer.decode(prompt), None
            if not isinstance(prompt, str):
                raise EndpointError(400, "prompt must be a string or a list of token ids", "invalid_prompt")
            return tokenizer.encode(prompt), prompt, None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EndpointError(400, "messages must be a non-empty list", "invalid_messages")
        native = template_supports_tools(tokenizer)
        rendered = []
        for message in messages:
            if not isinstance(message, dict) or "role" not in message:
                raise EndpointError(400, "each message needs a role", "invalid_messages")
            entry = {key: value for key, value in message.items() if key != "content"}
            entry["content"] = _content_text(message.get("content"))
            if (
                entry.get("tool_calls") and not native
            ):  # the template cannot show them: as the model wrote them
                entry["content"] += "".join(_hermes_block(call) for call in entry.pop("tool_calls"))
            rendered.append(entry)
        rendered, kwargs = with_tools(rendered, list(body.get("tools") or []), tokenizer)
        try:
            transcript = None
            for earlier in reversed(handle.transcripts.get(role, [])[-4:]):  # the latest conversations
                transcript = earlier.continued(rendered) if earlier._template_kwargs == kwargs else None
                if transcript is not None:
                    break
            if transcript is None:
                transcript = ChatTranscript.of_prompt(tokenizer, rendered, template_kwargs=kwargs)
        except Exception as exc:  # a template that rejects the messages: the caller's error
            raise EndpointError(
                400, f"the chat template of role '{role}' rejected the messages: {exc}", "template_error"
            ) from exc
        return list(transcript.ids), rendered[-1]["content"], transcript

    @staticmethod
    def _remember(handle: EpisodeHandle, role: str, transcript: ChatTranscript, sample, text: str) -> None:
        """Keep the conversation with its sampled reply (``text``: the whole assistant turn, a forced
        call's opening included), for a later request that continues it."""
        try:
            transcript.add_response(sample.prompt_ids[len(transcript.ids) :] + sample.response_ids, text)
        except TemplateDeltaError:  # a template that rewrites history: later prompts are encoded whole
            return
        handle.transcripts.setdefault(role, []).append(transcript)

    async def _reward(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            episode_id = request.match_info["episode_id"]
            handle = self.episodes.get(episode_id)
            if handle is None:
                raise EndpointError(
                    404,
                    f"episode '{episode_id}' is not running; a reward must be posted "
                    "before the program exits",
                    "unknown_episode",
                )
            team, agents = body.get("team"), body.get("agents") or {}
            if not isinstance(team, (int, float)) or isinstance(team, bool) or not isinstance(agents, dict):
                raise EndpointError(
                    400, 'reward body must be {"team": number, "agents": {role: number}}', "invalid_reward"
                )
            try:
                handle.ctx.report_rewards(float(team), {k: float(v) for k, v in agents.items()})
            except (TypeError, ValueError) as exc:
                raise EndpointError(400, str(exc), "invalid_reward") from exc
            handle.reward = handle.ctx.reported
            assert handle.reward is not None  # report_rewards set it
        except EndpointError as exc:
            return _error(exc.status, exc.message, exc.code)
        return web.json_response(
            {"episode_id": episode_id, "team": handle.reward[0], "agents": handle.reward[1]}
        )


def _forced_call(body: dict) -> ForcedCall | None:
    """OpenAI's ``tool_choice``: ``auto`` / ``none`` / absent force nothing; a named function, or
    ``required`` with exactly one tool, makes the reply that tool's call (``tools.ForcedCall``).
    ``required`` among several tools would need constrained decoding: refused."""
    choice = body.get("tool_choice")
    if choice in (None, "auto", "none"):
        return None
    functions: dict[Any, dict] = {  # keyed by the request's (JSON) names
        f.get("name"): f
        for f in (t.get("function") for t in body.get("tools") or [] if isinstance(t, dict))
        if isinstance(f, dict)
    }
    names = list(functions)
    if choice == "required":
        if len(names) != 1:
            raise EndpointError(
                400,
                f"tool_choice=required needs exactly one tool here (got {len(names)}); "
                'name the function: {"type": "function", "function": {"name": ...}}',
                "unsupported_tool_choice",
            )
        name = names[0]
    else:
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if name not in names:
            raise EndpointError(
                400,
                f"tool_choice {json.dumps(choice)} names no tool of the request's tools {names}",
                "invalid_tool_choice",
            )
    return forced_call(name, functions[name].get("parameters") or {})


def _hermes_block(call: dict) -> str:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass
    return (
        "<tool_call>"
        + json.dumps({"name": function.get("name", ""), "arguments": arguments})
        + "</tool_call>"
    )


def _reply(
    sample,
    text: str,
    *,
    role: str,
    chat: bool,
    finish: str,
    logprobs: bool,
    tokenizer,
    calls: Sequence[ToolCall] = (),
) -> dict:
    created = int(time.time())
    usage = {
        "prompt_tokens": len(sample.prompt_ids),
        "completion_tokens": len(sample.response_ids),
        "total_tokens": len(sample.prompt_ids) + len(sample.response_ids),
    }
    token_logprobs = None
    if logprobs:
        tokens = [tokenizer.decode([t]) for t in sample.response_ids]
        token_logprobs = {
            "content": [
                {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                for tok, lp in zip(
                    tokens, sample.rollout_logprobs, strict=False
                )  # strict=False: one logprob per response token, as the engine reported them
            ]
        }
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:  # the reply called tools: OpenAI's shape (content is the text around the calls)
            content, _ = parse_tool_calls(text)
            message = {
                "role": "assistant",
                "content": content or None,
                "tool_calls": [c.openai() for c in calls],
            }
            finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": token_logprobs}
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": created,
            "model": role,
            "choices": [choice],
            "usage": usage,
        }
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": created,
        "model": role,
        "choices": [choice],
        "usage": usage,
    }


async def _stream(request: web.Request, reply: dict, *, chat: bool) -> web.StreamResponse:
    """Server-sent events: the whole reply as one chunk, a closing chunk with ``finish_reason``, [DONE]."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    choice = reply["choices"][0]
    base = {key: reply[key] for key in ("id", "created", "model")}
    if chat:
        base["object"] = "chat.completion.chunk"
        delta = {"role": "assistant", "content": choice["message"]["content"]}
        if choice["message"].get("tool_calls"):
            delta["tool_calls"] = [
                {"index": i, **call} for i, call in enumerate(choice["message"]["tool_calls"])
            ]
        chunks = [
            {"index": 0, "delta": delta, "finish_reason": None, "logprobs": choice["logprobs"]},
            {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"], "logprobs": None},
        ]
    else:
        base["object"] = "text_completion"
        chunks = [
            {"index": 0, "text": choice["text"], "finish_reason": None, "logprobs": None},
            {"index": 0, "text": "", "finish_reason": choice["finish_reason"], "logprobs": None},
        ]
    for chunk in chunks:
        await response.write(f"data: {json.dumps({**base, 'choices': [chunk]})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
