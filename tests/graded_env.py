"""A one-turn env whose reward is graded by the reply's length: rewards of a group almost surely differ,
so a training step on it always has advantages to learn from (tests that need the weights to move)."""

from __future__ import annotations

from typing import Any

from verbatim.datamodel import Message
from verbatim.envs.base import Reset, StepResult


class GradedEnv:
    name = "graded"

    def reset(self, task: dict[str, Any], seed: int) -> Reset:
        return Reset(messages=(Message(role="user", content=f"Say something about the number {task['n']}."),))

    def step(self, message: Message) -> StepResult:
        return StepResult(reward=(len(message.content) % 11) / 10, done=True)


class GradedFactory:
    """``--env graded_env:GradedFactory`` (with this folder on PYTHONPATH)."""

    name = "graded"

    def make(self) -> GradedEnv:
        return GradedEnv()

    def tasks(self, count: int, seed: int) -> list[dict[str, Any]]:
        return [{"id": f"graded-{seed}-{i}", "n": seed + i} for i in range(count)]


class JudgedEnv(GradedEnv):
    """The graded env that also says whether a reply solved its task (a reward of 0.5 or more: about half the
    replies), so that pass@k has samples of both kinds (tests/test_eval_engine.py)."""

    def step(self, message: Message) -> StepResult:
        graded = super().step(message)
        return graded.model_copy(update={"info": {"solved": graded.reward >= 0.5}})


class JudgedFactory(GradedFactory):
    """``--env graded_env:JudgedFactory``."""

    name = "judged"

    def make(self) -> JudgedEnv:
        return JudgedEnv()


class TwoTurnGradedEnv(GradedEnv):
    """The graded env over two turns: the first reply gets a follow-up question, the second is graded. The second
    turn's prompt is the first's history, read from the prefix cache (tests/test_routing_engine.py)."""

    def __init__(self) -> None:
        self.turns = 0

    def step(self, message: Message) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            return StepResult(reward=0.0, done=False, messages=(Message(role="user", content="Now say it again, in "
                                                                        "other words, and a little longer."),))
        return super().step(message)


class TwoTurnGradedFactory(GradedFactory):
    """``--env graded_env:TwoTurnGradedFactory``."""

    def make(self) -> TwoTurnGradedEnv:
        return TwoTurnGradedEnv()
