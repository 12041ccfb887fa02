"""A virtualenv that holds only what ``make demo``'s holds, without installing anything.

The test virtualenv holds every extra (trackers, plotting, the test tools). :func:`fenced_python` makes a bare
virtualenv whose one path file names a folder of links to exactly the distributions that ``pip install
'verbatim-rl[EXTRAS]'`` installs (its requirements followed transitively, with their extras and markers), plus
those installed ``--no-deps`` beside it, and this checkout's ``src``. A command that works only because the
test env has more fails there as it would in the demo's: ``No module named …``; ``importlib.metadata`` and
``find_spec`` see the same set, and so does every process it starts (vLLM's engine processes).
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

SRC = Path(__file__).resolve().parent.parent / "src"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_by(root: str, extras: set[str]) -> dict[str, metadata.Distribution]:
    """``root`` with ``extras`` and every distribution it requires, transitively, by normalized name (those
    present in this environment: one for another platform is skipped)."""
    found: dict[str, metadata.Distribution] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(root, frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        key = _norm(dist.metadata["Name"])
        if (key, wanted) in seen:
            continue
        seen.add((key, wanted))
        found[key] = dist
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ({""} | set(wanted))):
                todo.append((req.name, frozenset(req.extras)))
    return found


def _tops(dist: metadata.Distribution) -> set[str]:
    """The entries of site-packages that ``dist`` installed (its packages, modules, libraries, dist-info)."""
    tops = set()
    for file in dist.files or ():
        first = file.parts[0]
        if first not in ("..", "__pycache__") and not first.endswith(".pth") and not first.startswith("__editable__"):
            tops.add(first)
    return tops


def fenced_python(root: Path, fence: dict[str, str]) -> Path:
    """The python of a new virtualenv under ``root`` that imports only what ``fence`` installs:
    ``VERBATIM_FENCE_EXTRAS`` (``cpu,report``) and ``VERBATIM_FENCE_ALONE`` (names installed ``--no-deps``)."""
    dists = installed_by("verbatim-rl", {e for e in fence["VERBATIM_FENCE_EXTRAS"].split(",") if e})
    for name in fence.get("VERBATIM_FENCE_ALONE", "").split():
        dists[_norm(name)] = metadata.distribution(name)
    links = root / "site"
    links.mkdir(parents=True)
    for dist in dists.values():
        base = Path(dist.locate_file(""))
        for top in _tops(dist):
            if (base / top).exists() and not (links / top).exists():
                (links / top).symlink_to(base / top)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_fence.pth").write_text(f"{SRC}\n{links}\n")
    return python
