"""Writing the bench table into its own section of docs/benchmarks.md, leaving other sections alone."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

SECTION = "## Renderers (verbatim bench render)"


def section_text(renderer: str, template: str, machine: str, table: str) -> str:
    today = dt.date.today().isoformat()
    return (f"{SECTION}\n\n"
            f"Per-turn time to build the next prompt of a conversation with `{renderer}` ({template}): "
            "`Renderer.bridge` appends only the new user message to the token history it holds; a re-rendering "
            "harness calls `apply_chat_template(..., tokenize=True)` on the whole conversation every turn. "
            "Median of repeated runs; the re-render column grows with the history, the bridge column does not.\n\n"
            f"Measured {today} on {machine} with `verbatim bench render --write docs/benchmarks.md`.\n\n"
            f"{table}\n")


def write_section(path: str | Path, renderer: str, template: str, machine: str, table: str) -> None:
    """Replace (or append) the renderers section of ``path``; other sections stay byte-identical."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    new = section_text(renderer, template, machine, table)
    if SECTION in text:
        head, rest = text.split(SECTION, 1)
        following = rest.find("\n## ")
        tail = rest[following + 1:] if following != -1 else ""
        text = head + new + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + new
    path.write_text(text, encoding="utf-8")
