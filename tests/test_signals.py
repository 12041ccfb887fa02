"""Stopping a run (what SIGINT/SIGTERM do): nothing new starts, the playing rollouts finish or are cut.

``Run.stop`` is what the signal handlers of ``verbatim run`` call; here a scripted engine makes
"still playing when the grace ends" exact (its requests wait until the test lets them go). The same
path through real signals, a real CLI process and a real vLLM server is in tests/test_kill_resume.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
from fakes import STOP, CharRenderer

from verbatim.datamodel import Completion, Message
from verbatim.engine.protocol import Sampling
from verbatim.envs.base import Reset, StepResult
from verbatim.errors import EngineError, InputError, RunInterrupted
from verbatim.harness import run as run_module
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, RunPlan, StopRequest
from verbatim.harness.store import RunManifest, read_run
from verbatim.lint.trace import lint_run
from verbatim.prefix_cache import reusable_tokens, shared_prefix

SIGINT_STOP = StopRequest("interrupted by SIGINT", "interrupted", exit_code=130)


class GatedEngine:
    """Answers "ok" + stop; from turn ``hold_from`` on, a request waits until ``release`` is set.

    Its prefix cache never evicts: a request finds cached the whole blocks of what its session computed.
    """

    block_size = 32
    version = 0

    def __init__(self, hold_from: int = 99, fail_after_hold: bool = False) -> None:
        self.hold_from, self.fail_after_hold = hold_from, fail_after_hold
        self.release = asyncio.Event()
        self.calls = 0
        self.held = 0
        self.computed: dict[str | None, np.ndarray] = {}

    async def generate(self, prompt_ids, sampling=None, *, session_id=None, group_id=None, cache_salt=None):
        self.calls += 1
        turn = int(np.count_nonzero(np.asarray(prompt_ids) == ord(">") + 10)) // 2 - 1  # <user> tags so far - 1
        if turn >= self.hold_from:
            self.held += 1
            await self.release.wait()
            if self.fail_after_hold:
                raise EngineError("the engine core died (it got the terminal's SIGINT too)")
        ids = [ord("o") + 10, ord("k") + 10, STOP]
        prompt = np.asarray(prompt_ids)
        known = shared_prefix(self.computed.get(session_id, prompt[:0]), prompt)
        self.computed[session_id] = np.concatenate([prompt, ids[:-1]])
        return Completion(token_ids=np.asarray(ids, np.int32), logprobs=np.full(3, -0.5, np.float32),
                          versions=np.zeros(3, np.int32), finish_reason="stop", prompt_tokens=len(prompt_ids),
                          cached_tokens=reusable_tokens(known, len(prompt), self.block_size))


class TurnsEnv:
    """Three turns; ``hang_step`` makes the second step block until ``unblock`` is set (a stuck env)."""

    def __init__(self, unblock: threading.Event | None = None) -> None:
        self.unblock = unblock

    def reset(self, task, seed):
        self.turns = 0
        return Reset(messages=(Message(role="user", content=f"task {task['n']}"),))

    def step(self, message):
        self.turns += 1
        if self.unblock is not None and self.turns == 2:
            self.unblock.wait(30)
        return StepResult(messages=(Message(role="user", content="more"),), reward=0.5, done=self.turns == 3)


class Factory:
    def __init__(self, unblock: threading.Event | None = None) -> None:
        self.unblock = unblock

    def make(self):
        return TurnsEnv(self.unblock)


def make_run(out: Path, engine, *, groups=4, group_size=2, concurrency=4, unblock=None) -> Run:
    plan = RunPlan(run_id="stop", groups=groups, group_size=group_size, concurrency=concurrency, batch_size=3)
    loop = LoopConfig(max_turns=4, context_budget=4096, sampling=Sampling(max_tokens=8), step_timeout_s=30)
    manifest = RunManifest(run_id="stop", format="jsonl", config={"plan": plan.model_dump()})
    return Run(plan, loop, engine, CharRenderer(), Factory(unblock), [{"n": i} for i in range(groups)], out,
               manifest)


async def stop_when_held(run: Run, engine: GatedEngine, held: int, request: StopRequest, grace_s: float) -> None:
    while engine.held < held:
        await asyncio.sleep(0.01)
    run.stop(request, grace_s)


def play(run: Run, *during, resume: bool = False) -> Exception | None:
    """``run.play()`` with helper coroutines beside it; returns the exception it raised, if any."""
    async def go():
        helpers = [asyncio.ensure_future(h) for h in during]
        try:
            await run.play(resume=resume)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
        finally:
            for helper in helpers:
                helper.cancel()
        return None

    return asyncio.run(go())


def test_rollouts_still_playing_after_the_grace_are_cut_and_kept_as_interrupted(tmp_path):
    engine = GatedEngine(hold_from=1)  # every rollout's second request waits for ever
    run = make_run(tmp_path / "run", engine)
    error = play(run, stop_when_held(run, engine, 4, SIGINT_STOP, grace_s=0.3))
    assert isinstance(error, RunInterrupted) and error.exit_code == 130
    assert "interrupted by SIGINT; the run stopped with 4 of 8 rollouts written (4 of them interrupted)" in \
        error.one_line()
    trace = read_run(tmp_path / "run")
    assert trace.manifest.status == "interrupted" and trace.problems == []
    assert len(trace.rollouts) == 4
    for rollout in trace.rollouts:
        assert rollout.status == "interrupted" and rollout.error == "interrupted by SIGINT"
        assert len(rollout.turns) == 1 and len(rollout.tokens) > rollout.turns[0].completion_end  # turn 0 + env
    assert lint_run(tmp_path / "run").ok
    assert engine.calls == 8, "a rollout started after the stop"


def test_resume_plays_interrupted_rollouts_again_and_keeps_their_first_record_aside(tmp_path):
    """An interrupted rollout is not a finished one: a resume plays it again, so the run it calls completed holds
    every planned rollout once, finished; the batch files that held the cut ones are kept byte for byte."""
    out = tmp_path / "run"
    engine = GatedEngine(hold_from=1)
    run = make_run(out, engine)
    assert isinstance(play(run, stop_when_held(run, engine, 4, SIGINT_STOP, grace_s=0.3)), RunInterrupted)
    before = {p.name: p.read_bytes() for p in out.glob("rollouts-*")}
    assert before and all(r.status == "interrupted" for r in read_run(out).rollouts)

    resumed = make_run(out, GatedEngine())
    assert resumed.completed_ids() == set()
    assert play(resumed, resume=True) is None
    after = read_run(out)
    counts = Counter(r.rollout_id for r in after.rollouts)
    assert len(counts) == 8 and set(counts.values()) == {1}
    assert {r.status for r in after.rollouts} == {"ok"} and after.manifest.status == "completed"
    aside = out / "discarded" / "interrupted"
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == before
    assert lint_run(out).ok


def test_rollouts_that_finish_within_the_grace_are_kept_whole_and_resume_plays_the_rest(tmp_path):
    engine = GatedEngine(hold_from=2)

    async def stop_then_release():
        await stop_when_held(run, engine, 4, SIGINT_STOP, grace_s=10)
        await asyncio.sleep(0.1)
        engine.release.set()

    run = make_run(tmp_path / "run", engine)
    error = play(run, stop_then_release())
    assert isinstance(error, RunInterrupted) and "4 of 8 rollouts written (0 of them interrupted)" in error.one_line()
    first = read_run(tmp_path / "run")
    assert [r.status for r in first.rollouts] == ["ok"] * 4 and first.manifest.status == "interrupted"

    assert play(make_run(tmp_path / "run", GatedEngine()), resume=True) is None
    after = read_run(tmp_path / "run")
    counts = Counter(r.rollout_id for r in after.rollouts)
    assert len(counts) == 8 and set(counts.values()) == {1} and after.manifest.status == "completed"
    assert lint_run(tmp_path / "run").ok


def test_a_second_stop_cuts_at_once(tmp_path):
    engine = GatedEngine(hold_from=1)

    async def twice():
        await stop_when_held(run, engine, 4, SIGINT_STOP, grace_s=60)
        await asyncio.sleep(0.1)
        run.stop(SIGINT_STOP)

    run = make_run(tmp_path / "run", engine)
    started = time.monotonic()
    error = play(run, twice())
    assert isinstance(error, RunInterrupted)
    assert time.monotonic() - started < 10, "the second stop waited for the 60 s grace"
    assert [r.status for r in read_run(tmp_path / "run").rollouts] == ["interrupted"] * 4


def test_a_rollout_stuck_in_its_env_past_the_cut_is_still_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "LATE_S", 0.3)
    unblock = threading.Event()
    engine = GatedEngine()
    run = make_run(tmp_path / "run", engine, groups=1, group_size=2, concurrency=2, unblock=unblock)

    async def stop_when_stuck():
        while engine.calls < 4:  # both rollouts are in their second env step, which hangs
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        run.stop(SIGINT_STOP, grace_s=0.2)

    try:
        error = play(run, stop_when_stuck())
    finally:
        unblock.set()
    assert isinstance(error, RunInterrupted)
    trace = read_run(tmp_path / "run")
    assert sorted(r.rollout_id for r in trace.rollouts) == ["g0000-r00", "g0000-r01"]
    for rollout in trace.rollouts:
        assert rollout.status == "interrupted" and "inside an env or renderer call" in rollout.error
        assert len(rollout.tokens) == 0
    assert lint_run(tmp_path / "run").ok


def test_an_engine_failure_while_stopping_is_an_interruption_not_an_error(tmp_path):
    engine = GatedEngine(hold_from=1, fail_after_hold=True)

    async def stop_then_fail():
        await stop_when_held(run, engine, 4, SIGINT_STOP, grace_s=10)
        engine.release.set()

    run = make_run(tmp_path / "run", engine)
    error = play(run, stop_then_fail())
    assert isinstance(error, RunInterrupted)
    assert [r.status for r in read_run(tmp_path / "run").rollouts] == ["interrupted"] * 4


KILLED_WRITER = """
import sys, time
from pathlib import Path
import verbatim.harness.store as store

