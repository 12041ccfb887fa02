"""Where verbatim finds its files: the chat templates it ships, and the folder it writes to.

* :func:`chat_templates_dir`: the official chat templates and real tokenizer files, shipped
  inside the package (``verbatim/chat_templates``, with ``SOURCES.md`` and the licences).
  ``$VERBATIM_SHARED_TEMPLATES`` names another folder of the same shape instead.
* :func:`verbatim_home`: converted models and engine caches, ``$VERBATIM_HOME`` or the
  user's cache dir.

Nothing here looks outside the package or those two variables' folders.
"""

from __future__ import annotations

import os
from pathlib import Path

from verbatim.errors import InputError

TEMPLATES_ENV = "VERBATIM_SHARED_TEMPLATES"
"""Environment variable naming a folder of templates (``*.jinja``) and ``tokenizers/`` to use instead."""

PACKAGE_TEMPLATES = Path(__file__).resolve().parent / "chat_templates"

RUN_OUTPUTS = "exports"
"""The one folder inside a run directory that a command's output file may go in (``RUN_DIR/exports/``)."""


def verbatim_home() -> Path:
    """``$VERBATIM_HOME``, else ``$XDG_CACHE_HOME/verbatim``, else ``~/.cache/verbatim``."""
    explicit = os.environ.get("VERBATIM_HOME")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "verbatim"


def chat_templates_dir() -> Path:
    """The official templates: ``$VERBATIM_SHARED_TEMPLATES`` if set, else the package's own copy."""
    explicit = os.environ.get(TEMPLATES_ENV)
    return Path(explicit).expanduser() if explicit else PACKAGE_TEMPLATES


def tokenizer_file(*parts: str) -> Path:
    """A shipped tokenizer file (``tokenizer_file("llama3", "tokenizer.model")``); one-line error if absent."""
    path = chat_templates_dir().joinpath("tokenizers", *parts)
    if not path.is_file():
        hint = (f"{TEMPLATES_ENV} points at a folder without it: unset it or fix the folder"
                if os.environ.get(TEMPLATES_ENV) else "reinstall verbatim: its package data is incomplete")
        raise InputError(f"tokenizer file {path} is missing", hint=hint)
    return path


def check_output_file(value: str | os.PathLike[str], flag: str, created: Path | None = None, *,
                      existing_ok: bool = False) -> Path:
    """Refuse, before any work, an output file that cannot be written: a folder, a missing or read-only
    parent folder, or a name the file system refuses; and an existing file unless ``existing_ok`` (the
    command's ``--force``: nothing is replaced unasked). Creates nothing. ``created`` is a folder the
    command itself will create (a run directory): a parent among its ancestors may be missing now."""
    path = Path(value).expanduser()
    if path.is_dir():
        raise InputError(f"{flag} {path} is a folder", hint="give a file name")
    if (path.exists() or path.is_symlink()) and not existing_ok:
        raise InputError(f"{flag} {path} already exists", hint="pass --force to replace it, or another name")
    parent = path.parent if str(path.parent) else Path(".")
    if any(len(part.encode()) > 255 for part in path.parts):
        raise InputError(f"{flag} {path}: a name in it is longer than the file system allows (255 bytes)")
    if not parent.is_dir() and created is not None and _among_ancestors(parent, created):
        parent = next(p for p in parent.resolve().parents if p.is_dir())
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: the folder {parent} does not exist", hint="create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: the folder {parent} is not writable")
    return path


def _among_ancestors(folder: Path, created: Path) -> bool:
    target = folder.expanduser().resolve()
    return any(target == p for p in (created.expanduser().resolve(), *created.expanduser().resolve().parents))


def enclosing_run(path: str | os.PathLike[str]) -> Path | None:
    """The nearest folder above ``path`` that is a run directory (holds a manifest.json), if any."""
    for folder in Path(path).expanduser().resolve().parents:
        if (folder / "manifest.json").is_file():
            return folder
    return None


def check_outside_run(value: str | os.PathLike[str], flag: str, hint: str = "pass a path outside the run") -> Path:
    """Refuse, before any work, an output file among a run directory's own files (where it could replace
    or be taken for one of them); the run's ``exports/`` folder is the one place inside a run it may go."""
    path = Path(value).expanduser()
    run = enclosing_run(path)
    if run is not None and not path.resolve().is_relative_to(run / RUN_OUTPUTS):
        raise InputError(f"{flag} {value} is inside the run directory {run}: an output never goes among a run's "
                         "files", hint=hint)
    return path


def check_run_dir(value: str | os.PathLike[str], flag: str = "--out") -> Path:
    """Refuse, before any work, a run directory that is an existing file or sits under one."""
    path = Path(value).expanduser()
    for folder in (path, *path.parents):
        if folder.exists() and not folder.is_dir():
            raise InputError(f"{flag} {path}: {folder} is a file, not a folder", hint="pass a folder for the run")
        if folder.exists():
            break
    return path
