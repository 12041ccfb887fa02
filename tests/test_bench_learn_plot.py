"""bench learn's curves: a line per run for single runs, a mean ± sd band per setting with repeats."""

from __future__ import annotations

import struct

import pytest

from verbatim.bench.learn import LearnSettings, plan_runs
from verbatim.bench.learn_plot import curves, panels, plot, smoothed


def _results(rewards_by_setting: dict[str, list[list[float]]]) -> list[dict]:
    """Fake results: each setting's runs (one list of per-step rewards a seed), labelled as plan_runs does."""
    seeds = len(next(iter(rewards_by_setting.values())))
    out = []
    for run in plan_runs(list(range(seeds)), ablation=True):
        if run.setting in rewards_by_setting:
            rewards = rewards_by_setting[run.setting][run.seed]
            history = [{"step": n, "version": n, "reward_mean": r} for n, r in enumerate(rewards, start=1)]
            out.append({"run": run.model_dump(mode="json"), "history": history,
                        "settings": LearnSettings().model_dump(mode="json")})
    return out


def _png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_a_curve_is_the_moving_mean_of_the_last_five_steps():
    assert smoothed([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]) == [0.0, 0.5, 2 / 3, 0.75, 0.8, 1.0, 0.8]
    assert smoothed([None or 0.0]) == [0.0]


def test_single_runs_are_one_line_each_with_their_raw_steps(tmp_path):
    results = _results({"on-policy": [[0.0] * 10], "lag 2 · keep · correction": [[1.0] * 10]})
    drawn = curves(results)
    assert [c.label for c in drawn] == ["seed 0", "seed 0 · lag 2 · keep · correction"]
    assert drawn[1].raw == (1.0,) * 10 and drawn[1].sd == ()
    assert panels(drawn) == [drawn]
    plot(results, tmp_path / "one.png")
    assert _png_size(tmp_path / "one.png") == (880, 495)  # one panel, 8 × 4.5 in at 110 dpi


def test_repeats_draw_each_setting_as_its_seeds_mean_and_spread_beside_on_policy(tmp_path):
    results = _results({"on-policy": [[0.2] * 10, [0.4] * 10, [0.6] * 10],
                        "lag 2 · keep · correction": [[0.0] * 10, [0.0] * 10, [0.3] * 10],
                        "re-rendered context": [[0.5] * 10, [0.5] * 10, [0.5] * 10]})
    drawn = curves(results)
    assert [c.label for c in drawn] == ["on-policy (3 seeds)", "lag 2 · keep · correction (3 seeds)",
                                        "re-rendered context (3 seeds)"]
    assert drawn[0].mean == pytest.approx((0.4,) * 10) and drawn[0].sd == pytest.approx((0.2,) * 10)
    assert drawn[1].mean == pytest.approx((0.1,) * 10) and drawn[2].sd == pytest.approx((0.0,) * 10)
    assert all(c.raw == () for c in drawn)
    assert [[c.setting for c in panel] for panel in panels(drawn)] == [
        ["on-policy", "lag 2 · keep · correction"], ["on-policy", "re-rendered context"]]
    plot(results, tmp_path / "repeats.png")
    assert _png_size(tmp_path / "repeats.png") == (1210, 495)  # two panels side by side, 11 × 4.5 in


def test_an_unfinished_benchmark_plots_the_settings_it_has():
    """A setting with one seed so far beside one with three: every setting a band (the single one's is flat)."""
    results = _results({"on-policy": [[0.2] * 10, [0.4] * 10, [0.6] * 10]})
    results.append(_results({"lag 2 · keep · correction": [[0.1] * 10]})[0])
    drawn = curves(results)
    assert [c.label for c in drawn] == ["on-policy (3 seeds)", "lag 2 · keep · correction (1 seed)"]
    assert drawn[1].sd == (0.0,) * 10
