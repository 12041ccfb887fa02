"""The daemon workers env and renderer calls run in, and where a rollout renders new text.

Workers are reused (a hop wakes an idle thread instead of starting one), a hung call keeps
its worker without holding up others, idle workers are bounded in number and time, and an
idle worker holds nothing its last call referenced. A rollout renders a short observation on
the event loop and a long one in a worker, and a renderer's failure reads the same either way.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import threading
import time
import weakref

from fakes import CharRenderer
from test_faults_env import FaultyEnv, ScriptedEngine

from verbatim.datamodel import Message
from verbatim.envs.base import StepResult
from verbatim.harness.rollout import INLINE_CHARS, LoopConfig, RolloutPlayer, RolloutSpec
from verbatim.harness.workers import NAME, WORKERS, Workers


def run_and_wait(workers: Workers, job) -> threading.Thread:
    done = threading.Event()
    ran_in: list[threading.Thread] = []

    def work() -> None:
        ran_in.append(threading.current_thread())
        job()
        done.set()

    workers.submit(work)
    assert done.wait(5)
    return ran_in[0]


def wait_until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_worker_is_reused_once_idle():
    workers = Workers()
    first = run_and_wait(workers, lambda: None)
    assert wait_until(lambda: workers.idle() == 1)
    assert run_and_wait(workers, lambda: None) is first and first.name == NAME and first.daemon


def test_a_hung_call_keeps_its_worker_and_the_next_call_gets_another():
    workers, release = Workers(), threading.Event()
    hung = threading.Event()

    def hang() -> None:
        hung.set()
        release.wait(10)

    workers.submit(hang)
    assert hung.wait(5)
    other = run_and_wait(workers, lambda: None)  # answered while the first worker is still stuck
    release.set()
    assert other.is_alive() and workers.idle() <= 2


def test_idle_workers_are_bounded_in_number_and_in_time():
    workers, start = Workers(keep=2, idle_s=0.2), threading.Barrier(6)
    threads: list[threading.Thread] = []

    def together() -> None:
        threads.append(threading.current_thread())
        start.wait(5)

    for _ in range(5):
        workers.submit(together)
    start.wait(5)
    assert len(set(threads)) == 5
    assert wait_until(lambda: sum(t.is_alive() for t in threads) == 2 and workers.idle() == 2)
    assert wait_until(lambda: not any(t.is_alive() for t in threads) and workers.idle() == 0)


def test_an_idle_worker_holds_nothing_its_last_call_referenced():
    class Env:
        pass

    workers, env = Workers(), Env()
    ref = weakref.ref(env)
    run_and_wait(workers, lambda e=env: e)
    assert wait_until(lambda: workers.idle() == 1)
    del env
    gc.collect()
    assert ref() is None


def _env_call_in_a_forked_child(done) -> None:
    finished = threading.Event()
    WORKERS.submit(finished.set)
    done.put(finished.wait(5))


def test_a_forked_child_starts_its_own_workers():
    """The parent's idle workers are not threads of a forked child: a call there must not wait on them."""
    run_and_wait(WORKERS, lambda: None)
    assert wait_until(lambda: WORKERS.idle() >= 1)
    context = multiprocessing.get_context("fork")
    done = context.Queue()
    child = context.Process(target=_env_call_in_a_forked_child, args=(done,))
    child.start()
    try:
        answered = done.get(timeout=30)
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
    assert answered is True and child.exitcode == 0


class ThreadRecordingRenderer(CharRenderer):
    """Records the thread each bridge runs in; raises where the observation says so."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def bridge(self, previous_ids, new_messages, *, tools=None):
        self.threads.append(threading.current_thread())
        if any("boom" in m.content for m in new_messages):
            raise ValueError("cannot render this")
        return super().bridge(previous_ids, new_messages, tools=tools)


class ObservationEnv(FaultyEnv):
    def __init__(self, text: str) -> None:
        self.text = text

    def step(self, message):
        self.steps += 1
        return StepResult(messages=(Message(role="user", content=self.text),), done=self.steps == 2)


def play(text: str) -> tuple:
    renderer = ThreadRecordingRenderer()
    player = RolloutPlayer(ScriptedEngine(), renderer, LoopConfig(max_turns=3, context_budget=65_536))
    spec = RolloutSpec(run_id="r", group_id="g", rollout_id="g-r0", task={"id": 0}, seed=0)
    loop_thread: list[threading.Thread] = []

    async def main():
        loop_thread.append(threading.current_thread())
        return await player.play(spec, ObservationEnv(text))

    return asyncio.run(main()), renderer.threads, loop_thread[0]


def test_a_short_observation_is_bridged_on_the_event_loop_and_a_long_one_in_a_worker():
    short, threads, loop = play("x" * INLINE_CHARS)
    assert short.status == "ok" and threads == [loop]
    long, threads, loop = play("x" * (INLINE_CHARS + 1))
    assert long.status == "ok" and len(threads) == 1 and threads[0] is not loop and threads[0].name == NAME


def test_a_renderer_failure_reads_the_same_on_the_loop_and_in_a_worker():
    reasons = []
    for size in (10, INLINE_CHARS + 10):
        rollout, _, _ = play("boom" + "x" * size)
        reasons.append((rollout.status, rollout.error))
    assert reasons == [("error", "bridge raised ValueError: cannot render this")] * 2
