"""Test program: the solver gets a calculator tool through the OpenAI ``tools`` API, the endpoint
returns the model's call as ``tool_calls``, the program runs it and sends the result back as a
``tool`` message; the final reply's number is checked against the task's answer. With
``OAI_FORCE_TOOL`` set, the first request names the tool in ``tool_choice``."""

import json
import os
import re
import sys

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def main() -> None:
    job = json.load(sys.stdin)
    client = OpenAI()
    messages = [{"role": "user", "content": job["task"]["question"]}]
    forced = (
        {"tool_choice": {"type": "function", "function": {"name": "calculator"}}}
        if os.environ.get("OAI_FORCE_TOOL")
        else {}
    )
    first = client.chat.completions.create(
        model="solver", messages=messages, tools=TOOLS, stream=True, **forced
    )
    chunks = list(first)
    calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])]
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices[0].finish_reason]
    assert finish == ["tool_calls"] and calls[0].function.name == "calculator", (finish, calls)
    expression = json.loads(calls[0].function.arguments)["expression"]
    result = str(eval(expression.replace("x", "*")))  # the program's own tool (a test: trusted input)
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[0].id,
                    "type": "function",
                    "function": {"name": "calculator", "arguments": calls[0].function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": result},
    ]
    final = client.chat.completions.create(model="solver", messages=messages, tools=TOOLS)
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    numbers = re.findall(r"-?\d+", final.choices[0].message.content)
    team = float(bool(numbers) and float(numbers[-1]) == job["task"]["answer"])
    client.post(f"{os.environ['OPENAI_BASE_URL']}/reward", body={"team": team}, cast_to=object)


if __name__ == "__main__":
    main()
