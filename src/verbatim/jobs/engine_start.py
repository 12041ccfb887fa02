"""An engine started for a run and closed however the run ends, its start shown on the console."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console

from verbatim.engine.logprobs_mode import unchecked_logprobs
from verbatim.engine.reaper import Reaper, forget_engine, record_engine
from verbatim.engine.start_log import start_logged

T = TypeVar("T")
ENGINE_LOG = "engine.log"
"""What the bundled engine's processes print (vLLM, Triton, NUMA and shared-memory notes), kept in the
run directory instead of the terminal."""


def on_engine_loop(run: Coroutine[Any, Any, T], engine: Any | None) -> T:
    """``run`` to its end on the event loop a given engine runs on (one a caller started on a loop of its own
    thread: the engine's calls must be made there), else on a new loop of this thread."""
    loop = getattr(engine, "loop", None)
    if loop is not None and loop.is_running() and not _running_on(loop):
        return asyncio.run_coroutine_threadsafe(run, loop).result()
    return asyncio.run(run)


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


@contextlib.asynccontextmanager
async def given(engine: Any, begin_from: Path | None = None) -> AsyncIterator[float]:
    """An engine the caller started and will close (a script's, a test's): neither started nor closed here,
    but begun (:meth:`~verbatim.engine.protocol.Engine.begin`) with ``begin_from`` as version 0, since another
    run may have left its weights and KV in it; yields 0.0, the seconds this run spent starting it."""
    if begin_from is not None:
        await engine.begin(str(begin_from), 0)
    yield 0.0


@contextlib.asynccontextmanager
async def started(engine: Any, console: Console, run_dir: Path | None = None, *,
                  begin_from: Path | None = None) -> AsyncIterator[float]:
    """The engine started (one line with the seconds so far until it answers), and closed however the
    block ends; yields the seconds the start took.

    ``begin_from``: the weights folder the run's tokens are sampled with, as version 0. A served engine (whose
    server another run may have used: its weights, its versions, its KV) is given them first, its prefix cache
    emptied (:meth:`~verbatim.engine.protocol.Engine.begin`); an engine this command starts holds them already.

    Its processes are watched by a :class:`Reaper` (they die with this command, even a SIGKILLed one)
    and recorded in ``run_dir`` while they run (a ``--resume`` refuses to start beside them). What a
    bundled engine prints goes to ``run_dir/engine.log``. A served replica whose logprob mode could not be
    checked is named on a ``warning:`` line."""
    log = run_dir / ENGINE_LOG if run_dir is not None and _local(engine) else None
    began = time.perf_counter()
    with Reaper() as reaper:
        try:
            await _start_showing_progress(engine, console, log)
            for line in unchecked_logprobs(engine):
                console.print(f"warning: {line}; μ is taken to be the sampling distribution's")
            reaper.note()
            if begin_from is not None and not _local(engine):
                await engine.begin(str(begin_from), 0)
            if run_dir is not None and log is not None:  # a local engine: its processes are ours
                record_engine(run_dir, skip=reaper.pids())
            yield time.perf_counter() - began
        finally:
            close = getattr(engine, "aclose", None)
            if close is not None:
                await close()
            else:
                engine.close()
            if run_dir is not None:
                forget_engine(run_dir)


def _local(engine: Any) -> bool:
    """An engine whose processes are this command's children (not a server reached over HTTP)."""
    return not hasattr(engine, "url") and not hasattr(engine, "replicas")


async def _start_showing_progress(engine: Any, console: Console, log: Path | None) -> None:
    where = f" (its output: {log})" if log is not None else ""
    with console.status(f"starting engine…{where}") as status:
        began = time.perf_counter()

        async def tick() -> None:
            while True:
                await asyncio.sleep(1)
                status.update(f"starting engine… {time.perf_counter() - began:.0f} s{where}")

        ticker = asyncio.ensure_future(tick())
        try:
            await start_logged(engine, log)
        finally:
            ticker.cancel()
