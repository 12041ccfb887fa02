"""Daemon threads that env, agent and renderer calls run in, kept for reuse.

A rollout makes a few thread hops a turn (env.step, the bridge). Starting a thread for each
costs a thread start and, on a machine whose cores the engine keeps busy, a wait to be
scheduled; an idle worker is woken instead. A call that hangs keeps its worker for good, as a
thread of its own would (nothing is bounded by hung calls, nobody joins them at exit), and the
next call starts a new worker. At most ``keep`` idle workers wait, each for ``idle_s`` seconds.
A forked child starts with none: its parent's workers are not threads of the child.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

NAME = "verbatim-worker"
"""Every worker's thread name (tests tell them from other threads by it)."""


class Workers:
    """Runs each submitted job in an idle worker, or a new one where none is idle."""

    def __init__(self, keep: int = 16, idle_s: float = 30.0) -> None:
        self.keep, self.idle_s = keep, idle_s
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        """Start ``job()`` in a worker; it must not raise (callers hand its outcome back themselves)."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=NAME, daemon=True).start()
        inbox.put(job)

    def forget(self) -> None:
        """Drop every idle worker without waking it (in a forked child, where none of them runs)."""
        self._idle, self._lock = [], threading.Lock()

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            try:
                job = inbox.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # nobody took this worker while it waited: it ends
                        self._idle.remove(inbox)
                        return
                continue  # taken just now: its job is on the way
            job()
            job = None  # what the call held (an env, a ledger) is not kept alive by an idle worker
            with self._lock:
                if len(self._idle) >= self.keep:
                    return
                self._idle.append(inbox)


WORKERS = Workers()
"""The process's workers, shared by every rollout."""

os.register_at_fork(after_in_child=WORKERS.forget)
