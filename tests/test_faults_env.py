"""Env faults end their own rollout with the right status and reason; the others finish.

The engine and renderer are scripted fakes (this tests the turn loop, not vLLM): the
renderer writes one token per character, the engine answers "ok" and a stop token.
Each fault runs inside a real ``Run`` next to healthy groups, written to a JSONL trace.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fakes import STOP, CharRenderer

from verbatim.datamodel import Completion, Message
from verbatim.envs.base import Reset, StepResult
from verbatim.harness.rollout import LoopConfig, RolloutPlayer, RolloutSpec
from verbatim.harness.run import Run, RunPlan
from verbatim.harness.store import RunManifest, read_run

RELEASE = threading.Event()  # hanging envs wait on this; set when the module's tests end


@pytest.fixture(autouse=True, scope="module")
def _release_hanging_envs():
    RELEASE.clear()
    yield
    RELEASE.set()


class ScriptedEngine:
    """Answers every request with "ok" + stop, exact logprobs, version 0."""

    version = 0
    block_size = 16

    def __init__(self) -> None:
        self.requests = 0

    async def generate(self, prompt_ids, sampling=None, *, session_id=None, group_id=None, cache_salt=None):
        self.requests += 1
        await asyncio.sleep(0)
        ids = CharRenderer.encode("ok") + [STOP]
        return Completion(token_ids=np.asarray(ids), logprobs=np.full(len(ids), -0.5),
                          versions=np.zeros(len(ids)), finish_reason="stop", prompt_tokens=len(prompt_ids),
                          cached_tokens=0)


def _hang() -> None:
    RELEASE.wait(60)


FAULTS = {  # task["fault"] -> what the env does on reset / on step
    "raise_reset": ("reset", lambda: 1 / 0),
    "raise_step": ("step", lambda: 1 / 0),
    "exit_step": ("step", lambda: sys.exit(3)),
    "hang_reset": ("reset", _hang),
    "hang_step": ("step", _hang),
    "dict_result": ("step", lambda: {"messages": [], "done": True}),
    "none_reset": ("reset", lambda: None),
    "dict_message": ("step", lambda: StepResult.model_construct(messages=({"role": "user", "content": "x"},),
                                                                reward=0.0, done=False, info={})),
    "wrong_role": ("step", lambda: StepResult(messages=(Message.model_construct(role="robot", content="x"),))),
    "int_content": ("step", lambda: StepResult(messages=(Message.model_construct(role="user", content=42),))),
    "invalid_model": ("step", lambda: StepResult(messages=({"role": "narrator", "content": "x"},))),
    "nan_reward": ("step", lambda: StepResult(reward=math.nan, done=True)),
    "huge_text": ("step", lambda: StepResult(messages=(Message(role="user", content="x" * 20_000_000),))),
    "over_budget": ("step", lambda: StepResult(messages=(Message(role="user", content="y" * 3000),))),
    "huge_reset": ("reset", lambda: Reset(messages=(Message(role="user", content="z" * 5000),))),
}


class FaultyEnv:
    """Two turns; the task's ``fault`` replaces its reset or its first step."""

    name = "faulty"

    def reset(self, task, seed):
        self.task_fault = task.get("fault")
        self.fault = FAULTS.get(self.task_fault)
        self.steps = 0
        if self.fault and self.fault[0] == "reset":
            return self.fault[1]()
        return Reset(messages=(Message(role="user", content=f"task {task['id']}"),))

    def step(self, message):
        self.steps += 1
        if self.fault and self.fault[0] == "step":
            return self.fault[1]()
        info = {"nan": math.nan, "set": {1, 2}}  # JSON has neither: the trace must still be written
        if self.task_fault == "cyclic_info":
            info["self"] = info
        return StepResult(messages=(Message(role="user", content="again"),), reward=0.5,
                          done=self.steps == 2, info=info)


class FaultyFactory:
    name = "faulty"

    def make(self):
        return FaultyEnv()

    def tasks(self, count, seed):
        return [{"id": i} for i in range(count)]


def play_run(tmp_path: Path, faults: list[str | None], *, group_size=2, timeout_s=1.0, budget=512, factory=None):
    tasks = [{"id": i, "fault": fault} for i, fault in enumerate(faults)]
    plan = RunPlan(run_id="faults", groups=len(tasks), group_size=group_size, concurrency=16, batch_size=4)
    loop = LoopConfig(max_turns=3, context_budget=budget, step_timeout_s=timeout_s)
    manifest = RunManifest(run_id="faults", format="jsonl")
    engine = ScriptedEngine()
    run = Run(plan, loop, engine, CharRenderer(), factory or FaultyFactory(), tasks, tmp_path / "run", manifest)
    started = time.monotonic()
    asyncio.run(run.play())  # asyncio.run also waits for the default executor: hung threads must not be there
    trace = read_run(tmp_path / "run")
    assert trace.problems == [] and trace.manifest.status == "completed"
    by_task = {}
    for rollout in trace.rollouts:
        by_task.setdefault(rollout.task["fault"], []).append(rollout)
    assert sum(map(len, by_task.values())) == len(tasks) * group_size
    return by_task, time.monotonic() - started


