"""``bench learn --repeats K``: each setting over K seeds, and whether an ablation differs from on-policy.

Pure: the rows of the finished runs (``learn.row``) grouped by setting, the mean and the sample standard
deviation of each setting's gain, and per ablation one verdict: it differs from the on-policy runs when the
two means lie further apart than the two standard deviations added (their ±1 sd bars do not touch); else
the repeats cannot tell them apart.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

ON_POLICY = "on-policy"
"""The setting every ablation is compared with: synchronous, the traced tokens, the default correction."""


def setting_of(result: dict[str, Any]) -> str:
    """The setting a result belongs to (results recorded before settings were named: from its label)."""
    run = result["run"]
    if "setting" in run:
        return run["setting"]
    label = run["label"]
    return label.split(" · ", 1)[1] if label.startswith("seed ") and " · " in label else (
        ON_POLICY if label.startswith("seed ") else label)


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def by_setting(results: list[dict[str, Any]], row: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, list]:
    """Each setting's rows, in the order the settings first appear."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        grouped.setdefault(setting_of(result), []).append(row(result) | {"seed": result["run"]["seed"]})
    return grouped


def differs(base: list[float], other: list[float]) -> str:
    """The verdict on ``other``'s gains against ``base``'s."""
    (mean_a, sd_a), (mean_b, sd_b) = spread(base), spread(other)
    if min(len(base), len(other)) < 2:
        return "one run: no spread to compare with"
    gap = mean_b - mean_a
    if abs(gap) > sd_a + sd_b:
        return f"{'above' if gap > 0 else 'below'} on-policy by more than the spread ({gap:+.3f})"
    return f"within the spread of on-policy ({gap:+.3f}): the repeats cannot tell them apart"


def _cell(values: list[float], fmt: str) -> str:
    mean, sd = spread(values)
    return f"{mean:{fmt}} ± {sd:{fmt.lstrip('+')}}"  # a mean may carry its sign, a spread has none


def _held(rows: list[dict[str, Any]], key: str) -> str:
    """A held-out figure's mean ± sd over the runs that evaluated (``–`` where none did)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return _cell(values, ".3f") if values else "–"


def markdown(grouped: dict[str, list[dict[str, Any]]], window: int, k: int) -> str:
    """One row per setting (mean ± standard deviation over its runs), a verdict per ablation, each run's gain;
    ``k``: the held-out samples a task (pass@k's k)."""
    lines = [f"| setting | runs | first {window} steps | last {window} steps | gain | held-out pass@1 before | "
             f"held-out pass@1 after | held-out pass@{k} before | held-out pass@{k} after | mean \\|Δ logp\\| | "
             "dropped | hybrid tokens | cache hit | minutes | versus on-policy |", "|" + "---|" * 15]
    base = [r["gain"] for r in grouped.get(ON_POLICY, [])]
    for name, rows in grouped.items():
        mismatch = [r["mismatch"] for r in rows if r["mismatch"] is not None]
        verdict = "–" if name == ON_POLICY or not base else differs(base, [r["gain"] for r in rows])
        lines.append(f"| {name} | {len(rows)} | {_cell([r['first'] for r in rows], '.3f')} | "
                     f"{_cell([r['last'] for r in rows], '.3f')} | {_cell([r['gain'] for r in rows], '+.3f')} | "
                     f"{_held(rows, 'pass1_before')} | {_held(rows, 'pass1_after')} | "
                     f"{_held(rows, 'passk_before')} | {_held(rows, 'passk_after')} | "
                     f"{_cell(mismatch, '.1e') if mismatch else '–'} | {_cell([r['dropped'] for r in rows], '.1%')} | "
                     f"{statistics.fmean(r['hybrid'] for r in rows):.0f} | "
                     f"{statistics.fmean(r['cache_hit'] for r in rows):.0%} | "
                     f"{statistics.fmean(r['wall_min'] for r in rows):.1f} | {verdict} |")
    gains = "; ".join(f"{name}: " + ", ".join(f"seed {r['seed']} {r['gain']:+.3f}" for r in rows)
                      for name, rows in grouped.items())
    return ("\n".join(lines) + "\n\nMean ± sample standard deviation over each setting's runs; an ablation "
            "differs from on-policy when the two means lie further apart than the two standard deviations "
            "added. A setting's runs differ by seed alone: every request's sampling seed derives from it "
            "(docs/engine.md, reproducible sampling), so a rerun of one seed repeats its draws (to rounding "
            "at the benchmark's concurrency, not bit for bit).\n\nEach run's gain: " + gains + ".\n")
