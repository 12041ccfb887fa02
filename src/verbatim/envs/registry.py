"""Finding environments by name: the built-ins, ``module:Class`` paths and ``verbatim.envs`` entry points.

``load_env(spec, **options)`` always returns an :class:`EnvFactory`. A spec may
name a factory class (built with ``options``), a factory instance, a function
returning a factory, or a plain :class:`Env` class, which gets a factory whose
``tasks`` asks for a task file.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

from verbatim.envs.base import Env, EnvFactory
from verbatim.envs.taskfile import load_tasks
from verbatim.errors import InputError

__all__ = ["BUILTIN_ENVS", "ENTRY_POINT_GROUP", "FALLBACK_MAX_TURNS", "default_max_turns", "env_names", "load_env",
           "load_tasks"]

ENTRY_POINT_GROUP = "verbatim.envs"

FALLBACK_MAX_TURNS = 8
"""The default ``--max-turns`` for an env whose factory has no ``turns_needed``."""

BUILTIN_ENVS: dict[str, str] = {
    "tools": "verbatim.envs.tools:ToolsFactory",
    "guess": "verbatim.envs.guess:GuessFactory",
    "longdoc": "verbatim.envs.longdoc:LongDocFactory",
    "python": "verbatim.envs.python:PythonFactory",
}


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def env_names() -> list[str]:
    """Built-in env names, then installed entry-point names."""
    return list(BUILTIN_ENVS) + sorted(set(_entry_points()) - set(BUILTIN_ENVS))


def load_env(spec: str, **options: Any) -> EnvFactory:
    """The env factory named by ``spec``; ``options`` go to the factory's constructor.

    Raises :class:`InputError` for an unknown name (with the closest names), a path
    that does not import, an object that is not an env, or options it does not take.
    """
    spec = spec.strip()
    library = _library_env(spec, options)
    if library is not None:
        return library
    target = BUILTIN_ENVS.get(spec) or _entry_points().get(spec)
    if target is None and ":" not in spec:
        raise InputError(f"unknown env {spec!r}", hint=_suggestion(spec))
    return _as_factory(_import(target or spec), options, spec)


def _library_env(spec: str, options: dict[str, Any]) -> EnvFactory | None:
    """``skyrl:ID`` and ``textarena:ID``: an environment library's env, imported only now."""
    if spec.startswith("skyrl:"):
        from verbatim.envs.skyrl_envs import SkyRLFactory

        if options:
            raise InputError("skyrl envs take their settings from each task (env_config, extras), not --env-arg")
        return SkyRLFactory(spec.removeprefix("skyrl:"))
    if spec.startswith("textarena:"):
        from verbatim.envs.textarena_games import TextArenaFactory

        return TextArenaFactory(spec.removeprefix("textarena:"), **options)
    return None


def default_max_turns(factory: EnvFactory, tasks: Sequence[dict[str, Any]]) -> int:
    """The turns every one of ``tasks`` may need (the factory's ``turns_needed``), else FALLBACK_MAX_TURNS."""
    needed = getattr(factory, "turns_needed", None)
    if not callable(needed) or not tasks:
        return FALLBACK_MAX_TURNS
    turns = []
    for index, task in enumerate(tasks):
        try:
            turns.append(int(needed(task)))
        except InputError as exc:  # a task the env refuses, named as the run's preflight names it
            raise InputError(f"task {index}: {exc.message}", hint=exc.hint) from None
    return max(1, *turns)


def _suggestion(name: str) -> str:
    names = env_names()
    close = difflib.get_close_matches(name, names, n=2, cutoff=0.5)
    known = f"known envs: {', '.join(names)}; or give module:Class"
    return f"did you mean {' or '.join(repr(c) for c in close)}? {known}" if close else known


def _import(path: str) -> Any:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise InputError(f"env path {path!r} must look like package.module:Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputError(f"cannot import env module {module_name!r}: {exc}") from None
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise InputError(f"module {module_name!r} has no {attribute!r}",
                             hint=_close_attr(module, part))
        value = getattr(value, part)
    return value


def _close_attr(module: Any, name: str) -> str:
    close = difflib.get_close_matches(name, [n for n in dir(module) if not n.startswith("_")], n=2)
    return f"did you mean {' or '.join(close)}?" if close else "check the class name"


def _as_factory(value: Any, options: dict[str, Any], spec: str) -> EnvFactory:
    if inspect.isclass(value) and _is_factory(value):
        return _construct(value, options, spec)
    if inspect.isclass(value) and _is_env(value):
        _check_options(value, options, spec)
        return EnvClassFactory(value, options)
    if _is_factory(value) and not inspect.isclass(value):
        if options:
            raise InputError(f"env {spec!r} is a ready-made factory; it takes no options")
        return value
    if callable(value) and not inspect.isclass(value):
        made = _construct(value, options, spec)
        if _is_factory(made):
            return made
    raise InputError(f"{spec!r} is not an env",
                     hint="point at an EnvFactory (name, make, tasks) or an Env class (name, reset, step)")


def _construct(builder: Any, options: dict[str, Any], spec: str) -> Any:
    _check_options(builder, options, spec)
    return builder(**options)


def _check_options(builder: Any, options: dict[str, Any], spec: str) -> None:
    try:
        inspect.signature(builder).bind(**options)
    except TypeError as exc:
        raise InputError(f"env {spec!r} does not take these options: {exc}") from None
    except ValueError:  # no signature (builtins): let the call decide
        pass


def _is_factory(value: Any) -> bool:
    return all(callable(getattr(value, attr, None)) for attr in ("make", "tasks")) and hasattr(value, "name")


def _is_env(value: Any) -> bool:
    return all(callable(getattr(value, attr, None)) for attr in ("reset", "step"))


class EnvClassFactory:
    """A factory for a user's :class:`Env` class with no task generator: tasks come from a file."""

    def __init__(self, env_class: type[Env], options: dict[str, Any]) -> None:
        self.env_class = env_class
        self.options = options
        self.name = getattr(env_class, "name", env_class.__name__)

    def make(self) -> Env:
        return self.env_class(**self.options)

    def tasks(self, count: int, seed: int) -> Sequence[dict[str, Any]]:
        raise InputError(f"env {self.name!r} has no task generator", hint="give a task file with --tasks FILE")
