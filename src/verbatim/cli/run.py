"""``verbatim run``'s output: the run (:func:`verbatim.jobs.run.run_rollouts`), then its summary table and
``--summary-json``; a stopped or failed run's summary is shown before its one-line reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from verbatim.durable import strict_json
from verbatim.errors import VerbatimError
from verbatim.harness.run import Run
from verbatim.harness.summary import RunSummary, outcome_line
from verbatim.jobs.run import RunOptions, run_rollouts
from verbatim.paths import check_output_file


def run_command(options: RunOptions, console: Console, summary_json: str | None = None, *,
                engine: Any | None = None, replace: bool = False) -> RunSummary:
    """``verbatim run``: the run, its summary table and ``--summary-json`` (an existing file replaced only with
    ``replace``, the CLI's ``--force``); ``engine``: one the caller started
    (:func:`~verbatim.jobs.run.run_rollouts`)."""
    if summary_json:
        check_output_file(summary_json, "--summary-json", created=Path(options.output.out),
                          existing_ok=replace)  # before the run
    ended: list[Run] = []
    try:
        summary = run_rollouts(options, console, on_end=ended.append, engine=engine)
    except VerbatimError:  # a stopped run: what it wrote is summarised before the one-line reason
        if ended and ended[0].summary is not None:
            console.print(summary_table(ended[0].summary, ended[0].out))
            _write_summary(ended[0].summary, summary_json)
        raise
    console.print(summary_table(summary, ended[0].out))
    warn_outcome(console, ended[0].out, summary.statuses, cut=summary.cut_at_max_turns,
                 breaks=summary.history_breaks, first=summary.first_error)
    warn_ignored_fields(summary.ignored_request_fields, console)
    _write_summary(summary, summary_json)
    return summary


def warn_outcome(console: Console, out: str | Path, statuses: dict[str, int], *, cut: int = 0, breaks: int = 0,
                 first: str | None = None, prefix: str = "warning: ") -> None:
    """One line (:func:`~verbatim.harness.summary.outcome_line`) when a run's or a step's rollouts failed, were
    cut at --max-turns or broke their history."""
    line = outcome_line(statuses, cut=cut, breaks=breaks, first=first)
    if line:
        console.print(f"{prefix}{line} ('verbatim show {out}' shows each rollout)", markup=False,
                      highlight=False, soft_wrap=True)


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
