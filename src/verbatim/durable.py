"""Durable writes, shared by every layer that writes files: a file or folder on disk before we go on.

``write_atomic(path, write)`` writes through ``write(tmp)`` to a temporary name beside ``path``,
fsyncs it, renames it over ``path`` and fsyncs the folder: a reader (or a process killed at any
point) sees the old file or the new one, never half of one. The temporary name starts with
``prefix`` so that readers of a folder can skip leftovers of a killed writer. ``staged_folder``
does the same for a whole folder (a model folder written file by file).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def fsync_file(path: str | os.PathLike[str]) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[Path], Any], prefix: str = ".tmp-") -> None:
    """``write(tmp)``, fsync, rename over ``path``, fsync the folder; the temporary file goes on any failure."""
    tmp = path.with_name(f"{prefix}{os.getpid()}-{path.name}")
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def staged_folder(target: Path, prefix: str) -> Iterator[Path]:
    """A fresh folder beside ``target`` (readable by others) to write into; when the block ends without
    an error it replaces ``target`` whole, otherwise it is removed and ``target`` stays as it was."""
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the folder from other users
        yield staging
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
