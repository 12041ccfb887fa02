"""`verbatim run` as a user runs it: a real process, killed mid-run, then resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.engine.reaper import alive, descendants
from verbatim.errors import VerbatimError
from verbatim.harness.store import read_run
from verbatim.lint.trace import lint_run

ARGS = ["--env", "guess", "--groups", "3", "--group-size", "4", "--max-turns", "2", "--max-tokens", "24",
        "--kv-cache-gib", "1", "--max-model-len", "2048", "--concurrency", "4"]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def _verbatim(*args: str) -> list[str]:
    return [sys.executable, "-c", "from verbatim.cli.app import main; main()", *args]


@pytest.mark.engine
@pytest.mark.slow
def test_killed_run_resumes_with_every_rollout_exactly_once(tmp_path: Path, default_model_dir, engine_runner,
                                                            monkeypatch):
    """The command is killed with its own engine, which must not outlive it; the resume (the same command line,
    given the session's engine) plays the rest, each rollout once. (A command's own start, its engine.log and a
    quiet terminal: tests/test_reproducible.py.)"""
    from command_config import config_of

    from verbatim.jobs.run import run_rollouts

    out = tmp_path / "run"
    proc = subprocess.Popen(_verbatim("run", *ARGS, "--out", str(out)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not list(out.glob("rollouts-*.parquet")):
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.2)
    engine = descendants(proc.pid)  # vLLM's engine core and worker (and the reaper watching them)
    assert any("VLLM" in _cmdline(pid) for pid, _ in engine), [_cmdline(pid) for pid, _ in engine]
    os.kill(proc.pid, signal.SIGKILL)  # only the command: its engine must not outlive it
    proc.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in engine):
        time.sleep(0.2)
    assert not any(alive(p) for p in engine), [_cmdline(pid) for pid, _ in engine if alive((pid, _))]
    before = read_run(out)
    assert 0 < len(before.rollouts) < 12
    assert before.manifest.status == "running"

    summary = run_rollouts(config_of("run", [*ARGS, "--out", str(out), "--resume"], monkeypatch),
                           engine=engine_runner.engine)
    after = read_run(out)
    assert after.problems == [] or all("unfinished write" in p for p in after.problems)
    counts = Counter(r.rollout_id for r in after.rollouts)
    assert len(counts) == 12 and set(counts.values()) == {1}
    kept = {r.rollout_id: r for r in before.rollouts}
    assert all(after_r.same_as(kept[after_r.rollout_id]) for after_r in after.rollouts if after_r.rollout_id in kept)
    assert after.manifest.status == "completed"
    assert lint_run(out).ok
    assert summary.rollouts == 12


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

