"""``verbatim bench routing``'s table and its refusal of a run without routing figures (the measurement itself is
the benchmark's: docs/benchmarks.md, written by a real run)."""

from __future__ import annotations

import pytest

from verbatim.bench.routing import SETTINGS, _require_measured, markdown, summary
from verbatim.errors import BenchmarkError


def result(setting: str, flips: float, replayed: float, unreplayed: float, steps: int = 2) -> dict:
    line = {"step": 1, "version": 1, "routing_flip_rate": flips, "mismatch_replayed": replayed,
            "mismatch_unreplayed": unreplayed}
    return {"setting": setting, "history": [line] * steps, "wall_s": 1.0}


def test_the_table_has_each_settings_means_and_the_ratio():
    text = markdown([result("fp32 engine", 0.0, 1e-7, 1e-7), result("bf16 engine", 0.005, 6e-4, 9e-4)], "CMD")
    assert "| bf16 engine | 2 | 0.50% | 6.00e-04 | 9.00e-04 | 1.50x |" in text and "`CMD`" in text
    assert summary(result("x", 0.1, 1.0, 2.0))["routing_flip_rate"] == pytest.approx(0.1)
    assert set(SETTINGS) == {"fp32 engine", "bf16 engine"}


def test_a_run_without_routing_figures_is_an_error_not_a_row():
    empty = result("bf16 engine", 0.0, 1e-7, 1e-7)
    empty["history"][0] = {**empty["history"][0], "routing_flip_rate": None}
    with pytest.raises(BenchmarkError, match="recorded no routing figures"):
        _require_measured(empty)
    with pytest.raises(BenchmarkError):
        _require_measured({"setting": "x", "history": [], "wall_s": 0.0})
