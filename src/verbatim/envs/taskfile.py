"""Tasks as data: JSONL task files and the typed task each built-in env reads.

A task is a JSON object; an env validates it with its own :class:`TaskSpec`
subclass in ``reset``, so a typo in a task file fails with a one-line error
that names the env and the field instead of surfacing mid-episode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from verbatim.datamodel import Frozen
from verbatim.durable import strict_loads
from verbatim.errors import InputError


class TaskSpec(Frozen):
    """Base of the built-in envs' task types; ``id`` is an optional label carried through."""

    id: str | int | None = None


Spec = TypeVar("Spec", bound=TaskSpec)


def parse_task(spec: type[Spec], task: dict[str, Any], env_name: str) -> Spec:
    """``task`` validated as ``spec``; a bad task raises :class:`InputError` naming the field."""
    if isinstance(task, spec):
        return task
    if not isinstance(task, dict):
        raise InputError(f"{env_name} task must be a JSON object, got {type(task).__name__}")
    try:
        return spec.model_validate(task)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "task"
        raise InputError(f"{env_name} task: {where}: {first['msg']}",
                         hint=f"fields: {', '.join(spec.model_fields)}") from None


def load_tasks(path: str | Path) -> list[dict[str, Any]]:
    """Every task (one JSON object per line) in a JSONL file; blank lines are skipped.

    Malformed JSON, a line that is not an object, a missing or empty file raise
    :class:`InputError` naming the file and line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"task file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read task file {path}: {exc}") from None
    tasks = [_task_line(path, number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not tasks:
        raise InputError(f"task file {path} has no tasks", hint="write one JSON object per line")
    return tasks


def _task_line(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        value = strict_loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path.name} line {number}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # NaN or Infinity
        raise InputError(f"{path.name} line {number}: {exc}") from None
    except RecursionError:
        raise InputError(f"{path.name} line {number}: JSON nested too deep") from None
    if not isinstance(value, dict):
        raise InputError(f"{path.name} line {number}: a task must be a JSON object, got {type(value).__name__}")
    return value
