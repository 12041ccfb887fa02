"""A training run from one config: :class:`TrainConfig` and :func:`run_training`.

``verbatim train`` maps its flags onto a :class:`TrainConfig` and calls :func:`run_training`; a torchrun
worker or a user's own script does the same, so the env, model, renderer, learner and loop are put
together in one place. Bad input is refused (one line, exit 2 from the CLI) before the engine starts or
anything is written; then the engine starts, the trainer loads the same weights, and
:class:`~verbatim.rl.train.TrainLoop` runs the steps.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from verbatim.engine.models import resolve
from verbatim.engine.protocol import Sampling
from verbatim.errors import InputError
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, StopRequest
from verbatim.harness.store import RunManifest
from verbatim.jobs.config import TrainConfig, flags_of
from verbatim.jobs.engine_start import given, on_engine_loop, started
from verbatim.jobs.run_record import recorded_config, write_config
from verbatim.jobs.stop_signals import on_stop_signals
from verbatim.rl.train import TrainLoop
from verbatim.rl.train_resume import check_resumable
from verbatim.rl.train_step import refuse_truncated
from verbatim.trackers.fanout import open_trackers


def check(options: TrainConfig) -> int:
    """The checks that read no model: the device, the updates per step, what a resume goes on from.
    Returns the steps already trained."""
    from verbatim.jobs.trainer_team import team_size
    from verbatim.trainer.reference import trainer_device

    trainer_device(options.placement.trainer_device)  # refused before the engine or the model
    check_updates(options)
    check_split(options, team_size(options.placement.trainer_procs))
    out, resume = Path(options.output.out), options.output.resume
    table = flags_of(type(options))
    recorded = recorded_config(out, table) if resume else None
    return check_resumable(out, resume, options.config(), recorded=None if recorded is None else
                           recorded.config()["train"], upgrade=table.nest)


def prepare(options: TrainConfig, engine: Any | None = None) -> tuple[TrainLoop, Callable[[], Any]]:
    """Resolve every input and build the loop, after :func:`check`; starts nothing (the engine starts in
    :func:`execute`). ``engine``: one the caller started, used instead of the config's (which still says
    where it is placed). Returns the loop, without its learner, and what makes the learner: this rank joins the
    team and its model goes to its device only once the engine has started, so an engine sharing a GPU with the
    trainer measures its share against a device the trainer does not fill yet."""
    from verbatim.envs.registry import default_max_turns, load_tasks
    from verbatim.harness.preflight import model_vocab_size, preflight
    from verbatim.jobs.compose import (
        default_renderer,
        engine_record,
        episode_source,
        existing_run_id,
        make_engine,
        players,
    )
    from verbatim.jobs.placement import check_here
    from verbatim.jobs.trainer_team import build_learner, join_team, rank_device, ranks_here, team_size
    from verbatim.renderers.registry import get_renderer
    from verbatim.trainer.distributed.lead import Lead
    from verbatim.trainer.distributed.loading import empty_model
    from verbatim.trainer.reference import load_model, trainer_device

    out, play, choice, placement = Path(options.output.out), options.play, options.engine, options.placement
    given_engine = engine is not None
    asked_device = trainer_device(placement.trainer_device)
    device = rank_device(asked_device, placement.trainer_devices)
    factory = episode_source(play)
    tasks = _task_source(options, factory, load_tasks)
    if engine is None:  # bad engine options: refused before the tokenizer
        engine = make_engine(choice, options.routing, options.plan.seed, lora=lora_serving(options),
                             record="--routing-replay" if options.learner.routing_replay else None)
    model_dir = resolve(choice.model)
    renderer_name = play.renderer or default_renderer(choice.model)
    renderer = get_renderer(renderer_name, model_dir=model_dir)
    max_turns = play.max_turns or default_max_turns(factory, tasks(0))
    loop = LoopConfig(max_turns=max_turns, context_budget=choice.max_model_len,
                      cache_policy=options.plan.cache_policy,
                      sampling=sampling(options))
    run_id = existing_run_id(out) or uuid.uuid4().hex[:12]
    config = options.config()  # its URLs without credentials
    manifest = RunManifest(run_id=run_id, model=str(model_dir), renderer=renderer_name,
                           engine=engine_record(choice, engine, options.plan.cache_policy.value,
                                                config["train"]["engine"]["urls"], options.routing.route),
                           config=config)
    make_player = players(play, choice.model)
    first = Run(options.plan.run_plan(run_id, 0), loop, engine, renderer, factory, tasks(0), out, manifest,
                make_player=make_player)
    evaluator = _evaluator(options, factory, tasks, loop, engine, renderer, manifest, make_player)
    if play.env is not None:  # the first step's prompts fit the context with --max-tokens (an agent's: when it asks)
        for run in (first, *([evaluator.run(0, 0)] if evaluator else [])):
            preflight(run, vocab_size=model_vocab_size(model_dir), max_model_len=choice.max_model_len,
                      max_tokens=options.sampling.max_tokens)
    ranks = team_size(placement.trainer_procs)
    model = empty_model(model_dir) if ranks > 1 else load_model(model_dir)  # a team's ranks load their shards
    check_adapter(options, model, model_dir, engine)
    if options.learner.routing_replay:
        from verbatim.trainer.routing_replay import check_replayable

        check_replayable(model)
    check_here(choice, trainer_device=asked_device, trainer_devices=placement.trainer_devices,
               ranks_here=ranks_here(placement.trainer_procs), parameters=trainer_size(model, ranks),
               dtype=options.learner.dtype, ranks=ranks, reference=options.learner.loss.kl_coef > 0,
               engine_dtype=placed_dtype(engine))  # every rank of this machine, before the model moves

    def learner_of() -> Any:
        team, announcements = join_team(device, placement.trainer_timeout_s)  # the other ranks wait here for rank 0
        learner: Any = build_learner(options, model_dir, team, device, model)
        return learner if announcements is None else Lead(learner, announcements)

    return TrainLoop(options.plan, loop, None, engine, renderer, factory, tasks, out, manifest, model_dir,
                     served=choice.kind == "http" or placement.weight_sync == "folder",
                     used=choice.kind == "http" or given_engine, make_player=make_player,
                     evaluator=evaluator), learner_of


def _evaluator(options: TrainConfig, factory: Any, tasks: Any, loop: Any, engine: Any, renderer: Any,
               manifest: Any, make_player: Any) -> Any:
    """What plays the run's evaluations (``--eval-every``), None without them: its tasks (refused before the engine
    starts when they are not held out), its turns and its temperature."""
    from verbatim.envs.registry import default_max_turns
    from verbatim.jobs.evaluate import training_eval_tasks
    from verbatim.rl.evaluate import Evaluator, eval_run_plan

    plan = options.evaluation
    held_out = training_eval_tasks(options, factory, tasks)
    if held_out is None:
        return None
    sampling = loop.sampling if plan.eval_temperature is None else \
        loop.sampling.model_copy(update={"temperature": plan.eval_temperature})
    turns = options.play.max_turns or default_max_turns(factory, held_out)
    run_plan = eval_run_plan(plan, len(held_out), options.plan.seed, options.plan.concurrency)
    return Evaluator(plan, options.plan.steps, held_out, loop.model_copy(update={"sampling": sampling,
                                                                                  "max_turns": turns}),
                     run_plan, engine, factory, renderer, manifest, Path(options.output.out), make_player)


def lora_serving(options: TrainConfig) -> tuple[int, int] | None:
    """What the engine needs to serve a LoRA run's adapters: their rank, and how many versions' adapters its requests
    may name at once (``TrainPlan.versions_in_flight``); None for a run that trains the whole model."""
    rank = options.learner.lora.rank
    return None if rank is None else (rank, options.plan.versions_in_flight)


def check_adapter(options: TrainConfig, model: Any, model_dir: Path, engine: Any) -> None:
    """A LoRA run's targets name linear layers of its model, vLLM serves LoRA for its family, and an in-process
    engine started for LoRA takes its rank: refused in one line before the engine starts (a server refuses too
    large a rank at the run's first adapter, which the run loads as it begins, before any rollout). An engine that
    serves no LoRA at all is pushed the weights with the adapter merged (rl/train.py)."""
    from verbatim.engine.lora_serving import check_family
    from verbatim.engine.runtime import lora_capacity
    from verbatim.trainer.lora import peft_config

    rank = options.learner.lora.rank
    if rank is None:
        return
    peft_config(model, options.learner.lora)
    check_family(model_dir)
    if not hasattr(engine, "config"):  # a server: its refusal of the first adapter, before any rollout
        return
    served = engine.config.lora_rank
    if served is not None and lora_capacity(served) < rank:  # (none: it is pushed merged weights)
        raise InputError(f"--lora-rank {rank}: the engine given to this run serves LoRA up to rank "
                         f"{lora_capacity(served)}", hint="start it with EngineConfig(lora_rank=...) or let the run "
                                                          "start its own")


def owes_last_evaluation(config: TrainConfig) -> bool:
    """A run whose steps are all trained but whose evaluation after the last did not finish (a kill during it):
    a resume plays that, not "complete"."""
    from verbatim.harness.metrics_log import metrics_path, read_metrics
    from verbatim.rl.evaluate import owes_evaluation

    steps, out = config.plan.steps, Path(config.output.out)
    return metrics_path(out).is_file() and owes_evaluation(config.evaluation, steps, steps, read_metrics(out))


def placed_dtype(engine: Any) -> str | None:
    """The in-process engine's format as placement names it (fp32, bf16, fp16); None for a served engine."""
    from verbatim.engine.precision import short_name
    from verbatim.jobs.compose import engine_dtype_of

    dtype = engine_dtype_of(engine)
    return short_name(dtype) if dtype is not None else None


def trainer_size(model: Any, ranks: int) -> Any:
    """The model's parameters as placement counts them: on a team, with what a rank gathers at once."""
    from verbatim.jobs.placement import TrainerSize
    from verbatim.trainer.distributed.sharding import unit_parameters

    total = sum(p.numel() for p in model.parameters())
    return TrainerSize.of(total, *unit_parameters(model)) if ranks > 1 else TrainerSize(total)


def sampling(options: TrainConfig) -> Sampling:
    """The run's sampling settings; a mask the trainer's π does not reproduce needs the user's opt-in."""
    chosen = options.sampling.sampling()
    refuse_truncated(chosen.record(), options.plan.allow_truncated_sampling, "--top-p/--top-k")
    return chosen


def check_updates(options: TrainConfig) -> None:
    """More optimizer updates per step than a step can have rows is refused before anything starts."""
    most = options.plan.groups * options.plan.group_size
    if options.learner.updates_per_step > most:
        raise InputError(f"--updates-per-step {options.learner.updates_per_step} is more than the {most} rollouts "
                         f"a step trains (--groups {options.plan.groups} × --group-size {options.plan.group_size})",
                         hint="lower --updates-per-step or raise --groups/--group-size")


def check_split(options: TrainConfig, ranks: int) -> None:
    """A step's groups go to the ranks whole, and a microbatch must hold the longest row (and PrefixFlow's longest
    prefix): a team with more ranks than a step has groups, or a token budget below the context length, is
    refused before anything starts."""
    if ranks > options.plan.groups:
        raise InputError(f"{ranks} trainer ranks for the {options.plan.groups} groups of a step: a group trains on "
                         f"one rank whole, so {ranks - options.plan.groups} ranks would never train",
                         hint=f"use at most {options.plan.groups} ranks, or raise --groups")
    budget, context = options.learner.microbatch_tokens, options.engine.max_model_len
    if budget is not None and budget < context:
        raise InputError(f"--microbatch-tokens {budget} is below the context length {context} (--max-model-len): "
                         "a row, or a group's shared prefix under PrefixFlow, can be that long and must fit one "
                         "microbatch", hint=f"use --microbatch-tokens {context} or more, or lower --max-model-len")


def _task_source(options: TrainConfig, factory: Any, load_tasks: Any) -> Any:
    """Step k's tasks: the env's generator seeded by (seed, k), or the task file's in turn."""
    from verbatim.envs.held_out import draw

    plan, groups = options.plan, options.plan.groups
    if options.play.tasks is None:  # not the env's held-out tasks (envs/held_out.py) unless --no-hold-out
        def drawn(k: int) -> list[dict[str, Any]]:
            return draw(factory, groups, plan.task_seed(k), held_out=False) if plan.hold_out else \
                list(factory.tasks(groups, plan.task_seed(k)))

        drawn(0)  # a generator that fails does so now, before the engine starts
        return drawn
    pool = list(load_tasks(options.play.tasks))
    if not pool:
        raise InputError(f"{options.play.tasks} holds no tasks")
    return lambda k: [pool[(k * groups + g) % len(pool)] for g in range(groups)]


async def execute(loop: TrainLoop, options: TrainConfig, console: Console, learner_of: Callable[[], Any], *,
                  given_engine: bool = False) -> list[dict[str, Any]]:
    """The engine started (unless it was given), then the learner made (:func:`prepare`), the steps trained
    (SIGINT/SIGTERM finish the step being trained, then stop)."""
    async with (given(loop.engine) if given_engine else started(loop.engine, console, loop.out)) as start_s:
        loop.engine_start_s = start_s
        loop.learner = learner_of()  # the engine runs no request yet: blocking its event loop stalls nothing
        write_config(loop.out, flags_of(type(options)), options.recorded(), "train")  # what a rerun repeats
        undo = _stop_on_signals(loop, console)
        try:
            return await loop.train(resume=options.output.resume)
        finally:
            undo()


def _stop_on_signals(loop: TrainLoop, console: Console) -> Any:
    def on_signal(sig: signal.Signals) -> None:
        console.print(f"{sig.name}: finishing the step being trained, then stopping (--resume goes on)")
        loop.stop(StopRequest(f"interrupted by {sig.name}", "interrupted", exit_code=128 + sig))

    return on_stop_signals(on_signal)


def run_training(config: TrainConfig, console: Console | None = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 on_end: Callable[[TrainLoop], None] | None = None, *,
                 engine: Any | None = None) -> list[dict[str, Any]]:
    """Train the run ``config`` describes; returns its metrics by step (``metrics.jsonl``'s records).

    ``engine``: an engine the caller started (and closes), used instead of starting the config's: the run
    begins it with its own weights and an empty prefix cache, whatever another run left in it, and runs on
    the event loop the engine runs on.

    ``on_step`` sees each step's record as it is written; ``on_end`` sees the loop however training ends
    (its ``history`` holds the steps trained). A ``--resume`` of a complete run says so, trains nothing and
    returns the recorded steps without ``on_end``; it never starts the engine.
    """
    from verbatim.jobs.trainer_team import (
        check_procs,
        end_followers,
        follow_run,
        following,
        leave_team,
        named_ranks,
        start_followers,
    )

    if following():  # a rank above 0 under torchrun: its learner follows rank 0's
        follow_run(config)
        return []
    console = console or Console(stderr=True)
    check_procs(config.placement.trainer_procs)
    trained = check(config)
    out = Path(config.output.out)
    if config.output.resume and trained >= config.plan.steps and not owes_last_evaluation(config):
        from verbatim.harness.metrics_log import read_metrics

        console.print(f"{out} is complete: all {trained} steps are trained (pass a higher --steps with "
                      "--resume to train more)", soft_wrap=True)
        return read_metrics(out)
    trackers = open_trackers(config.output.log, out, config.config()["train"])  # a missing one: exit 2 now
    try:
        followers = start_followers(config.model_dump_json(), config.placement.trainer_procs, out)
    except BaseException:  # no team: nothing below runs, so close the trackers here
        trackers.close()
        raise
    released = False
    try:
        with named_ranks(followers, config.placement.trainer_timeout_s):
            loop, learner_of = prepare(config, engine)
            loop.on_step = trackers.after(on_step)
            loop.on_rollout = trackers.rollout
            try:
                metrics = on_engine_loop(execute(loop, config, console, learner_of, given_engine=engine is not None),
                                         engine)
                getattr(loop.learner, "close", lambda: None)()  # a Lead lets its followers go
                released = True
                return metrics
            finally:
                if on_end is not None:
                    on_end(loop)
    finally:
        trackers.close()
        end_followers(followers, wait_s=60.0 if released else 0.0)
        leave_team()

