"""Marked sections of a Markdown document, rewritten in place by the benchmarks.

A section is the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; a
benchmark replaces only its own section and leaves the prose around it alone. Every
section a benchmark writes ends with the machine it ran on, detected
(:mod:`verbatim.bench.machine`). The document is named by the user (``--write PATH``)
and must already hold the section's two markers: :func:`require_section` says so before
any measuring starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from verbatim.bench import machine
from verbatim.errors import InputError


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def has_section(text: str, name: str) -> bool:
    begin, end = markers(name)
    return begin in text and end in text.split(begin, 1)[1]


def require_section(doc: str | Path, name: str) -> Path:
    """``doc`` as a path, once it is known to exist and hold section ``name``; else a one-line InputError."""
    path = Path(doc)
    begin, end = markers(name)
    if not path.is_file():
        raise InputError(f"--write {path}: no such file",
                         hint=f"name an existing markdown file holding the lines {begin} and {end}")
    if not has_section(path.read_text(encoding="utf-8"), name):
        raise InputError(f"--write {path}: no {begin} … {end} section",
                         hint="add those two lines where the table should go, then rerun")
    return path


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with section ``name`` holding ``body``; everything outside the markers unchanged."""
    if not has_section(text, name):
        begin, end = markers(name)
        raise InputError(f"no {begin} … {end} section to replace")
    begin, end = markers(name)
    head, rest = text.split(begin, 1)
    return head + f"{begin}\n{body}\n{end}" + rest.split(end, 1)[1]


def with_provenance(body: str, machine_line: str) -> str:
    """``body`` followed by the line naming the machine it was measured on."""
    return f"{body.rstrip()}\n\n{machine_line}"


def write_section(doc: str | Path, name: str, body: str, *, libraries: Sequence[str] = (),
                  machine_line: str | None = None) -> None:
    """Rewrite section ``name`` of ``doc`` with ``body`` and the detected machine (and ``libraries``' versions).

    ``machine_line`` replaces detection (tests pass a fixed one).
    """
    path = require_section(doc, name)
    line = machine_line if machine_line is not None else machine.provenance(libraries)
    text = path.read_text(encoding="utf-8")
    path.write_text(replace_section(text, name, with_provenance(body, line)), encoding="utf-8")


def command_line(name: str, **options: object) -> str:
    """``verbatim bench NAME`` as a reader would type it: options left at None or ``[]`` (or the default model) are
    left out, True is a flag, False its ``--no-`` form, and a list repeats its flag."""
    parts = [f"verbatim bench {name}"]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value == [] or (key == "model" and value == "default"):
            continue
        if value is True:
            parts.append(flag)
        elif value is False:
            parts.append("--no-" + key.replace("_", "-"))
        else:
            parts += [f"{flag} {v}" for v in (value if isinstance(value, list) else [value])]
    return " ".join(parts)
