"""``verbatim run``: build the engine, renderer, env and tasks from options, play, report.

SIGINT and SIGTERM stop a playing run gracefully (:meth:`Run.stop`): the first one starts no
more rollouts and gives the playing ones ``stop_grace_s`` to finish, a second one cuts them at
once; either way every rollout in flight is written (as ``interrupted`` if it did not finish),
the manifest says ``interrupted``, the summary is printed and the exit code is 130 (SIGINT) or
143 (SIGTERM).
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from verbatim.datamodel import Frozen, Rollout
from verbatim.durable import strict_json
from verbatim.engine.models import resolve
from verbatim.engine.protocol import CachePolicy, Sampling
from verbatim.engine.router import Router
from verbatim.engine.runtime import DEFAULT_MAX_MODEL_LEN, MAX_SEED
from verbatim.engine.server_url import redact
from verbatim.errors import VerbatimError
from verbatim.harness.preflight import model_vocab_size, preflight
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, RunPlan, StopRequest
from verbatim.harness.store import RunManifest
from verbatim.harness.summary import RunSummary
from verbatim.jobs.compose import EngineChoice, default_renderer, episode_source, existing_run_id, players
from verbatim.jobs.engine_start import started
from verbatim.paths import check_output_file, check_run_dir
from verbatim.trackers.fanout import TrackerNames, open_trackers


class RunOptions(Frozen):
    """Everything `verbatim run` was asked to do (recorded in the manifest)."""

    env: str | None = None
    agent: str | None = None
    """``FILE.py:FUNCTION`` or ``module:function``: an agent played through the endpoint instead of an env."""
    agent_cmd: str | None = None
    """A command run once per rollout, the endpoint in OPENAI_BASE_URL (``verbatim.agents.command``)."""
    agent_timeout_s: float = Field(default=600.0, gt=0)
    tasks: str | None = None
    model: str = "default"
    renderer: str | None = None
    groups: int | None = Field(default=None, ge=1)
    """None: every task of the task file, else DEFAULT_GROUPS from the env's generator."""
    group_size: int = Field(default=4, ge=1)
    max_turns: int | None = Field(default=None, ge=1)
    """None: as many turns as the env's tasks may need (:func:`verbatim.envs.registry.default_max_turns`)."""
    max_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    out: str = "runs/latest"
    engine: str = "inproc"
    urls: tuple[str, ...] = ()
    route: str | None = None
    """Routing policy over the --url replicas (default sticky_least_loaded+group when there are several)."""
    high_water: float = Field(default=0.9, gt=0, le=1)
    admission: bool = True
    cache_policy: str = "keep"
    concurrency: int = Field(default=16, ge=1)
    max_model_len: int = Field(default=DEFAULT_MAX_MODEL_LEN, ge=256)
    kv_cache_gib: int = Field(default=2, ge=1)
    engine_gpu_memory: float | None = Field(default=None, gt=0, le=1)
    engine_tensor_parallel: int = Field(default=1, ge=1)
    stop_grace_s: float = Field(default=30.0, ge=0)
    """After SIGINT/SIGTERM, how long the playing rollouts may take to finish before they are cut."""
    resume: bool = False
    log: TrackerNames = ()
    """Experiment trackers the summary and a table of rollouts are also sent to (``--log``)."""


DEFAULT_GROUPS = 2
"""Groups a run plays from the env's own task generator when --groups is not given."""


def with_tasks(options: RunOptions, factory: Any) -> tuple[RunOptions, list[dict[str, Any]]]:
    """The tasks to play, and the options with --groups and --max-turns filled in where not given.

    A task file gives one group per task unless --groups says fewer; the env's generator gives
    DEFAULT_GROUPS. --max-turns defaults to the most turns the env's tasks may need.
    """
    from verbatim.envs.registry import default_max_turns, load_tasks

    if options.tasks:
        tasks = list(load_tasks(options.tasks))  # an empty file is refused there
        groups = options.groups or len(tasks)
    else:
        groups = options.groups or DEFAULT_GROUPS
        tasks = list(factory.tasks(groups, options.seed))
    max_turns = options.max_turns or default_max_turns(factory, tasks[:groups])
    return options.model_copy(update={"groups": groups, "max_turns": max_turns}), tasks


def _plan(options: RunOptions, run_id: str) -> RunPlan:
    return RunPlan(run_id=run_id, groups=options.groups, group_size=options.group_size, seed=options.seed,
                   concurrency=options.concurrency, batch_size=max(options.group_size, 4))


def engine_choice(options: RunOptions) -> EngineChoice:
    return EngineChoice(kind=options.engine, model=options.model, urls=options.urls, route=options.route,
                        high_water=options.high_water, admission=options.admission,
                        max_model_len=options.max_model_len, kv_cache_gib=options.kv_cache_gib, seed=options.seed,
                        gpu_memory=options.engine_gpu_memory, tensor_parallel=options.engine_tensor_parallel)


