"""Durable writes, shared by every layer that writes files: a file or folder on disk before we go on.

``write_atomic(path, write)`` writes through ``write(tmp)`` to a temporary name beside ``path``,
fsyncs it, renames it over ``path`` and fsyncs the folder: a reader (or a process killed at any
point) sees the old file or the new one, never half of one. The temporary name starts with
``prefix`` so that readers of a folder can skip leftovers of a killed writer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
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
