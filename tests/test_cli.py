"""The CLI skeleton: version, help, models list, one-line errors with exit codes."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from verbatim import __version__
from verbatim.cli.app import app

runner = CliRunner()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"verbatim {__version__}"


@pytest.mark.parametrize("args", [[], ["models"], ["models", "list"], ["models", "prepare"], ["generate"]])
def test_help_on_every_command(args):
    result = runner.invoke(app, [*args, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout


def test_models_list_shows_the_default():
    result = runner.invoke(app, ["models", "list"])
    assert result.exit_code == 0
    assert "smollm2-135m-instruct" in result.stdout and "(default)" in result.stdout


@pytest.mark.parametrize("args,needle", [
    (["--bogus"], "No such option: --bogus"),
    (["nosuchcommand"], "No such command 'nosuchcommand'"),
    (["generate", "--max-tokens", "zero"], "Invalid value for '--max-tokens'"),
    (["models", "prepare", "no-such-model"], "unknown bundled model 'no-such-model'"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, needle):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    if args[-1] != "no-such-model":  # usage errors point at the command's help
        assert "(see 'verbatim" in lines[0]
    assert "Traceback" not in result.output


def test_debug_shows_the_traceback():
    result = runner.invoke(app, ["--debug", "models", "prepare", "no-such-model"])
    assert result.exit_code != 0
    assert type(result.exception).__name__ == "UnknownModelError"


def test_exit_codes_raised_inside_commands_reach_the_shell():
    import typer

    from verbatim.cli.app import _OneLineErrors

    demo = typer.Typer(cls=_OneLineErrors)

    @demo.command()
    def fail() -> None:
        raise typer.Exit(3)

    @demo.command()
    def ok() -> None:
        pass

    assert runner.invoke(demo, ["fail"]).exit_code == 3
    assert runner.invoke(demo, ["ok"]).exit_code == 0


def _commands(group, path=()):
    for name, command in getattr(group, "commands", {}).items():
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))
        else:
            yield " ".join((*path, name)), command


def test_every_option_and_argument_of_every_command_has_a_description():
    import typer.main

    missing = [f"{path} {param.opts[0]}" for path, command in _commands(typer.main.get_command(app))
               for param in command.params if not getattr(param, "help", None)]
    assert missing == []


def test_one_default_context_length_for_every_command_and_models_list():
    import typer.main

    from verbatim.engine.runtime import DEFAULT_MAX_MODEL_LEN, EngineConfig

    defaults = {path: param.default for path, command in _commands(typer.main.get_command(app))
                for param in command.params if param.name == "max_model_len"}
    assert {"run", "train", "generate", "serve", "fleet up"} <= set(defaults)
    assert set(defaults.values()) == {DEFAULT_MAX_MODEL_LEN} == {EngineConfig(model="m").max_model_len}
    listed = " ".join(runner.invoke(app, ["models", "list"]).stdout.split())
    assert f"context {DEFAULT_MAX_MODEL_LEN} tokens" in listed and "8k" not in listed


def test_sigusr1_prints_every_threads_stack_and_the_command_goes_on():
    """A run that seems stuck: ``kill -USR1`` of the command writes where each thread waits on stderr."""
    import signal
    import subprocess
    import sys

    waiting = ("import threading, time, verbatim.cli.app as cli\n"
               "def command():\n"
               "    threading.Thread(target=time.sleep, args=(60,), name='helper', daemon=True).start()\n"
               "    print('ready', flush=True)\n"
               "    input()\n"
               "    print('went on', flush=True)\n"
               "cli.app = command\n"
               "cli.main()\n")
    proc = subprocess.Popen([sys.executable, "-c", waiting], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGUSR1)
        stdout, stderr = proc.communicate("\n", timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and stdout == "went on\n", stderr
    assert "Current thread" in stderr and stderr.count("Thread 0x") == 1, stderr  # both threads, one "Current"
    assert 'in command' in stderr and "threading.py" in stderr, stderr
