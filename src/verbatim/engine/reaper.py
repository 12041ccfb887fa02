"""Engine processes die with the command that started them, even a ``kill -9``ed one.

vLLM runs its engine core and workers as child processes. A command that exits normally closes
them; one killed with SIGKILL cannot, and they would go on holding gigabytes of memory and every
core, invisible to the user and competing with a ``--resume``. Two guards:

* :class:`Reaper` starts a small watcher process (``python -m verbatim.engine.reaper PID``) in its
  own session, joined to the command by a pipe. It notes the command's descendants (pid and start
  time, so a reused pid is never touched) every half second. When the pipe closes, because the
  command ended however it ended, it sends SIGTERM to every noted process still alive, then
  SIGKILL after a grace period.
* :func:`record_engine` writes the engine's processes into the run directory
  (``.engine-processes.json``); :func:`check_no_leftover_engine` refuses a ``--resume`` while any of
  them is still alive (one line naming the pids), so two engines never write one run.

Linux only (``/proc``); elsewhere both are no-ops. Standard library only: the watcher must start fast.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5
BYE = b"bye"
GRACE_S = 5.0
RECORD = ".engine-processes.json"

Process = tuple[int, int]
"""(pid, start time in clock ticks since boot): a process, never confused with a later one on the same pid."""


# -- /proc, pure reads ------------------------------------------------------------------------------


def _fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after "pid (comm) " (state, ppid, pgrp, …), or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of ``pid``, or None if it is gone."""
    fields = _fields(pid)
    return None if fields is None else (int(fields[1]), int(fields[19]))


def _every_process() -> list[tuple[int, list[str]]]:
    """(pid, stat fields) of every process now."""
    pids = [int(e) for e in os.listdir("/proc") if e.isdigit()] if os.path.isdir("/proc") else []
    return [(pid, fields) for pid in pids if (fields := _fields(pid)) is not None]


def descendants(root: int) -> set[Process]:
    """Every process below ``root`` (children, their children…), with its start time."""
    children: dict[int, list[tuple[int, int]]] = {}
    for pid, fields in _every_process():
        children.setdefault(int(fields[1]), []).append((pid, int(fields[19])))
    found: set[Process] = set()
    todo = [root]
    while todo:
        for pid, started in children.get(todo.pop(), []):
            if (pid, started) not in found:
                found.add((pid, started))
                todo.append(pid)
    return found


def _live(fields: list[str] | None) -> bool:
    """Stat fields of a process that exists and is not a zombie (or being torn down)."""
    return fields is not None and fields[0] not in ("Z", "X")


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    return _live(_fields(pid))


def alive(process: Process) -> bool:
    """The process still runs: same pid and start time, and not a zombie."""
    fields = _fields(process[0])
    return _live(fields) and int(fields[19]) == process[1]


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace") or "?"
    except OSError:
        return "?"


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    return [pid for pid, fields in _every_process() if int(fields[2]) == pgid and _live(fields)]


def stop_group(pgid: int, grace_s: float = 30.0) -> None:
    """SIGTERM a process group (a server and its engine core and workers), wait for every member to
    go, then SIGKILL whatever is left: a server that exits first must not leave its engine behind."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and group_members(pgid):
            time.sleep(0.2)
        if not group_members(pgid):
            return


# -- the watcher ------------------------------------------------------------------------------------


def reap(processes: set[Process], grace_s: float = GRACE_S) -> None:
    """SIGTERM every live process of ``processes``, SIGKILL those still alive after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        live = [p for p in processes if alive(p)]
        for pid, _ in live:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            time.sleep(0.1)
            live = [p for p in live if alive(p)]
        if not live:
            return


