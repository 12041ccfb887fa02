"""``verbatim plot RUN_DIR``: a training run's curves (reward, mismatch, cache hits per step) as one PNG.

Registered on the root app by :mod:`verbatim.cli.app`, which turns known errors into one
line and an exit code; this module never imports it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from verbatim.cli.console import console


def plot_command(
    run_dir: Path = typer.Argument(..., help="A training run directory written by 'verbatim train --out'."),
    out: Path = typer.Option(None, "--out", help="The PNG to write (default: RUN_DIR/curve.png, redrawn each time)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out file."),
) -> None:
    """Plot a training run's metrics.jsonl: mean reward, mismatch |log π − log μ| and cache hit rate per step."""
    from verbatim.harness.curves import plot_training
    from verbatim.harness.metrics_log import read_metrics
    from verbatim.harness.step_metrics import is_trained
    from verbatim.paths import check_output_file

    if out is not None:
        check_output_file(out, "--out", existing_ok=force)
    records = read_metrics(run_dir)
    steps = sum(map(is_trained, records))  # step 0's line: the evaluation before the first step
    evaluated = sum(bool(r.get("eval")) for r in records)
    written = plot_training(records, out or run_dir / "curve.png", title=f"{run_dir.resolve().name}: "
                            f"{steps} steps")
    more = f", {evaluated} evaluations" if evaluated else ""
    console.print(f"wrote {written} ({steps} steps{more})", soft_wrap=True)
