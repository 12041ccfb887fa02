"""``guess``: find a secret whole number with higher/lower feedback over several turns.

Reward 1.0 on the turn the model names the number, 0 if it runs out of guesses.
A reply without a number costs a guess and gets a reminder, never an exception.

The guess is the first number of a reply, so the game's own text writes no number but the range's
bounds: guess counts are words ("three guesses", "two guesses left"). A policy that echoes the prompt
would otherwise be guessing its counter (3, 2, 1 whatever the feedback), a reward it can learn
without playing; an echo of the range names only its low bound.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from pydantic import Field, model_validator

from verbatim.datamodel import Message
from verbatim.envs.answers import first_number
from verbatim.envs.base import Reset, StepResult
from verbatim.envs.held_out import SHARE
from verbatim.envs.taskfile import TaskSpec, parse_task

SYSTEM = "You are playing a guessing game. Reply with one whole number only."


class GuessTask(TaskSpec):
    target: int
    low: int = 1
    high: int = 50
    max_guesses: int = Field(default=6, ge=1, le=100)

    @model_validator(mode="after")
    def _target_in_range(self) -> GuessTask:
        if not self.low <= self.target <= self.high:
            raise ValueError(f"target {self.target} is outside {self.low}..{self.high}")
        return self


class GuessEnv:
    """One game: the opening names the range; each step reads the first number in the reply."""

    name = "guess"

    def __init__(self) -> None:
        self.task: GuessTask | None = None
        self.guesses = 0

    def reset(self, task: dict[str, Any], seed: int) -> Reset:
        self.task = parse_task(GuessTask, task, self.name)
        self.guesses = 0
        t = self.task
        opening = (f"I picked a whole number from {t.low} to {t.high}. Guess it! "
                   f"You have {_count(t.max_guesses)}. After each guess I say higher or lower.")
        return Reset(messages=(Message(role="system", content=SYSTEM), Message(role="user", content=opening)))

    def step(self, message: Message) -> StepResult:
        if self.task is None:
            raise RuntimeError("GuessEnv.step before reset")
        t = self.task
        self.guesses += 1
        left = t.max_guesses - self.guesses
        number = first_number(message.content)
        guess = int(number) if number is not None and number == int(number) else None
        info = {"guesses": self.guesses, "guess": guess, "target": t.target}
        if guess == t.target:
            return self._reply(f"Correct! The number was {t.target}.", 1.0, True, info | {"solved": True})
        if left <= 0:
            return self._reply(f"Out of guesses. The number was {t.target}.", 0.0, True, info | {"solved": False})
        return self._reply(f"{self._hint(guess)} {_left(left)}", 0.0, False, info | {"solved": False})

    def _hint(self, guess: int | None) -> str:
        t = self.task
        if guess is None:
            return f"Reply with one whole number from {t.low} to {t.high}."
        if not t.low <= guess <= t.high:
            return f"{guess} is outside {t.low} to {t.high}."
        return "Higher." if guess < t.target else "Lower."

    @staticmethod
    def _reply(text: str, reward: float, done: bool, info: dict[str, Any]) -> StepResult:
        return StepResult(messages=(Message(role="user", content=text),), reward=reward, done=done, info=info)


def _left(count: int) -> str:
    text = _count(count)
    return f"{text[0].upper()}{text[1:]} left."


_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen").split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()


def in_words(n: int) -> str:
    """``n`` (0..100) in English words: ``42`` → ``forty-two``."""
    if not 0 <= n <= 100:
        raise ValueError(f"{n} is outside 0..100")
    if n == 100:
        return "one hundred"
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens - 2] + (f"-{_ONES[ones]}" if ones else "")


def _count(n: int) -> str:
    return f"{in_words(n)} guess" + ("" if n == 1 else "es")


class GuessFactory:
    """Games over ``low..high`` with ``max_guesses`` tries; targets drawn from the seed."""

    name = "guess"

    def __init__(self, low: int = 1, high: int = 50, max_guesses: int = 6) -> None:
        parse_task(GuessTask, {"target": low, "low": low, "high": high, "max_guesses": max_guesses}, self.name)
        self.low, self.high, self.max_guesses = low, high, max_guesses

    def make(self) -> GuessEnv:
        return GuessEnv()

    def turns_needed(self, task: dict[str, Any]) -> int:
        """One model turn per guess."""
        return parse_task(GuessTask, task, self.name).max_guesses

    def held_out(self, task: dict[str, Any]) -> bool:
        """Held out from training for evaluation (envs/held_out.py): one target in five, the third of every five
        from the range's low end (1..5 holds out 3; 1..50 holds out 3, 8, …, 48)."""
        t = parse_task(GuessTask, task, self.name)
        return (t.target - t.low) % SHARE == 2

    def tasks(self, count: int, seed: int) -> Sequence[dict[str, Any]]:
        rng = random.Random(f"guess:{seed}")
        return [{"id": f"guess-{seed}-{i}", "target": rng.randint(self.low, self.high), "low": self.low,
                 "high": self.high, "max_guesses": self.max_guesses} for i in range(count)]
