"""Token-exact chat transcripts: an agent's conversation is kept as token ids, never re-tokenized.

Unlike the usual recipe (render the whole conversation with the chat template and tokenize it each
turn, which re-tokenizes the model's own replies and lets templates rewrite old turns), a
``ChatTranscript`` owns ``ids``, the exact token ids so far, and only appends. A user turn: render the
full message list as text, check that the text rendered before is an unchanged prefix, tokenize only
the new suffix (a template that rewrites earlier turns raises ``TemplateDeltaError``). A model reply:
its sampled ids verbatim, then the template's closing for an assistant turn (found once by rendering
a sentinel reply; only its rest when the reply already ended on a stop token that begins it).
Invariant: the ``prompt_ids`` training sees are exactly what the engine saw.
Details: docs/design-notes.md, "megamarl/orchestration/chat.py".
"""

from __future__ import annotations

from typing import Any

from megamarl.orchestration.tools import with_tools

_SENTINEL = "\x00megamarl-reply\x00"


class TemplateDeltaError(ValueError):
    """The chat template re-rendered earlier turns differently, so appending a delta is unsafe."""


class ChatTranscript:
    """One agent's conversation in one episode: ``messages`` (text) and ``ids`` (exact tokens)."""

    def __init__(
        self, tokenizer: Any, system_prompt: str | None = None, *, tools: list[dict] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.messages: list[dict[str, str]] = []
        if system_prompt is not None:
            self.messages.append({"role": "system", "content": system_prompt})
        # tool schemas: the template's ``tools`` argument, or a tool block in the system turn (tools.py)
        self.messages, self._template_kwargs = with_tools(self.messages, list(tools or []), tokenizer)
        self.ids: list[int] = []
        self._text = ""  # the template's rendering of ``messages`` that ``ids`` corresponds to
        self._closing: str | None = None

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **self._template_kwargs
        )

    def _delta(self, full: str) -> str:
        if not full.startswith(self._text):
            raise TemplateDeltaError(
                "the chat template rendered earlier turns differently after appending a message; "
                "token-exact multi-turn prompts need a template that only appends (use "
                "agents.<name>.multi_turn=false for this model)"
            )
        return full[len(self._text) :]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    @classmethod
    def of_prompt(
        cls, tokenizer: Any, messages: list[dict], *, template_kwargs: dict | None = None
    ) -> ChatTranscript:
        """A transcript whose ids are ``messages`` rendered (with the generation prompt) and encoded
        in one piece: a conversation that arrives whole (the OpenAI endpoint's requests)."""
        transcript = cls(tokenizer)
        transcript.messages, transcript._template_kwargs = list(messages), dict(template_kwargs or {})
        transcript._text = transcript._render(transcript.messages, generation_prompt=True)
        transcript.ids = transcript._encode(transcript._text)
        return transcript

    def continued(self, messages: list[dict]) -> ChatTranscript | None:
        """A new transcript for ``messages`` (rendered with the generation prompt) that keeps this
        one's ids, sampled replies included, and encodes only the appended text; None when this
        one's text is not an unchanged prefix of theirs (another conversation, or edited history)."""
        full = self._render(messages, generation_prompt=True)
        if not full.startswith(self._text):
            return None
        transcript = ChatTranscript(self.tokenizer)
        transcript.messages, transcript._template_kwargs = list(messages), self._template_kwargs
        transcript._text, transcript._closing = full, self._closing
        transcript.ids = self.ids + self._encode(full[len(self._text) :])
        return transcript

    def add_user(self, content: str) -> list[int]:
        """Append a user turn plus the assistant generation prompt; return the appended ids."""
        return self.add_message("user", content)

    def add_message(self, role: str, content: str) -> list[int]:
        """Append a ``role`` turn (user, or tool: a tool's result) plus the generation prompt."""
        return self.add_messages([{"role": role, "content": content}])

    def add_messages(self, turns: list[dict[str, str]]) -> list[int]:
        """Append several turns (the results of a reply's tool calls) and then one generation prompt:
        the prompt between them would not be a prefix of the next rendering."""
        messages = self.messages + list(turns)
        full = self._render(messages, generation_prompt=True)
        new_ids = self._encode(self._delta(full))
        self.ids.extend(new_ids)
        self.messages, self._text = messages, full
        return new_ids

    def closing(self) -> str:
        """Text the template writes after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        if self._closing is None:
            probe = self._render(
                [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL}],
                generation_prompt=False,
            )
            self._closing = probe[probe.rindex(_SENTINEL) + len(_SENTINEL) :]
        return self._closing

    def add_response(self, response_ids: list[int], text: str) -> list[int]:
        """Append a sampled reply (``text`` is its content without the stop token); return the ids
        appended after ``response_ids`` to close the turn."""
        messages = self.messages + [{"role": "assistant", "content": text}]
        closed = self._render(messages, generation_prompt=False)
        self._delta(closed)  # history must be unchanged
        closing = self.closing()
        emitted = self.tokenizer.decode(response_ids[-1:], skip_special_tokens=False) if response_ids else ""
        if emitted and closing.startswith(emitted) and response_ids[-1] in self.tokenizer.all_special_ids:
            closing = closing[len(emitted) :]  # the reply ended on the template's own end token
        tail = self._encode(closing)
        self.ids.extend(response_ids)
        self.ids.extend(tail)
        self.messages, self._text = messages, closed
        return tail

    def __len__(self) -> int:
        return len(self.ids)
