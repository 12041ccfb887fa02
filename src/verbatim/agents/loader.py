"""Finding the user's agent: ``--agent FILE.py:FUNCTION`` or ``--agent package.module:function``.

The function takes ``(task, client)``: the task's JSON object and an OpenAI client whose base URL is the
endpoint of that one rollout (an ``openai.AsyncOpenAI`` for an ``async def``, an ``openai.OpenAI`` for a
plain function, which runs in a thread of its own). It returns the rollout's reward: a number, or
``{"reward": …, "solved": …, "metrics": {…}}`` (:mod:`verbatim.agents.result`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verbatim.errors import InputError

HINT = "give --agent FILE.py:FUNCTION or package.module:function, a function taking (task, client)"


@dataclass(frozen=True)
class AgentCall:
    """The user's agent function, and whether it is a coroutine function."""

    name: str
    function: Callable[..., Any]

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.function)


class AgentFactory:
    """What a :class:`~verbatim.harness.run.Run` plays an agent from: ``make()`` is the agent, tasks come from
    ``--tasks`` (an agent has no task generator)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.name = agent.name

    def make(self) -> Any:
        """The agent (an :class:`AgentCall`, or a :class:`~verbatim.agents.command.CommandAgent`)."""
        return self.agent

    def tasks(self, count: int, seed: int) -> Sequence[dict[str, Any]]:
        raise InputError(f"agent {self.name!r} has no task generator", hint="give a task file with --tasks FILE")


def load_agent(spec: str) -> AgentFactory:
    """The agent ``spec`` names; an :class:`InputError` says what is wrong with it."""
    where, _, name = spec.strip().rpartition(":")
    if not where or not name:
        raise InputError(f"--agent {spec!r} names no function", hint=HINT)
    module = _module_of_file(where) if where.endswith(".py") or "/" in where else _module(where)
    function = getattr(module, name, None)
    if function is None:
        raise InputError(f"--agent: {where} has no {name!r}", hint=HINT)
    if not callable(function) or inspect.isclass(function):
        raise InputError(f"--agent: {where}:{name} is not a function", hint=HINT)
    try:
        inspect.signature(function).bind(None, None)
    except TypeError:
        raise InputError(f"--agent: {where}:{name} does not take (task, client)", hint=HINT) from None
    except ValueError:  # no signature to read: the call decides
        pass
    return AgentFactory(AgentCall(name=spec.strip(), function=function))


def load_agent_command(command: str) -> AgentFactory:
    """``--agent-cmd``: the command line run once per rollout (:mod:`verbatim.agents.command`)."""
    from verbatim.agents.command import CommandAgent

    if not command.strip():
        raise InputError("--agent-cmd is empty", hint='give the command that runs your agent, e.g. "node agent.js"')
    return AgentFactory(CommandAgent(command.strip()))


def _module_of_file(where: str) -> Any:
    path = Path(where).expanduser()
    if not path.is_file():
        raise InputError(f"--agent: {path} is not a file", hint=HINT)
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"verbatim_agent_{path.stem}_{digest}"
    loaded = importlib.util.spec_from_file_location(name, path)
    if loaded is None or loaded.loader is None:
        raise InputError(f"--agent: cannot load {path} as Python", hint=HINT)
    module = importlib.util.module_from_spec(loaded)
    sys.modules[name] = module
    sys.path.insert(0, str(path.resolve().parent))  # the agent's own modules beside it
    try:
        loaded.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's module failing to import is bad input
        sys.modules.pop(name, None)
        raise InputError(f"--agent: importing {path} raised {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def _module(where: str) -> Any:
    try:
        return importlib.import_module(where)
    except Exception as exc:  # noqa: BLE001 - ImportError, or the module's own error at import
        raise InputError(f"--agent: cannot import {where!r}: {type(exc).__name__}: {exc}", hint=HINT) from None
