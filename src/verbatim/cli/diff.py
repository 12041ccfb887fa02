"""``verbatim diff RUN_A RUN_B``: are two runs the same, and where do they first part?

Exit 0 when everything compared agrees (harness/run_diff.py says what is), 1 when
something differs, 2 for bad input. Registered on the root app by :mod:`verbatim.cli.app`, which turns
known errors into one line and an exit code; this module never imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from verbatim.cli.console import console, err_console
from verbatim.durable import strict_json

if TYPE_CHECKING:
    from verbatim.harness.run_diff import Divergence, RunDiff


def diff_command(
    run_a: Path = typer.Argument(..., help="A run directory written by 'verbatim run' or 'verbatim train'."),
    run_b: Path = typer.Argument(..., help="The run to compare it with."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as one JSON object."),
) -> None:
    """Compare two runs: rollouts token by token (ids, μ bit for bit, versions), metrics step by step, the
    trainer's π files and the newest shared checkpoint; show where they first part. Exit 1 if they differ."""
    from verbatim.harness.run_diff import diff_runs

    result = diff_runs(run_a, run_b)
    for problem in result.problems:
        err_console.print(f"warning: {problem}", markup=False, highlight=False)
    if as_json:
        print(strict_json(result.model_dump(mode="json") | {"same": result.same}))
    else:
        _print(result, run_a, run_b)
    raise typer.Exit(0 if result.same else 1)


def _print(result: RunDiff, run_a: Path, run_b: Path) -> None:
    console.print(f"A {run_a}\nB {run_b}", markup=False, highlight=False)
    if result.settings:
        console.print("settings that differ: " + "; ".join(result.settings), markup=False, highlight=False,
                      soft_wrap=True)
    else:
        console.print("settings: the same (where each run writes aside)")
    table = Table(show_edge=False, header_style="bold")
    for column in ("compared", "items", "differ", "first difference", "A", "B"):
        table.add_column(column, overflow="fold")
    for c in result.comparisons:
        first = c.first
        table.add_row(c.name, str(c.items), str(c.differ) if c.differ else "–",
                      first.where if first else (c.note or ""), first.a if first else "", first.b if first else "")
    console.print(table)
    if result.same:
        console.print("the runs are the same in everything compared")
        return
    parted = next(c for c in result.comparisons if not c.same)
    console.print(f"the runs differ; first in {parted.name}: {parted.first.where}", markup=False, highlight=False)
    _print_text(parted.first, run_a)
    if parted.name != "rollout ids" and parted.first.where.startswith("rollout "):
        rollout = parted.first.where.split(",")[0].removeprefix("rollout ")
        console.print(f"read it: verbatim show {run_a} {rollout}   ·   verbatim show {run_b} {rollout}",
                      markup=False, highlight=False, soft_wrap=True)


def _print_text(first: Divergence, run_a: Path) -> None:
    """The tokens before a rollout's first difference as text, and each run's token there, decoded with the
    run's tokenizer (as ``verbatim show`` does); nothing where it cannot be loaded."""
    if not first.before and first.ids is None:
        return
    from verbatim.cli.show import load_decoder
    from verbatim.harness.store import read_manifest

    decode, _ = load_decoder(read_manifest(run_a))
    if decode is None:
        return
    text = f"after {decode(first.before)!r}"
    if first.ids is not None:
        text += f": A {decode([first.ids[0]])!r}, B {decode([first.ids[1]])!r}"
    console.print(text, markup=False, highlight=False, soft_wrap=True)