def stall(fd):  # the batch is in its temporary file; the process is killed before the rename
    print("writing", flush=True)
    time.sleep(60)

out = Path(sys.argv[1])
writer = store.TraceWriter(out, store.read_manifest(out))
store.os.fsync = stall
writer.write_batch(store.read_run(out).rollouts[:2])
"""


def test_a_batch_write_killed_half_way_leaves_nothing_behind_after_resume(tmp_path):
    """SIGKILL in the middle of a real batch write, then a resume: the temporary file is gone, nothing twice."""
    out = tmp_path / "run"
    engine = GatedEngine(hold_from=1)
    stopped = make_run(out, engine)
    assert isinstance(play(stopped, stop_when_held(stopped, engine, 4, SIGINT_STOP, grace_s=0)), RunInterrupted)
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
    finally:
        writer.kill()
        writer.wait(30)
    assert [p.name.split("-", 2)[2] for p in out.glob(".tmp-*")] == ["rollouts-000003.jsonl"]
    assert "an unfinished write" in read_run(out).problems[0]

    assert play(make_run(out, GatedEngine()), resume=True) is None
    assert list(out.glob(".tmp-*")) == []
    after = read_run(out)
    counts = Counter(r.rollout_id for r in after.rollouts)
    assert after.problems == [] and len(counts) == 8 and set(counts.values()) == {1}
    assert lint_run(out).ok


def test_a_second_writer_is_refused_while_a_run_plays_and_disturbs_nothing(tmp_path):
    """A second ``verbatim run --resume`` on a directory being written would clear the first's pending
    writes and play its rollouts twice: it gets one line (exit 2) and touches nothing."""
    out = tmp_path / "run"
    engine = GatedEngine(hold_from=1)
    first = make_run(out, engine)
    pending = out / ".tmp-1-rollouts-000099.jsonl"  # a batch the first run is writing at this moment
    refusals: list[InputError] = []

    async def intrude():
        while engine.held < 4:
            await asyncio.sleep(0.01)
        pending.write_text("half a batch")
        second = make_run(out, GatedEngine())
        try:
            try:
                second.check_out_dir(resume=True)  # what `verbatim run` checks before starting its engine
            except InputError as exc:
                refusals.append(exc)
            try:
                await asyncio.wait_for(second.play(resume=True), 20)
            except InputError as exc:
                refusals.append(exc)
            survived.append(pending.exists())
            pending.unlink(missing_ok=True)
        finally:
            engine.release.set()  # whatever happened, the first run finishes

    survived: list[bool] = []
    assert play(first, intrude()) is None
    assert survived == [True], "the second writer cleared the first one's pending write"
    assert len(refusals) == 2 and all(e.exit_code == 2 for e in refusals)
    assert "is being written by another verbatim run" in refusals[0].one_line()
    trace = read_run(out)
    counts = Counter(r.rollout_id for r in trace.rollouts)
    assert len(counts) == 8 and set(counts.values()) == {1} and trace.manifest.status == "completed"
    assert lint_run(out).ok
    make_run(out, GatedEngine()).check_out_dir(resume=True)  # the first run ended: its lock is gone
