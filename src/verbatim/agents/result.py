"""What an agent function returns: a reward, or ``{"reward": …, "solved": …, "metrics": {…}}``. Pure."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from verbatim.datamodel import Frozen

SHAPE = 'return a number or {"reward": number, "solved": bool, "metrics": {name: number}}'


class AgentResult(Frozen):
    reward: float
    solved: bool | None = None
    metrics: dict[str, float] = Field(default_factory=dict)


def read_result(value: Any) -> AgentResult:
    """The result ``value`` holds; a :class:`ValueError` says what is wrong with it (the rollout's error)."""
    if _number(value):
        return AgentResult(reward=float(value))
    if not isinstance(value, dict):
        raise ValueError(f"the agent returned {_show(value)}; {SHAPE}")
    unknown = sorted(set(value) - {"reward", "solved", "metrics"})
    if unknown:
        raise ValueError(f"the agent's result has unknown keys {unknown}; {SHAPE}")
    if not _number(value.get("reward")):
        raise ValueError(f"the agent's reward is {_show(value.get('reward'))}, not a finite number; {SHAPE}")
    solved = value.get("solved")
    if solved is not None and not isinstance(solved, bool):
        raise ValueError(f"the agent's solved is {_show(solved)}, not true or false")
    metrics = value.get("metrics") or {}
    if not isinstance(metrics, dict) or not all(isinstance(k, str) and _number(v) for k, v in metrics.items()):
        raise ValueError(f"the agent's metrics are {_show(metrics)}; give an object of finite numbers")
    return AgentResult(reward=float(value["reward"]), solved=solved,
                       metrics={k: float(v) for k, v in metrics.items()})


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
