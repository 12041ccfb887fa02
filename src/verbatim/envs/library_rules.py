"""What the adapters of environment libraries share: the reply as text, and what they refuse before they play.

An environment that calls a language model itself (a judge, a game master, an opponent) would put a second
policy inside the rollout; one that needs the network cannot run here or in CI and changes under the trace.
Neither is run half-way: before the environment's module is imported (importing some of them already reaches
for the network), the adapter reads its source, its folder and the library modules they import, for the
calls that give them away, and refuses the environment with the reason and the file.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path
from typing import Any

from verbatim.datamodel import Message
from verbatim.errors import InputError

CALLS_A_MODEL = ("OpenRouterAgent", "import openai", "from openai", "import anthropic", "from anthropic", "litellm",
                 "jury")
NEEDS_THE_NETWORK = ("nltk.download", "import requests", "from requests", "urllib.request", "aiohttp", "httpx.",
                     "websockets")
MOST_FILES = 200
"""Files read for one environment at most (its folder and the library modules reached from it)."""


def reply_text(message: Message) -> str:
    """The model's reply as a text environment reads it: its content, then each tool call as the model wrote
    it (reasoning is left out, as the parser split it off)."""
    return message.content + "".join(call.raw or "" for call in message.tool_calls)


def entry_name(entry: Any) -> str:
    """``package.module:Class`` of a registry's entry point, given as that string or as the class."""
    return entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"


def refuse_unfit(library_root: Path, entry_point: str, library: str, env_id: str) -> None:
    """:class:`InputError` when the code behind ``entry_point`` (``package.module:Class``, a module of the
    library installed under ``library_root``) calls a model or needs the network."""
    for path in sources(library_root, entry_point.partition(":")[0]):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for markers, why in ((CALLS_A_MODEL, "calls a language model itself"),
                             (NEEDS_THE_NETWORK, "needs the network")):
            found = next((m for m in markers if m in text), None)
            if found is not None:
                shown = path.relative_to(library_root) if path.is_relative_to(library_root) else path
                raise InputError(f"{library} env {env_id!r} {why} ({found!r} in {shown}); verbatim plays only "
                                 "environments whose every token comes from the policy or the environment's own code",
                                 hint="pick another env, or wrap it as your own Env class")


def sources(root: Path, module: str) -> list[Path]:
    """The module's file, the other files of its folder, and the library's modules they import, breadth first.

    Through a package's ``__init__`` only the names imported from it are followed (``from lib.tools import
    A`` reads where ``A`` comes from, not every tool); the library's top-level package is never read (it
    imports everything)."""
    first = _module_file(root, module)
    if first is None:
        return []
    top = module.split(".")[0]
    todo: list[tuple[Path, frozenset[str] | None]] = [(first, None)]
    todo += [(p, None) for p in sorted(first.parent.glob("*.py")) if p != first]
    seen: list[Path] = []
    while todo and len(seen) < MOST_FILES:
        path, names = todo.pop(0)
        if path in seen:
            continue
        seen.append(path)
        todo.extend(item for item in _imported(root, top, path, names) if item[0] not in seen)
    return seen


def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(root: Path, top: str, path: Path,
              names: frozenset[str] | None) -> list[tuple[Path, frozenset[str] | None]]:
    """The library files ``path`` imports from (only those binding ``names``, when given) and what it takes."""
    try:
        with warnings.catch_warnings():  # a library's own invalid escapes are not the user's concern
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    found: list[tuple[Path, frozenset[str] | None]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        taken = frozenset(alias.name for alias in node.names)
        if names is not None and not (taken & names or "*" in taken):
            continue
        if node.level:  # relative: from the file's own package
            package = path.parent
            for _ in range(node.level - 1):
                package = package.parent
            name = str(package.relative_to(root)).replace("/", ".") + (f".{node.module}" if node.module else "")
        elif node.module and node.module.startswith(f"{top}."):
            name = node.module
        else:
            continue
        wanted = taken if names is None else taken & names
        for alias in sorted(wanted):  # a submodule imported by name: `from pkg import module`
            file = _module_file(root, f"{name}.{alias}")
            if file is not None:
                found.append((file, None))
        file = _module_file(root, name)
        if file is not None and file != root / top / "__init__.py":
            found.append((file, wanted if file.name == "__init__.py" else None))
    return found
