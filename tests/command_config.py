"""The config a ``verbatim run`` or ``verbatim train`` command line builds, caught where the command would start
its run (no engine, nothing written): the flags parsed by the CLI itself."""

from __future__ import annotations

from typing import Any

from typer.testing import CliRunner

from verbatim.cli.app import app

TARGETS = {"run": "verbatim.cli.run.run_command", "train": "verbatim.cli.train.train_command",
           "eval": "verbatim.cli.evaluate.eval_command"}


def config_of(command: str, args: list[str], monkeypatch) -> Any:
    """The ``RunOptions`` or ``TrainConfig`` of ``verbatim COMMAND ARGS``."""
    seen = []
    with monkeypatch.context() as patch:
        patch.setattr(TARGETS[command], lambda options, *rest, **given: seen.append(options))
        result = CliRunner().invoke(app, [command, *args])
    assert result.exit_code == 0 and len(seen) == 1, (result.output, result.exception)
    return seen[0]


def with_flags(config: Any, **flags: Any) -> Any:
    """``config`` with some flags set otherwise (``resume=True``, ``lr=0.5``), by its flag table: a field in any
    section changed as its flag would change it."""
    from verbatim.jobs.config import flags_of

    table = flags_of(type(config))
    return table.config({**table.values(config), **flags})
