"""Requests and weight updates of the HTTP engine never overlap, so a completion's version is exact."""

from __future__ import annotations

import asyncio

import numpy as np

from verbatim.engine.drain import Drain
from verbatim.engine.http import HttpEngine


async def _tick(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_requests_run_together() -> None:
    async def main() -> int:
        drain, release, peak = Drain(), asyncio.Event(), []

        async def request() -> None:
            async with drain.request():
                peak.append(drain.in_flight)
                await release.wait()

        tasks = [asyncio.create_task(request()) for _ in range(3)]
        await _tick()
        release.set()
        await asyncio.gather(*tasks)
        return max(peak)

    assert asyncio.run(main()) == 3


def test_an_update_waits_for_the_requests_in_flight_and_holds_back_new_ones() -> None:
    async def main() -> list[str]:
        drain, events = Drain(), []
        first_done, update_done = asyncio.Event(), asyncio.Event()

        async def first() -> None:
            async with drain.request():
                events.append("first starts")
                await first_done.wait()
                events.append("first ends")

        async def update() -> None:
            async with drain.update():
                events.append("update runs")
                await update_done.wait()
                events.append("update ends")

        async def late() -> None:
            async with drain.request():
                events.append("late starts")

        tasks = [asyncio.create_task(first())]
        await _tick()
        tasks.append(asyncio.create_task(update()))
        await _tick()
        tasks.append(asyncio.create_task(late()))  # arrives while the update waits: queues behind it
        await _tick()
        assert events == ["first starts"]
        first_done.set()
        await _tick()
        assert events == ["first starts", "first ends", "update runs"]
        update_done.set()
        await asyncio.gather(*tasks)
        return events

    assert asyncio.run(main()) == ["first starts", "first ends", "update runs", "update ends", "late starts"]


def test_a_request_sent_during_an_update_is_labelled_with_the_new_version() -> None:
    """The server would hold such a request until the update ends and run it on the new weights."""

    async def main() -> tuple[int, ...]:
        engine = HttpEngine("http://127.0.0.1:9")  # never contacted: _call is replaced below
        reload_started, reload_may_end = asyncio.Event(), asyncio.Event()

        async def call(method: str, path: str, **_: object) -> object:
            if path == "/collective_rpc":
                reload_started.set()
                await reload_may_end.wait()
            if path == "/v1/completions":
                return {"choices": [{"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.1, -0.2]},
                                     "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}}
            return {}

        engine._call = call  # type: ignore[method-assign]
        update = asyncio.create_task(engine.update_weights("/weights", 1))
        await reload_started.wait()
        request = asyncio.create_task(engine.generate([1, 2, 3]))
        await _tick()
        reload_may_end.set()
        await update
        completion = await request
        await engine.aclose()
        return tuple(int(v) for v in np.asarray(completion.versions))

    assert asyncio.run(main()) == (1, 1)
