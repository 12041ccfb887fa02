"""A run: groups of rollouts over tasks, played concurrently, written crash-safe, resumable.

Group members share their task prompt. The first member of a group sends its
first request alone; the others start once it has been answered, so the shared
prompt is prefilled once and every other member reads it from the prefix cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from ..datamodel import Frozen, Rollout
from ..envs.base import EnvFactory
from ..errors import InputError
from .rollout import LoopConfig, RolloutPlayer, RolloutSpec
from .store import RunManifest, TraceWriter, read_manifest, read_run
from .summary import RunSummary, summarize


class RunPlan(Frozen):
    """Which rollouts a run consists of."""

    run_id: str
    groups: int = Field(default=2, ge=1)
    group_size: int = Field(default=4, ge=1)
    seed: int = 0
    concurrency: int = Field(default=16, ge=1)
    batch_size: int = Field(default=8, ge=1)
    """Rollouts per trace file: a crash loses at most this many finished rollouts."""


def plan_specs(plan: RunPlan, tasks: Sequence[dict[str, Any]]) -> list[list[RolloutSpec]]:
    if len(tasks) < plan.groups:
        raise InputError(f"{plan.groups} groups need {plan.groups} tasks, only {len(tasks)} available",
                         hint="lower --groups or add tasks")
    groups = []
    for g in range(plan.groups):
        group_id = f"g{g:04d}"
        groups.append([
            RolloutSpec(run_id=plan.run_id, group_id=group_id, rollout_id=f"{group_id}-r{i:02d}",
                        task=dict(tasks[g]), seed=plan.seed * 1_000_003 + g * plan.group_size + i)
            for i in range(plan.group_size)
        ])
    return groups


class _Batcher:
    """Collects finished rollouts and writes them in batches (serialised, crash-safe)."""

    def __init__(self, writer: TraceWriter, batch_size: int) -> None:
        self.writer, self.batch_size = writer, batch_size
        self.pending: list[Rollout] = []
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


class Run:
    """Plays a plan's rollouts on an engine and writes them to ``out``."""

    def __init__(self, plan: RunPlan, loop: LoopConfig, engine: Any, renderer: Any, env: EnvFactory,
                 tasks: Sequence[dict[str, Any]], out: Path, manifest: RunManifest) -> None:
        self.plan, self.loop, self.engine, self.renderer, self.env = plan, loop, engine, renderer, env
        self.groups = plan_specs(plan, tasks)
        self.out, self.manifest = Path(out), manifest
        self._first_answer: dict[str, asyncio.Event] = {}
        self.on_rollout: Callable[[Rollout], None] | None = None

    def completed_ids(self) -> set[str]:
        if not (self.out / "manifest.json").exists():
            return set()
        return {r.rollout_id for r in read_run(self.out).rollouts}

    def check_out_dir(self, resume: bool) -> None:
        """Refuse to overwrite a run, or to resume one with a different plan (before anything starts)."""
        if not (self.out / "manifest.json").exists():
            return
        if not resume:
            raise InputError(f"{self.out} already holds a run", hint="pass --resume to finish it, or another --out")
        previous = read_manifest(self.out)
        if previous.config.get("plan") != self.manifest.config.get("plan"):
            raise InputError(f"--resume: {self.out} was written with a different plan",
                             hint="use the same --env/--groups/--group-size/--seed as the first run")

    async def play(self, *, resume: bool = False) -> RunSummary:
        self.check_out_dir(resume)
        done = self.completed_ids() if resume else set()
        writer = TraceWriter(self.out, self.manifest)
        batcher = _Batcher(writer, self.plan.batch_size)
        limit = asyncio.Semaphore(self.plan.concurrency)
        player = RolloutPlayer(self.engine, self.renderer, self.loop, on_first_request=self._answered)
        started = time.perf_counter()
        tasks = []
        for group in self.groups:
            todo = [s for s in group if s.rollout_id not in done]
            self._first_answer[group[0].group_id] = asyncio.Event()
            for index, spec in enumerate(todo):
                tasks.append(asyncio.create_task(self._one(player, spec, index > 0, limit, batcher)))
        try:
            await asyncio.gather(*tasks)
        finally:
            await batcher.flush()
        writer.write_manifest(self.manifest.model_copy(update={"status": "completed"}))
        trace = read_run(self.out)
        return summarize(trace.rollouts, block_size=getattr(self.engine, "block_size", 128),
                         wall_s=time.perf_counter() - started, renderer=self.renderer)

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
            rollout = await player.play(spec, self.env.make())
        if not self._first_answer[spec.group_id].is_set():
            self._first_answer[spec.group_id].set()  # the leader failed before answering: release the group
        await batcher.add(rollout)
        if self.on_rollout:
            self.on_rollout(rollout)
