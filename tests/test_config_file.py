"""``verbatim run|train --config FILE``: a TOML or YAML file whose keys are the flags. The options a
command would start with are caught where it would start (no engine); bad files are one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from command_config import config_of
from typer.testing import CliRunner

from verbatim.cli.app import app

runner = CliRunner()


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


RUN_TOML = """
env = "guess"
max_turns = 5
max-tokens = 12
temperature = 0
engine = "http"
url = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
admission = false
"""


def test_a_toml_file_sets_run_options_in_either_spelling(tmp_path, monkeypatch):
    options = config_of("run", ["--config", write(tmp_path, "run.toml", RUN_TOML)], monkeypatch)
    assert (options.play.env, options.play.max_turns, options.sampling.max_tokens) == ("guess", 5, 12)
    assert options.sampling.temperature == 0.0 and options.engine.kind == "http"
    assert options.engine.urls == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert options.routing.admission is False
    assert options.groups is None  # not in the file: the flag's default (the task count, else 2, resolved later)


def test_the_command_line_wins_over_the_file(tmp_path, monkeypatch):
    config = write(tmp_path, "run.toml", RUN_TOML)
    options = config_of("run", ["--max-turns", "7", "--config", config, "--url", "http://127.0.0.1:9"],
                         monkeypatch)
    assert options.play.max_turns == 7 and options.sampling.max_tokens == 12
    assert options.engine.urls == ("http://127.0.0.1:9",)  # a repeated flag replaces the file's list


def test_a_yaml_file_sets_train_options_env_args_as_a_table(tmp_path, monkeypatch):
    config = write(tmp_path, "train.yaml", """
env: guess
env_arg: {high: 5, label: "7"}
tasks: tasks.jsonl   # --task-file's other name
lr: 2.0e-5
steps: 3
prefixflow: false
""")
    options = config_of("train", ["--config", config], monkeypatch)
    assert options.play.env_args == {"high": 5, "label": "7"}  # a string stays a string
    assert options.play.tasks == "tasks.jsonl" and options.plan.steps == 3
    assert options.learner.lr == 2e-5 and options.learner.prefixflow is False


def test_env_args_as_a_list_of_pairs(tmp_path, monkeypatch):
    config = write(tmp_path, "train.yml", "env: guess\nenv-arg: [high=5, max_guesses=3]\n")
    assert config_of("train", ["--config", config], monkeypatch).play.env_args == {"high": 5, "max_guesses": 3}


@pytest.mark.parametrize("command,name,text,needle", [
    ("run", "a.toml", 'env = "guess"\nmax_turn = 3\n', "a.toml: unknown key 'max_turn' (not a flag of 'verbatim run') "
                                                       "(did you mean 'max_turns'?)"),
    ("train", "a.toml", 'env = "guess"\nstop_grace = 3.0\n',
     "unknown key 'stop_grace' (not a flag of 'verbatim train')"),
    ("run", "a.toml", 'env = "guess"\nmax_turns = "3"\n', 'a.toml: max_turns must be an integer, not string "3"'),
    ("run", "a.toml", 'env = "guess"\nmax_turns = true\n', "a.toml: max_turns must be an integer, not boolean true"),
    ("run", "a.toml", 'env = "guess"\nresume = 1\n', "a.toml: resume must be true or false, not integer 1"),
    ("run", "a.toml", 'env = "guess"\nurl = "http://x"\n', 'url must be a list (the flag repeats), not string "http://x"'),
    ("train", "a.toml", 'env = "guess"\nenv_arg = [5]\n', "a.toml: env_arg[0] must be a string, not integer 5"),
    ("run", "a.toml", 'env = "guess"\nmax_turns = 0\n', "a.toml: max_turns = 0 must be at least 1"),
    ("run", "a.toml", 'env = "guess"\nmax_turns = 2\nmax-turns = 3\n',
     "--max-turns is given twice (as 'max_turns' and 'max-turns')"),
    ("run", "a.toml", 'env = "guess"\nmax_turns = \n', "a.toml is not valid TOML: Invalid value (at line 2"),
    ("train", "a.yaml", "env: guess\nsteps: [1\n", "a.yaml is not valid YAML at line 3"),
    ("run", "a.yaml", "- env\n- guess\n", "a.yaml: a config file holds a table of flags (KEY = VALUE), not a list"),
    ("run", "a.json", "{}", "the config file a.json must end in .toml, .yaml or .yml"),
])
def test_a_bad_config_file_is_one_line_naming_the_key_or_line(tmp_path, monkeypatch, command, name, text, needle):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, name, text)
    result = runner.invoke(app, [command, "--config", name, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.output
    assert not (tmp_path / "out").exists()


def test_a_missing_config_file_is_one_line(tmp_path):
    result = runner.invoke(app, ["run", "--config", str(tmp_path / "none.toml")])
    assert result.exit_code == 2 and "cannot read the config file" in result.output and "none.toml" in result.output
