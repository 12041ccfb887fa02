"""``tools``: answer a question by calling calculator, unit and price tools over several turns.

The model calls tools as ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``
(the renderer parses them into ``Message.tool_calls``); each call is answered
by a ``tool`` message. A reply without tool calls is the final answer: reward
1.0 if its number (after ``Answer:``, else the last number) equals the task's
answer to 2 decimals (``info["solved"]``). The episode also ends after ``max_steps`` model turns.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from verbatim.datamodel import Message, ToolCall
from verbatim.envs.answers import final_number, numbers_match
from verbatim.envs.base import Reset, StepResult
from verbatim.envs.held_out import hashed_share
from verbatim.envs.taskfile import TaskSpec, parse_task
from verbatim.envs.tool_functions import TOOL_DEFINITIONS, TOOL_SUMMARY, UNITS, format_number, run_tool
from verbatim.errors import InputError

SYSTEM = (
    "Solve the task with tools. To call a tool write:\n"
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>\n'
    f"Tools: {TOOL_SUMMARY}.\n"
    "When you know the result, reply: Answer: <number>"
)
ITEMS = ("apple", "pear", "lemon", "melon", "carrot", "onion", "egg", "bagel")
KINDS = ("arithmetic", "convert", "shopping")


class ToolsTask(TaskSpec):
    question: str
    answer: float
    kind: str = "custom"
    prices: dict[str, float] = Field(default_factory=dict)
    max_steps: int = Field(default=6, ge=1, le=50)


class ToolsEnv:
    """One question; tool calls are executed in order, a call-free reply ends the episode."""

    name = "tools"

    def __init__(self) -> None:
        self.task: ToolsTask | None = None
        self.steps = 0
        self.calls = 0

    def reset(self, task: dict[str, Any], seed: int) -> Reset:
        self.task = parse_task(ToolsTask, task, self.name)
        self.steps = self.calls = 0
        opening = (Message(role="system", content=SYSTEM), Message(role="user", content=self.task.question))
        return Reset(messages=opening, tools=TOOL_DEFINITIONS)

    def step(self, message: Message) -> StepResult:
        if self.task is None:
            raise RuntimeError("ToolsEnv.step before reset")
        self.steps += 1
        call_problems = [p for p in message.problems if "tool call" in p]
        if message.tool_calls or call_problems:
            return self._tool_turn(message.tool_calls, call_problems)
        got = final_number(message.content)
        info = {"steps": self.steps, "tool_calls": self.calls, "answer": got, "expected": self.task.answer}
        if got is None:
            out_of_steps = self.steps >= self.task.max_steps
            text = "No answer found. Call a tool, or reply: Answer: <number>"
            return StepResult(messages=(Message(role="user", content=text),), done=out_of_steps,
                              info=info | {"correct": False, "solved": False})
        correct = numbers_match(got, self.task.answer)
        return StepResult(reward=1.0 if correct else 0.0, done=True,
                          info=info | {"correct": correct, "solved": correct})

    def _tool_turn(self, calls: Sequence[ToolCall], problems: list[str]) -> StepResult:
        observations = []
        for index, call in enumerate(calls):
            self.calls += 1
            call_id = call.id or f"call_{self.steps}_{index}"
            observations.append(Message(role="tool", content=run_tool(call, self.task.prices),
                                        tool_call_id=call_id, name=call.name))
        if problems:
            text = "Your tool call could not be read: " + "; ".join(problems) + (
                '. Write <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
            observations.append(Message(role="user", content=text))
        done = self.steps >= self.task.max_steps
        return StepResult(messages=tuple(observations), done=done,
                          info={"steps": self.steps, "tool_calls": self.calls, "correct": False,
                                "solved": False, "out_of_steps": done})


class ToolsFactory:
    """Seeded questions of three kinds: arithmetic, unit conversion, shopping with a price table."""

    name = "tools"

    def __init__(self, max_steps: int = 6, kinds: Sequence[str] = KINDS) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown or not kinds:
            raise InputError(f"tools env: unknown kinds {sorted(unknown)}", hint=f"kinds: {', '.join(KINDS)}")
        self.max_steps, self.kinds = max_steps, tuple(kinds)

    def make(self) -> ToolsEnv:
        return ToolsEnv()

    def turns_needed(self, task: dict[str, Any]) -> int:
        """The task's ``max_steps``: the episode ends there at the latest."""
        return parse_task(ToolsTask, task, self.name).max_steps

    def held_out(self, task: dict[str, Any]) -> bool:
        """Held out from training for evaluation (envs/held_out.py): one task in five by a hash of its content."""
        return hashed_share(task)

    def tasks(self, count: int, seed: int) -> Sequence[dict[str, Any]]:
        rng = random.Random(f"tools:{seed}")
        out = []
        for i in range(count):
            kind = self.kinds[i % len(self.kinds)]
            task = {"arithmetic": arithmetic_task, "convert": convert_task, "shopping": shopping_task}[kind](rng)
            out.append({"id": f"tools-{seed}-{i}", "kind": kind, **task, "max_steps": self.max_steps})
        return out


def arithmetic_task(rng: random.Random) -> dict[str, Any]:
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 12)
    return {"question": f"What is ({a} + {b}) * {c}?", "answer": float((a + b) * c)}


def convert_task(rng: random.Random) -> dict[str, Any]:
    while True:  # a pair whose answer is neither tiny nor huge, so 2 decimals decide it
        dimension = rng.choice(("length", "mass", "time"))
        units = [u for u, (dim, _) in UNITS.items() if dim == dimension]
        source, target = rng.sample(units, 2)
        value = rng.randint(1, 40) / rng.choice((1, 2))
        answer = round(value * UNITS[source][1] / UNITS[target][1], 6)
        if 1 <= answer <= 100_000:
            return {"question": f"Convert {format_number(value)} {source} to {target}.", "answer": answer}


def shopping_task(rng: random.Random) -> dict[str, Any]:
    prices = {item: float(rng.randint(1, 9)) for item in ITEMS}
    first, second = rng.sample(ITEMS, 2)
    n1, n2 = rng.randint(2, 6), rng.randint(2, 6)
    question = f"Using the price tool: what do {n1} {first}s and {n2} {second}s cost in total?"
    return {"question": question, "answer": n1 * prices[first] + n2 * prices[second], "prices": prices}
