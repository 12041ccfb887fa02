"""``verbatim run --resume`` goes on with the run it finds, never with other settings: what produced the rollouts
already recorded stays what the run folder says (the CLI through Typer's runner: the check comes before any
engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
from command_config import config_of
from typer.testing import CliRunner

from verbatim.cli.app import app
from verbatim.errors import InputError
from verbatim.harness.store import RunManifest, TraceWriter
from verbatim.jobs.compose import episode_source
from verbatim.jobs.config import RUN_FLAGS
from verbatim.jobs.run import check_same_settings, with_tasks
from verbatim.jobs.run_record import write_config

runner = CliRunner()
AGENT = "def hang(task, client):\n    return 0.0\n\n\ndef chat(task, client):\n    return 1.0\n"


@pytest.fixture
def recorded(tmp_path, monkeypatch) -> tuple[Path, list[str]]:
    """A run folder as ``verbatim run --agent agent.py:hang --max-turns 2`` leaves it when stopped."""
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "tasks.jsonl").write_text('{"n": 1}\n{"n": 2}\n')
    out = tmp_path / "R"
    args = ["--agent", f"{tmp_path / 'agent.py'}:hang", "--tasks", str(tmp_path / "tasks.jsonl"),
            "--max-turns", "2", "--group-size", "2", "--out", str(out)]
    options, _ = with_tasks(config_of("run", args, monkeypatch), episode_source(config_of("run", args,
                                                                                           monkeypatch).play))
    TraceWriter(out, RunManifest(run_id="r", engine={"block_size": 16}, status="interrupted",
                                 config={"options": options.recorded().model_dump(mode="json"), "plan": {}}))
    write_config(out, RUN_FLAGS, options, "run")
    return out, args


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir()}


@pytest.mark.parametrize("change,needle", [
    ({"--agent": "chat"}, "play.agent: "),
    ({"--max-turns": "4"}, "play.max_turns: 2 -> 4"),
    ({"--temperature": "0.5"}, "sampling.temperature: 1.0 -> 0.5"),
    ({"--model": "smollm2-tiny"}, "engine.model: 'default' -> 'smollm2-tiny'"),
])
def test_a_resume_with_other_settings_is_refused_and_changes_nothing(recorded, change, needle):
    out, args = recorded
    args = list(args)
    for flag, value in change.items():
        at = args.index(flag) if flag in args else None
        if flag == "--agent":
            value = args[at + 1].replace(":hang", ":chat")
        if at is None:
            args += [flag, value]
        else:
            args[at + 1] = value
    before = _files(out)
    result = runner.invoke(app, ["run", *args, "--resume"])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert "--resume with a changed config" in line and needle in line, line
    assert "config.toml --resume" in line  # how to repeat the first run's settings
    assert _files(out) == before


def test_the_same_settings_or_the_recorded_config_file_pass(recorded, monkeypatch):
    out, args = recorded
    check_same_settings(with_tasks(*_resolved(args + ["--resume", "--log", "tensorboard"], monkeypatch))[0], out)
    from_file = ["--config", str(out / "config.toml"), "--out", str(out), "--resume"]
    check_same_settings(with_tasks(*_resolved(from_file, monkeypatch))[0], out)


@pytest.mark.parametrize("config,needle", [({"train": {}}, "holds a 'verbatim train' run"),
                                           ({"plan": {}}, "records no settings of 'verbatim run'")])
def test_a_run_whose_settings_are_not_a_runs_is_not_resumed(tmp_path, monkeypatch, config, needle):
    out = tmp_path / "T"
    TraceWriter(out, RunManifest(run_id="t", engine={"block_size": 16}, config=config))
    options = config_of("run", ["--env", "guess", "--out", str(out), "--resume"], monkeypatch)
    with pytest.raises(InputError, match=needle):
        check_same_settings(options, out)


def _resolved(args: list[str], monkeypatch):
    options = config_of("run", args, monkeypatch)
    return options, episode_source(options.play)
