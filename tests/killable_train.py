"""``verbatim train …`` as a process of its own that a test can kill at a chosen point (SIGKILL to its whole
session), its output in files; this folder is on its PYTHONPATH (test envs such as graded_env.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from subprocess_cli import cli_env

from verbatim.engine.reaper import Process, descendants
from verbatim.harness.store import batch_files, read_run


def served(server) -> list[str]:
    """The flags of a run on ``server`` (a ``tiny_server`` or ``vllm_server``: tests/conftest.py) and its model."""
    return ["--engine", "http", "--url", server.url, "--model", str(server.config.model)]


_COUNTED: dict[tuple[Path, int], tuple[tuple, int]] = {}


def step_rollouts(out: Path, step: int) -> int:
    """The rollouts of ``step`` that the run in ``out`` has recorded (0 before it has a manifest), as reading the
    run finds them; read again only when its batch files have changed. A kill loop asks every 10 ms, and a read
    each time (~5 ms) took a third of the one core that this process shares with the trainer it waits on."""
    if not (out / "manifest.json").exists():
        return 0
    try:
        files = tuple((path.name, *_size_and_time(path)) for _, path in batch_files(out))
    except FileNotFoundError:  # a file moved while listed (a resume sets a discarded step's rollouts aside)
        files = ()
    key = (out, step)
    if not files or _COUNTED.get(key, ((), 0))[0] != files:
        _COUNTED[key] = (files, sum(1 for r in read_run(out).rollouts if r.info.get("step") == step))
    return _COUNTED[key][1]


def _size_and_time(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


class Trainer:
    """``verbatim train …`` in its own session, output to files."""

    def __init__(self, tmp: Path, name: str, args: list[str], python: Path | None = None) -> None:
        """``python``: another interpreter, e.g. the demo's fenced one (tests/demo_fence.py)."""
        self.stdout, self.stderr = tmp / f"{name}.out", tmp / f"{name}.err"
        with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
            self.proc = subprocess.Popen([str(python or sys.executable), "-m", "verbatim.cli", "train", *args],
                                         stdout=out, stderr=err, start_new_session=True, env=cli_env())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"verbatim train did not end within {timeout:.0f}s: {self.err()}") from None

    def err(self) -> str:
        return self.stderr.read_text(errors="replace")[-3000:]

    def kill_when(self, condition, timeout: float = 300.0, *, session: bool = True) -> set[Process]:
        """SIGKILL once ``condition()`` holds: to the whole session, or (``session=False``) to the command alone,
        as the kernel's OOM killer would, leaving its engine's processes to notice and end themselves. Returns
        the processes that ran below the command when it was killed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                below = descendants(self.proc.pid)
                if session:
                    self.kill()
                else:
                    os.kill(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(30)
                return below
            if not self.alive():
                raise AssertionError(f"the trainer ended before the kill point: {self.err()}")
            time.sleep(0.01)
        self.kill()
        raise AssertionError(f"the kill point never came: {self.err()}")