EXPECTED = {  # fault -> (status, words the reason must hold)
    "raise_reset": ("error", "env.reset raised ZeroDivisionError: division by zero"),
    "raise_step": ("error", "env.step raised ZeroDivisionError: division by zero"),
    "exit_step": ("error", "env.step raised SystemExit: 3"),
    "hang_reset": ("error", "env.reset timed out after 1s"),
    "hang_step": ("error", "env.step timed out after 1s"),
    "dict_result": ("error", "env.step returned dict, not a StepResult"),
    "none_reset": ("error", "env.reset returned NoneType, not a Reset"),
    "dict_message": ("error", "env.step message 0 is a dict, not a Message"),
    "wrong_role": ("error", "env.step message 0 has the role 'robot'"),
    "int_content": ("error", "env.step message 0 has content of type int, not str"),
    "invalid_model": ("error", "env.step built an invalid StepResult: messages.0.role: Input should be"),
    "nan_reward": ("error", "env.step returned the reward nan; it must be a finite number"),
    "huge_text": ("truncated", "context budget: the prompt of turn 1 adds 20000000 characters"),
    "over_budget": ("truncated", "context budget: the prompt of turn 1 needs"),
    "huge_reset": ("truncated", "context budget: the opening prompt needs"),
}


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_an_env_fault_ends_its_rollouts_with_status_and_reason_and_the_others_finish(tmp_path, fault):
    by_task, wall = play_run(tmp_path, [None, fault, None])
    status, reason = EXPECTED[fault]
    for rollout in by_task[fault]:
        assert rollout.status == status and reason in rollout.error, rollout.error
        assert "\n" not in rollout.error and rollout.info["stop_reason"] == rollout.error
    healthy = by_task[None]
    assert len(healthy) == 4 and all(r.status == "ok" and r.reward == 1.0 for r in healthy)
    assert all(r.info["env"] == {"nan": None, "set": "{1, 2}"} for r in healthy)
    assert wall < 6.0, f"the run took {wall:.1f}s"


def test_env_info_that_json_cannot_hold_is_noted_and_the_rollout_kept(tmp_path):
    by_task, _ = play_run(tmp_path, ["cyclic_info"], group_size=1)
    (rollout,) = by_task["cyclic_info"]
    assert rollout.status == "ok" and rollout.reward == 1.0
    assert rollout.info["env"] == {"unserialisable": "ValueError: Circular reference detected"}


def test_many_hanging_envs_neither_starve_the_others_nor_hold_the_run_open(tmp_path):
    """More hung envs than a thread pool has workers: healthy rollouts still get their env calls."""
    by_task, wall = play_run(tmp_path, ["hang_step"] * 6 + [None] * 2, group_size=2, timeout_s=1.5)
    assert all(r.status == "error" and "timed out" in r.error for r in by_task["hang_step"])
    assert [r.status for r in by_task[None]] == ["ok"] * 4
    assert wall < 8.0, f"the run took {wall:.1f}s"


class BrokenFactory(FaultyFactory):
    """``make()`` raises on the calls numbered in ``broken`` (on every call when ``broken`` is None)."""

    def __init__(self, broken: set[int] | None) -> None:
        self.broken, self.calls = broken, 0

    def make(self):
        call, self.calls = self.calls, self.calls + 1
        if self.broken is None or call in self.broken:
            raise OSError(f"no sandbox left\n(call {call})")
        return super().make()


@pytest.mark.parametrize("broken", [{0, 5}, None], ids=["two-calls", "every-call"])
def test_an_env_factory_whose_make_raises_ends_that_rollout_as_an_error_and_the_run_goes_on(tmp_path, broken):
    """Call 0 is a group leader's: its followers are released at once. Failed ``make()`` calls are not engine
    failures: eight in a row do not stop the run (five failed requests would)."""
    factory = BrokenFactory(broken)
    by_task, wall = play_run(tmp_path, [None] * 4, factory=factory, timeout_s=10.0)  # a stuck follower waits 40 s
    rollouts = by_task[None]
    failed = [r for r in rollouts if r.status == "error"]
    assert factory.calls == 8 and len(failed) == (8 if broken is None else 2)
    assert sorted(r.error for r in failed) == sorted(
        f"env factory make() raised OSError: no sandbox left (call {call})" for call in (broken or range(8)))
    assert all(r.info["stop_reason"] == r.error and len(r.tokens) == 0 and r.turns == () for r in failed)
    assert all(r.status == "ok" and r.reward == 1.0 for r in rollouts if r.status != "error")
    assert len(rollouts) - len(failed) == sum(r.status == "ok" for r in rollouts)
    assert wall < 20.0, f"the run took {wall:.1f}s: followers waited for a leader that never asked"


def test_an_enormous_observation_is_not_tokenized():
    """20 MB of text ends the rollout at once: the budget check comes before the tokenizer."""
    calls = []

    class CountingRenderer(CharRenderer):
        def bridge(self, previous_ids, new_messages, *, tools=None):
            calls.append(sum(len(m.content) for m in new_messages))
            return super().bridge(previous_ids, new_messages, tools=tools)

    player = RolloutPlayer(ScriptedEngine(), CountingRenderer(), LoopConfig(max_turns=3, context_budget=512))
    spec = RolloutSpec(run_id="r", group_id="g", rollout_id="g-r0", task={"id": 0, "fault": "huge_text"}, seed=0)
    started = time.monotonic()
    rollout = asyncio.run(player.play(spec, FaultyEnv()))
    assert rollout.status == "truncated" and calls == [] and time.monotonic() - started < 2.0
    assert len(rollout.turns) == 1 and rollout.info["messages"][-1] == {"role": "assistant", "content": "ok"}
