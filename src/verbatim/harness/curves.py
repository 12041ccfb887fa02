"""A training run's curves as one PNG: reward, policy entropy, trainer-sampler mismatch and prefix-cache hits
per step.

Four panels share the step axis:

1. mean reward (and the success rate, when the env reports one; with ``--eval-every``, held-out pass@1, or avg@K
   where the env never says solved, at each evaluated step, 0 the one before the first);
2. the policy's entropy, mean nats per model token (a collapse toward 0 is a policy that stopped exploring);
3. the mismatch, mean |log π − log μ| over trained tokens (log scale when every value is positive);
4. the prefix-cache hit rate (0..1).

A step whose value is missing or null leaves a gap. matplotlib is optional
(``pip install 'verbatim-rl[report]'``) and drawn without pyplot, on the Agg canvas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verbatim.errors import InputError, install_hint
from verbatim.harness.evaluation import score


def plot_training(records: Sequence[dict[str, Any]], out_png: str | Path, title: str) -> Path:
    """Draw the four panels for these metrics records (one per step) into ``out_png``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise InputError("verbatim plot needs matplotlib", hint=install_hint("report")) from exc
    if not records:
        raise InputError(f"no steps to plot for {title}: metrics.jsonl is empty (no step finished yet)")
    steps = [_step(number, record) for number, record in enumerate(records, start=1)]
    figure = Figure(figsize=(8, 10.5))
    FigureCanvasAgg(figure)
    reward, entropy, mismatch, cache = figure.subplots(4, 1, sharex=True)
    _reward_panel(reward, steps, records)
    _entropy_panel(entropy, steps, records)
    _mismatch_panel(mismatch, steps, records)
    _cache_panel(cache, steps, records)
    cache.set_xlabel("trainer step")
    figure.suptitle(title)
    figure.tight_layout()
    out = Path(out_png)
    try:
        figure.savefig(out, dpi=110, format="png")
    except OSError as exc:
        raise InputError(f"cannot write {out}: {exc.strerror or exc}", hint="pass another --out") from exc
    return out


def series(records: Sequence[dict[str, Any]], key: str) -> list[float]:
    """One metric per step as floats; missing or null values are NaN (a gap in the line)."""
    values = []
    for record in records:
        value = record.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        values.append(float(value) if ok else math.nan)
    return values


def evaluations(steps: list[int], records: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
    """The evaluated steps and their held-out figure (pass@1, else avg@K): the points of the eval curve."""
    found = [(step, score(record.get("eval"))) for step, record in zip(steps, records)]
    return [(step, value) for step, value in found if value is not None]


def _step(number: int, record: dict[str, Any]) -> int:
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise InputError(f"metrics record {number} has no integer 'step' (got {step!r})")
    return step


def _present(values: list[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def _reward_panel(axis: Any, steps: list[int], records: Sequence[dict[str, Any]]) -> None:
    axis.plot(steps, series(records, "reward_mean"), marker=".", color="#3b6ea8", label="mean reward")
    success = series(records, "success_rate")
    if _present(success):
        axis.plot(steps, success, marker=".", color="#4a9a5b", label="success rate")
    held = evaluations(steps, records)
    if held:  # --eval-every: pass@1 on held-out tasks (avg@K where the env never says solved)
        axis.plot(*zip(*held), marker="s", linestyle="--", color="#222222", label="held-out (eval)")
    axis.set_ylabel("reward")
    axis.legend(loc="best", fontsize="small")
    axis.grid(alpha=0.3)


def _entropy_panel(axis: Any, steps: list[int], records: Sequence[dict[str, Any]]) -> None:
    values = series(records, "entropy")
    axis.plot(steps, values, marker=".", color="#c08a2b")
    if not _present(values):  # a run trained before the metric existed
        axis.text(0.5, 0.5, "no entropy recorded", transform=axis.transAxes, ha="center", va="center")
    axis.set_ylabel("policy entropy (nats)")
    axis.grid(alpha=0.3)


def _mismatch_panel(axis: Any, steps: list[int], records: Sequence[dict[str, Any]]) -> None:
    values = series(records, "mismatch_mean_abs")
    present = _present(values)
    axis.plot(steps, values, marker=".", color="#b5533c")
    if present and all(v > 0 for v in present):
        axis.set_yscale("log")
    if not present:
        axis.text(0.5, 0.5, "no mismatch recorded", transform=axis.transAxes, ha="center", va="center")
    axis.set_ylabel("mean |log π − log μ|")
    axis.grid(alpha=0.3)


def _cache_panel(axis: Any, steps: list[int], records: Sequence[dict[str, Any]]) -> None:
    axis.plot(steps, series(records, "cache_hit_rate"), marker=".", color="#7a5aa6")
    axis.set_ylim(-0.02, 1.02)
    axis.set_ylabel("cache hit rate")
    axis.grid(alpha=0.3)
