"""Benchmarks start their engines the way ``verbatim run`` does, and say what they are doing.

vLLM's start-up output goes to a log file (:mod:`verbatim.engine.start_log`), never the terminal; a
long benchmark reports its stage through a ``Say`` callback (the command shows it as a status line).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from verbatim.engine.start_log import start_logged

Say = Callable[[str], None]
"""Where a benchmark reports what it is doing (one line, replaced by the next)."""


def quiet(_: str) -> None:
    """A ``Say`` that shows nothing."""


def engine_log(benchmark: str) -> Path:
    """The file a benchmark's engine writes to: one per benchmark, in the temporary folder."""
    return Path(tempfile.gettempdir()) / f"verbatim-bench-{benchmark}-engine.log"


@contextlib.asynccontextmanager
async def started(engine: Any, log: Path, say: Say = quiet, label: str = "engine") -> AsyncIterator[Any]:
    """``engine`` started with its output appended to ``log``, closed however the block ends."""
    say(f"starting {label}… (its output: {log})")
    began = time.perf_counter()
    try:
        await start_logged(engine, log)
        say(f"{label} started in {time.perf_counter() - began:.0f} s")
        yield engine
    finally:
        engine.close()
