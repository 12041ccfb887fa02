"""Writing the bench render table into its marked section of a document, leaving the rest alone."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from verbatim.bench import docsection

SECTION = "bench-render"
LIBRARIES = ("transformers", "tokenizers")


def section_text(renderer: str, template: str, command: str, table: str) -> str:
    today = dt.date.today().isoformat()
    return (f"Per-turn time to build the next prompt of a conversation with `{renderer}` ({template}): "
            "`Renderer.bridge` appends only the new user message to the token history it holds; a re-rendering "
            "harness calls `apply_chat_template(..., tokenize=True)` on the whole conversation every turn. "
            "Median of repeated runs; the re-render column grows with the history, the bridge column does not.\n\n"
            f"Measured {today} with `{command}`.\n\n"
            f"{table}")


def write_section(path: str | Path, renderer: str, template: str, command: str, table: str,
                  *, machine_line: str | None = None) -> None:
    """Replace the ``bench-render`` section of ``path``; everything outside its markers stays byte-identical."""
    docsection.write_section(path, SECTION, section_text(renderer, template, command, table),
                             libraries=LIBRARIES, machine_line=machine_line)
