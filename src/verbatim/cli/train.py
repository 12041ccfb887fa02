"""``verbatim train``: its flags (cli/job_flags.py, from the config's table) become a
:class:`~verbatim.jobs.config.TrainConfig`, which :func:`~verbatim.jobs.train.run_training` runs; this module
prints.

Bad input is one line, exit 2, nothing written. Each step prints one line; the end prints the reward
table. SIGINT/SIGTERM finish the step being trained (its checkpoint is written), then stop (exit
130/143); ``--resume`` goes on from there, as it does after a SIGKILL.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from verbatim.harness.evaluation import headline
from verbatim.harness.step_metrics import StepMetrics, steps_of
from verbatim.jobs.train import TrainConfig, run_training
from verbatim.paths import check_output_file, check_run_dir
from verbatim.rl.train import TrainLoop


def step_line(step: StepMetrics, steps: int) -> str:
    """A step's line (and its evaluation's); step 0's line is the evaluation before the first step."""
    evaluated = f"eval v{step.version}: {headline(step.eval)}" if step.eval is not None else ""
    if not step.trained:
        return f"before step 1 · {evaluated}"
    return _trained_line(step, steps) + (f"\n  {evaluated}" if evaluated else "")


def _trained_line(step: StepMetrics, steps: int) -> str:
    return (f"step {step.step}/{steps} · v{step.version} · reward {_fmt(step.reward_mean, '.3f')}"
            f" · success {_fmt(step.success_rate, '.0%')} · loss {_fmt(step.loss, '+.4f')} · |Δlogp| "
            f"{_fmt(step.mismatch_mean_abs, '.1e')} · cache hit {_fmt(step.cache_hit_rate, '.0%')} · rollout "
            f"{_fmt(step.rollout_s, '.1f')}s train {_fmt(step.train_s, '.1f')}s "
            f"sync {_fmt(step.weight_sync_s, '.1f')}s")


def reward_table(history: list[StepMetrics], out: Path) -> Table:
    """A row per step; with evaluations, their headline (pass@1, else avg@K) in a column of its own."""
    evaluated = any(r.eval is not None for r in history)
    table = Table(title=f"training ({out})")
    for column in ("step", "version", "reward", "success", "loss", "grad norm", "|Δ logp|", "cache hit",
                   *(("eval",) if evaluated else ())):
        table.add_column(column, justify="right")
    for r in history:
        table.add_row(str(r.step), str(r.version), _fmt(r.reward_mean, ".3f"), _fmt(r.success_rate, ".0%"),
                      _fmt(r.loss, "+.4f"), _fmt(r.grad_norm, ".3f"), _fmt(r.mismatch_mean_abs, ".1e"),
                      _fmt(r.cache_hit_rate, ".0%"), *((_fmt(r.eval_score(), ".3f"),) if evaluated else ()))
    if evaluated:
        table.caption = "eval: held-out pass@1 (avg@K where the env never says solved), after the step's update"
    return table


def _fmt(value: Any, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def summary(lines: list[StepMetrics], options: TrainConfig, wall_s: float,
            engine_start_s: float = 0.0, share_s: float = 0.0) -> dict[str, Any]:
    history = [r for r in lines if r.trained]
    evaluations = [{"step": r.step, **r.eval} for r in lines if r.eval is not None]
    return {"steps": len(history), "final_version": history[-1].version if history else 0,
            **({"eval_by_step": evaluations} if evaluations else {}),
            "mean_reward_by_step": [r.reward_mean for r in history],
            "success_rate_by_step": [r.success_rate for r in history],
            "mismatch_by_step": [r.mismatch_mean_abs for r in history],
            "cache_hit_rate_by_step": [r.cache_hit_rate for r in history],
            "wall_s": round(wall_s, 2), "engine_start_s": round(engine_start_s, 2),
            "weight_share_s": round(share_s, 2), "run_dir": options.output.out}


def train_command(options: TrainConfig, console: Console, summary_json: str | None = None, *,
                  engine: Any | None = None, replace: bool = False) -> list[dict]:
    """``verbatim train``: a line a step, the reward table and ``--summary-json`` (an existing file replaced only
    with ``replace``, the CLI's ``--force``); ``engine``: one the caller started
    (:func:`~verbatim.jobs.train.run_training`)."""
    from verbatim.cli.run import warn_ignored_fields, warn_outcome, write_summary_json
    from verbatim.harness.summary import summed
    from verbatim.jobs.trainer_team import following

    if following():  # a rank above 0 under torchrun: rank 0 owns the run folder and prints; this one trains
        return run_training(options, console)
    started = time.perf_counter()
    check_run_dir(options.output.out)
    if summary_json:
        check_output_file(summary_json, "--summary-json", created=Path(options.output.out),
                          existing_ok=replace)  # before training
    ended: list[TrainLoop] = []

    def on_end(loop: TrainLoop) -> None:
        ended.append(loop)
        steps = steps_of(loop.history)
        if steps:
            console.print(reward_table(steps, Path(options.output.out)))
            warn_ignored_fields(summed(r.ignored_request_fields for r in steps), console)
        if summary_json and steps:
            write_summary_json(summary_json, summary(steps, options, time.perf_counter() - started,
                                                     loop.engine_start_s, loop.share_s))

    def on_step(record: dict[str, Any]) -> None:
        console.print(step_line(StepMetrics.model_validate(record), options.plan.steps))
        warn_outcome(console, options.output.out, record.get("statuses") or {},
                     cut=record.get("cut_at_max_turns") or 0, breaks=record.get("history_breaks") or 0,
                     first=record.get("first_error"), prefix=f"  step {record['step']}: ")

    history = run_training(options, console, on_step=on_step, on_end=on_end, engine=engine)
    if not ended:  # a resumed run with nothing left to train: its table, and the engine never started
        steps = steps_of(history)
        if steps:
            console.print(reward_table(steps, Path(options.output.out)))
        if summary_json:
            write_summary_json(summary_json, summary(steps, options, time.perf_counter() - started))
    return history
