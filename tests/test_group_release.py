"""A group's followers start when the leader's prompt is prefilled, not when its reply is done.

The engine is a scripted fake (this tests the run's scheduling, not vLLM): its leader request
reports its first token, then holds its decode until every follower has sent its first request.
The real engine's cache hits for followers are checked in tests/test_harness_e2e.py.
"""

from __future__ import annotations

import asyncio

import numpy as np
from fakes import STOP, CharRenderer

from verbatim.datamodel import Completion, Message
from verbatim.engine.protocol import prefilled
from verbatim.envs.base import Reset, StepResult
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, RunPlan
from verbatim.harness.store import RunManifest, read_run


class StreamingEngine:
    """Every request: its first token (``prefilled()`` where ``streams``), then the rest of its reply. The very
    first request's decode waits (at most ``hold_s``) until ``group_size`` requests have been sent."""

    version = 0
    block_size = 16

    def __init__(self, group_size: int, streams: bool, hold_s: float = 2.0) -> None:
        self.group_size, self.streams, self.hold_s = group_size, streams, hold_s
        self.sent: list[str] = []
        self.all_sent = asyncio.Event()
        self.leader_held = False

    async def generate(self, prompt_ids, sampling=None, *, session_id=None, group_id=None, cache_salt=None):
        self.sent.append(session_id)
        if len(self.sent) == self.group_size:
            self.all_sent.set()
        await asyncio.sleep(0)
        if self.streams:
            prefilled()
        if len(self.sent) == 1:
            try:
                await asyncio.wait_for(self.all_sent.wait(), self.hold_s)
                self.leader_held = True
            except asyncio.TimeoutError:
                pass
        ids = CharRenderer.encode("ok") + [STOP]
        return Completion(token_ids=np.asarray(ids), logprobs=np.full(len(ids), -0.5), versions=np.zeros(len(ids)),
                          finish_reason="stop", prompt_tokens=len(prompt_ids), cached_tokens=0)


class OneTurn:
    name = "one-turn"

    def make(self):
        return self

    def tasks(self, count, seed):
        return [{"id": i} for i in range(count)]

    def reset(self, task, seed):
        return Reset(messages=(Message(role="user", content=f"task {task['id']}"),))

    def step(self, message):
        return StepResult(reward=1.0, done=True)


def _play(tmp_path, engine, group_size):
    plan = RunPlan(run_id="g", groups=1, group_size=group_size, concurrency=16, batch_size=4)
    loop = LoopConfig(max_turns=1, context_budget=512)
    factory = OneTurn()
    run = Run(plan, loop, engine, CharRenderer(), factory, factory.tasks(1, 0), tmp_path / "run",
              RunManifest(run_id="g", format="jsonl"))
    asyncio.run(run.play())
    return read_run(tmp_path / "run").rollouts


def test_followers_start_at_the_leaders_first_token(tmp_path):
    engine = StreamingEngine(group_size=4, streams=True)
    rollouts = _play(tmp_path, engine, 4)
    assert engine.leader_held, "the followers waited for the leader's whole reply"
    assert len(engine.sent) == 4 and len(set(engine.sent)) == 4
    assert [r.status for r in rollouts] == ["ok"] * 4


def test_an_engine_that_does_not_stream_releases_the_followers_when_the_leader_is_answered(tmp_path):
    engine = StreamingEngine(group_size=4, streams=False, hold_s=0.3)
    rollouts = _play(tmp_path, engine, 4)
    assert not engine.leader_held  # no first-token signal: the followers came after the leader's reply
    assert len(set(engine.sent)) == 4
    assert [r.status for r in rollouts] == ["ok"] * 4
