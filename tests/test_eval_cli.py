"""``verbatim eval`` and ``train --eval-every`` refuse bad input with one line, exit 2, before any engine starts and
with nothing recorded lost; the figures of an evaluation come from its rollouts (harness/evaluation.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_bad_input import one_error_line
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.datamodel import Rollout, Source, TokenColumns
from verbatim.errors import InputError
from verbatim.harness.evaluation import figures, headline, score
from verbatim.jobs.config import TrainConfig

runner = CliRunner()


@pytest.mark.parametrize("args,needle", [
    (["--samples", "0"], "--samples 0 must be at least 1"),
    (["--samples", "4", "--pass-k", "1,8"], "--pass-k 1,8: pass@8 needs 1 <= k <= the 4 samples a task gets"),
    (["--pass-k", "one"], "--pass-k one must be whole numbers separated by commas"),
    (["--env-arg", "high=2"], "env 'guess' gave 0 held-out tasks of the 8 asked"),
])
def test_bad_eval_flags_are_one_line_and_write_nothing(tmp_path, args, needle):
    out = tmp_path / "never"
    one_error_line(runner.invoke(app, ["eval", "--env", "guess", *args, "--out", str(out)]), needle)
    assert not out.exists()


def test_a_folder_that_is_no_checkpoint_is_named(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000003").mkdir(parents=True)
    (run / "checkpoints" / "step-000003" / "config.json").write_text("{}")
    (run / "manifest.json").write_text("{}")
    out = tmp_path / "never"
    one_error_line(runner.invoke(app, ["eval", "--env", "guess", "--model", str(run), "--out", str(out)]),
                   f"--model {run}: the run in {run} has no complete checkpoint to play")
    step = run / "checkpoints" / "step-000003"
    one_error_line(runner.invoke(app, ["eval", "--env", "guess", "--model", str(step), "--out", str(out)]),
                   f"--model {step} is not a complete checkpoint")
    assert not out.exists()


@pytest.mark.parametrize("args,needle", [
    (["--eval-every", "1", "--agent", "AGENT", "--tasks", "TASKS"], "--eval-every with --agent or --agent-cmd "
                                                                    "needs --eval-tasks FILE"),
    (["--env", "guess", "--eval-every", "1", "--tasks", "TASKS", "--eval-tasks", "TASKS"],
     "2 of the 2 evaluation tasks equal tasks the run trains on"),
    (["--env", "guess", "--eval-every", "1", "--env-arg", "high=2"], "--eval-every: env 'guess' gave 0 held-out"),
    (["--env", "guess", "--eval-every", "0"], "--eval-every 0 must be at least 1"),
    (["--env", "guess", "--eval-every", "1", "--eval-samples", "2", "--eval-pass-k", "4"],
     "--eval-pass-k 4: pass@4 needs 1 <= k <= the 2 samples"),
])
def test_bad_evaluation_flags_of_train_are_one_line_before_the_engine(tmp_path, default_model_dir, args, needle):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"target": 3}\n{"target": 7}\n')
    out = tmp_path / "never"
    agent = str(Path(__file__).resolve().parent.parent / "examples" / "calculator_agent.py") + ":solve"
    args = [{"TASKS": str(tasks), "AGENT": agent}.get(a, a) for a in args]
    one_error_line(runner.invoke(app, ["train", *args, "--out", str(out)]), needle)
    assert not out.exists()


def test_a_resume_with_a_bad_evaluation_flag_loses_nothing_recorded(tmp_path, default_model_dir):
    """A recorded run stays as it was when a resume's evaluation flags are refused."""
    run = tmp_path / "run"
    shutil.copytree(_recorded_run(tmp_path), run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    one_error_line(runner.invoke(app, ["train", "--env", "guess", "--eval-every", "1", "--env-arg", "high=2",
                                       "--out", str(run), "--resume"]), "--eval-every: env 'guess' gave 0")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def _recorded_run(tmp_path):
    folder = tmp_path / "recorded"
    folder.mkdir()
    config = TrainConfig(play={"env": "guess", "env_args": {"high": 2}}, output={"out": str(tmp_path / "run")},
                         evaluation={"eval_every": 1}).config()
    (folder / "manifest.json").write_text(json.dumps({"schema_version": 1, "run_id": "r", "config": config}))
    (folder / "metrics.jsonl").write_text('{"step": 1, "version": 1}\n')
    return folder


def _rollout(group: int, sample: int, solved: bool | None, status: str = "ok", version: int = 2) -> Rollout:
    tokens = TokenColumns(token_id=np.array([1, 2, 3]), source=np.array([Source.PROMPT, Source.MODEL, Source.MODEL]),
                          logprob=np.array([np.nan, -0.5, -0.2]), policy_version=np.array([-1, version, version]),
                          turn=np.array([0, 0, 0]))
    info = {} if solved is None else {"env": {"solved": solved}}
    return Rollout(run_id="e", group_id=f"g{group:04d}", rollout_id=f"g{group:04d}-r{sample:02d}",
                   task={"id": f"eval-{group}"}, tokens=tokens,
                   reward=None if status == "error" else float(bool(solved)),
                   status=status, error=None if status == "ok" else "cut", info=info)


def test_figures_count_an_unfinished_sample_as_unsolved_and_check_the_version():
    rollouts = [_rollout(0, 0, True), _rollout(0, 1, False), _rollout(0, 2, None, "error"), _rollout(0, 3, True),
                _rollout(1, 0, False), _rollout(1, 1, False), _rollout(1, 2, False), _rollout(1, 3, True)]
    found = figures(rollouts[::-1], version=2)  # in any order: tasks as planned
    assert [row["task"] for row in found["per_task"]] == ["eval-0", "eval-1"]
    assert found["per_task"][0]["success_rate"] == 0.5 and found["per_task"][1]["success_rate"] == 0.25
    assert found["pass_at_k"]["1"] == pytest.approx(0.375) and found["pass_at_k"]["4"] == 1.0
    assert found["version"] == 2 and score(found) == found["pass_at_k"]["1"]
    assert headline(found) == "pass@1 0.375, pass@4 1.000, avg@4 0.375, 2 tasks × 4 samples"
    with pytest.raises(InputError, match="holds tokens of version 2, not 3"):
        figures(rollouts, version=3)


def test_figures_of_an_env_that_never_says_solved_are_avg_at_k_and_say_why():
    """Failed samples too: a task whose samples all failed is not judged where the env never judges."""
    found = figures([_rollout(0, 0, None), _rollout(0, 1, None), _rollout(1, 0, None, "error"),
                     _rollout(1, 1, None, "error")])
    assert found["pass_at_k"] is None and found["success_rate"] is None
    assert "never said whether a rollout solved" in found["why_no_pass_at_k"]
    assert score(found) == found["mean_reward"] == 0.0 and [t["pass_at_k"] for t in found["per_task"]] == [None] * 2


def test_a_run_trained_to_its_last_step_owes_the_evaluation_a_kill_cut_short(tmp_path):
    """--resume of a run whose last step is checkpointed but whose last evaluation never wrote its line plays that
    evaluation, rather than saying the run is complete."""
    from verbatim.harness.metrics_log import rewrite_metrics
    from verbatim.jobs.train import owes_last_evaluation

    out = tmp_path / "run"
    out.mkdir()
    config = TrainConfig(play={"env": "guess"}, plan={"steps": 2}, output={"out": str(out)},
                         evaluation={"eval_every": 1})
    lines = [{"step": 0, "version": 0, "eval": {}}, {"step": 1, "version": 1, "eval": {}}, {"step": 2, "version": 2}]
    rewrite_metrics(out, lines)
    assert owes_last_evaluation(config)
    rewrite_metrics(out, [*lines[:2], {**lines[2], "eval": {}}])
    assert not owes_last_evaluation(config)
    rewrite_metrics(out, lines)
    assert not owes_last_evaluation(config.model_copy(update={"evaluation": config.evaluation.model_copy(
        update={"eval_every": None})}))


def test_a_run_recorded_before_held_out_tasks_resumes_only_as_it_trained(tmp_path):
    """Training draws only the tasks an env's rule keeps since issue #46: a run recorded before trained on every
    generated task, so its resume must say --no-hold-out (or its steps would play other tasks)."""
    from verbatim.harness.store import RunManifest, TraceWriter
    from verbatim.jobs.train import check

    out = tmp_path / "run"
    config = TrainConfig(play={"env": "guess"}, plan={"steps": 2}, output={"out": str(out), "resume": True})
    recorded = config.config()
    del recorded["train"]["plan"]["hold_out"]
    del recorded["train"]["evaluation"]
    TraceWriter(out, RunManifest(run_id="r", model="m", renderer="r", engine={"block_size": 16}, config=recorded))
    with pytest.raises(InputError, match="plan.hold_out: False -> True"):
        check(config)
    old_way = config.model_copy(update={"plan": config.plan.model_copy(update={"hold_out": False})})
    assert check(old_way) == 0


def test_a_run_folder_names_its_newest_complete_checkpoint(tmp_path):
    from verbatim.jobs.compose import checkpoint_model

    run = tmp_path / "run"
    (run / "manifest.json").parent.mkdir()
    (run / "manifest.json").write_text("{}")
    for step, complete in ((2, True), (4, True), (6, False)):
        folder = run / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        for name in ("model.safetensors", "optimizer.pt", "rng.pt", "config.json")[:4 if complete else 1]:
            (folder / name).write_text("x")
        (folder / "state.json").write_text(json.dumps({"schema": 1, "step": step}))
    assert checkpoint_model(str(run)) == str(run / "checkpoints" / "step-000004")
    assert checkpoint_model(str(run / "checkpoints" / "step-000002")) == str(run / "checkpoints" / "step-000002")
    with pytest.raises(InputError, match="is not a complete checkpoint"):
        checkpoint_model(str(run / "checkpoints" / "step-000006"))
