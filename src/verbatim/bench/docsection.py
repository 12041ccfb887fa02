"""Marked sections of a Markdown document, rewritten in place by the benchmarks.

A section is the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; a
benchmark replaces only its own section and leaves the prose around it alone.
"""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_section(text: str, name: str, body: str, *, heading: str = "", intro: str = "") -> str:
    """``text`` with section ``name`` holding ``body``; appended (with heading and intro) when absent."""
    begin, end = markers(name)
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text.split(begin, 1)[1]:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    parts = [p for p in (heading, intro, block) if p]
    return text.rstrip("\n") + "\n\n" + "\n\n".join(parts) + "\n"


def write_section(doc: Path, name: str, body: str, *, heading: str = "", intro: str = "") -> None:
    """Rewrite section ``name`` of ``doc`` (created as ``# Benchmarks`` if missing)."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    doc.write_text(replace_section(text, name, body, heading=heading, intro=intro))
