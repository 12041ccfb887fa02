"""`verbatim run` as a user calls it: its bad input, its refusals, a task file. (A run killed with its own engine,
which must not outlive it: tests/test_reproducible.py; killed and resumed at 15 points: tests/test_kill_resume.py.)"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.errors import VerbatimError

runner = CliRunner()


@pytest.mark.parametrize("args,needle", [
    (["run", "--env", "nosuchenv"], "unknown env"),
    (["run", "--env", "guess", "--cache-policy", "sometimes"],
     "--cache-policy sometimes must be 'flush', 'keep', 'salt' or"),
    (["run", "--env", "guess", "--model", "/nonexistent/model"], "/nonexistent/model does not exist"),
    (["run", "--env", "guess", "--engine", "http"], "needs --url"),
    (["run", "--env", "guess", "--route", "round_robin"], "go with --engine http"),
    (["run", "--env", "guess", "--engine", "http", "--url", "http://127.0.0.1:9", "--route", "sticky"],
     "unknown routing policy"),
])
def test_bad_run_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, needle):
    out = tmp_path / "never"
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert not out.exists()


def test_malformed_task_file_names_the_line(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"secret": 3}\n{"secret": 4\n')
    result = runner.invoke(app, ["run", "--env", "guess", "--tasks", str(tasks), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "line 2" in result.stderr and not (tmp_path / "o").exists()


def test_an_existing_run_is_not_overwritten_without_resume(tmp_path, default_model_dir):
    out = tmp_path / "run"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"run_id": "x"}))
    result = runner.invoke(app, ["run", "--env", "guess", "--out", str(out)])
    assert result.exit_code == 2 and "already holds a run" in result.stderr
    assert json.loads((out / "manifest.json").read_text()) == {"run_id": "x"}


# ---------------------------------------------------------------------------
# Defaults that show the tool working (issue 16)
# ---------------------------------------------------------------------------


def _prepared(tmp_path, **options):
    from verbatim.jobs.config import RUN_FLAGS
    from verbatim.jobs.run import prepare_run

    flags = {"engine": "http", "url": ["http://127.0.0.1:9"], "out": str(tmp_path / "run"), **options}
    run, _ = prepare_run(RUN_FLAGS.config(flags))  # constructing the engine starts nothing
    return run


def test_a_one_task_file_runs_one_group_and_max_turns_covers_the_envs_guesses(tmp_path, default_model_dir):
    tasks = tmp_path / "one.jsonl"
    tasks.write_text('{"target": 7, "max_guesses": 5}\n')
    run = _prepared(tmp_path, env="guess", tasks=str(tasks))
    assert len(run.groups) == 1 and run.loop.max_turns == 5
    assert run.manifest.config["options"]["groups"] == 1 and run.manifest.config["options"]["play"]["max_turns"] == 5
    default = _prepared(tmp_path, env="guess")  # the env's generator: 2 groups of 6-guess games
    assert len(default.groups) == 2 and default.loop.max_turns == 6
    chosen = _prepared(tmp_path, env="guess", groups=3, max_turns=2)
    assert len(chosen.groups) == 3 and chosen.loop.max_turns == 2
    with pytest.raises(VerbatimError, match="2 groups need 2 tasks"):
        _prepared(tmp_path, env="guess", tasks=str(tasks), groups=2)

