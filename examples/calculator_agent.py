"""A small tool-using agent, written against the plain ``openai`` client, that verbatim can train.

    verbatim train --agent examples/calculator_agent.py:solve --tasks examples/calculator_tasks.jsonl \
        --steps 4 --groups 2 --group-size 4 --max-turns 3 --max-tokens 48 --out runs/calculator

verbatim calls ``solve(task, client)`` once per rollout with a client of that rollout's own endpoint (its
base URL and key are set; nothing else about the agent changes). The agent keeps its conversation the
ordinary way, appending each reply and each tool result, so every request extends the last one token for
token. It returns the reward: 1 for the right number in the final answer, less the further off it is.
Point the same function at any OpenAI-compatible server and it runs there unchanged.
"""

from __future__ import annotations

import json
import re

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]

SYSTEM = "Solve the problem. Call calculate for arithmetic, then answer with the number alone."


def calculate(expression: str) -> str:
    if not re.fullmatch(r"[\d\s+\-*/().]+", expression or ""):
        return "error: only numbers, + - * / and parentheses"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - checked to be plain arithmetic above
    except (ArithmeticError, SyntaxError) as exc:
        return f"error: {exc}"


def solve(task: dict, client) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    answer = ""
    for _ in range(3):
        reply = client.chat.completions.create(model="verbatim", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments).get("expression", ""))
            except (ValueError, AttributeError):
                result = "error: arguments must be a JSON object with an expression"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"reward": score(answer, task["answer"]), "solved": score(answer, task["answer"]) == 1.0}


def score(answer: str, expected: float) -> float:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer)
    if not numbers:
        return 0.0
    return max(0.0, 1.0 - abs(float(numbers[-1]) - expected) / max(abs(expected), 1.0))
