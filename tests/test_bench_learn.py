"""bench learn's bookkeeping (no training here: the runs themselves are the benchmark)."""

from __future__ import annotations

import json

import pytest

from verbatim.bench import learn
from verbatim.bench.learn import LearnSettings, plan_runs, run_all
from verbatim.errors import InputError


def steps(*records: dict) -> list[dict]:
    """``metrics.jsonl``'s records of a run whose steps hold ``records``' values (steps and versions from 1)."""
    return [{"step": n, "version": n} | record for n, record in enumerate(records, start=1)]


def fake_result(run, settings) -> dict:
    return {"run": run.model_dump(mode="json"), "history": steps(*[{"reward_mean": 0.5}] * 10), "wall_s": 1.0,
            "settings": settings.model_dump(mode="json")}


def test_a_record_keeps_finished_runs_and_only_the_missing_ones_are_trained(tmp_path, monkeypatch):
    settings = LearnSettings()
    runs = plan_runs([0, 1], ablation=True)
    record = tmp_path / "runs.jsonl"
    record.write_text(json.dumps(fake_result(runs[0], settings)) + "\n")  # seed 0 finished before a kill
    trained = []
    monkeypatch.setattr(learn, "_train_in_child", lambda run, s, model, root, watch=None: trained.append(run.label)
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
    monkeypatch.setattr(learn, "_train_in_child", lambda run, s, model, root, watch=None: trained.append(run.label)
                        or fake_result(run, s))
    run_all(runs, LearnSettings(), "default", record=record)
    assert trained == ["seed 0"]
    record.write_text("{not json\n")
    with pytest.raises(InputError, match="line 1 is not JSON"):
        run_all(runs, LearnSettings(), "default", record=record)


def test_the_lora_run_trains_an_adapter_at_its_own_learning_rate(tmp_path):
    run = next(r for r in plan_runs([0], ablation=True) if r.lora_rank)
    config = learn.train_config(run, LearnSettings(), "default", tmp_path)
    assert (config.learner.lora.rank, config.learner.lr) == (16, 3e-4)
    on_policy = learn.train_config(plan_runs([0], ablation=False)[0], LearnSettings(), "default", tmp_path)
    assert (on_policy.learner.lora.rank, on_policy.learner.lr) == (None, LearnSettings().lr)


def test_the_re_rendered_run_is_an_ablation_not_a_seed_and_says_how_far_its_rows_moved():
    settings = LearnSettings()
    runs = plan_runs([0, 1], ablation=True)
    assert [r.label for r in runs] == ["seed 0", "seed 1", "seed 0 · lag 2 · keep · correction",
                                       "seed 1 · lag 2 · keep · correction", "seed 0 · lag 2 · keep · no correction",
                                       "seed 1 · lag 2 · keep · no correction", "seed 0 · re-rendered context",
                                       "seed 1 · re-rendered context", "seed 0 · cut replies closed",
                                       "seed 1 · cut replies closed", "seed 0 · LoRA rank 16 · lr 3e-4",
                                       "seed 1 · LoRA rank 16 · lr 3e-4"]
    step = {"reward_mean": 0.5, "mismatch_mean_abs": 0.0, "model_tokens": 40, "rerendered_changed": 0.25,
            "rerendered_never_sampled": 3, "rerendered_failed": 0, "rerendered_replies": 8, "rerendered_reencoded": 1}
    results = [fake_result(r, settings) for r in runs]
    for ablation in (results[7], results[9]):  # a failure here must not fail the verdict
        ablation["history"] = steps(*[step | {"reward_mean": 0.0}] * 10)
    text = learn.markdown(results, settings, "verbatim bench learn", None)
    assert "Goal (last 5 steps' mean reward at least 0.2 above the first 5 in every seed): NOT met " \
           "(gains +0.000, +0.000)." in text  # two seeds only
    assert "seed 1 · re-rendered context: 25% of its trained rollouts re-render to other tokens than the model " \
           "saw; 30 of its 400 trained reply tokens were never sampled" in " ".join(text.split())
    assert "; 10 of its 80 trained replies were trained as other ids than sampled" in " ".join(text.split())
    assert "| seed 1 · re-rendered context | 0.000 | 0.000 | +0.000 | – | – | – |" in text
    assert "seed 1 · cut replies closed: the traced tokens, and after each reply cut by max tokens the stop token " \
           "the re-render adds, trained with the reply's advantage: 30 of its 400 trained reply tokens" \
           in " ".join(text.split())
    assert "| seed 1 · cut replies closed | 0.000 | 0.000 | +0.000 | – | – | 0.0e+00 |" in text  # μ is the trace's


def _gains(result_gains: dict[str, list[float]], settings: LearnSettings) -> list[dict]:
    """Fake results whose first five steps score 0 and last five the gain."""
    results = []
    for run in plan_runs(list(range(len(next(iter(result_gains.values()))))), ablation=True):
        gains = result_gains.get(run.setting)
        if gains is None:
            continue
        gain = gains[run.seed]
        result = fake_result(run, settings)
        result["history"] = steps(*[{"reward_mean": 0.0}] * 5, *[{"reward_mean": gain}] * 5)
        results.append(result)
    return results


def test_repeats_give_each_setting_its_mean_and_spread_and_say_which_ablation_differs():
    settings = LearnSettings()
    results = _gains({"on-policy": [0.4, 0.5, 0.6], "re-rendered context": [0.45, 0.55, 0.5],
                      "cut replies closed": [0.0, 0.05, 0.1]}, settings)
    text = learn.markdown(results, settings, "verbatim bench learn --repeats 3", None)
    assert "| on-policy | 3 | 0.000 ± 0.000 | 0.500 ± 0.100 | +0.500 ± 0.100 |" in text
    assert "| re-rendered context | 3 |" in text and "within the spread of on-policy (+0.000)" in text
    assert "below on-policy by more than the spread (-0.450)" in text
    assert "on-policy: seed 0 +0.400, seed 1 +0.500, seed 2 +0.600" in text
    assert "Every run:" in text and "| seed 2 · cut replies closed |" in text


def test_held_out_pass_at_k_before_the_first_step_and_after_the_last_is_each_runs_and_each_settings():
    settings = LearnSettings(eval_samples=4)
    results = _gains({"on-policy": [0.4, 0.5], "re-rendered context": [0.45, 0.55]}, settings)
    for n, result in enumerate(results):
        evaluated = [{"step": 0, "version": 0, "eval": {"pass_at_k": {"1": 0.125, "2": 0.2, "4": 0.25}}}]
        result["history"] = evaluated + result["history"]
        if n != 3:  # the last run stopped before its last evaluation
            result["history"][-1]["eval"] = {"pass_at_k": {"1": 0.5 + 0.25 * n, "2": 0.6, "4": 0.75}}
    text = learn.markdown(results, settings, "verbatim bench learn --repeats 2", None)
    assert "| held-out pass@1 before | held-out pass@1 after | held-out pass@4 before | held-out pass@4 after |" \
        in text
    assert "| on-policy | 2 | 0.000 ± 0.000 | 0.450 ± 0.071 | +0.450 ± 0.071 | 0.125 ± 0.000 | 0.625 ± 0.177 | " \
        "0.250 ± 0.000 | 0.750 ± 0.000 |" in text
    assert "| re-rendered context | 2 | 0.000 ± 0.000 | 0.500 ± 0.071 | +0.500 ± 0.071 | 0.125 ± 0.000 | " \
        "1.000 ± 0.000 |" in text
    assert "| seed 1 | 0.000 | 0.500 | +0.500 | 0.125 → 0.750 | 0.250 → 0.750 |" in text
    assert "| seed 1 · re-rendered context | 0.000 | 0.550 | +0.550 | – | – |" in text
    assert "Held out: 8 games × 4 samples of the target training never draws" in text


def test_repeats_pick_the_seeds_and_refuse_too_few():
    assert learn.learn_seeds(None, None) == [0, 1] and learn.learn_seeds([5], None) == [5]
    assert learn.learn_seeds(None, 3) == [0, 1, 2] and learn.learn_seeds([7, 8, 9, 10], 3) == [7, 8, 9]
    with pytest.raises(InputError, match="--repeats 3 needs 3 seeds; --seed gave 2"):
        learn.learn_seeds([1, 2], 3)


def test_a_training_run_reports_each_step_it_logs_while_it_plays(tmp_path):
    """The child stands in for a training run: it logs three steps, a line each, then exits."""
    import subprocess
    import sys

    metrics = tmp_path / "metrics.jsonl"
    script = (f"import time, sys\nopen({str(metrics)!r}, 'a').write('{{\"step\": 0, \"version\": 0, \"eval\": "
              "{}}\\n')\nfor step in range(1, 4):\n    time.sleep(0.3)\n"
              f"    open({str(metrics)!r}, 'a').write('{{\"step\": %d, \"version\": %d}}\\n' % (step, step))\n"
              "sys.exit(7)")  # step 0's line, the evaluation before the first step, is no trained step
    seen = []
    code = learn.wait_reporting_steps(subprocess.Popen([sys.executable, "-c", script]), metrics, seen.append,
                                      every_s=0.1)
    assert code == 7 and seen[-1] == 3 and seen == sorted(set(seen))  # every growth once, the last one too


def test_the_runs_being_trained_are_reported_by_run_and_step(tmp_path, monkeypatch):
    steps = []

    def fake_child(run, settings, model, root, watch):
        for n in (1, 2):
            watch(n)
        return fake_result(run, settings)

    monkeypatch.setattr(learn, "_train_in_child", fake_child)
    runs = plan_runs([0], ablation=False)
    run_all(runs, LearnSettings(), "default", on_step=lambda run, n, index: steps.append((run.label, n, index)))
    assert steps == [("seed 0", 1, 0), ("seed 0", 2, 0)]


@pytest.mark.parametrize("as_json", [False, True])
def test_each_finished_run_is_reported_as_a_line_or_as_json(tmp_path, monkeypatch, as_json):
    from typer.testing import CliRunner

    from verbatim.cli.app import app

    monkeypatch.setattr(learn, "_train_in_child", lambda run, s, model, root, watch=None: fake_result(run, s))
    flags = ["--json"] if as_json else []
    result = CliRunner().invoke(app, ["bench", "learn", "--seed", "3", "--no-ablation", *flags])
    assert result.exit_code == 0, result.output
    if as_json:
        reported = json.loads(result.stdout.splitlines()[0])
        assert reported["run"]["label"] == "seed 3" and len(reported["history"]) == 10
    else:
        assert "seed 3: reward 0.500 -> 0.500 (+0.000) in 0.0 min" in result.stderr
        assert "seed 3" in result.stdout  # the table
