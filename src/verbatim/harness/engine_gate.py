"""The engine as a run's rollouts see it: calls that a stopping run can cut, failures that are counted.

A run stops for a signal or because its engine is gone. Either way the rollouts still playing
must end soon and say so: :meth:`EngineGate.cut` makes every engine call in flight (and every
later one) fail at once with :class:`~verbatim.errors.RunInterrupted`, so a rollout ends through
its normal error path and keeps every token it has; the run records it as ``interrupted``.

A request that fails after the engine's own retries ends its rollout as ``error``; that is data.
But when ``failures_to_stop`` requests in a row fail with no success in between, every request is
failing (the engine died, hangs or answers garbage), and the gate tells the run to stop rather
than play the remaining rollouts into the same wall.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from verbatim.datamodel import Completion
from verbatim.errors import InputError, RunInterrupted, VerbatimError

FAILURES_TO_STOP = 5
"""Failed requests in a row (each after its retries) that mean the engine is gone."""

ABORT_WAIT_S = 5.0
"""How long a cut call may take to hand its request back to the engine (abort, close the connection)."""


class EngineGate:
    """Wraps an engine: forwards everything, cuts ``generate`` calls on demand, counts failures."""

    def __init__(self, engine: Any, on_failing: Callable[[str], None],
                 failures_to_stop: int = FAILURES_TO_STOP) -> None:
        self.engine = engine
        self.on_failing = on_failing
        self.failures_to_stop = failures_to_stop
        self.stopping = False
        """Set when the run starts stopping: a failure from now on is an interruption, not an error
        (a terminal's Ctrl-C also reaches an in-process engine's core and stops it)."""
        self.streak = 0
        self.cut_ids: set[str] = set()
        self._cut = asyncio.Event()
        self._reason = ""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    @property
    def is_cut(self) -> bool:
        return self._cut.is_set()

    async def wait_cut(self) -> None:
        await self._cut.wait()

    def begin_stop(self, reason: str) -> None:
        """The run is stopping for ``reason``: calls go on, but a failure now means an interruption."""
        self.stopping, self._reason = True, self._reason or reason

    def cut(self, reason: str | None = None) -> None:
        """End every engine call now and refuse new ones, each with ``reason`` (or the stop's)."""
        self.begin_stop(reason or "the run is stopping")
        self._cut.set()

    async def generate(self, prompt_ids: Any, sampling: Any = None, *, session_id: str | None = None,
                       **options: Any) -> Completion:
        if self._cut.is_set():
            raise self._interrupted(session_id)
        call = asyncio.ensure_future(self.engine.generate(prompt_ids, sampling, session_id=session_id, **options))
        cut = asyncio.ensure_future(self._cut.wait())
        try:
            await asyncio.wait({call, cut}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the rollout itself was cancelled: its request goes too
            call.cancel()
            raise
        finally:
            cut.cancel()
        if not call.done():
            call.cancel()  # the engine aborts a cancelled request (vLLM) or drops its connection (HTTP)
            await asyncio.wait({call}, timeout=ABORT_WAIT_S)
            raise self._interrupted(session_id)
        return self._settled(call, session_id)

    def _settled(self, call: asyncio.Future, session_id: str | None) -> Completion:
        try:
            completion = call.result()
        except InputError:  # the engine refused this request: the rollout's problem, not the engine's
            raise
        except Exception as exc:
            if self.stopping:
                raise self._interrupted(session_id) from exc
            self._failed(exc)
            raise
        self.streak = 0
        return completion

    def _failed(self, exc: Exception) -> None:
        self.streak += 1
        if self.streak == self.failures_to_stop:
            what = exc.one_line() if isinstance(exc, VerbatimError) else f"{type(exc).__name__}: {exc}"
            self.on_failing(f"the engine failed {self.streak} requests in a row, the last with: {what}")

    def _interrupted(self, session_id: str | None) -> RunInterrupted:
        if session_id is not None:
            self.cut_ids.add(session_id)
        return RunInterrupted(self._reason or "the run is stopping")
