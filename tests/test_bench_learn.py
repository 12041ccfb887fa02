"""bench learn's bookkeeping (no training here: the runs themselves are the benchmark)."""

from __future__ import annotations

import json

import pytest

from verbatim.bench import learn
from verbatim.bench.learn import LearnSettings, plan_runs, run_all
from verbatim.errors import InputError


def fake_result(run, settings) -> dict:
    return {"run": run.model_dump(mode="json"), "history": [{"reward_mean": 0.5}] * 10, "wall_s": 1.0,
            "settings": settings.model_dump(mode="json")}


def test_a_record_keeps_finished_runs_and_only_the_missing_ones_are_trained(tmp_path, monkeypatch):
    settings = LearnSettings()
    runs = plan_runs([0, 1], ablation=True)
    record = tmp_path / "runs.jsonl"
    record.write_text(json.dumps(fake_result(runs[0], settings)) + "\n")  # seed 0 finished before a kill
    trained = []
    monkeypatch.setattr(learn, "_train_in_child", lambda run, s, model, root: trained.append(run.label)
                        or fake_result(run, s))
    results = run_all(runs, settings, "default", record=record)
    assert [r["run"]["label"] for r in results] == [r.label for r in runs]
    assert trained == [r.label for r in runs[1:]]
    assert len(record.read_text().splitlines()) == len(runs)
    trained.clear()
    run_all(runs, settings, "default", record=record)
    assert trained == []  # everything is recorded now


def test_a_record_of_other_settings_is_not_reused_and_a_damaged_one_is_one_line(tmp_path, monkeypatch):
    runs = plan_runs([0], ablation=False)
    record = tmp_path / "runs.jsonl"
    record.write_text(json.dumps(fake_result(runs[0], LearnSettings(steps=12))) + "\n")
    trained = []
    monkeypatch.setattr(learn, "_train_in_child", lambda run, s, model, root: trained.append(run.label)
                        or fake_result(run, s))
    run_all(runs, LearnSettings(), "default", record=record)
    assert trained == ["seed 0"]
    record.write_text("{not json\n")
    with pytest.raises(InputError, match="line 1 is not JSON"):
        run_all(runs, LearnSettings(), "default", record=record)
