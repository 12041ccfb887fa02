"""The ``Env`` plug point: environments speak messages, never tokens.

An environment object plays one rollout: ``reset`` gives the opening messages
(and optional tool definitions), ``step`` takes the model's parsed reply and
answers with observation messages, a reward and whether the episode is done.
The harness renders, bridges and records tokens; an env never sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import Field

from verbatim.datamodel import Frozen, Message


class StepResult(Frozen):
    """What an environment answers to one model message."""

    messages: tuple[Message, ...] = ()
    """Observation messages (user / tool) to append before the next turn."""
    reward: float = 0.0
    """Reward for this turn; the rollout's reward is the sum over turns unless the env says otherwise."""
    done: bool = False
    info: dict[str, Any] = Field(default_factory=dict)


class Reset(Frozen):
    """The opening of an episode: messages and the tool definitions the model may call."""

    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] | None = None


@runtime_checkable
class Env(Protocol):
    """One environment instance per rollout (it may keep state between steps)."""

    name: str

    def reset(self, task: dict[str, Any], seed: int) -> Reset: ...

    def step(self, message: Message) -> StepResult: ...


@runtime_checkable
class EnvFactory(Protocol):
    """Makes env instances and, for built-in envs, deterministic tasks from a seed.

    A factory may also define ``turns_needed(task) -> int``: the most model turns an episode of
    ``task`` can take (guess: its guesses). ``verbatim run`` and ``train`` use it as the default
    ``--max-turns``, so a default run is never cut before the env could finish. Where an env
    knows whether an episode succeeded it says so as ``info["solved"]`` (a bool) in each
    :class:`StepResult`; the last one is the rollout's, counted by the run summary. A factory may define
    ``held_out(task) -> bool``, a rule on a task's content: training never draws a task it holds out, and
    evaluation (``verbatim eval``, ``train --eval-every``) draws only those (envs/held_out.py).
    """

    name: str

    def make(self) -> Env: ...

    def tasks(self, count: int, seed: int) -> Sequence[dict[str, Any]]: ...
