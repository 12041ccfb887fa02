"""``bench learn``'s reward curves (the PNG beside its table).

One run per setting: a line per run, the mean reward over the last ``WINDOW`` steps, with each step's
own mean reward faint behind it. With repeats (a setting run with several seeds) one line per run would
be a tangle of seeds, so each ablation gets a panel of its own beside the on-policy runs: each setting's
mean over its seeds, step by step, inside a band of ± one standard deviation, the spread the table's
verdict compares (bench/learn_repeats.py). The curves are computed here without matplotlib
(:func:`curves`); only :func:`plot` draws.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from verbatim.bench.learn import WINDOW
from verbatim.bench.learn_repeats import ON_POLICY, setting_of
from verbatim.datamodel import Frozen
from verbatim.errors import InputError, install_hint
from verbatim.harness.step_metrics import steps_of


class Curve(Frozen):
    """One line of the plot: a run, or a setting's mean over its seeds with its spread."""

    label: str
    setting: str
    mean: tuple[float, ...]
    """Per step, the moving mean of the reward (over the runs, for a setting)."""
    sd: tuple[float, ...] = ()
    """Per step, the sample standard deviation over the runs (empty for a single run)."""
    raw: tuple[float, ...] = ()
    """A single run's per-step mean reward, unsmoothed (empty for a setting)."""


def smoothed(rewards: list[float], window: int = WINDOW) -> list[float]:
    """Each step's mean over it and the ``window - 1`` steps before it (fewer at the start)."""
    return [statistics.fmean(rewards[max(0, i - window + 1): i + 1]) for i in range(len(rewards))]


def _rewards(result: dict[str, Any]) -> list[float]:
    return [r.reward_mean or 0.0 for r in steps_of(result["history"]) if r.trained]


def curves(results: list[dict[str, Any]]) -> list[Curve]:
    """A curve per run, or, when some setting has several runs, a curve per setting over its runs' steps."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        grouped.setdefault(setting_of(result), []).append(result)
    if all(len(runs) == 1 for runs in grouped.values()):
        return [Curve(label=r["run"]["label"], setting=setting_of(r), mean=tuple(smoothed(_rewards(r))),
                      raw=tuple(_rewards(r))) for r in results]
    out = []
    for setting, runs in grouped.items():
        per_run = [smoothed(_rewards(r)) for r in runs]
        steps = min(map(len, per_run))
        columns = [[run[i] for run in per_run] for i in range(steps)]
        out.append(Curve(label=f"{setting} ({len(runs)} seed{'s' if len(runs) > 1 else ''})", setting=setting,
                         mean=tuple(statistics.fmean(c) for c in columns),
                         sd=tuple(statistics.stdev(c) if len(c) > 1 else 0.0 for c in columns)))
    return out


def panels(drawn: list[Curve]) -> list[list[Curve]]:
    """The curves each panel shows: all in one for single runs; else each ablation beside on-policy."""
    if not any(c.sd for c in drawn):
        return [drawn]
    base = [c for c in drawn if c.setting == ON_POLICY]
    return [base + [c] for c in drawn if c.setting != ON_POLICY] or [base]


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Write the reward curves of ``results`` as a PNG at ``path``."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise InputError("bench learn's plot needs matplotlib", hint=install_hint("report")) from exc
    groups = panels(curves(results))
    cols = 1 if len(groups) == 1 else 2
    rows = -(-len(groups) // cols)
    figure = Figure(figsize=(8 if cols == 1 else 11, 4.5 if rows == 1 else 3.6 * rows))
    axes = figure.subplots(rows, cols, squeeze=False, sharey=True)
    banded = any(c.sd for group in groups for c in group)
    for ax, group in zip(axes.flat, groups, strict=False):
        for index, curve in enumerate(group):
            _draw(ax, curve, "0.35" if banded and curve.setting == ON_POLICY else f"C{index}")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
        ax.set_xlabel("step")
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    if banded:
        figure.suptitle(f"mean reward ({WINDOW}-step mean over each setting's seeds; band: ± 1 sd over seeds)",
                        fontsize="medium")
        for row in axes:
            row[0].set_ylabel("mean reward")
    else:
        axes[0][0].set_ylabel(f"mean reward ({WINDOW}-step mean; faint: per step)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _draw(ax: Any, curve: Curve, color: str) -> None:
    steps = range(1, len(curve.mean) + 1)
    ax.plot(steps, curve.mean, label=curve.label, color=color)
    if curve.sd:
        ax.fill_between(steps, [m - s for m, s in zip(curve.mean, curve.sd, strict=True)],
                        [m + s for m, s in zip(curve.mean, curve.sd, strict=True)], color=color, alpha=0.2)
    if curve.raw:
        ax.plot(steps, curve.raw, alpha=0.25, color=color)
