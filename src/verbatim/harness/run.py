"""A run: groups of rollouts over tasks, played concurrently, written crash-safe, resumable.

Group members share their task prompt. The first member of a group sends its
first request alone; the others start once its prompt is prefilled (its first
token, where the engine streams; else once it is answered), so the shared prompt
is prefilled once and every other member reads it from the prefix cache.

Stopping (:meth:`Run.stop`: a signal, or an engine that fails every request): no
new rollout starts; those playing get ``grace_s`` to finish, then their engine
calls are cut (:class:`~.gate.EngineGate`) and they are written as
``interrupted`` with the tokens they have; one stuck in an env call a few seconds
later still is written as ``interrupted``, without tokens. The manifest says
``interrupted`` (signal) or ``failed`` (engine), and ``play`` raises the matching
error after everything is written. ``--resume`` plays the rollouts that never
started and those written ``interrupted`` (their batch files are moved whole into
``discarded/interrupted/``, the finished rollouts beside them written back), so a
resumed run holds each planned rollout once, finished; a finished one is never
played twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from verbatim.datamodel import Frozen, Rollout
from verbatim.engine.reaper import check_no_leftover_engine
from verbatim.engine.runtime import MAX_SEED
from verbatim.envs.base import EnvFactory
from verbatim.errors import EngineError, InputError, RunInterrupted, VerbatimError
from verbatim.harness.engine_gate import FAILURES_TO_STOP, EngineGate
from verbatim.harness.env_output import describe_failure, jsonable
from verbatim.harness.rollout import LoopConfig, RolloutPlayer, RolloutSpec
from verbatim.harness.store import (
    RunLock,
    RunManifest,
    TraceWriter,
    clear_unfinished_writes,
    read_manifest,
    read_run,
    set_aside_interrupted,
)
from verbatim.harness.summary import RunSummary, summarize


class RunPlan(Frozen):
    """Which rollouts a run consists of."""

    run_id: str
    groups: int = Field(default=2, ge=1)
    group_size: int = Field(default=4, ge=1)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    concurrency: int = Field(default=16, ge=1)
    batch_size: int = Field(default=8, ge=1)
    """Rollouts per trace file: a crash loses at most this many finished rollouts."""
    step: int | None = Field(default=None, ge=0)
    """The training step these rollouts belong to (``verbatim train``): ids are prefixed ``sNNNN-`` and
    each rollout records it in ``info["step"]``; None for a plain run."""

    def group_id(self, g: int) -> str:
        return f"g{g:04d}" if self.step is None else f"s{self.step:04d}-g{g:04d}"


def plan_specs(plan: RunPlan, tasks: Sequence[dict[str, Any]]) -> list[list[RolloutSpec]]:
    if len(tasks) < plan.groups:
        raise InputError(f"{plan.groups} groups need {plan.groups} tasks, only {len(tasks)} available",
                         hint="lower --groups or add tasks")
    groups = []
    base = plan.seed * 1_000_003 + (plan.step or 0) * 100_003
    for g in range(plan.groups):
        group_id = plan.group_id(g)
        groups.append([
            RolloutSpec(run_id=plan.run_id, group_id=group_id, rollout_id=f"{group_id}-r{i:02d}",
                        task=dict(tasks[g]), seed=base + g * plan.group_size + i, step=plan.step)
            for i in range(plan.group_size)
        ])
    return groups


class _Batcher:
    """Collects finished rollouts and writes them in batches (serialised, crash-safe)."""

    def __init__(self, writer: TraceWriter, batch_size: int) -> None:
        self.writer, self.batch_size = writer, batch_size
        self.pending: list[Rollout] = []
        self.written: list[Rollout] = []
        self.lock = asyncio.Lock()

    async def add(self, rollout: Rollout) -> None:
        async with self.lock:
            self.pending.append(rollout)
            if len(self.pending) >= self.batch_size:
                await self.flush_locked()

    async def flush(self) -> None:
        async with self.lock:
            await self.flush_locked()

    async def flush_locked(self) -> None:
        batch, self.pending = self.pending, []
        if batch:
            await asyncio.to_thread(self.writer.write_batch, batch)
            self.written += batch


LATE_S = 5.0
"""After the cut, how long a rollout inside an env or renderer call has to reach its next engine call."""


@dataclass(frozen=True)
class StopRequest:
    """Why a run stops, what its manifest then says, and its exit code."""

    reason: str
    status: str  # manifest status: "interrupted" (a signal) or "failed" (the engine)
    exit_code: int = 1


class Run:
    """Plays a plan's rollouts on an engine and writes them to ``out``."""

    def __init__(self, plan: RunPlan, loop: LoopConfig, engine: Any, renderer: Any, env: EnvFactory,
                 tasks: Sequence[dict[str, Any]], out: Path, manifest: RunManifest,
                 failures_to_stop: int = FAILURES_TO_STOP, make_player: Callable[..., Any] = RolloutPlayer) -> None:
        self.plan, self.loop, self.engine, self.renderer, self.env = plan, loop, engine, renderer, env
        self.make_player = make_player
        """Builds the player of a play from (engine, renderer, loop, on_first_request=…): a
        :class:`RolloutPlayer` for an env, an agent's player (``verbatim.agents``) plays its ``make()``
        the same way; either is entered as an async context around the play."""
        self.groups = plan_specs(plan, tasks)
        self.out, self.manifest = Path(out), manifest
        self._first_answer: dict[str, asyncio.Event] = {}
        self.on_rollout: Callable[[Rollout], None] | None = None
        self.stopped: StopRequest | None = None
        self.summary: RunSummary | None = None
        self.gate = EngineGate(engine, self._engine_failing, failures_to_stop)
        self._playing: set[str] = set()
        self._interrupted = 0
        self.rollouts: list[Rollout] = []
        """After :meth:`play`: this plan's rollouts as written (those of earlier plays included)."""
        self.whole_status = "completed"
        """The manifest's status once every rollout is written (``verbatim train`` keeps "running": its run
        is complete when the last step is trained, not when a step is played)."""

    def completed_ids(self) -> set[str]:
        """The rollouts on disk a resume keeps (an interrupted one is played again)."""
        return {r.rollout_id for r in self._on_disk() if r.status != "interrupted"}

    def _on_disk(self) -> list[Rollout]:
        return read_run(self.out).rollouts if (self.out / "manifest.json").exists() else []

    def check_out_dir(self, resume: bool) -> None:
        """Refuse to overwrite a run, to resume one with a different plan, or to write where another
        run is writing (before anything starts)."""
        RunLock.check_free(self.out)
        if resume and not (self.out / "manifest.json").exists():
            raise InputError(f"--resume: {self.out} holds no run to resume",
                             hint="check --out, or drop --resume to start a new run")
        check_no_leftover_engine(self.out)
        self._check_plan(resume)

    def _check_plan(self, resume: bool) -> None:
        if not (self.out / "manifest.json").exists():
            return
        if not resume:
            raise InputError(f"{self.out} already holds a run", hint="pass --resume to finish it, or another --out")
        previous = read_manifest(self.out)
        if previous.config.get("plan") != self.manifest.config.get("plan"):
            raise InputError(f"--resume: {self.out} was written with a different plan",
                             hint="use the same --env/--groups/--group-size/--seed as the first run")

    # -- stopping -------------------------------------------------------------------

    def stop(self, request: StopRequest, grace_s: float = 30.0) -> None:
        """Start no more rollouts; cut the playing ones after ``grace_s`` (at once on a second request)."""
        if self.stopped is not None:
            self.gate.cut()
            return
        self.stopped = request
        self.gate.begin_stop(request.reason)
        for event in self._first_answer.values():
            event.set()  # followers waiting for their leader: wake up and see the stop
        if grace_s <= 0:
            self.gate.cut()
        else:
            asyncio.get_running_loop().call_later(grace_s, self.gate.cut)

    def _engine_failing(self, reason: str) -> None:
        self.stop(StopRequest(reason, "failed"), grace_s=0)

    # -- playing ----------------------------------------------------------------------

    async def play(self, *, resume: bool = False, hold_lock: bool = True, look_on_disk: bool = True) -> RunSummary:
        """Play every rollout of the plan not yet written (all of them unless ``resume``).

        ``hold_lock=False`` is for a caller that holds the run directory's :class:`RunLock` itself
        across several plays (``verbatim train`` plays one plan per step); ``look_on_disk=False``
        tells a resumed play that none of its plan's rollouts can be on disk yet (a step that never
        began), so the trace is not read again."""
        if not hold_lock:
            return await self._play_locked(resume, look_on_disk)
        with RunLock(self.out):  # held until the last write: no second writer clears or duplicates ours
            return await self._play_locked(resume, look_on_disk)

    async def _play_locked(self, resume: bool, look_on_disk: bool) -> RunSummary:
        self._check_plan(resume)
        clear_unfinished_writes(self.out)
        self._record_block_size()
        mine = self.rollout_ids
        writer = TraceWriter(self.out, self.manifest)
        if resume and look_on_disk:
            set_aside_interrupted(writer, mine)
        earlier = [r for r in self._on_disk() if r.rollout_id in mine] if resume and look_on_disk else []
        done = {r.rollout_id for r in earlier}
        batcher = _Batcher(writer, self.plan.batch_size)
        limit = asyncio.Semaphore(self.plan.concurrency)
        started = time.perf_counter()
        try:
            async with self.make_player(self.gate, self.renderer, self.loop,
                                        on_first_request=self._answered) as player:
                await self._settle(self._start(player, done, limit, batcher))
        finally:
            await batcher.flush()
        rollouts = earlier + batcher.written  # what is on disk, without reading the whole trace again
        whole = len({r.rollout_id for r in rollouts}) == self.total and not self._interrupted
        status = self.stopped.status if self.stopped and not whole else self.whole_status
        writer.write_manifest(self.manifest.model_copy(update={"status": status}))
        self.rollouts = rollouts
        self.summary = summarize(rollouts, block_size=self.manifest.block_size(self.out),
                                 wall_s=time.perf_counter() - started, renderer=self.renderer)
        if self.stopped:
            raise self._stop_error(len(rollouts))
        return self.summary

    def _start(self, player: Any, done: set[str], limit: asyncio.Semaphore,
               batcher: _Batcher) -> dict[asyncio.Task, str]:
        tasks: dict[asyncio.Task, str] = {}
        for group in self.groups:
            todo = [s for s in group if s.rollout_id not in done]
            self._first_answer[group[0].group_id] = asyncio.Event()
            for index, spec in enumerate(todo):
                task = asyncio.create_task(self._one(player, spec, index > 0, limit, batcher))
                task.add_done_callback(self._crashed)
                tasks[task] = spec.rollout_id
        return tasks

    def _record_block_size(self) -> None:
        """The manifest records the engine's block size as the started engine reports it (an HTTP engine
        learns its server's when it starts); lint and the summary read it from there."""
        engine = {**self.manifest.engine, "block_size": int(self.engine.block_size)}
        self.manifest = self.manifest.model_copy(update={"engine": engine})

    async def _settle(self, tasks: dict[asyncio.Task, str]) -> None:
        """Wait for every rollout; once the gate is cut, give the stragglers ``LATE_S`` and then cancel them."""
        if not tasks:
            return
        everything = asyncio.ensure_future(asyncio.wait(tasks))
        cut = asyncio.ensure_future(self.gate.wait_cut())
        await asyncio.wait({everything, cut}, return_when=asyncio.FIRST_COMPLETED)
        cut.cancel()
        if not everything.done():
            _, late = await asyncio.wait(tasks, timeout=LATE_S)
            for task in late:
                if tasks[task] in self._playing:  # stuck in an env or renderer call
                    task.cancel()
            await everything
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()

    def _crashed(self, task: asyncio.Task) -> None:
        """A rollout task that raised (a batch that cannot be written): end the others, then re-raise."""
        if not task.cancelled() and task.exception() is not None:
            self.gate.cut(f"the run failed: {task.exception()}")

    @property
    def total(self) -> int:
        return sum(len(g) for g in self.groups)

    @property
    def rollout_ids(self) -> set[str]:
        return {spec.rollout_id for group in self.groups for spec in group}

    def _stop_error(self, written: int) -> VerbatimError:
        stop = self.stopped
        text = (f"{stop.reason}; the run stopped with {written} of {self.total} rollouts written "
                f"({self._interrupted} of them interrupted)")
        hint = "rerun the same command with --resume to play the rest" if written < self.total else None
        if stop.status == "failed":
            return EngineError(text, hint=f"check the engine; then {hint}" if hint else "check the engine")
        return RunInterrupted(text, exit_code=stop.exit_code, hint=hint)

    def _answered(self, group_id: str) -> None:
        self._first_answer[group_id].set()

    async def _one(self, player: RolloutPlayer, spec: RolloutSpec, follower: bool,
                   limit: asyncio.Semaphore, batcher: _Batcher) -> None:
        if follower:  # let the group's first request prefill the shared prompt
            event = self._first_answer[spec.group_id]
            try:
                await asyncio.wait_for(event.wait(), self.loop.step_timeout_s * 4)
            except asyncio.TimeoutError:
                pass
        async with limit:
            if self.stopped:
                return  # never started: --resume plays it
            rollout = await self._play_one(player, spec)
        if not self._first_answer[spec.group_id].is_set():
            self._first_answer[spec.group_id].set()  # the leader failed before answering: release the group
        await batcher.add(rollout)
        if self.on_rollout:
            self.on_rollout(rollout)

    async def _play_one(self, player: RolloutPlayer, spec: RolloutSpec) -> Rollout:
        self._playing.add(spec.rollout_id)
        try:
            rollout = await self._play_env(player, spec)
        except asyncio.CancelledError:
            if not self.gate.is_cut:
                raise
            rollout = self._stuck_record(spec)  # cancelled by _settle: stuck past the cut
        finally:
            self._playing.discard(spec.rollout_id)
        if spec.rollout_id in self.gate.cut_ids and rollout.status == "error":
            rollout = rollout.model_copy(update={"status": "interrupted"})
        if rollout.status == "interrupted":
            self._interrupted += 1
        return rollout

    async def _play_env(self, player: RolloutPlayer, spec: RolloutSpec) -> Rollout:
        """Play ``spec`` on a fresh env; a factory whose ``make()`` raises ends this rollout as ``error``."""
        try:
            env = self.env.make()
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code failing is data, not a crash
            return self._record(spec, "error", f"env factory make() {describe_failure(exc)}")
        return await player.play(spec, env)

    def _stuck_record(self, spec: RolloutSpec) -> Rollout:
        """An interrupted rollout whose tokens are out of reach (it was inside an env call)."""
        reason = f"{self.stopped.reason if self.stopped else 'the run stopped'} (inside an env or renderer call)"
        return self._record(spec, "interrupted", reason)

    @staticmethod
    def _record(spec: RolloutSpec, status: str, reason: str) -> Rollout:
        """A rollout without tokens that ended before its first request, for ``reason``."""
        info = {"session_id": spec.rollout_id, "seed": spec.seed, "stop_reason": reason}
        if spec.step is not None:
            info["step"] = spec.step
        return Rollout(run_id=spec.run_id, group_id=spec.group_id, rollout_id=spec.rollout_id,
                       task=jsonable(spec.task), status=status, error=reason, info=info)
