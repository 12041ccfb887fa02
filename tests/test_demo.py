"""``make demo`` passes with only what its target installs.

The test virtualenv holds every extra; the demo's holds only the extras its Makefile target names. Each
``verbatim`` command of the demo runs here on an interpreter that imports only what that target installs
(tests/demo_fence.py): the reading commands (``lint trace``, ``show``, ``plot``) on a small written run,
``models prepare`` as the demo runs it; ``run`` and ``train`` start engines, and run on the same interpreter in
test_reproducible's first run of each (no engine of their own here).
"""

from __future__ import annotations

import subprocess

import demo_target
import pytest
import view_runs
from subprocess_cli import cli, cli_env

from verbatim.renderers.registry import get_renderer

CHECKED_HERE = {("models", "prepare"), ("lint", "trace"), ("show",), ("plot",)}
CHECKED_IN_TEST_REPRODUCIBLE = {("run",), ("train",)}


def _name(command: list[str]) -> tuple[str, ...]:
    """A command's subcommand words (``lint trace``), without its arguments."""
    words = [w for w in command if not w.startswith(("-", "$"))]
    return tuple(words[:2]) if words[0] in ("models", "lint") else tuple(words[:1])


def test_every_command_of_the_demo_is_run_on_the_demos_interpreter_somewhere():
    names = {_name(c) for c in demo_target.commands()}
    assert names <= CHECKED_HERE | CHECKED_IN_TEST_REPRODUCIBLE, names - CHECKED_HERE - CHECKED_IN_TEST_REPRODUCIBLE
    assert {("run",), ("train",), ("plot",)} <= names  # the parser still reads the target
    assert "report" in demo_target.fence()["VERBATIM_FENCE_EXTRAS"].split(",")  # plot's matplotlib


def test_the_demos_interpreter_has_only_what_the_demo_installs(demo_python):
    for module, found in (("hypothesis", False), ("pytest", False), ("tensorboard", False), ("numpy", True),
                          ("matplotlib", True), ("verbatim.cli", True)):
        done = subprocess.run([str(demo_python), "-c", f"import {module}"], capture_output=True, text=True,
                              env=cli_env(), timeout=120)
        assert (done.returncode == 0) is found, (module, done.stderr[-500:])
    spec = subprocess.run([str(demo_python), "-c", "import importlib.util as u; print(u.find_spec('pytest'))"],
                          capture_output=True, text=True, env=cli_env(), timeout=120)
    assert spec.stdout.strip() == "None", spec.stderr  # a library's availability check sees the same


@pytest.mark.slow
def test_the_demos_reading_commands_pass_with_only_the_demos_extras(tmp_path, default_model_dir, demo_python):
    renderer = get_renderer("smollm2", model_dir=default_model_dir)
    group = [view_runs.play(renderer, f"g0-r{i}", "g0", ["50", "25"], ["Lower."], reward=float(i)) for i in range(2)]
    run = view_runs.write_run(tmp_path / "run", renderer, str(default_model_dir), [group],
                              metrics=view_runs.step_metrics())  # a clean run: lint trace exits 0
    for command in demo_target.commands():
        name = _name(command)
        if name not in CHECKED_HERE:
            continue
        args = [*name, str(run)] if name != ("models", "prepare") else list(name)
        done = cli(*args, python=demo_python)
        assert done.returncode == 0, f"verbatim {' '.join(args)} with the demo's extras: {done.stderr[-2000:]}"
    assert (run / "curve.png").stat().st_size > 0
