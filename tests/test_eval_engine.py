"""``verbatim eval`` on the real engine (the session's, the default model): its figures are what its own trace gives,
recomputed here with binomials; the trace is an ordinary one (lint clean)."""

from __future__ import annotations

import io
import json
from math import comb

import pytest
from rich.console import Console
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.cli.evaluate import eval_command
from verbatim.harness.store import read_run
from verbatim.jobs.config import EvalOptions

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TASKS, SAMPLES = 3, 4


def test_eval_reports_the_pass_at_k_its_own_trace_gives(engine_runner, tmp_path):
    out, summary = tmp_path / "eval", tmp_path / "summary.json"
    options = EvalOptions(play={"env": "graded_env:JudgedFactory"}, sampling={"max_tokens": 12},
                          engine={"max_model_len": 2048}, output={"out": str(out)}, groups=TASKS, group_size=SAMPLES)
    printed = io.StringIO()
    eval_command(options, Console(file=printed, width=200), str(summary), engine=engine_runner.engine)
    written = json.loads(summary.read_text())

    rollouts = read_run(out).rollouts
    solved: dict[str, list[bool]] = {}
    for rollout in rollouts:
        solved.setdefault(rollout.task["id"], []).append(rollout.info["env"]["solved"])
    assert sorted(solved) == [f"eval-{i}" for i in range(TASKS)] and all(len(s) == SAMPLES for s in solved.values())
    counts = [sum(s) for s in solved.values()]
    assert 0 < sum(counts) < TASKS * SAMPLES, counts  # both kinds of sample: the estimator has work to do
    for k in (1, 2, 4):
        want = sum(1 - comb(SAMPLES - c, k) / comb(SAMPLES, k) for c in counts) / TASKS
        assert written["pass_at_k"][str(k)] == pytest.approx(want, abs=1e-12), k
    assert written["success_rate"] == pytest.approx(sum(counts) / (TASKS * SAMPLES))
    assert written["mean_reward"] == pytest.approx(sum(r.reward for r in rollouts) / len(rollouts))
    assert [row["task"] for row in written["per_task"]] == [f"eval-{i}" for i in range(TASKS)]
    assert written["run"]["rollouts"] == TASKS * SAMPLES
    assert f"eval: pass@1 {written['pass_at_k']['1']:.3f}, pass@4" in printed.getvalue()
    assert "'verbatim eval --config" in (out / "config.toml").read_text()  # what repeats it
    lint = CliRunner().invoke(app, ["lint", "trace", str(out)])
    assert lint.exit_code == 0, lint.output[-2000:]
