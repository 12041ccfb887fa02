"""A run folder's ``config.toml``: the run's whole config as the flags ``--config`` reads.

Written from the config through its flag table (:meth:`~verbatim.jobs.flag_table.FlagTable.values`) when a
run starts or resumes, so ``verbatim train --config RUN/config.toml --out NEW`` repeats the run, and read
back through the same table by a ``--resume``, which compares the config it is given against it. Every flag
is written, defaults too; ``--resume`` is not (the file describes a run, not a way to go on with one). A
run folder written before this file existed resumes from its manifest's config.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from verbatim.durable import write_atomic
from verbatim.errors import InputError
from verbatim.jobs.flag_table import FlagTable

CONFIG_FILE = "config.toml"
NOT_RECORDED = frozenset({"resume"})


def write_config(out: Path, table: FlagTable, config: BaseModel, command: str) -> Path:
    """``out/config.toml``, replaced whole (atomically)."""
    path = Path(out) / CONFIG_FILE
    lines = [f"# The config of this run: 'verbatim {command} --config {path} --out NEW' repeats it.",
             "# Every flag of 'verbatim " + command + "', as a key (flags on the command line win over it)."]
    for key, value in table.values(config).items():
        if key in NOT_RECORDED or value is None:  # None: the flag is left out, as its default is
            continue
        lines.append(f"{key} = {toml_value(value)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path


def recorded_config(out: Path, table: FlagTable) -> Any | None:
    """The config ``out/config.toml`` records, read through ``table``; None where the folder has none (a run
    written before the file existed) or Python cannot read TOML (3.10: the manifest's config serves)."""
    path = Path(out) / CONFIG_FILE
    if not path.exists():
        return None
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        return None
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InputError(f"cannot read {path}: {exc}", hint="restore it, or resume from a copy of the run") from None
    keys = table.by_key()
    unknown = sorted(set(values) - set(keys))
    if unknown:
        raise InputError(f"{path} holds keys that are no flag of this version: {', '.join(unknown)}",
                         hint="resume with the version that wrote the run")
    try:
        return table.config(values)
    except ValidationError as exc:
        raise InputError(f"{path}: {table.refusal(exc) or exc}") from None


def toml_value(value: Any) -> str:
    """``value`` (a flag's: text, number, true/false, or a list of them) as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return _basic_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML form for a flag value of type {type(value).__name__}")


def _basic_string(text: str) -> str:
    """A TOML basic string: quotes and backslashes escaped, control characters as ``\\uXXXX``."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
