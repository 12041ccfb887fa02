"""``verbatim train``: reinforcement learning on the real engine, from token-exact traces.

Options are resolved before anything starts (bad input: one line, exit 2, nothing written);
then the engine starts, the trainer loads the same weights in float32, and
:class:`~verbatim.harness.train.TrainLoop` runs the steps. Each step prints one line; the end
prints the reward table. SIGINT/SIGTERM finish the step being trained (its checkpoint is written),
then stop (exit 130/143); ``--resume`` goes on from there, as it does after a SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError
from rich.console import Console
from rich.table import Table

from verbatim.datamodel import Frozen
from verbatim.engine.models import resolve
from verbatim.engine.protocol import CachePolicy, Sampling
from verbatim.engine.runtime import DEFAULT_MAX_MODEL_LEN
from verbatim.engine.server_url import redact
from verbatim.errors import InputError
from verbatim.harness.rollout import LoopConfig
from verbatim.harness.run import Run, StopRequest
from verbatim.harness.store import RunManifest
from verbatim.harness.train import TrainLoop, TrainPlan
from verbatim.harness.train_resume import check_resumable
from verbatim.harness.train_step import refuse_truncated
from verbatim.paths import check_output_file, check_run_dir
from verbatim.trainer.advantages import Advantage
from verbatim.trainer.correction import CorrectionConfig
from verbatim.trainer.learner import LearnerConfig
from verbatim.trainer.objective import LossConfig


class TrainOptions(Frozen):
    """Everything ``verbatim train`` was asked to do (its ``train`` section is the run's config)."""

    env: str | None = None
    agent: str | None = None
    """``FILE.py:FUNCTION`` or ``module:function``: an agent played through the endpoint instead of an env."""
    agent_cmd: str | None = None
    """A command run once per rollout, the endpoint in OPENAI_BASE_URL (``verbatim.agents.command``)."""
    agent_timeout_s: float = Field(default=600.0, gt=0)
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the env's factory (``--env-arg KEY=VALUE``)."""
    tasks: str | None = None
    model: str = "default"
    renderer: str | None = None
    max_turns: int | None = Field(default=None, ge=1)
    """None: as many turns as the env's tasks may need (:func:`verbatim.envs.registry.default_max_turns`)."""
    max_tokens: int = Field(default=48, ge=1)
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    plan: TrainPlan
    learner: LearnerConfig
    out: str = "runs/train"
    engine: str = "inproc"
    urls: tuple[str, ...] = ()
    route: str | None = None
    max_model_len: int = Field(default=DEFAULT_MAX_MODEL_LEN, ge=256)
    kv_cache_gib: int = Field(default=2, ge=1)
    trainer_device: str = "cpu"
    """Where the trainer's model runs (cpu, cuda, cuda:N); a resumed run may move."""
    resume: bool = False

    def config(self) -> dict[str, Any]:
        """What a --resume must match (the output path, the trainer's device and --resume itself excluded)."""
        train = self.model_dump(mode="json", exclude={"resume", "out", "trainer_device"})
        train["urls"] = [redact(u) for u in self.urls]
        return {"train": train}


def check(options: TrainOptions) -> int:
    """The checks that read no model: the device, the updates per step, what a resume goes on from.
    Returns the steps already trained."""
    from verbatim.trainer.reference import trainer_device

    trainer_device(options.trainer_device)  # refused before the engine or the model
    check_updates(options)
    return check_resumable(Path(options.out), options.resume, options.config())


def prepare(options: TrainOptions) -> TrainLoop:
    """Resolve every input and build the loop, after :func:`check`; starts nothing (the engine starts in
    :func:`execute`)."""
    from verbatim.cli.run import RunOptions, _make_engine, default_renderer, episode_source, players
    from verbatim.envs.registry import default_max_turns, load_tasks
    from verbatim.harness.preflight import model_vocab_size, preflight
    from verbatim.renderers.registry import get_renderer
    from verbatim.trainer.learner import Learner
    from verbatim.trainer.reference import load_model, trainer_device

    out = Path(options.out)
    config = options.config()
    device = trainer_device(options.trainer_device)
    factory = episode_source(options.env, options.agent, options.env_args, options.agent_cmd)
    tasks = _task_source(options, factory, load_tasks)
    engine_options = RunOptions(env=options.env, model=options.model, engine=options.engine, urls=options.urls,
                                route=options.route, max_model_len=options.max_model_len,
                                kv_cache_gib=options.kv_cache_gib, seed=options.plan.seed)
    engine = _make_engine(engine_options)  # refuses bad engine options before the tokenizer loads
    model_dir = resolve(options.model)
    renderer_name = options.renderer or default_renderer(options.model)
    renderer = get_renderer(renderer_name, model_dir=model_dir)
    max_turns = options.max_turns or default_max_turns(factory, tasks(0))
    loop = LoopConfig(max_turns=max_turns, context_budget=options.max_model_len,
                      cache_policy=options.plan.cache_policy,
                      sampling=sampling(options))
    run_id = _existing_run_id(out) or uuid.uuid4().hex[:12]
    manifest = RunManifest(run_id=run_id, model=str(model_dir), renderer=renderer_name,
                           engine={"kind": options.engine, "block_size": engine.block_size,
                                   "cache_policy": options.plan.cache_policy.value,
                                   "urls": config["train"]["urls"], "route": options.route},
                           config=config)
    make_player = players(options.agent or options.agent_cmd, options.model, options.agent_timeout_s)
    first = Run(options.plan.run_plan(run_id, 0), loop, engine, renderer, factory, tasks(0), out, manifest,
                make_player=make_player)
    if options.env is not None:  # the first step's prompts fit the context with --max-tokens (an agent's: when it asks)
        preflight(first, vocab_size=model_vocab_size(model_dir), max_model_len=options.max_model_len,
                  max_tokens=options.max_tokens)
    learner = Learner(load_model(model_dir).to(device), options.learner)
    return TrainLoop(options.plan, loop, learner, engine, renderer, factory, tasks, out, manifest, model_dir,
                     served=options.engine == "http", make_player=make_player)


def sampling(options: TrainOptions) -> Sampling:
    """The run's sampling settings; a mask the trainer's π does not reproduce needs the user's opt-in."""
    chosen = Sampling(max_tokens=options.max_tokens, temperature=options.temperature, top_p=options.top_p,
                      top_k=options.top_k)
    refuse_truncated(chosen.record(), options.plan.allow_truncated_sampling, "--top-p/--top-k")
    return chosen


def check_updates(options: TrainOptions) -> None:
    """More optimizer updates per step than a step can have rows is refused before anything starts."""
    most = options.plan.groups * options.plan.group_size
    if options.learner.updates_per_step > most:
        raise InputError(f"--updates-per-step {options.learner.updates_per_step} is more than the {most} rollouts "
                         f"a step trains (--groups {options.plan.groups} × --group-size {options.plan.group_size})",
                         hint="lower --updates-per-step or raise --groups/--group-size")


def _task_source(options: TrainOptions, factory: Any, load_tasks: Any) -> Any:
    """Step k's tasks: the env's generator seeded by (seed, k), or the task file's in turn."""
    groups, seed = options.plan.groups, options.plan.seed
    if options.tasks is None:
        factory.tasks(groups, seed)  # a generator that fails does so now, before the engine starts
        return lambda k: list(factory.tasks(groups, seed * 100_003 + k))
    pool = list(load_tasks(options.tasks))
    if not pool:
        raise InputError(f"{options.tasks} holds no tasks")
    return lambda k: [pool[(k * groups + g) % len(pool)] for g in range(groups)]


def _existing_run_id(out: Path) -> str | None:
    from verbatim.harness.store import read_manifest

    return read_manifest(out).run_id if (out / "manifest.json").exists() else None


async def execute(loop: TrainLoop, options: TrainOptions, console: Console) -> list[dict[str, Any]]:
    from verbatim.cli.run import started

    async with started(loop.engine, console, loop.out) as start_s:
        loop.engine_start_s = start_s
        undo = _stop_on_signals(loop, console)
        try:
            return await loop.train(resume=options.resume)
        finally:
            undo()


def _stop_on_signals(loop: TrainLoop, console: Console) -> Any:
    events = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        console.print(f"{name}: finishing the step being trained, then stopping (--resume goes on)")
        loop.stop(StopRequest(f"interrupted by {name}", "interrupted", exit_code=128 + signum))

    for sig in (signal.SIGINT, signal.SIGTERM):
        events.add_signal_handler(sig, on_signal, sig)
    return lambda: [events.remove_signal_handler(s) for s in (signal.SIGINT, signal.SIGTERM)]


def step_line(record: dict[str, Any], steps: int) -> str:
    def num(key: str, fmt: str) -> str:
        value = record.get(key)
        return "–" if value is None else format(value, fmt)

    return (f"step {record['step']}/{steps} · v{record['version']} · reward {num('reward_mean', '.3f')}"
            f" · success {num('success_rate', '.0%')} · loss {num('loss', '+.4f')} · |Δlogp| "
            f"{num('mismatch_mean_abs', '.1e')} · cache hit {num('cache_hit_rate', '.0%')} · rollout "
            f"{num('rollout_s', '.1f')}s train {num('train_s', '.1f')}s sync {num('weight_sync_s', '.1f')}s")


def reward_table(history: list[dict[str, Any]], out: Path) -> Table:
    table = Table(title=f"training ({out})")
    for column in ("step", "version", "reward", "success", "loss", "grad norm", "|Δ logp|", "cache hit"):
        table.add_column(column, justify="right")
    for r in history:
        table.add_row(str(r["step"]), str(r["version"]), _fmt(r.get("reward_mean"), ".3f"),
                      _fmt(r.get("success_rate"), ".0%"), _fmt(r.get("loss"), "+.4f"), _fmt(r.get("grad_norm"), ".3f"),
                      _fmt(r.get("mismatch_mean_abs"), ".1e"), _fmt(r.get("cache_hit_rate"), ".0%"))
    return table


def _fmt(value: Any, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def summary(history: list[dict[str, Any]], options: TrainOptions, wall_s: float,
            engine_start_s: float = 0.0, share_s: float = 0.0) -> dict[str, Any]:
    return {"steps": len(history), "final_version": history[-1]["version"] if history else 0,
            "mean_reward_by_step": [r.get("reward_mean") for r in history],
            "success_rate_by_step": [r.get("success_rate") for r in history],
            "mismatch_by_step": [r.get("mismatch_mean_abs") for r in history],
            "cache_hit_rate_by_step": [r.get("cache_hit_rate") for r in history],
            "wall_s": round(wall_s, 2), "engine_start_s": round(engine_start_s, 2),
            "weight_share_s": round(share_s, 2), "run_dir": options.out}


def train_command(options: TrainOptions, console: Console, summary_json: str | None = None) -> list[dict]:
    from verbatim.cli.run import warn_ignored_fields, write_summary_json
    from verbatim.harness.summary import summed

    started = time.perf_counter()
    check_run_dir(options.out)
    if summary_json:
        check_output_file(summary_json, "--summary-json", created=Path(options.out))  # before training, not after it
    trained = check(options)
    if options.resume and trained >= options.plan.steps:
        history = _complete(options, trained, console)
        if summary_json:
            write_summary_json(summary_json, summary(history, options, time.perf_counter() - started))
        return history
    loop = prepare(options)
    loop.on_step = lambda record: console.print(step_line(record, options.plan.steps))
    try:
        history = asyncio.run(execute(loop, options, console))
    finally:
        if loop.history:
            console.print(reward_table(loop.history, Path(options.out)))
            warn_ignored_fields(summed(r.get("ignored_request_fields") for r in loop.history), console)
        if summary_json and loop.history:
            write_summary_json(summary_json, summary(loop.history, options, time.perf_counter() - started,
                                                     loop.engine_start_s, loop.share_s))
    return history


def _complete(options: TrainOptions, trained: int, console: Console) -> list[dict[str, Any]]:
    """A resumed run with nothing left to train: said so, with its table; the engine never starts."""
    from verbatim.harness.metrics_log import read_metrics

    history = read_metrics(options.out)
    console.print(f"{options.out} is complete: all {trained} steps are trained (pass a higher --steps with "
                  "--resume to train more)", soft_wrap=True)
    if history:
        console.print(reward_table(history, Path(options.out)))
    return history


def parse_band(text: str | None, flag: str) -> tuple[float, float] | None:
    """``LOW,HIGH`` (0 <= LOW < HIGH) or ``none``."""
    if text is None or text.strip().lower() in ("none", "off", ""):
        return None
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        raise InputError(f"{flag} must look like LOW,HIGH (e.g. 0.5,5) or none, got {text!r}") from None
    if not 0 <= low < high:
        raise InputError(f"{flag} {text} must satisfy 0 <= LOW < HIGH", hint="e.g. 0.5,5, or none")
    return (low, high)


def parse_env_args(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; a value is read as JSON (numbers, true/false, lists) or else kept as text."""
    args: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise InputError(f"--env-arg {item!r} must look like KEY=VALUE (e.g. high=5)")
        if _non_finite(value):  # JSON's NaN/Infinity and float()'s inf/nan alike
            raise InputError(f"--env-arg {item!r}: {value.strip()} is not a finite number")
        try:
            args[key.strip()] = json.loads(value)
        except ValueError:
            args[key.strip()] = value
    return args


def _non_finite(text: str) -> bool:
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def cache_policy_option(value: str) -> CachePolicy:
    return CachePolicy.parse(value)


def advantage_option(value: str) -> Advantage:
    if value not in ("grpo", "rloo"):
        raise InputError(f"unknown --advantage {value!r}", hint="use grpo or rloo")
    return value  # type: ignore[return-value]


def lr_schedule_option(value: str) -> str:
    if value not in ("constant", "linear", "cosine"):
        raise InputError(f"unknown --lr-schedule {value!r}", hint="use constant, linear or cosine")
    return value


def group_size_option(value: int) -> int:
    if value < 2:
        raise InputError(f"--group-size {value}: group-relative advantages need at least 2 rollouts per group",
                         hint="use --group-size 2 or more")
    return value


def sequence_tis_option(value: str | None, token_tis_cap: float) -> str | None:
    """``product``, ``geo_mean`` or none; refused while token-level TIS is on (the two are alternatives)."""
    if value is None or value.strip().lower() in ("none", "off", ""):
        return None
    if value not in ("product", "geo_mean"):
        raise InputError(f"unknown --sequence-tis {value!r}", hint="use product or geo_mean")
    if token_tis_cap:
        raise InputError(f"--sequence-tis {value} replaces token-level TIS, which --token-tis-cap "
                         f"{token_tis_cap:g} keeps on", hint="add --token-tis-cap 0")
    return value


# A settings field's option where the two names differ; any other field `a_b` is the option `--a-b`.
_FLAGS = {"max_version_lag": "--max-lag", "env_args": "--env-arg", "tasks": "--task-file", "urls": "--url"}


@contextmanager
def flag_errors() -> Iterator[None]:
    """A settings model's refusal of an option's value, as that option: ``--clip-eps 1.5 must be in (0, 1)``."""
    try:
        yield
    except ValidationError as exc:
        line = _flag_line(exc)
        if line is None:
            raise
        raise InputError(line) from None


def _flag_line(exc: ValidationError) -> str | None:
    first = exc.errors()[0]
    names = [part for part in first.get("loc", ()) if isinstance(part, str)]
    if not names:
        return None
    flag = _FLAGS.get(names[0], "--" + names[0].replace("_", "-"))
    value = first.get("input")
    shown = format(value, "g") if isinstance(value, float) else str(value)
    wanted = _bounds(exc.title, names[0]) if first.get("type", "").startswith(("greater", "less")) else None
    if wanted is None:
        wanted = str(first.get("msg", "is invalid")).removeprefix("Value error, ").replace("Input should be",
                                                                                         "must be")
    return f"{flag} {shown} {wanted}"


def _bounds(model: str, field: str) -> str | None:
    """A numeric field's range in words: ``must be in (0, 1)``, ``must be at least 1``."""
    models = {m.__name__: m for m in (TrainOptions, TrainPlan, LearnerConfig, LossConfig, CorrectionConfig)}
    info = models[model].model_fields.get(field) if model in models else None
    if info is None:
        return None
    found = {name: getattr(rule, name) for rule in info.metadata for name in ("gt", "ge", "lt", "le")
             if getattr(rule, name, None) is not None}
    low = ("(", found["gt"]) if "gt" in found else ("[", found["ge"]) if "ge" in found else None
    high = (found["lt"], ")") if "lt" in found else (found["le"], "]") if "le" in found else None
    if low and high:
        return f"must be in {low[0]}{low[1]}, {high[0]}{high[1]}"
    words = {"gt": "above", "ge": "at least", "lt": "below", "le": "at most"}
    return " ".join(f"must be {words[name]} {bound}" for name, bound in found.items()) or None