def watch(parent: int, pipe: int, poll_s: float = POLL_S) -> None:
    """Note ``parent``'s new descendants until ``pipe`` closes; reap them unless the parent said
    goodbye first.

    Only processes started after the watcher are noted (a command run inside a longer-lived
    process, such as a test, leaves that process's other children alone). A parent that ends
    normally (its engine closed) writes ``bye`` before closing the pipe; a pipe that closes
    without it means the parent was killed (the kernel closes a dying process's files before
    /proc shows it dead, so the pipe, not /proc, is the signal)."""
    if _stat(parent) is None:
        return
    me = os.getpid()
    before = descendants(parent)
    print("watching", flush=True)  # the parent waits for this before it starts its engine
    known: set[Process] = set()
    pending, said_bye = b"", False
    while True:
        known |= {p for p in descendants(parent) - before if p[0] != me}
        known = {p for p in known if alive(p)}
        ready, _, _ = select.select([pipe], [], [], poll_s)
        if not ready:
            continue
        data = os.read(pipe, 65536)
        if not data:
            break
        pending += data  # "pid start" lines the parent sends (Reaper.note): noted at once, not at the next poll
        *lines, pending = pending.split(b"\n")
        said_bye = said_bye or BYE in lines
        known |= {(int(pid), int(started)) for pid, started in (line.split() for line in lines
                                                                 if line.strip() and line != BYE)}
    if not said_bye:
        reap(known)


class Reaper:
    """The watcher of this process's engine children, for as long as the context is open."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.before: set[Process] = set()

    def __enter__(self) -> Reaper:
        if sys.platform.startswith("linux"):
            self.before = descendants(os.getpid())
            self.proc = subprocess.Popen([sys.executable, "-m", "verbatim.engine.reaper", str(os.getpid())],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
            assert self.proc.stdout is not None
            ready, _, _ = select.select([self.proc.stdout], [], [], 30)
            if ready:  # it has noted what ran before: whatever starts from now on is watched
                self.proc.stdout.readline()
        return self

    def note(self) -> None:
        """Tell the watcher this process's children now (the engine just started): no poll can miss them."""
        if self.proc is None or self.proc.stdin is None:
            return
        new = descendants(os.getpid()) - self.before
        lines = "".join(f"{pid} {started}\n" for pid, started in new if pid != self.proc.pid)
        self.proc.stdin.write(lines.encode())
        self.proc.stdin.flush()

    def pids(self) -> set[int]:
        """The watcher's own pid (not an engine process)."""
        return {self.proc.pid} if self.proc is not None else set()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            try:  # a normal end (the engine is closed by now): the watcher reaps nothing and ends
                self.proc.stdin.write(BYE + b"\n")
                self.proc.stdin.flush()
            except OSError:
                pass
            self.proc.stdin.close()
            try:
                self.proc.wait(GRACE_S + 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# -- a run directory's record of its engine ------------------------------------------------------------


def record_engine(run_dir: Path, skip: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Write this process's descendants (the engine's processes, not the pids in ``skip``) into the run
    directory."""
    if not run_dir.is_dir():
        return
    found = sorted(p for p in descendants(os.getpid()) if p[0] not in skip)
    if not found:
        return
    (run_dir / RECORD).write_text(json.dumps({"parent": os.getpid(), "processes": found}) + "\n")


def forget_engine(run_dir: Path) -> None:
    (run_dir / RECORD).unlink(missing_ok=True)


def leftover_engine(run_dir: Path) -> list[tuple[int, str]]:
    """(pid, name) of each process a killed command's engine left alive in ``run_dir``'s record."""
    try:
        record = json.loads((run_dir / RECORD).read_text())
        processes = [(int(pid), int(started)) for pid, started in record["processes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [(pid, _name(pid)) for pid, started in processes if alive((pid, started))]


def check_no_leftover_engine(run_dir: Path, wait_s: float = 2 * GRACE_S) -> None:
    """Refuse to start beside engine processes a killed command left running for ``run_dir`` (after
    ``wait_s`` for them to go: the killed command's watcher may be reaping them right now)."""
    from verbatim.errors import InputError

    deadline = time.monotonic() + wait_s
    left = leftover_engine(Path(run_dir))
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = leftover_engine(Path(run_dir))
    if left:
        named = ", ".join(f"{pid} ({name})" for pid, name in left[:4])
        raise InputError(f"{run_dir} is still held by the engine of a killed run: {named}",
                         hint=f"stop it first (kill {' '.join(str(pid) for pid, _ in left)}), then resume")


def main(argv: list[str]) -> None:
    watch(int(argv[1]), sys.stdin.fileno())


if __name__ == "__main__":
    main(sys.argv)
