"""``verbatim bench prefixflow --ranks N``: PrefixFlow against full-sequence training on a team, as on one process.

The learner step of :mod:`verbatim.bench.train_scale` (the default model, fresh processes launched as torchrun
launches them, a warm-up step first) on groups of ``group_size`` rows sharing a prompt of ``prefix`` tokens,
``suffix`` model tokens each, one group a rank: trained through PrefixFlow, then as whole sequences, on one
process and on each team size. A team's speedup (whole sequences' step time over PrefixFlow's, each the slowest
rank's) against one process's says whether PrefixFlow keeps its gain under data parallelism, where every rank
runs its phases in lockstep with the others (docs/scale.md). Both paths must make the same update (loss and
gradient norm), or the command fails without a table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from verbatim.bench.train_scale import ScaleWork, run_team
from verbatim.errors import BenchmarkError

SECTION = "bench-prefixflow-team"


def run_bench(work: ScaleWork, ranks: Sequence[int],
              progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """One row per team size (one process first): each path's step time and the speedup."""
    rows = []
    for size in sorted(set(ranks) | {1}):
        times, updates = {}, {}
        for flow in (False, True):
            team = run_team(replace(work, prefixflow=flow), size)
            times[flow] = max(r["step_s"] for r in team)
            updates[flow] = (team[0]["loss"], team[0]["grad_norm"])
        for key, full, flow in zip(("loss", "gradient norm"), updates[False], updates[True], strict=True):
            if abs(flow - full) > 1e-4 * max(1.0, abs(full)):
                raise BenchmarkError(f"on {size} rank(s) PrefixFlow made another update than whole sequences: "
                                     f"{key} {flow:.6g} against {full:.6g}")
        rows.append({"ranks": size, "full_s": times[False], "prefixflow_s": times[True],
                     "speedup": times[False] / times[True], "loss": updates[False][0], "grad_norm": updates[False][1]})
        if progress is not None:
            progress(rows[-1])
    for row in rows:
        row["of_one_process"] = row["speedup"] / rows[0]["speedup"]
    return rows


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| ranks | full sequences (s) | PrefixFlow (s) | speedup | of one process's speedup |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['ranks']} | {r['full_s']:.1f} | {r['prefixflow_s']:.1f} | {r['speedup']:.2f}x "
              f"| {100 * r['of_one_process']:.0f}% |" for r in rows]
    return "\n".join(lines)


def section_text(rows: Sequence[dict[str, Any]], work: ScaleWork, command: str, today: str) -> str:
    return (markdown_table(rows) + f"\n\nMeasured by `{command}` ({today}; CPU processes on gloo, one torch thread "
            f"a rank; the {work.model} model; a step of {work.groups} groups (one a rank on the largest team) of "
            f"{work.group_size} rows sharing a {work.prompt}-token prompt, {work.reply} model tokens each, "
            f"{_microbatches(work)}, after a warm-up step; both paths made the same update: gradient norm "
            f"{rows[0]['grad_norm']:.6g}). Each time is the step's slowest rank's.")


def _microbatches(work: ScaleWork) -> str:
    if work.microbatch_tokens is None:
        return f"microbatch {work.microbatch}"
    return (f"microbatches of up to {work.microbatch_tokens} tokens on both paths (--microbatch-tokens: "
            f"{work.microbatch} whole sequences, or as many of PrefixFlow's suffixes as fit)")
