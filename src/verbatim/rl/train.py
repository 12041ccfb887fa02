"""``verbatim train``'s loop: play a step's groups, learn from exactly their tokens, push the weights.

Steps are counted from 1 (in the console, the files and the docs). Step ``n``:

1. play ``groups × group_size`` rollouts (:class:`~verbatim.harness.run.Run` with ``step=n``: the
   ordinary trace, ids prefixed ``sNNNN-``, each rollout's ``info["step"]``) with version ``n − 1``;
2. group-relative advantages, the learner's step on the traced tokens (in a worker thread), and
   its log π of each trained rollout before the update (π_old) with the correction's keep mask into
   ``RUN_DIR/trainer_logprobs/step-{n:06d}.parquet`` (atomic; ``verbatim view`` colours tokens by it);
3. the new weights into the engine under the cache policy, as version ``n`` (rl/weight_sync.py: served
   replicas reload a folder published atomically under ``RUN_DIR/weights/``, the router updating every
   replica before the version is used; a LoRA run pushes its adapter);
4. every ``checkpoint_every`` steps, at the last planned step and at the step a stopped run ends on,
   an atomic checkpoint ``RUN_DIR/checkpoints/step-{n:06d}`` (weights, optimizer, RNG, version,
   config, the metrics so far, and the model's config and tokenizer files: a loadable model folder);
   then, where ``--eval-every`` makes step ``n`` due, the evaluation of version ``n`` on held-out tasks
   (rl/evaluate.py: ``RUN_DIR/eval/step-{n:06d}``; the next steps play meanwhile, the next push waits), then
   the step's line ``"step": n`` in ``RUN_DIR/metrics.jsonl`` (with the evaluation's figures as ``eval``;
   the evaluation before the first step plays beside step 1 and has a line of its own, step 0).

The manifest says ``running`` while steps remain, ``completed`` once the last planned step is
trained, ``interrupted`` after a signal (or any stop) that leaves planned steps undone, and
``failed`` when an error ended the run.

``max_lag`` L: step ``n``'s rollouts start once ``n − 1 − L`` steps are trained, so with L ≥ 1 the
next step plays while this one trains, and its tokens carry the versions that sampled them (an
update lands mid-rollout). No token is more than L versions behind the trainer; the
correction's version-lag rule masks any that would be. With ``fixed_lag`` a step's push waits until
step ``n + L`` has played, so step ``n`` samples with version ``n − 1 − L`` exactly (fewer in the first
steps), every token of a step with one version.

Resume (``resume=True``): the newest complete checkpoint's weights, optimizer, RNG and version
are loaded, the engine gets those weights before any rollout, what steps past it recorded is moved
to ``RUN_DIR/discarded/`` (their metrics lines, logprob files and the rollouts sampled by their
versions: they are trained again), and the first unfinished step plays only its missing rollouts
(the written ones were sampled by the checkpoint's version, or by versions the trace records).
A step is counted once: its checkpoint is the commit. What a resume may go on from (and the two
settings it may change, ``--checkpoint-every`` and ``--steps``) is checked before the engine starts
(rl/train_resume.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from verbatim.datamodel import Rollout
from verbatim.engine.checkpoints import model_files
from verbatim.engine.protocol import CachePolicy
from verbatim.envs.base import EnvFactory
from verbatim.errors import RunInterrupted
from verbatim.harness.metrics_log import append_metrics, rewrite_metrics
from verbatim.harness.rollout import LoopConfig, RolloutPlayer
from verbatim.harness.run import Run, StopRequest
from verbatim.harness.store import RunLock, RunManifest, TraceWriter, clear_unfinished_writes, read_manifest
from verbatim.rl.evaluate import Evaluator, owes_evaluation
from verbatim.rl.plan import TrainPlan
from verbatim.rl.rerendered import closed_input, rerendered_input
from verbatim.rl.train_resume import CHECKPOINTS, set_aside, trained_steps
from verbatim.rl.train_step import step_input, step_logprobs, step_record
from verbatim.rl.weight_sync import WeightSync
from verbatim.trainer.checkpoint import latest_checkpoint
from verbatim.trainer.learner import Learner
from verbatim.trainer.logprob_files import step_file, write_logprobs


class TrainLoop:
    """Plays and trains the plan's steps on one engine (or a router over replicas)."""

    def __init__(self, plan: TrainPlan, loop: LoopConfig, learner: Learner | None, engine: Any, renderer: Any,
                 env: EnvFactory, tasks: Callable[[int], Sequence[dict[str, Any]]], out: Path,
                 manifest: RunManifest, model_dir: Path, *, served: bool = False, used: bool = False,
                 make_player: Callable[..., Any] = RolloutPlayer, evaluator: Evaluator | None = None) -> None:
        self.plan, self.loop, self.learner, self.engine = plan, loop, learner, engine
        self.make_player = make_player
        """Each step's :class:`Run` plays with it (an env's rollout loop, or an agent's endpoint)."""
        self.renderer, self.env, self.tasks = renderer, env, tasks
        self.out, self.manifest, self.model_dir = Path(out), manifest, Path(model_dir)
        self.used = used
        """The engine may hold what another run left (a server, or an engine the caller started and gives this
        loop): the loop begins it with its own weights, its prefix cache emptied. ``served``: the weights reach
        the engine through a published folder (a server reads it) rather than memory."""
        self.history: list[dict[str, Any]] = []
        self.engine_start_s = 0.0
        """Seconds the engine took to start (set by the command that started it)."""
        self.share_s = 0.0
        """Seconds the learner's weights took to move into the engine's shared buffer (:meth:`WeightSync.share`)."""
        self.on_step: Callable[[dict[str, Any]], None] | None = None
        self.on_rollout: Callable[[Rollout], None] | None = None
        self._trained = 0
        self._played = 0
        """Steps whose rollouts are all played (the producer's progress, which a fixed lag's push waits for)."""
        self._producing = False
        self._checkpointed = 0
        self._progress = asyncio.Condition()
        self._runs: set[Run] = set()
        self.stopped: StopRequest | None = None
        self.evaluator = evaluator
        """Plays the run's evaluations (``--eval-every``; rl/evaluate.py), None without them."""
        self._evaluating: tuple[int, asyncio.Task] | None = None
        """The evaluation a (re)started run owes its first step's weights, played beside that step."""
        self.weights = WeightSync(engine, self.out, self.model_dir, served=served, used=used,
                                  keep_adapters=plan.versions_in_flight)
        """How the learner's weights reach the engine (rl/weight_sync.py)."""

    @property
    def checkpoints(self) -> Path:
        return self.out / CHECKPOINTS

    # -- the whole run ----------------------------------------------------------------------

    async def train(self, *, resume: bool = False) -> list[dict[str, Any]]:
        """Train every step not yet checkpointed; returns the metrics of all steps."""
        with RunLock(self.out):
            clear_unfinished_writes(self.out)
            writer = TraceWriter(self.out, self.manifest)  # "running", with the engine's block size, before any step
            try:
                self.share_s = await self.weights.share(self.learner)
                await self._steps(await self._restore(resume))
            except (RunInterrupted, asyncio.CancelledError, KeyboardInterrupt):
                with suppress(Exception):  # the stop's own error is the one to show
                    self._record_status(writer, "interrupted")
                raise
            except BaseException:
                with suppress(Exception):
                    self._record_status(writer, "failed")
                raise
            self._record_status(writer, "completed")
        return self.history

    async def _steps(self, start: int) -> None:
        self._trained = self._checkpointed = self._played = start
        self._producing = True
        queue: asyncio.Queue = asyncio.Queue()
        producer = asyncio.create_task(self._produce(start, queue))
        if self._owes_evaluation(start):  # before the first step, or one a stop or a kill cut short: a stop
            # does not cut it (the step being trained ends with it), it lasts no longer than an evaluation
            owed = self.evaluator.run(start, self.learner.version)
            self._evaluating = (start, asyncio.create_task(self._evaluate(owed, self.learner.version)))
        try:
            for k in range(start, self.plan.steps):
                played = await self._next(queue, producer)
                await self._learn(k, *played)
                if self.stopped is not None and k + 1 < self.plan.steps:
                    raise RunInterrupted(f"{self.stopped.reason}: stopped after step {k + 1} of "
                                         f"{self.plan.steps}", exit_code=self.stopped.exit_code,
                                         hint="rerun the same command with --resume to go on")
            await self._settle_evaluation()  # a resume whose steps were all trained owed only the last one
            if self.stopped is not None and self._owes_evaluation(self.plan.steps):
                raise RunInterrupted(f"{self.stopped.reason}: stopped before the evaluation after the last step",
                                     exit_code=self.stopped.exit_code,
                                     hint="rerun the same command with --resume to evaluate")
        except RunInterrupted:
            await self._keep_last_step()
            raise
        finally:
            producer.cancel()
            owed = [self._evaluating[1]] if self._evaluating is not None else []
            for task in owed:
                task.cancel()
            await asyncio.gather(producer, *owed, return_exceptions=True)

    def _record_status(self, writer: TraceWriter, status: str) -> None:
        """The run's status in its manifest (as the steps' plays last wrote it, with the engine's block size)."""
        writer.write_manifest(read_manifest(self.out).model_copy(update={"status": status}))

    def stop(self, request: StopRequest, grace_s: float = 30.0) -> None:
        """Finish the step being trained, then stop; rollouts playing are stopped as ``verbatim run`` stops."""
        first = self.stopped is None
        self.stopped = self.stopped or request
        for run in list(self._runs):
            run.stop(request, grace_s if first else 0)

    async def _restore(self, resume: bool) -> int:
        """The step to start from (0, or the newest checkpoint's), with the learner's weights in the engine: a
        server gets them whatever it held (another run's weights and KV, which it would otherwise sample this
        run's first step with), an engine this run started only when they are not its own."""
        start = await self._restored(resume)
        if self.used or self.learner.trains_adapter:  # a LoRA run serves its adapter from version 0 on
            await self.weights.begin(self.learner)
        elif self.learner.version > self.engine.version:
            await self.weights.push(self.learner, CachePolicy.FLUSH)
        return start

    async def _restored(self, resume: bool) -> int:
        """The learner and the metrics as of the newest checkpoint (none: as of step 0); returns its step."""
        if not resume:
            rewrite_metrics(self.out, [])
            return 0
        latest = latest_checkpoint(self.checkpoints)
        set_aside(self.out, trained_steps(self.out), self.plan.max_lag)  # steps trained past it: trained again
        if latest is None:
            rewrite_metrics(self.out, [])
            return 0
        state = await asyncio.to_thread(self.learner.restore, latest)
        self.learner.version = int(state["version"])
        self.history = list(state.get("metrics", []))
        rewrite_metrics(self.out, self.history)
        return int(state["step"])

    # -- playing ahead ----------------------------------------------------------------------

    async def _produce(self, start: int, queue: asyncio.Queue) -> None:
        try:
            await self._play_steps(start, queue)
        finally:
            async with self._progress:  # a fixed lag's push waits for no step that will not be played
                self._producing = False
                self._progress.notify_all()

    async def _play_steps(self, start: int, queue: asyncio.Queue) -> None:
        for k in range(start, self.plan.steps):
            async with self._progress:
                await self._progress.wait_for(lambda k=k: self._trained >= k - self.plan.max_lag)
            if self.stopped is not None:
                return
            began = time.perf_counter()
            run = self.step_run(k)
            self._runs.add(run)
            try:
                # only the steps a killed run may have begun have rollouts on disk to look for
                await run.play(resume=True, hold_lock=False, look_on_disk=k <= start + self.plan.max_lag)
            finally:
                self._runs.discard(run)
            await queue.put((run.rollouts, run.summary, time.perf_counter() - began))
            async with self._progress:
                self._played = k + 1
                self._progress.notify_all()

    async def _next(self, queue: asyncio.Queue, producer: asyncio.Task) -> tuple:
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({getter, producer}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
        producer.result()  # raises the play's error (a stopped or failed run)
        raise RunInterrupted(f"{self.stopped.reason if self.stopped else 'stopped'}: no more steps were played",
                             hint="rerun the same command with --resume to go on")

    def step_run(self, k: int) -> Run:
        """The play of step ``k + 1`` (``k`` steps trained before it)."""
        plan = self.plan.run_plan(self.manifest.run_id, k)
        run = Run(plan, self.loop, self.engine, self.renderer, self.env, self.tasks(k), self.out, self.manifest,
                  make_player=self.make_player)
        run.whole_status = "running"  # the run is complete when its last step is trained (train records it)
        run.on_rollout = self.on_rollout
        return run

    # -- learning ---------------------------------------------------------------------------

    async def _learn(self, k: int, rollouts: list[Rollout], summary: Any, rollout_s: float) -> None:
        """Train step ``k + 1`` (``k`` steps are trained) on its rollouts, push the weights, commit it."""
        n = k + 1
        rows, row_info = step_input(rollouts, self.plan.advantage,
                                    allow_truncated=self.plan.allow_truncated_sampling)
        if self.plan.context != "traced":
            build = rerendered_input if self.plan.context == "rerendered" else closed_input
            rows, more = await asyncio.to_thread(build, rows, rollouts, self.renderer)
            row_info |= more
        version = self.learner.version
        learned = await asyncio.to_thread(self.learner.train_step, rows, (k, self.plan.steps))
        found, meta = step_logprobs(n, version, rows, learned, self.manifest.model,
                                    self.learner.config.correction.model_dump(mode="json"))
        if self.plan.context != "traced":  # its rows are not the trace's: no per-token file to pin to them
            found, meta = [], meta | {"context": self.plan.context}
        await asyncio.to_thread(write_logprobs, step_file(self.out, n), found, meta)  # before the commit: a
        # step trained again after a crash writes it again
        await self._wait_for_older_steps(n)
        await self._settle_evaluation()  # its weights stay in the engine until it ends
        began = time.perf_counter()
        pushed = await self.weights.push(self.learner, self.plan.cache_policy)
        sync_s = time.perf_counter() - began
        times = {"rollout": rollout_s, "train": learned.get("train_s", 0.0), "weight_sync": sync_s,
                 "policy": learned.get("policy_s", 0.0), "update": learned.get("update_s", 0.0)}
        record = step_record(n, self.learner.version, rollouts, summary, row_info, learned, times) | pushed
        self.history.append(record)
        record["checkpoint_s"] = 0.0
        if n % self.plan.checkpoint_every == 0 or n == self.plan.steps or self.stopped is not None:
            record["checkpoint_s"] = await self._checkpoint(n)
        async with self._progress:  # the next steps may play while this version is evaluated
            self._trained = n
            self._progress.notify_all()
        evaluated = await self._stoppable_evaluation(n) if self._owes_evaluation(n) and self.stopped is None \
            else None
        if evaluated is not None:  # else none was due, or a stop came first or cut it: a resume finishes it
            record["eval"] = evaluated
        append_metrics(self.out, record)
        if self.on_step:
            self.on_step(record)

    # -- evaluating -------------------------------------------------------------------------

    def _owes_evaluation(self, step: int) -> bool:
        """The weights after ``step`` are to be evaluated and their line records no evaluation yet."""
        return self.evaluator is not None and owes_evaluation(self.evaluator.plan, step, self.plan.steps,
                                                              self.history)

    async def _stoppable_evaluation(self, step: int) -> dict[str, Any] | None:
        """The evaluation after ``step``, which a stop cuts (None then: the step's line goes without it, and a
        resume, from this step's checkpoint, finishes it)."""
        run = self.evaluator.run(step, self.learner.version)
        self._runs.add(run)
        try:
            return await self._evaluate(run, self.learner.version)
        except RunInterrupted:
            if self.stopped is None:
                raise
            return None
        finally:
            self._runs.discard(run)

    async def _evaluate(self, run: Run, version: int) -> dict[str, Any]:
        """``run``, the evaluation of the engine's weights, ``version``; its figures, with the seconds it took."""
        began = time.perf_counter()
        found = await self.evaluator.play(run, version)
        return found | {"wall_s": round(time.perf_counter() - began, 3)}

    async def _settle_evaluation(self) -> None:
        """Wait for the evaluation begun with the run (before its first push) and record it: step 0's line of its
        own, or the eval object of the step the run resumed from."""
        owed, self._evaluating = self._evaluating, None
        if owed is None:
            return
        step, task = owed
        found = await task
        line = next((r for r in self.history if r.get("step") == step), None)
        if line is None:
            line = {"step": step, "version": found["version"]}
            self.history = sorted([*self.history, line], key=lambda r: r.get("step", 0))
        line["eval"] = found
        rewrite_metrics(self.out, self.history)
        if self.on_step:
            self.on_step(line)

    async def _wait_for_older_steps(self, n: int) -> None:
        """Under a fixed lag, hold step ``n``'s weights back until step ``n + L``, the last to sample with older
        ones, has played."""
        if not self.plan.fixed_lag or self.plan.max_lag == 0:
            return
        last = min(n + self.plan.max_lag, self.plan.steps)
        async with self._progress:
            await self._progress.wait_for(lambda: self._played >= last or not self._producing)

    async def _keep_last_step(self) -> None:
        """A stopped run checkpoints the last step it trained, where the interval skipped it (not a step the
        stop cut short: the learner must hold exactly what that step's metrics line records)."""
        n = self._trained
        if n <= self._checkpointed or not self.history:
            return
        last = self.history[-1]
        if last.get("step") == n and last.get("version") == self.learner.version:
            await self._checkpoint(n)

    async def _checkpoint(self, n: int) -> float:
        """Commit step ``n`` (the learner after it, the metrics so far) as a checkpoint; returns the seconds."""
        state = {"version": self.learner.version, "config": self.manifest.config, "metrics": self.history}
        began = time.perf_counter()
        await asyncio.to_thread(self.learner.save, self.checkpoints, n, state, self.plan.keep_checkpoints,
                                model_files(self.model_dir))
        self._checkpointed = n
        return round(time.perf_counter() - began, 3)
