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

from verbatim.jobs.train import TrainConfig, run_training
from verbatim.paths import check_output_file, check_run_dir
from verbatim.rl.train import TrainLoop


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
