"""The python env's sandbox: each escape attempt is stopped and reported, fast; normal code just runs.

Every test runs real subprocesses. The layer tests check, with the audit hook
switched off, that each OS layer ``probe_isolation`` reports holds on its own.
"""

from __future__ import annotations

import os
import socket
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from probes import sandbox_pids

from verbatim.envs.sandbox import Isolation, SandboxLimits, SandboxResult, probe_isolation, run_python

FAST = SandboxLimits(cpu_seconds=1, wall_seconds=4.0, memory_bytes=256 * 2**20, output_chars=500)


def run(code: str, limits: SandboxLimits = FAST, isolation: Isolation | None = None) -> SandboxResult:
    return run_python(textwrap.dedent(code), limits, isolation)


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    yield server
    server.close()


def assert_nobody_connected(server: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        server.accept()


def test_normal_code_returns_output_exit_status_and_files_in_its_directory():
    result = run("""
        import sys, numpy
        open("notes.txt", "w").write("kept")
        print(open("notes.txt").read(), numpy.arange(4).sum())
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    """)
    assert (result.stdout, result.stderr, result.exit_code, result.killed) == ("kept 6\n", "to stderr\n", 3, None)
    assert result.observation() == "exit status 3\nstdout:\nkept 6\nstderr:\nto stderr"
    assert run("print('hi')").ok


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    result = run("while True:\n    pass\n")
    assert result.killed == "cpu time limit (1 s)" and result.exit_code < 0
    assert result.wall_s < 4.0 and result.observation().startswith("killed: cpu time limit")


def test_sleeping_code_is_killed_on_the_wall_clock():
    one_second = FAST.model_copy(update={"wall_seconds": 1.0})
    result = run("import time\nprint('start', flush=True)\ntime.sleep(60)\n", one_second)
    assert result.killed == "timeout after 1 s (wall clock)" and result.exit_code is None
    assert result.stdout == "start\n" and result.wall_s < 2.5


@pytest.mark.parametrize("code", ["x = bytearray(2 * 2**30)",
                                  "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))"])
def test_too_much_memory_is_refused(code):
    result = run(code)
    assert result.killed == "memory limit (256 MiB)" and "MemoryError" in result.observation()
    assert result.wall_s < 4.0


def test_writes_outside_the_working_directory_are_refused(tmp_path):
    target = Path("/tmp") / f"verbatim-escape-{uuid.uuid4().hex}"
    outside = tmp_path / "owned-by-root"
    outside.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    for code in [f"open({str(target)!r}, 'w').write('x')",
                 f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')",
                 f"import os\nfd = os.open({str(outside)!r}, os.O_RDONLY)\n"
                 "os.open('f', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
                 f"import os\nos.mkdir({str(outside / 'sub')!r})",
                 f"import os\nopen('a', 'w').close()\nos.rename('a', {str(target)!r})",
                 f"import shutil\nshutil.rmtree({str(outside)!r})"]:
        result = run(code)
        hidden = probe_isolation().jail and "No such file or directory" in result.stderr  # the jail shows no host
        assert result.exit_code == 1 and ("PermissionError: sandbox: " in result.stderr or hidden), (code, result)
    assert not target.exists() and outside.is_dir() and list(outside.iterdir()) == []


def test_sockets_are_refused(listener):
    port = listener.getsockname()[1]
    result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
    assert result.exit_code == 1 and "network sockets are not allowed" in result.stderr
    assert_nobody_connected(listener)
    assert run("import socket\na, b = socket.socketpair()\na.send(b'ok')\nprint(b.recv(2).decode())").stdout == "ok\n"


@pytest.mark.parametrize("code", [
    "import os\nwhile True:\n    os.fork()",
    "import subprocess\nsubprocess.run(['true'])",
    "import os\nos.system('true')",
    "import multiprocessing\nmultiprocessing.Process(target=print).start()",
])
def test_process_creation_is_refused(code):
    result = run(code)
    assert result.exit_code == 1 and "no new processes" in result.stderr and result.wall_s < 4.0
    assert sandbox_pids() == []


def test_native_escape_hatches_and_signals_are_refused():
    result = run("import ctypes\nctypes.CDLL('libc.so.6').fork()")
    assert "ctypes.dlopen is not allowed" in result.stderr
    result = run(f"import os, signal\nos.kill({os.getpid()}, signal.SIGTERM)")
    assert "no signals to other processes" in result.stderr


def test_output_floods_are_cut_and_the_result_stays_small():
    result = run("print('x' * 10**7)")
    assert result.truncated and result.killed == f"file size limit ({FAST.file_bytes} bytes)"
    assert len(result.stdout) < 600 and "bytes in all, middle cut" in result.stdout
    result = run("while True:\n    print('y' * 1000)")
    assert result.truncated and result.exit_code != 0 and result.wall_s < 4.0


def test_children_are_killed_with_the_process_group():
    unguarded = Isolation(network_namespace=None, own_uid=False, audit_guard=False)
    result = run("import os, time\nif os.fork() == 0:\n    print(os.getpid(), flush=True)\n    time.sleep(60)\n"
                 "else:\n    time.sleep(0.3)\n", isolation=unguarded)
    child = int(result.stdout.split()[0])
    time.sleep(0.2)
    state = Path(f"/proc/{child}/status")
    assert not state.exists() or "State:\tZ" in state.read_text()


def test_each_reported_os_layer_holds_without_the_audit_hook(listener, tmp_path):
    layers = probe_isolation()
    assert layers.audit_guard and "rlimits" in layers.describe()
    port = listener.getsockname()[1]
    connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    if layers.network_namespace:
        result = run(connect, isolation=layers.model_copy(update={"audit_guard": False}))
        assert result.exit_code == 1 and "connected" not in result.stdout and "Error" in result.stderr
        assert_nobody_connected(listener)
    if layers.own_uid:
        os.chmod(tmp_path, 0o755)
        unguarded = layers.model_copy(update={"audit_guard": False})
        result = run(f"open({str(tmp_path / 'x')!r}, 'w')", isolation=unguarded)
        refused = "Permission denied" in result.stderr or (layers.jail and "No such file" in result.stderr)
        assert refused and not (tmp_path / "x").exists()
        bomb = run("""
            import os, time
            forks = 0
            try:
                for _ in range(1000):
                    if os.fork() == 0:
                        time.sleep(30)
                        os._exit(0)
                    forks += 1
            except OSError as exc:
                print(forks, exc.errno)
        """, FAST.model_copy(update={"processes": 8}), unguarded)
        forks, errno = (int(v) for v in bomb.stdout.split())
        assert forks < 8 and errno == 11, bomb  # EAGAIN from RLIMIT_NPROC
        assert sandbox_pids() == []
    if not (layers.network_namespace or layers.own_uid):  # no OS layer here: the hook alone must hold
        assert "network sockets are not allowed" in run(connect).stderr


def test_tempfiles_and_threads_work_inside_the_limits():
    result = run("""
        import tempfile, threading, numpy
        with tempfile.NamedTemporaryFile("w", delete=False) as f:
            f.write("scratch")
        print(open(f.name).read(), f.name.startswith(tempfile.gettempdir()))
        threads = [threading.Thread(target=sum, args=([1, 2],)) for _ in range(4)]
        [t.start() for t in threads]; [t.join() for t in threads]
        print(numpy.ones((50, 50)).dot(numpy.ones(50)).sum())
    """)
    assert result.ok and result.stdout == "scratch True\n2500.0\n", result
