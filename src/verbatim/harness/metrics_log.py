"""A training run's ``metrics.jsonl``: one JSON object per trainer step, appended as the run goes.

Each step's record (``step``, ``version``, ``reward_mean``, ``success_rate``,
``mismatch_mean_abs``, ``cache_hit_rate``, and any others) is one line, written with one
``write``, flushed and fsynced. A writer killed mid-line leaves a torn last line: reading
skips it and the next append cuts it off first. On ``--resume`` the loop rewrites the file
(atomically) without the lines of steps that were never checkpointed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from verbatim.durable import strict_json, write_atomic
from verbatim.errors import InputError, TraceError, TraceFormatError

METRICS_FILE = "metrics.jsonl"


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS_FILE


def append_metrics(run_dir: str | Path, record: dict[str, Any]) -> None:
    """Append one step's record as one line (flushed and fsynced); a torn last line is cut off first."""
    path = metrics_path(run_dir)
    line = _line(record)
    try:
        with open(path, "ab+") as handle:
            _cut_torn_tail(handle)
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise TraceError(f"cannot append to {path}: {exc.strerror or exc}") from exc


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every complete record, in file order; a torn last line (a killed writer) is skipped."""
    path = metrics_path(run_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{run_dir} has no {METRICS_FILE}: it is not a training run (verbatim train --out …)") \
            from None
    except NotADirectoryError:
        raise InputError(f"{run_dir} is not a directory", hint="pass the run directory 'verbatim train --out' "
                         "wrote") from None
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from exc
    lines = data.split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline
    records = [_record(path, number, text) for number, text in enumerate(lines, start=1) if text.strip()]
    tail = _parsed(torn)
    if tail is not None:  # a whole record that lost only its newline
        records.append(tail)
    return records


def rewrite_metrics(run_dir: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """Replace metrics.jsonl with these records at once (temp file, fsync, rename): old or new, never half."""
    path = metrics_path(run_dir)
    data = b"".join(_line(record) for record in records)
    try:
        write_atomic(path, lambda tmp: tmp.write_bytes(data))  # the mode of every run file, not mkstemp's 0600
    except OSError as exc:
        raise TraceError(f"cannot rewrite {path}: {exc.strerror or exc}; it is unchanged") from exc


def _line(record: dict[str, Any]) -> bytes:
    if not isinstance(record, dict):
        raise InputError(f"a metrics record is a dict, not {type(record).__name__}")
    try:
        return (strict_json(record, separators=(",", ":")) + "\n").encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise InputError(f"metrics record of step {record.get('step')} is not JSON data: {exc}") from exc


def _record(path: Path, number: int, text: bytes) -> dict[str, Any]:
    record = _parsed(text)
    if record is None:
        raise TraceFormatError(f"{path} line {number} is not a JSON object: the file was edited or damaged",
                               hint="delete that line or restore the file: each line is one step's record")
    return record


def _parsed(text: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _cut_torn_tail(handle: Any) -> None:
    """End the file (opened ``ab+``) with a newline: a torn last line goes, a whole record keeps its place."""
    end = handle.seek(0, os.SEEK_END)
    if end == 0:
        return
    handle.seek(end - 1)
    if handle.read(1) == b"\n":
        return
    start = _last_line_start(handle, end)
    handle.seek(start)
    if _parsed(handle.read(end - start)) is not None:
        handle.write(b"\n")
    else:
        handle.truncate(start)


def _last_line_start(handle: Any, end: int) -> int:
    position = end
    while position > 0:
        start = max(0, position - 65536)
        handle.seek(start)
        newline = handle.read(position - start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        position = start
    return 0
