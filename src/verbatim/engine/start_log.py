"""An engine started with its processes' output in a log file instead of the terminal.

vLLM, Triton and the CPU backend print screens of start-up notes (NUMA, shared memory, compile
caches) on file descriptor 2, from the engine core's processes as well as this one. While an engine
starts, descriptor 2 is the log: the processes it spawns inherit it and keep writing there for their
whole life, while this process gets its terminal back once the engine answers. A start that fails
names vLLM's root cause (read back from what this start appended to the log) in its one line.

``verbatim run``/``train`` keep the log in the run directory; the benchmarks in a file they name.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verbatim.engine.runtime import log_root_cause, with_root_cause
from verbatim.errors import EngineError

STARTS_ENV = "VERBATIM_ENGINE_STARTS"
"""Names a file that gets one line per vLLM engine started (:func:`note_start`); the test suite counts its
engines with it (tests/conftest.py), a user may audit a script's."""


def note_start(kind: str, model: str | os.PathLike[str]) -> None:
    """A vLLM engine starts here (``inproc``: in this process; ``served``: a ``vllm serve`` process): one line
    ``KIND PID MODEL`` appended to the file ``$VERBATIM_ENGINE_STARTS`` names; nothing when it is unset."""
    path = os.environ.get(STARTS_ENV)
    if path:
        with open(path, "a") as handle:  # one short append: whole lines from concurrent processes
            handle.write(f"{kind} {os.getpid()} {model}\n")


@contextlib.contextmanager
def stderr_into(log: Path | None) -> Iterator[None]:
    """While the block runs, file descriptor 2 appends to ``log`` (nothing changes for None)."""
    if log is None:
        yield
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(log, "ab") as handle:
            os.dup2(handle.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


async def start_logged(engine: Any, log: Path | None) -> None:
    """``engine.start()`` with its output in ``log``; a failed start's error names the log's root cause."""
    offset = log.stat().st_size if log is not None and log.exists() else 0  # a --resume appends
    with stderr_into(log):
        try:
            await engine.start()
        except EngineError as exc:  # vLLM's own words are in the log: name its root cause in the one line
            if log is None:
                raise
            sys.stderr.flush()
            message = with_root_cause(exc.message, log_root_cause(log, offset))
            raise EngineError(message, hint=exc.hint or f"the engine's traceback is in {log}") from exc
