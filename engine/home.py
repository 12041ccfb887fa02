"""Where verbatim keeps its files: ``$VERBATIM_HOME`` or the user's cache dir."""

from __future__ import annotations

import os
from pathlib import Path


def verbatim_home() -> Path:
    """``$VERBATIM_HOME``, else ``$XDG_CACHE_HOME/verbatim``, else ``~/.cache/verbatim``."""
    explicit = os.environ.get("VERBATIM_HOME")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "verbatim"
