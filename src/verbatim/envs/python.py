"""``python``: the model writes a program that prints an answer; it runs in the sandbox.

The code is the first fenced ```python (or bare ```) block of the reply, else
the whole reply. Its stdout, stderr and exit status (or why it was killed) come
back as a user message. Reward 1.0 when the last non-empty line of stdout
equals the task's ``expected`` text (whitespace-normalised; ``info["solved"]``); the model gets
``max_attempts`` tries.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from verbatim.datamodel import Message
from verbatim.envs.base import Reset, StepResult
from verbatim.envs.held_out import hashed_share
from verbatim.envs.sandbox import SandboxLimits, run_python
from verbatim.envs.taskfile import TaskSpec, parse_task

SYSTEM = ("Write a short Python program that prints the answer. "
          "Put the code in a ```python block. You will see what it prints.")
_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


class PythonTask(TaskSpec):
    prompt: str
    expected: str
    kind: str = "custom"
    max_attempts: int = Field(default=2, ge=1, le=20)


def extract_code(text: str) -> str:
    """The first fenced code block of ``text``, else ``text`` itself (stripped)."""
    match = _FENCE.search(text)
    return (match.group(1) if match else text).strip()


def last_line(text: str) -> str:
    lines = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class PythonEnv:
    """Each step runs the reply's code once; the observation is the sandbox's report."""

    name = "python"

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.task: PythonTask | None = None
        self.attempts = 0

    def reset(self, task: dict[str, Any], seed: int) -> Reset:
        self.task = parse_task(PythonTask, task, self.name)
        self.attempts = 0
        return Reset(messages=(Message(role="system", content=SYSTEM), Message(role="user", content=self.task.prompt)))

    def step(self, message: Message) -> StepResult:
        if self.task is None:
            raise RuntimeError("PythonEnv.step before reset")
        self.attempts += 1
        done_trying = self.attempts >= self.task.max_attempts
        code = extract_code(message.content)
        if not code:
            text = "No code found. Write your program in a ```python block."
            return StepResult(messages=(Message(role="user", content=text),), done=done_trying,
                              info={"attempts": self.attempts, "correct": False, "solved": False})
        result = run_python(code, self.limits)
        correct = result.ok and last_line(result.stdout) == " ".join(self.task.expected.split())
        text = result.observation()
        if not correct and not done_trying:
            text += "\nThat is not the expected answer. Fix the program and try again."
        info = {"attempts": self.attempts, "correct": correct, "solved": correct, "exit_code": result.exit_code,
                "killed": result.killed, "wall_s": result.wall_s}
        return StepResult(messages=(Message(role="user", content=text),), reward=1.0 if correct else 0.0,
                          done=correct or done_trying, info=info)


class PythonFactory:
    """Seeded small problems (sums, sorting, counting, factorials, extremes) with exact expected output."""

    name = "python"

    def __init__(self, max_attempts: int = 2, cpu_seconds: int = 2, wall_seconds: float = 5.0,
                 memory_mib: int = 512) -> None:
        self.max_attempts = max_attempts
        self.limits = SandboxLimits(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds,
                                    memory_bytes=memory_mib * 2**20)

    def make(self) -> PythonEnv:
        return PythonEnv(self.limits)

    def turns_needed(self, task: dict[str, Any]) -> int:
        """One model turn per attempt."""
        return parse_task(PythonTask, task, self.name).max_attempts

    def held_out(self, task: dict[str, Any]) -> bool:
        """Held out from training for evaluation (envs/held_out.py): one task in five by a hash of its content."""
        return hashed_share(task)

    def tasks(self, count: int, seed: int) -> Sequence[dict[str, Any]]:
        rng = random.Random(f"python:{seed}")
        makers = (sum_task, sort_task, count_task, factorial_task, extremes_task)
        out = []
        for i in range(count):
            maker = makers[i % len(makers)]
            out.append({"id": f"python-{seed}-{i}", "kind": maker.__name__.removesuffix("_task"), **maker(rng),
                        "max_attempts": self.max_attempts})
        return out


def sum_task(rng: random.Random) -> dict[str, str]:
    low, high = rng.randint(1, 50), rng.randint(100, 999)
    return {"prompt": f"Print the sum of all whole numbers from {low} to {high}, inclusive.",
            "expected": str(sum(range(low, high + 1)))}


def sort_task(rng: random.Random) -> dict[str, str]:
    values = rng.sample(range(1, 100), rng.randint(5, 8))
    return {"prompt": f"Print the list {values} sorted from smallest to largest, as a Python list.",
            "expected": str(sorted(values))}


def count_task(rng: random.Random) -> dict[str, str]:
    letter = rng.choice("aeiou")
    text = "".join(rng.choice("abcdeiou") for _ in range(rng.randint(20, 40)))
    return {"prompt": f"Print how many times the letter '{letter}' appears in the string '{text}'.",
            "expected": str(text.count(letter))}


def factorial_task(rng: random.Random) -> dict[str, str]:
    n = rng.randint(8, 20)
    value = 1
    for k in range(2, n + 1):
        value *= k
    return {"prompt": f"Print the factorial of {n}.", "expected": str(value)}


def extremes_task(rng: random.Random) -> dict[str, str]:
    values = [rng.randint(-500, 500) for _ in range(rng.randint(6, 10))]
    return {"prompt": f"Print the product of the largest and the smallest number in {values}.",
            "expected": str(max(values) * min(values))}
