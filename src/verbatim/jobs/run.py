"""A rollout run from one config: :class:`RunOptions` and :func:`run_rollouts`.

``verbatim run`` maps its flags onto :class:`RunOptions` and calls :func:`run_rollouts`, which prints only its
progress; a user's script or a test does the same, so the env or agent, tasks, renderer and engine are put
together in one place (:func:`prepare_run`). Bad input is refused (one line, exit 2 from the CLI) before the
engine starts or anything is written.

SIGINT and SIGTERM stop a playing run gracefully (:meth:`Run.stop`): the first one starts no
more rollouts and gives the playing ones ``stop_grace_s`` to finish, a second one cuts them at
once; either way every rollout in flight is written (as ``interrupted`` if it did not finish),
the manifest says ``interrupted``, and the error carries exit code 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from verbatim.datamodel import Rollout
from verbatim.engine.models import resolve
from verbatim.engine.router import Router
from verbatim.errors import InputError
from verbatim.harness.config_changes import config_differences
from verbatim.harness.preflight import model_vocab_size, preflight
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, RunPlan, StopRequest
from verbatim.harness.store import MANIFEST, RunManifest, read_manifest
from verbatim.harness.summary import RunSummary
from verbatim.jobs.compose import (
    default_renderer,
    engine_record,
    episode_source,
    existing_run_id,
    playable_model,
    players,
)
from verbatim.jobs.config import RunOptions, flags_of
from verbatim.jobs.engine_start import given, on_engine_loop, started
from verbatim.jobs.run_record import CONFIG_FILE, recorded_config, write_config
from verbatim.jobs.stop_signals import on_stop_signals
from verbatim.paths import check_run_dir
from verbatim.trackers.fanout import open_trackers


def with_tasks(options: RunOptions, factory: Any) -> tuple[RunOptions, list[dict[str, Any]]]:
    """The tasks to play, and the options with --groups and --max-turns filled in where not given.

    A task file gives one group per task unless --groups says fewer; the env's generator gives the options'
    ``DEFAULT_GROUPS`` (an evaluation's: from the env's held-out part, envs/held_out.py). --max-turns defaults to
    the most turns the env's tasks may need.
    """
    from verbatim.envs.held_out import eval_tasks
    from verbatim.envs.registry import default_max_turns, load_tasks

    play = options.play
    if play.tasks:
        tasks = list(load_tasks(play.tasks))  # an empty file is refused there
        groups = options.groups or len(tasks)
    else:
        groups = options.groups or options.DEFAULT_GROUPS
        tasks = eval_tasks(factory, groups, options.seed) if options.HELD_OUT else \
            list(factory.tasks(groups, options.seed))
    play = play.model_copy(update={"max_turns": play.max_turns or default_max_turns(factory, tasks[:groups])})
    return options.model_copy(update={"groups": groups, "play": play}), tasks


def _plan(options: RunOptions, run_id: str) -> RunPlan:
    return RunPlan(run_id=run_id, groups=options.groups, group_size=options.group_size, seed=options.seed,
                   concurrency=options.concurrency, batch_size=max(options.group_size, 4))


def prepare_run(options: RunOptions, engine: Any | None = None) -> tuple[Run, Any]:
    """Resolve every input before anything is written or started (bad input fails here, exit 2); ``engine``:
    one the caller started, used instead of the config's."""
    from verbatim.jobs.compose import make_engine
    from verbatim.jobs.placement import check_here
    from verbatim.renderers.registry import get_renderer

    model = playable_model(options.engine.model)  # a training run's folder: its newest checkpoint
    options = options.model_copy(update={"engine": options.engine.model_copy(update={"model": model})})
    policy = options.cache_policy
    factory = episode_source(options.play)
    options, tasks = with_tasks(options, factory)
    play, choice, out = options.play, options.engine, Path(options.output.out)
    if options.output.resume:
        check_same_settings(options, out)
    model_dir = resolve(choice.model)  # the tokenizer is local even when the engine is a server
    renderer_name = play.renderer or default_renderer(choice.model)
    renderer = get_renderer(renderer_name, model_dir=model_dir)
    run_id = existing_run_id(out) if options.output.resume else None
    run_id = run_id or uuid.uuid4().hex[:12]
    plan = _plan(options, run_id)
    loop = LoopConfig(max_turns=play.max_turns, context_budget=choice.max_model_len, cache_policy=policy,
                      sampling=options.sampling.sampling())
    engine = make_engine(choice, options.routing, options.seed) if engine is None else engine  # starts nothing
    check_here(choice)
    recorded = options.recorded()  # no credentials in traces
    route = engine.config.label if isinstance(engine, Router) else None
    manifest = RunManifest(
        run_id=run_id, model=str(model_dir or choice.model), renderer=renderer_name,
        engine=engine_record(choice, engine, policy.value, list(recorded.engine.urls), route),
        config={"options": recorded.model_dump(mode="json", exclude={"output": {"resume"}}),
                "plan": plan.model_dump(exclude={"run_id"})},
    )
    run = Run(plan, loop, engine, renderer, factory, tasks, out, manifest, make_player=players(play, choice.model))
    run.check_out_dir(options.output.resume)
    if play.env is not None:  # an agent's prompts are known only when it asks
        preflight(run, vocab_size=model_vocab_size(model_dir), max_model_len=choice.max_model_len,
                  max_tokens=options.sampling.max_tokens)
    return run, engine


