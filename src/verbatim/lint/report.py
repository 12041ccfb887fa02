"""The people-facing view of ``verbatim lint trace``: a rich table of verdicts."""

from __future__ import annotations

import os

from rich.table import Table
from rich.text import Text

from verbatim.lint.findings import Problem, TraceReport

MAX_PROBLEMS_SHOWN = 4


def report_table(run_dir: str | os.PathLike[str], report: TraceReport) -> Table:
    rollouts = [v for v in report.verdicts if v.rollout_id is not None]
    clean = sum(v.ok for v in rollouts)
    others = len(report.verdicts) - len(rollouts)
    title = f"{clean}/{len(rollouts)} rollouts' tokens clean"
    if others:
        title += f", {others} damaged file(s) or group(s)"
    if report.run is not None:
        title += f"; {report.run.line()}"
    table = Table(title=title, caption=str(run_dir))
    for column in ("rollout", "group", "status", "turns", "tokens ok", "findings and problems"):
        table.add_column(column, overflow="fold")
    for verdict in report.verdicts:
        label = verdict.rollout_id or ("(group)" if verdict.group_id else "(file)")
        cells = (label, verdict.group_id or "", verdict.status or "",
                 str(verdict.turns) if verdict.rollout_id is not None else "",
                 "yes" if verdict.ok else "no", _problems_text(verdict.findings + verdict.problems))
        table.add_row(*(Text(cell) for cell in cells))  # plain text: ids and details may hold brackets
    return table


def _problems_text(problems: tuple[Problem, ...]) -> str:
    lines = [_problem_line(p) for p in problems[:MAX_PROBLEMS_SHOWN]]
    if len(problems) > MAX_PROBLEMS_SHOWN:
        lines.append(f"… {len(problems) - MAX_PROBLEMS_SHOWN} more (see --json)")
    return "\n".join(lines)


def _problem_line(problem: Problem) -> str:
    where = f" turn {problem.turn}" if problem.turn is not None else ""
    cause = f" [cause: {problem.cause}]" if problem.cause else ""
    return f"{problem.kind}{where}: {problem.detail}{cause}"
