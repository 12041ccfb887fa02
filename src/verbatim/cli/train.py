"""``verbatim train``: its flags (cli/train_flags.py) become a :class:`~verbatim.jobs.train.TrainConfig`,
which :func:`~verbatim.jobs.train.run_training` runs; this module prints.

Bad input is one line, exit 2, nothing written. Each step prints one line; the end prints the reward
table. SIGINT/SIGTERM finish the step being trained (its checkpoint is written), then stop (exit
130/143); ``--resume`` goes on from there, as it does after a SIGKILL.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from verbatim.engine.protocol import CachePolicy
from verbatim.errors import InputError
from verbatim.jobs.train import TrainConfig, run_training
from verbatim.paths import check_output_file, check_run_dir
from verbatim.rl.train import TrainLoop, TrainPlan
from verbatim.trainer.advantages import ADVANTAGES, Advantage
from verbatim.trainer.correction import CorrectionConfig
from verbatim.trainer.learner import LearnerConfig
from verbatim.trainer.objective import LossConfig


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


def summary(history: list[dict[str, Any]], options: TrainConfig, wall_s: float,
            engine_start_s: float = 0.0, share_s: float = 0.0) -> dict[str, Any]:
    return {"steps": len(history), "final_version": history[-1]["version"] if history else 0,
            "mean_reward_by_step": [r.get("reward_mean") for r in history],
            "success_rate_by_step": [r.get("success_rate") for r in history],
            "mismatch_by_step": [r.get("mismatch_mean_abs") for r in history],
            "cache_hit_rate_by_step": [r.get("cache_hit_rate") for r in history],
            "wall_s": round(wall_s, 2), "engine_start_s": round(engine_start_s, 2),
            "weight_share_s": round(share_s, 2), "run_dir": options.out}


def train_command(options: TrainConfig, console: Console, summary_json: str | None = None) -> list[dict]:
    from verbatim.cli.run import warn_ignored_fields, write_summary_json
    from verbatim.harness.summary import summed
    from verbatim.jobs.trainer_team import following

    if following():  # a rank above 0 under torchrun: rank 0 owns the run folder and prints; this one trains
        return run_training(options, console)
    started = time.perf_counter()
    check_run_dir(options.out)
    if summary_json:
        check_output_file(summary_json, "--summary-json", created=Path(options.out))  # before training, not after it
    ended: list[TrainLoop] = []

    def on_end(loop: TrainLoop) -> None:
        ended.append(loop)
        if loop.history:
            console.print(reward_table(loop.history, Path(options.out)))
            warn_ignored_fields(summed(r.get("ignored_request_fields") for r in loop.history), console)
        if summary_json and loop.history:
            write_summary_json(summary_json, summary(loop.history, options, time.perf_counter() - started,
                                                     loop.engine_start_s, loop.share_s))

    def on_step(record: dict[str, Any]) -> None:
        console.print(step_line(record, options.plan.steps))

    history = run_training(options, console, on_step=on_step, on_end=on_end)
    if not ended:  # a resumed run with nothing left to train: its table, and the engine never started
        if history:
            console.print(reward_table(history, Path(options.out)))
        if summary_json:
            write_summary_json(summary_json, summary(history, options, time.perf_counter() - started))
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
    if value not in ADVANTAGES:
        raise InputError(f"unknown --advantage {value!r}", hint=f"use {', '.join(ADVANTAGES)}")
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
    from verbatim.jobs.run import RunOptions

    models = {m.__name__: m for m in (TrainConfig, RunOptions, TrainPlan, LearnerConfig, LossConfig, CorrectionConfig)}
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
