"""What an env hands back, checked before the loop uses it.

Envs are user code: ``reset`` and ``step`` may return a dict instead of a
``Reset``/``StepResult``, messages that skipped validation (``model_construct``,
duck-typed objects), a wrong role, non-string content or a reward that is not a
finite number. Each of these raises :class:`EnvOutputError` with one line that
names what is wrong, so the rollout ends as ``error`` with that reason instead
of failing later somewhere less clear (or crashing the run's trace writer).
"""

from __future__ import annotations

import json
import math
from typing import Any, get_args

from pydantic import ValidationError

from verbatim.datamodel import Message, Role
from verbatim.durable import finite
from verbatim.envs.base import Reset, StepResult
from verbatim.errors import EnvError

ROLES = frozenset(get_args(Role))
_INFO_LIMIT = 1_000_000
"""Characters of env info kept in a trace row; more is replaced by a note."""


class EnvOutputError(EnvError):
    """An env returned something the rollout loop cannot use."""


def describe_failure(exc: BaseException) -> str:
    """One line for an exception raised inside an env (validation errors name their first field)."""
    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or exc.title
        return f"built an invalid {exc.title}: {where}: {first['msg']}"
    text = " ".join(str(exc).split())
    return f"raised {type(exc).__name__}: {text[:300]}"


def checked_reset(value: Any) -> Reset:
    if not isinstance(value, Reset):
        raise EnvOutputError(f"env.reset returned {type(value).__name__}, not a Reset")
    if not value.messages:
        raise EnvOutputError("env.reset returned no messages")
    _check_messages(value.messages, "env.reset")
    if value.tools is not None and not all(isinstance(tool, dict) for tool in value.tools):
        raise EnvOutputError("env.reset: every tool definition must be a dict")
    return value


def checked_step(value: Any) -> StepResult:
    if not isinstance(value, StepResult):
        raise EnvOutputError(f"env.step returned {type(value).__name__}, not a StepResult")
    _check_messages(value.messages, "env.step")
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvOutputError(f"env.step returned the reward {reward!r}; it must be a finite number")
    if not isinstance(value.done, bool):
        raise EnvOutputError(f"env.step returned done={value.done!r}; it must be True or False")
    if not isinstance(value.info, dict):
        raise EnvOutputError(f"env.step returned info of type {type(value.info).__name__}; it must be a dict")
    return value


def _check_messages(messages: Any, what: str) -> None:
    if not isinstance(messages, (tuple, list)):
        raise EnvOutputError(f"{what} returned messages of type {type(messages).__name__}, not a sequence")
    for index, message in enumerate(messages):
        where = f"{what} message {index}"
        if not isinstance(message, Message):
            raise EnvOutputError(f"{where} is a {type(message).__name__}, not a Message")
        if message.role not in ROLES:
            raise EnvOutputError(f"{where} has the role {message.role!r}; use one of {', '.join(sorted(ROLES))}")
        if not isinstance(message.content, str):
            raise EnvOutputError(f"{where} has content of type {type(message.content).__name__}, not str")


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data that every trace format can hold.

    Anything JSON lacks becomes its ``repr``; NaN and infinities become None
    (JSON lines forbid them); cycles and oversized values become a short note.
    """
    try:
        text = json.dumps(value, default=repr, allow_nan=True)
    except (ValueError, TypeError, RecursionError) as exc:
        return {"unserialisable": f"{type(exc).__name__}: {exc}"[:300]}
    if len(text) > _INFO_LIMIT:
        return {"too_large": f"{len(text)} characters of JSON, over the {_INFO_LIMIT} kept"}
    return finite(json.loads(text))
