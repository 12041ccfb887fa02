"""Durable writes, shared by every layer that writes files: a file or folder on disk before we go on.

``write_atomic(path, write)`` writes through ``write(tmp)`` to a temporary name beside ``path``,
fsyncs it, renames it over ``path`` and fsyncs the folder: a reader (or a process killed at any
point) sees the old file or the new one, never half of one. The temporary name starts with
``prefix`` so that readers of a folder can skip leftovers of a killed writer. ``staged_folder``
does the same for a whole folder (a model folder written file by file).

``strict_json(value)`` is the JSON text every file verbatim writes holds: strict JSON, which has no
NaN or Infinity, so a non-finite float is written as null.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
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


def io_reason(exc: BaseException) -> str:
    """The OS's words for a failed write: strerror of the OSError behind it, else the error's first line."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    quoted = re.search(r'message: "([^"]+)"', text)  # safetensors' Rust io::Error, e.g. StorageFull
    if quoted:
        return quoted.group(1)
    lines = text.strip().splitlines()
    return lines[0] if lines else type(exc).__name__


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


def strict_json(value: Any, **dumps: Any) -> str:
    """``json.dumps(value, **dumps)`` as strict JSON: NaN, Infinity and -Infinity (which ``json.dumps``
    writes by default and a strict parser refuses) are written as null; what JSON cannot hold at all
    still raises (``allow_nan=False``)."""
    return json.dumps(finite(value), allow_nan=False, **dumps)


def strict_loads(text: str | bytes) -> Any:
    """``json.loads`` that refuses NaN, Infinity and -Infinity (Python's reader takes them; JSON has no such
    numbers) with a ``ValueError`` naming the token."""
    return json.loads(text, parse_constant=_refuse_constant)


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON number (write a finite number or null)")


def finite(value: Any) -> Any:
    """``value`` with every non-finite float in it (in dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value
