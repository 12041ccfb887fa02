"""Requests and weight updates of one engine client, kept apart so every token's version is exact.

An HTTP engine labels a completion with the version it was sent under. That label is exact only if
no update can start while the request is on its way or running, and no request can start while an
update is under way (the server would hold it until the update ends and run it on the new weights).
:class:`Drain` is that rule: any number of requests at once, or one update alone; an update waits
for the requests in flight to end and holds back new ones until it is done (it does not starve:
requests that arrive while it waits queue behind it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Drain:
    """Many requests or one update at a time; an update drains the requests in flight first."""

    def __init__(self) -> None:
        self._in_flight = 0
        self._updating = False
        self._changed = asyncio.Condition()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        """Hold one request's place: waits while an update is pending or running."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._updating)
            self._in_flight += 1
        try:
            yield
        finally:
            async with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    @asynccontextmanager
    async def update(self) -> AsyncIterator[None]:
        """Hold the engine for an update: new requests wait, the ones in flight finish first."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._updating)
            self._updating = True
            await self._changed.wait_for(lambda: self._in_flight == 0)
        try:
            yield
        finally:
            async with self._changed:
                self._updating = False
                self._changed.notify_all()
