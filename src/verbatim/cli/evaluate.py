"""``verbatim eval``'s output: the evaluation (:func:`verbatim.jobs.evaluate.run_eval`), then its figures, per
task and overall, and ``--summary-json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from verbatim.cli.run import summary_table, warn_ignored_fields, warn_outcome, write_summary_json
from verbatim.harness.evaluation import headline
from verbatim.jobs.config import EvalOptions
from verbatim.jobs.evaluate import run_eval
from verbatim.paths import check_output_file


def eval_command(options: EvalOptions, console: Console, summary_json: str | None = None, *,
                 engine: Any | None = None, replace: bool = False) -> dict[str, Any]:
    """``verbatim eval``: the evaluation, its run summary, its figures and ``--summary-json`` (the figures, with
    the run's summary under ``run``)."""
    if summary_json:
        check_output_file(summary_json, "--summary-json", created=Path(options.output.out), existing_ok=replace)
    summary, found = run_eval(options, console, engine=engine)
    out = options.output.out
    console.print(summary_table(summary, Path(out)))
    warn_outcome(console, out, summary.statuses, cut=summary.cut_at_max_turns, breaks=summary.history_breaks,
                 first=summary.first_error)
    warn_ignored_fields(summary.ignored_request_fields, console)
    console.print(task_table(found))
    if found.get("why_no_pass_at_k"):
        console.print(f"no pass@k: {found['why_no_pass_at_k']}", markup=False)
    console.print(f"eval: {headline(found)} ('verbatim show {out}' shows each sample)", markup=False,
                  highlight=False, soft_wrap=True)
    if summary_json:
        write_summary_json(summary_json, {**found, "run": summary.model_dump()})
    return found


def task_table(found: dict[str, Any]) -> Table:
    """A row per task and one for all of them: avg@K, success rate, pass@k."""
    ks = list(found.get("pass_at_k") or {})
    table = Table(title=f"evaluation: {found['tasks']} tasks × {found['samples']} samples")
    for column in ("task", f"avg@{found['samples']}", "success", *(f"pass@{k}" for k in ks)):
        table.add_column(column, justify="left" if column == "task" else "right")
    for row in found["per_task"]:
        passes = row["pass_at_k"] or {}
        table.add_row(str(row["task"]), _figure(row["mean_reward"]), _figure(row["success_rate"]),
                      *(_figure(passes.get(k)) for k in ks))
    table.add_row("all", _figure(found["mean_reward"]), _figure(found["success_rate"]),
                  *(_figure(found["pass_at_k"][k]) for k in ks), style="bold")
    return table


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
