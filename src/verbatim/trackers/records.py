"""What a tracker is sent, as plain data: a step's numbers and its rollouts' table rows (pure functions)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from verbatim.datamodel import Rollout, Source

TABLE = "rollout_table"
"""The name a step's rollout table is logged under (``rollouts`` is the step's count of rollouts)."""
ROLLOUT_COLUMNS = ("rollout", "reward", "status", "turns", "tokens", "sampled", "text")
"""The columns of a step's rollout table."""
ROLLOUTS_SHOWN = 8
"""Rollouts a step's table shows (the first by rollout id)."""
TEXT_CHARS = 4000
"""A rollout's text is cut to this many characters (the trace keeps it all)."""


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers in ``record``, nested mappings flattened to ``outer/inner``; strings, lists, None and
    non-finite numbers are left out (a tracker's scalar charts take finite numbers only)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= scalars(value, f"{name}/")
        elif isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[name] = float(value)
    return out


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``config`` as ``outer.inner`` → text (a tracker's parameters are flat strings)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out |= flat_config(value, f"{name}.")
        else:
            out[name] = str(value)
    return out


def rollout_row(rollout: Rollout) -> dict[str, Any]:
    """One table row: the conversation as the env and the parsed replies give it (``role: content`` a line,
    cut to :data:`TEXT_CHARS`), reward, status, turns, tokens in all and sampled."""
    messages = rollout.info.get("messages") or []
    text = "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in messages if isinstance(m, dict))
    if len(text) > TEXT_CHARS:
        text = text[:TEXT_CHARS] + " …"
    return {"rollout": rollout.rollout_id, "reward": rollout.reward, "status": rollout.status,
            "turns": len(rollout.turns), "tokens": len(rollout.tokens),
            "sampled": int((rollout.tokens.source == Source.MODEL).sum()), "text": text}


def table_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """Rows as lists in :data:`ROLLOUT_COLUMNS` order, the first :data:`ROLLOUTS_SHOWN` by rollout id."""
    chosen = sorted(rows, key=lambda row: row["rollout"])[:ROLLOUTS_SHOWN]
    return [[row[column] for column in ROLLOUT_COLUMNS] for row in chosen]


def markdown_table(rows: list[list[Any]]) -> str:
    """The rows as a Markdown table (TensorBoard's text plugin renders it); newlines in text as ``<br>``."""
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")
    lines = ["| " + " | ".join(ROLLOUT_COLUMNS) + " |", "|" + "---|" * len(ROLLOUT_COLUMNS)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