def check_same_settings(options: RunOptions, out: Path) -> None:
    """A resume goes on with the settings that played the recorded rollouts (``config.toml``, or the manifest's
    config for a run written before it): another agent, env, model or sampling is refused before anything
    starts, so the record keeps saying what produced every rollout."""
    if not (out / MANIFEST).exists():
        return  # refused as "holds no run to resume" by Run.check_out_dir
    previous = read_manifest(out).config
    if "train" in previous:
        raise InputError(f"--resume: {out} holds a 'verbatim train' run, not a 'verbatim run' run",
                         hint="resume it with 'verbatim train --resume', or pass another --out")
    if "options" not in previous:
        raise InputError(f"--resume: {out}'s manifest records no settings of 'verbatim run', so going on with "
                         "them cannot be checked", hint="pass another --out")
    saved = recorded_config(out, flags_of(type(options)))
    if saved is None:
        saved = type(options).model_validate(previous["options"])
    changed = config_differences(saved.settings(), options.settings())
    if changed:
        raise InputError(f"--resume with a changed config: {'; '.join(changed)}",
                         hint=f"resume with the first run's settings (--config {out / CONFIG_FILE} --resume "
                              "repeats them), or pass another --out")


def stop_on_signals(run: Run, console: Console, grace_s: float) -> Callable[[], None]:
    """Route SIGINT/SIGTERM to ``run.stop`` while it plays; returns the function that undoes it."""

    def on_signal(sig: signal.Signals) -> None:
        if run.stopped is None:
            console.print(f"{sig.name}: no new rollouts; the playing ones get {grace_s:g}s to finish "
                          f"({sig.name} again stops them now)")
        else:
            console.print(f"{sig.name} again: stopping the playing rollouts now")
        run.stop(StopRequest(f"interrupted by {sig.name}", "interrupted", exit_code=128 + sig), grace_s)

    return on_stop_signals(on_signal)


async def execute(run: Run, engine: Any, resume: bool, console: Console, stop_grace_s: float = 30.0,
                  on_rollout: Callable[[Rollout], None] | None = None, *, engine_given: bool = False,
                  record: Callable[[], None] | None = None) -> RunSummary:
    """Start the engine (unless it was given: then begin it with the run's model), call ``record`` (the run
    folder's config.toml), then play with a progress bar. Until the engine answered nothing is written or shown
    but a transient spinner: a ``--url`` that is not a vLLM server ends here, exit code 2."""
    model = Path(run.manifest.model)
    async with (given(engine, model) if engine_given else started(engine, console, run.out, begin_from=model)) \
            as start_s:
        if record is not None:
            record()
        undo_signals = stop_on_signals(run, console, stop_grace_s)  # until here Ctrl-C ends a slow start at once
        try:
            summary = await _play_with_progress(run, resume, console, on_rollout)
        finally:
            undo_signals()
    return summary.model_copy(update={"engine_start_s": round(start_s, 3)})


async def _play_with_progress(run: Run, resume: bool, console: Console,
                              on_rollout: Callable[[Rollout], None] | None = None) -> RunSummary:
    total = sum(len(g) for g in run.groups)
    stats = {"prompt": 0, "cached": 0, "generated": 0}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[live]}"), console=console, transient=False) as progress:
        done = len(run.completed_ids()) if resume else 0
        bar = progress.add_task("rollouts", total=total, completed=done, live="")

        def tick(rollout: Rollout) -> None:
            for turn in rollout.turns:
                stats["prompt"] += turn.prompt_tokens
                stats["cached"] += turn.cached_tokens
                stats["generated"] += turn.completion_tokens
            elapsed = progress.tasks[0].elapsed or 1e-9
            hit = stats["cached"] / stats["prompt"] if stats["prompt"] else 0.0
            progress.update(bar, advance=1, live=f"{stats['generated'] / elapsed:.1f} tok/s · cache hit {hit:.0%}")
            if on_rollout is not None:
                on_rollout(rollout)

        run.on_rollout = tick
        return await run.play(resume=resume)


def run_rollouts(options: RunOptions, console: Console | None = None, *,
                 on_end: Callable[[Run], None] | None = None, engine: Any | None = None) -> RunSummary:
    """Play the run ``options`` describe; returns its summary (sent to the trackers of ``--log`` too).

    ``on_end`` sees the run however playing ends: after a stop or a failure, ``run.summary`` holds what was
    written (the error is raised after it)."""
    console = console or Console(stderr=True)
    check_run_dir(options.output.out)
    run, engine_used = prepare_run(options, engine)
    config = options.recorded().model_dump(mode="json", exclude={"output": {"log"}})
    trackers = open_trackers(options.output.log, Path(options.output.out), config)  # not installed: exit 2
    try:
        resolved = type(options).model_validate(run.manifest.config["options"])  # --groups, --max-turns filled in
        summary = on_engine_loop(execute(run, engine_used, options.output.resume, console, options.stop_grace_s,
                                         trackers.rollout, engine_given=engine is not None,
                                         record=lambda: write_config(run.out, flags_of(type(options)), resolved,
                                                                     options.COMMAND)), engine)
        trackers.step(summary.model_dump())
        return summary
    finally:
        trackers.close()
        if on_end is not None:
            on_end(run)
