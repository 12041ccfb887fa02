"""`verbatim ARGS` in a process of its own, with this folder on PYTHONPATH (for test envs like graded_env.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def cli(*args: str, launcher: tuple[str, ...] = (), python: Path | None = None) -> subprocess.CompletedProcess:
    """``launcher``: what runs the CLI's module, e.g. torchrun's ``("-m", "torch.distributed.run", ...)``;
    ``python``: another interpreter, e.g. the demo's fenced one (tests/demo_fence.py)."""
    return subprocess.run([str(python or sys.executable), *launcher, "-m", "verbatim.cli", *args],
                          capture_output=True, text=True, timeout=1200, env=cli_env())


def cli_env() -> dict[str, str]:
    """This process's environment with the tests folder on PYTHONPATH."""
    tests = str(Path(__file__).resolve().parent)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p))


def communicate_or_stacks(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc``'s output once it ends; past ``timeout`` s, a failure that shows where its threads were waiting
    (the CLI writes every thread's stack on SIGUSR1), the process killed."""
    import signal
    import time

    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(3.0)
        proc.kill()
        stdout, stderr = proc.communicate()
        stacks = f"still running after {timeout:g} s; its stacks:\n{stderr[-12000:]}\n{stdout[-2000:]}"
        raise AssertionError(stacks) from None
