"""Tools: JSON-schema functions an agent may call, and the tool-call blocks models write.

A tool is a registered function with an OpenAI-style JSON schema (``TOOLS``; built-in ``calculator``).
An agent declares its tools (``agents.<role>.tools``); its prompt carries their schemas through the
chat template, or a Hermes-style block in the system turn for a template that ignores tools
(``tool_system_prompt``). ``parse_tool_calls`` finds calls in Hermes/Qwen ``<tool_call>{...}</tool_call>``
blocks or a Llama 3.x JSON reply; a block that is not valid JSON or names no function stays content.
``call_tool`` never raises: an unknown tool or a failing function gives an ``error: ...`` result.
Details: docs/design-notes.md, "megamarl/orchestration/tools.py".
"""

from __future__ import annotations

import ast
import json
import operator
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from megamarl.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""

    def openai(self) -> dict:
        """As an OpenAI ``message.tool_calls`` entry (arguments as a JSON string)."""
        return {
            "id": self.id or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]

    def schema(self) -> dict:
        """The OpenAI / transformers tool schema."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


TOOLS: Registry[Tool] = Registry(
    "tool",
    signature="Tool(name, description, parameters: JSON schema, fn(**arguments) -> str)",
    keys=("agents.<name>.tools",),
)


def _as_call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI does
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], arguments) if isinstance(arguments, dict) else None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """``(content, calls)``: the reply's tool calls and its text without them (module docstring)."""
    calls, kept = [], []
    last = 0
    for match in _HERMES.finditer(text):
        try:
            call = _as_call(json.loads(match.group(1)))
        except json.JSONDecodeError:
            call = None
        if call is not None:
            calls.append(call)
            kept.append(text[last : match.start()])
            last = match.end()
    if calls:
        return ("".join(kept) + text[last:]).strip(), calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if body.startswith(("{", "[")):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        found = [_as_call(o) for o in (obj if isinstance(obj, list) else [obj])]
        if found and all(c is not None for c in found):
            return "", cast("list[ToolCall]", found)
    return text, []


def call_tool(call: ToolCall, tools: Mapping[str, Tool]) -> str:
    """The tool's result as text; ``error: ...`` for an unknown tool, bad arguments or a raising function."""
    tool = tools.get(call.name)
    if tool is None:
        return f"error: unknown tool '{call.name}'; tools: {sorted(tools)}"
    try:
        return str(tool.fn(**call.arguments))
    except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation, not a crash
        return f"error: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class ForcedCall:
    """A reply made to call one tool (``agents.<a>.tool_choice``, or OpenAI's ``tool_choice`` naming a
    function): ``opening`` is written into the assistant turn before sampling (prompt tokens) and the
    model writes the rest. For a tool with a single string parameter (the calculator's ``expression``)
    the opening runs into that string's value: the model writes the value, which ends at its first
    ``"`` (a stop string), and the call is that value, so the reply cannot break the JSON around it
    (what constrained decoding does for vLLM's named ``tool_choice``; a 135M model asked to write the
    arguments object continues the schema instead). Other tools: the opening ends at ``"arguments": ``
    and the model writes the JSON object and the closing tag."""

    name: str
    argument: str | None  # the single string parameter the reply writes; None: the whole arguments object

    @property
    def opening(self) -> str:
        head = '<tool_call>{"name": ' + json.dumps(self.name) + ', "arguments": '
        return head + "{" + json.dumps(self.argument) + ': "' if self.argument else head

    @property
    def stop(self) -> tuple[str, ...]:
        return ('"',) if self.argument else ()

    def calls(self, reply: str) -> list[ToolCall]:
        """The call the reply makes. Argument mode: always one, with the reply as the argument
        (re-parsing the block would misread a reply that holds ``</tool_call>``); else the calls
        parsed from the opening and the reply."""
        if self.argument:
            return [ToolCall(self.name, {self.argument: reply})]
        return parse_tool_calls(self.opening + reply)[1]

    def turn_text(self, reply: str) -> str:
        """The assistant turn's text: the call as a well-formed block (argument mode), else the
        opening followed by the reply."""
        if self.argument:
            return (
                "<tool_call>"
                + json.dumps({"name": self.name, "arguments": {self.argument: reply}})
                + "</tool_call>"
            )
        return self.opening + reply


def forced_call(name: str, parameters: Mapping[str, Any]) -> ForcedCall:
    """The forced call of tool ``name`` whose arguments have the JSON schema ``parameters``."""
    properties = parameters.get("properties") or {}
    [(only, schema)] = properties.items() if len(properties) == 1 else [(None, {})]
    single_string = (
        only is not None and schema.get("type") == "string" and parameters.get("required") == [only]
    )
    return ForcedCall(name, only if single_string else None)


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` argument (most tool-trained models')."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def tool_system_prompt(schemas: list[dict]) -> str:
    """Hermes-style tool instructions, for templates that ignore ``tools``."""
    listing = "\n".join(json.dumps(s) for s in schemas)
    return (
        "You may call functions. Available tools:\n<tools>\n" + listing + "\n</tools>\n"
        'To call one, reply with <tool_call>{"name": <name>, "arguments": <object>}</tool_call>; '
        "its result arrives in the next message."
    )


def with_tools(messages: list[dict], schemas: list[dict], tokenizer: Any) -> tuple[list[dict], dict]:
    """Messages and ``apply_chat_template`` kwargs that show ``schemas`` to the model: the template's
    own ``tools`` when it renders them, else the tool block appended to (or as) the system turn."""
    if not schemas:
        return messages, {}
    if template_supports_tools(tokenizer):
        return messages, {"tools": schemas}
    block = tool_system_prompt(schemas)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{block}".lstrip())
        return [first, *messages[1:]], {}
    return [{"role": "system", "content": block}, *messages], {}


# -- built-in tools -------------------------------------------------------------------------------

_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _arith(node: ast.AST) -> float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses; x is read as *)."""
    value = _arith(ast.parse(str(expression).replace("x", "*").replace("×", "*"), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


TOOLS.add(
    "calculator",
    Tool(
        "calculator",
        "Evaluate an arithmetic expression such as 12 * (3 + 4).",
        {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression"}},
            "required": ["expression"],
        },
        calculator,
    ),
)
