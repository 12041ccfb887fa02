"""`verbatim ARGS` in a process of its own, with this folder on PYTHONPATH (for test envs like graded_env.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def cli(*args: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``launcher``: what runs the CLI's module, e.g. torchrun's ``("-m", "torch.distributed.run", ...)``."""
    tests = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, *launcher, "-m", "verbatim.cli", *args], capture_output=True, text=True,
                          timeout=1200, env=env)