def prepare_run(options: RunOptions) -> tuple[Run, Any]:
    """Resolve every input before anything is written or started (bad input fails here, exit 2)."""
    from verbatim.jobs.compose import make_engine
    from verbatim.jobs.placement import check_here
    from verbatim.renderers.registry import get_renderer

    policy = CachePolicy.parse(options.cache_policy)
    factory = episode_source(options.env, options.agent, agent_cmd=options.agent_cmd)
    options, tasks = with_tasks(options, factory)
    model_dir = resolve(options.model)  # the tokenizer is local even when the engine is a server
    renderer_name = options.renderer or default_renderer(options.model)
    renderer = get_renderer(renderer_name, model_dir=model_dir)
    out = Path(options.out)
    run_id = existing_run_id(out) if options.resume else None
    run_id = run_id or uuid.uuid4().hex[:12]
    plan = _plan(options, run_id)
    loop = LoopConfig(max_turns=options.max_turns, context_budget=options.max_model_len, cache_policy=policy,
                      sampling=Sampling(max_tokens=options.max_tokens, temperature=options.temperature))
    choice = engine_choice(options)
    engine = make_engine(choice)  # constructing starts nothing
    check_here(choice)
    urls = [redact(u) for u in options.urls]  # no credentials in traces
    route = engine.config.label if isinstance(engine, Router) else None
    manifest = RunManifest(
        run_id=run_id, model=str(model_dir or options.model), renderer=renderer_name,
        engine={"kind": options.engine, "block_size": engine.block_size,
                "cache_policy": policy.value, "urls": urls, "route": route},
        config={"options": options.model_dump(exclude={"resume"}) | {"urls": urls},
                "plan": plan.model_dump(exclude={"run_id"})},
    )
    run = Run(plan, loop, engine, renderer, factory, tasks, out, manifest,
              make_player=players(options.agent or options.agent_cmd, options.model, options.agent_timeout_s))
    run.check_out_dir(options.resume)
    if options.env is not None:  # an agent's prompts are known only when it asks
        preflight(run, vocab_size=model_vocab_size(model_dir), max_model_len=options.max_model_len,
                  max_tokens=options.max_tokens)
    return run, engine


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_on_signals(run: Run, console: Console, grace_s: float) -> Callable[[], None]:
    """Route SIGINT/SIGTERM to ``run.stop`` while it plays; returns the function that undoes it."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if run.stopped is None:
            console.print(f"{name}: no new rollouts; the playing ones get {grace_s:g}s to finish "
                          f"({name} again stops them now)")
        else:
            console.print(f"{name} again: stopping the playing rollouts now")
        run.stop(StopRequest(f"interrupted by {name}", "interrupted", exit_code=128 + signum), grace_s)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)

    def undo() -> None:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)

    return undo


async def execute(run: Run, engine: Any, resume: bool, console: Console, stop_grace_s: float = 30.0,
                  on_rollout: Callable[[Rollout], None] | None = None) -> RunSummary:
    """Start the engine, then play with a progress bar. Until the engine answered nothing is written or
    shown but a transient spinner: a ``--url`` that is not a vLLM server ends here, exit code 2."""
    async with started(engine, console, run.out, begin_from=Path(run.manifest.model)) as start_s:
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


def run_command(options: RunOptions, console: Console, summary_json: str | None = None) -> RunSummary:
    check_run_dir(options.out)
    if summary_json:
        check_output_file(summary_json, "--summary-json", created=Path(options.out))  # before the run, not after it
    run, engine = prepare_run(options)
    config = options.model_dump(mode="json", exclude={"log"}) | {"urls": [redact(u) for u in options.urls]}
    trackers = open_trackers(options.log, Path(options.out), config)  # a tracker that is not installed: exit 2
    try:
        summary = asyncio.run(execute(run, engine, options.resume, console, options.stop_grace_s, trackers.rollout))
        trackers.step(summary.model_dump())
    except VerbatimError:  # a stopped run: what it wrote is summarised before the one-line reason
        if run.summary is not None:
            console.print(summary_table(run.summary, run.out))
            _write_summary(run.summary, summary_json)
        raise
    finally:
        trackers.close()
    console.print(summary_table(summary, run.out))
    warn_ignored_fields(summary.ignored_request_fields, console)
    _write_summary(summary, summary_json)
    return summary


def warn_ignored_fields(fields: dict[str, int], console: Console) -> None:
    """One line, once per run, for request fields the run's sampling settings overrode."""
    if fields:
        listed = ", ".join(f"{name} ({count}×)" for name, count in fields.items())
        console.print(f"warning: the agent's requests set {listed}; the run's sampling settings govern every "
                      "request (μ describes the run's policy), so these were ignored")


def _write_summary(summary: RunSummary, path: str | None) -> None:
    if path:
        write_summary_json(path, summary.model_dump())


def write_summary_json(path: str, data: dict) -> None:
    """``--summary-json``: the summary as indented strict JSON (a non-finite number as null; its folder may be
    one the run created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(strict_json(data, indent=2) + "\n")


def summary_table(summary: RunSummary, out: Path) -> Table:
    table = Table(title=f"run summary ({out})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = summary.model_dump()
    rows["cache_hit_rate"] = f"{summary.cache_hit_rate:.1%}"
    if summary.success_rate is not None:
        rows["success_rate"] = f"{summary.success_rate:.1%}"
    for key, value in rows.items():
        if isinstance(value, float):
            value = f"{value:.3f}"
        table.add_row(key, "-" if value is None else str(value))
    table.caption = STATUS_CAPTION
    return table


STATUS_CAPTION = ("status ok: the env ended the episode (solved or not; see solved); truncated: --max-turns came "
                  "first; error: see 'verbatim show RUN'")
