"""Engine processes die with the command that started them (engine/reaper.py), without an engine:
a parent that starts a child under a Reaper, then is SIGKILLed, or exits normally."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from verbatim.engine.reaper import RECORD, alive, check_no_leftover_engine, descendants, leftover_engine
from verbatim.errors import InputError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc (Linux)")

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from verbatim.engine.reaper import Reaper
    before = subprocess.Popen(["sleep", "600"])  # started before the reaper: never its business
    with Reaper() as reaper:
        child = subprocess.Popen(["sleep", "600"])  # stands in for vLLM's engine core
        reaper.note()
        print(before.pid, child.pid, flush=True)
        if sys.argv[1] == "exit":
            child.kill(); child.wait()  # a normal exit closes its engine first
        else:
            time.sleep(600)
""")


def start_parent(mode: str) -> tuple[subprocess.Popen, int, int]:
    proc = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    before, child = map(int, proc.stdout.readline().split())
    return proc, before, child


def gone_within(pid: int, seconds: float) -> bool:
    started = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive((pid, started)):
            return True
        time.sleep(0.1)
    return False


def test_the_engine_dies_with_a_sigkilled_parent_and_older_children_are_left_alone():
    proc, before, child = start_parent("kill")  # the parent notes its engine (Reaper.note), as the CLI does
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert gone_within(child, 10), "the child outlived its SIGKILLed parent"
        assert not gone_within(before, 1), "a process older than the reaper was reaped"
    finally:
        for pid in (before, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_normal_exit_reaps_nothing_and_the_watcher_ends():
    proc, before, _ = start_parent("exit")
    try:
        assert proc.wait(20) == 0
        assert not gone_within(before, 1)
        watchers = [p for p, _ in descendants(1) if "verbatim.engine.reaper" in
                    Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace") and
                    str(proc.pid) in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        assert watchers == []
    finally:
        os.kill(before, signal.SIGKILL)


def test_a_resume_is_refused_while_a_recorded_engine_process_lives(tmp_path):
    sleeper = subprocess.Popen(["sleep", "600"])
    while Path(f"/proc/{sleeper.pid}/cmdline").read_bytes() == b"":  # until it has exec'd
        time.sleep(0.01)
    try:
        started = int(Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        (tmp_path / RECORD).write_text(json.dumps({"parent": 1, "processes": [[sleeper.pid, started]]}))
        assert leftover_engine(tmp_path) == [(sleeper.pid, "sleep")]
        with pytest.raises(InputError, match=f"still held by the engine of a killed run: {sleeper.pid} "):
            check_no_leftover_engine(tmp_path, wait_s=0.5)
        (tmp_path / RECORD).write_text(json.dumps({"parent": 1, "processes": [[sleeper.pid, started + 1]]}))
        check_no_leftover_engine(tmp_path)  # the same pid, another process: not the run's engine
    finally:
        sleeper.kill()
        sleeper.wait()
    (tmp_path / RECORD).write_text(json.dumps({"parent": 1, "processes": [[sleeper.pid, started]]}))
    check_no_leftover_engine(tmp_path)  # dead: nothing holds the run


def test_stopping_a_server_group_leaves_no_member_behind():
    """A leader that exits on SIGTERM while its child ignores it (an engine core stuck in shutdown)."""
    from verbatim.engine.reaper import group_members, stop_group

    leader = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import signal, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
                                  "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                  "print('up', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
        child.stdout.readline()
        print(child.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(leader.stdout.readline())
    assert set(group_members(leader.pid)) == {leader.pid, child}
    stop_group(leader.pid, grace_s=1.0)
    leader.wait(10)
    assert group_members(leader.pid) == []
