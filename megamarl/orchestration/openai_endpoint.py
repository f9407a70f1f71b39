"""A recording OpenAI-compatible endpoint: programs written for the OpenAI API act as megamarl agents.

The driver serves ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` and
``/v1/episodes/{episode_id}/reward`` (aiohttp, on the rollout's event loop) while the external
orchestra (``external.py``) runs programs. Each call is routed to an *episode* (URL
prefix ``/episodes/{id}/v1/...``, header, ``metadata`` or ``user``) and an *agent role* (header or
``model``), rendered with the role's chat template and sampled by ``EpisodeContext.complete`` exactly
as ``ctx.act`` (the role's policy, sampling config and seed), and recorded as a Sample; the request's
``temperature``/``top_p`` are ignored. Tools and tool calls round-trip in OpenAI's shape; ``POST
.../reward`` reports the episode's one reward (finite, within ``max_abs_reward``; a second is a 409).
Every route needs the episode's own random token (``Authorization: Bearer``, the program's
``OPENAI_API_KEY``), so no other local process can read or write an episode. Bodies, connections and
their timeouts are bounded (``EndpointLimits``, ``http_guard``). Errors use OpenAI's body, so the
official client raises its usual exceptions. Routing, continuation, streaming and tools in full:
docs/design-notes.md, "megamarl/orchestration/openai_endpoint.py".
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import quote

from aiohttp import web

from megamarl.orchestration.chat import ChatTranscript, TemplateDeltaError
from megamarl.orchestration.context import EpisodeContext, EpisodeDone, EpisodeDropped
from megamarl.orchestration.http_guard import ConnectionGuard, track
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
POLICY_HEADER = "X-Megamarl-Policy"  # on every completion: the policy that wrote it
VERSION_HEADER = "X-Megamarl-Weight-Version"  # ... and the version of its weights


READ_CHUNK = 64 * 1024
# after an early answer (413, 401) aiohttp drains the unread body this long before closing, so the
# client reads the answer instead of a reset; the drained bytes are discarded, never kept
LINGER_S = 2.0


@dataclass
class EndpointLimits:
    """What one client of the endpoint may cost the driver. Set as ``orchestra.kwargs`` of ``external``."""

    max_body_bytes: int = 1024 * 1024  # a larger request body is refused (413) before it is read
    max_abs_reward: float = 1e4  # a posted reward must be finite and within [-max_abs_reward, max_abs_reward]
    # open connections; past it, a new one closes the oldest that is not being served (503 if all are)
    max_connections: int = 256
    header_timeout_s: float = 10.0  # a request head must be complete this long after its first byte
    read_timeout_s: float = 30.0  # a request body must be complete this long after its head (else 408)
    # a connection with no complete request this long after it opened or was last answered is closed
    # (longer than the OpenAI client's 5 s keep-alive, so a closing never races the client's reuse)
    idle_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for key in ("max_body_bytes", "max_connections"):
            if getattr(self, key) < 1:
                raise ValueError(f"orchestra.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("max_abs_reward", "header_timeout_s", "read_timeout_s", "idle_timeout_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"orchestra.{key} must be a finite number > 0, got {value}")


class EndpointError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class EpisodeHandle:
    """What the endpoint knows about one running episode."""

    ctx: EpisodeContext
    # the episode's key: every request about this episode carries it (``Authorization: Bearer``)
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    reward: tuple[float, dict[str, float]] | None = None
    error: BaseException | None = None  # e.g. EpisodeDropped from a request: re-raised by the orchestra
    num_requests: int = 0
    # role -> its conversations so far (each ends with a sampled reply): a request that continues one
    # reuses its ids, so the replies in a multi-turn prompt are the sampled tokens, not re-encoded text
    transcripts: dict[str, list[ChatTranscript]] = field(default_factory=dict)


def _error(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    response = web.json_response(
        {"error": {"message": message, "type": kind, "code": code, "param": None}}, status=status
    )
    if status in (408, 413):  # the body was not read whole: this connection cannot carry another request
        response.force_close()
    return response


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

    def __init__(self, *, host: str = "", port: int = 0, limits: EndpointLimits | None = None) -> None:
        """``host``: the bind address, "" for auto; bound and advertised at ``start`` by the one rule
        (``parallel.network.listen_address``: loopback on one node; every interface of a multi-node run,
        its URLs carrying this node's address). ``port`` 0: a free one."""
        self.host, self.port = host, port
        self.limits = limits if limits is not None else EndpointLimits()
        self.episodes: dict[str, EpisodeHandle] = {}
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self.guard: ConnectionGuard | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.base_url = ""

    # -- lifecycle -------------------------------------------------------------------------------

    def app(self, guard: ConnectionGuard | None = None) -> web.Application:
        # bodies are read by ``_body`` under max_body_bytes; aiohttp's own cap only backs it up
        app = web.Application(
            client_max_size=self.limits.max_body_bytes,
            middlewares=[track(guard)] if guard is not None else [],
        )
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
        limits = self.limits
        guard = ConnectionGuard(
            max_connections=limits.max_connections, header_timeout_s=limits.header_timeout_s
        )
        runner = web.AppRunner(
            self.app(guard),
            access_log=None,
            keepalive_timeout=limits.idle_timeout_s,  # aiohttp starts it at connection_made, too
            lingering_time=LINGER_S,
        )
        await runner.setup()
        guard.protocol_factory = runner.server
        bind, advertise = listen_address(self.host)
        # accept at most this many sockets per wake-up, so a burst of connections is admitted (and
        # older ones evicted) in slices instead of taking every descriptor before any is closed
        backlog = min(128, limits.max_connections)
        server = await loop.create_server(guard.factory, bind, self.port, backlog=backlog)
        port = server.sockets[0].getsockname()[1]  # port 0: the OS's pick
        self._runner, self._server, self.guard = runner, server, guard
        self.loop, self.base_url = loop, f"http://{advertise}:{port}"
        return self.base_url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()  # no new connections; the runner closes the open ones
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner, self._server, self.guard, self.loop, self.base_url = None, None, None, None, ""

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

    def _authorize(self, request: web.Request) -> EpisodeHandle:
        """The running episode whose token the request carries (``Authorization: Bearer <token>``), each
        token compared in constant time; a request with none of them is a 401 before its body is read."""
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        key = given.strip().encode(errors="replace")
        found = None
        for handle in self.episodes.values():  # no early exit: the time taken says nothing of a match
            if hmac.compare_digest(key, handle.token.encode()) and scheme.lower() == "bearer":
                found = handle
        if found is None or not key:
            raise EndpointError(
                401,
                "no running episode has this API key: send the program's OPENAI_API_KEY as "
                "'Authorization: Bearer <key>' (the official client does); an episode's key ends with it",
                "invalid_api_key",
            )
        return found

    @staticmethod
    def _named(request: web.Request, handle: EpisodeHandle, body: dict | None = None) -> None:
        """An episode the request names (URL prefix, header, ``metadata.episode_id``, ``user``) must be
        the key's own: one episode's key cannot touch another. Naming none is fine: the key routes it."""
        named = request.match_info.get("episode_id") or request.headers.get(EPISODE_HEADER)
        if not named and body is not None:
            metadata = cast(dict, body.get("metadata")) if isinstance(body.get("metadata"), dict) else {}
            named = metadata.get("episode_id") or body.get("user")
        if named and str(named) != handle.ctx.episode_id:
            raise EndpointError(401, f"this API key is not episode '{named}''s key", "invalid_api_key")

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
        """The JSON body, read in chunks up to ``max_body_bytes`` (413: a larger declared length is
        refused unread, a chunked one once it passes the limit) within ``read_timeout_s`` (408)."""
        limit = self.limits.max_body_bytes
        too_large = f"bytes > orchestra.max_body_bytes={limit}"
        if request.content_length is not None and request.content_length > limit:
            raise EndpointError(
                413, f"request body of {request.content_length} {too_large}", "body_too_large"
            )
        data = bytearray()

        async def read() -> None:
            while chunk := await request.content.read(READ_CHUNK):
                data.extend(chunk)
                if len(data) > limit:
                    raise EndpointError(
                        413, f"request body of more than {len(data)} {too_large}", "body_too_large"
                    )

        try:
            await asyncio.wait_for(read(), self.limits.read_timeout_s)
        except asyncio.TimeoutError:
            raise EndpointError(
                408,
                f"request body incomplete after orchestra.read_timeout_s={self.limits.read_timeout_s} s "
                f"({len(data)} bytes received)",
                "request_timeout",
            ) from None
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EndpointError(400, f"request body is not JSON: {exc}", "invalid_json") from exc
        if not isinstance(body, dict):
            raise EndpointError(400, "request body must be a JSON object", "invalid_json")
        return body

    # -- handlers --------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        try:
            handle = self._authorize(request)
            self._named(request, handle)
        except EndpointError as exc:
            return _error(exc.status, exc.message, exc.code)
        roles = sorted(handle.ctx.agents)
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
            handle = self._authorize(request)
            self._named(request, handle)  # before the body: a wrong key costs no read
            body = await self._body(request)
            self._named(request, handle, body)
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
        headers = {VERSION_HEADER: str(sample.weight_version), POLICY_HEADER: sample.policy}
        if not body.get("stream"):
            return web.json_response(reply, headers=headers)
        return await _stream(request, reply, chat=chat, headers=headers)

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
            handle = self._authorize(request)
            self._named(request, handle)
            self._unrewarded(handle)  # before the body: a second post costs no read
            self.report(handle, await self._body(request))
            assert handle.reward is not None  # report set it
        except EndpointError as exc:
            return _error(exc.status, exc.message, exc.code)
        return web.json_response(
            {"episode_id": handle.ctx.episode_id, "team": handle.reward[0], "agents": handle.reward[1]}
        )

    @staticmethod
    def _unrewarded(handle: EpisodeHandle) -> None:
        if handle.reward is not None:  # one reward per episode: never overwritten
            raise EndpointError(
                409,
                f"episode '{handle.ctx.episode_id}' already has its reward {handle.reward[0]!r}",
                "reward_already_posted",
            )

    def report(self, handle: EpisodeHandle, body: Any) -> None:
        """The episode's one reward, ``{"team": number, "agents": {role: number}}`` (the reward route's
        body, or a long-lived program's done line), each value checked; EndpointError if refused."""
        self._unrewarded(handle)
        team = body.get("team") if isinstance(body, dict) else None
        agents = (body.get("agents") or {}) if isinstance(body, dict) else None
        if not isinstance(agents, dict):
            raise EndpointError(
                400, 'reward body must be {"team": number, "agents": {role: number}}', "invalid_reward"
            )
        self._check_reward("team", team)
        for role, value in agents.items():
            self._check_reward(f"agents.{role}", value)
        try:
            handle.ctx.report_rewards(float(cast(float, team)), {k: float(v) for k, v in agents.items()})
        except (TypeError, ValueError) as exc:
            raise EndpointError(400, str(exc), "invalid_reward") from exc
        handle.reward = handle.ctx.reported

    def _check_reward(self, name: str, value: Any) -> None:
        """A reward trains every sample of the episode: a NaN, an infinity or a huge value would turn
        the step's advantages into NaN (or swamp them), so each must be a finite number within bound."""
        bound = self.limits.max_abs_reward
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise EndpointError(
                400,
                f'reward {name} must be a number, got {value!r:.40}; body: {{"team": number, '
                '"agents": {role: number}}',
                "invalid_reward",
            )
        # an int is compared as an int: float() of a 400-digit one would overflow
        if not ((isinstance(value, int) or math.isfinite(value)) and abs(value) <= bound):
            raise EndpointError(
                400,
                f"reward {name}={value!r:.40} must be finite and within [-{bound:g}, {bound:g}] "
                "(orchestra.max_abs_reward)",
                "invalid_reward",
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
    # which weights wrote the reply: OpenAI's system_fingerprint (an OpenAI client's
    # ``completion.system_fingerprint``) and the fields themselves (``completion.model_extra``)
    stamp = {
        "system_fingerprint": f"{sample.policy}@v{sample.weight_version}",
        "megamarl": {"policy": sample.policy, "weight_version": sample.weight_version},
    }
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
            **stamp,
        }
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": created,
        "model": role,
        "choices": [choice],
        "usage": usage,
        **stamp,
    }


async def _stream(
    request: web.Request, reply: dict, *, chat: bool, headers: dict[str, str]
) -> web.StreamResponse:
    """Server-sent events: the whole reply as one chunk, a closing chunk with ``finish_reason``, [DONE];
    every chunk carries the reply's weight stamp."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await response.prepare(request)
    choice = reply["choices"][0]
    base = {key: reply[key] for key in ("id", "created", "model", "system_fingerprint", "megamarl")}
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
