"""SIGINT and SIGTERM routed to a playing run's stop, the same way for ``run`` and ``train``."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def on_stop_signals(handle: Callable[[signal.Signals], None]) -> Callable[[], None]:
    """``handle(sig)`` for each SIGINT/SIGTERM while the running event loop plays; returns what undoes it.

    A run on the loop of an engine its caller started (another thread) leaves the signals to that caller:
    only the main thread's loop can take them."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, handle, sig)

    def undo() -> None:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)

    return undo
