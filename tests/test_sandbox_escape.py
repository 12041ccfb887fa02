"""Attacks on the python env's sandbox, each a test that fails if the attack gets through.

Most attacks run with the audit hook switched off (``BARE``): that is what code has
after escaping the hook through ctypes or a C extension, so what stops it here is the
OS layers alone: the jail (namespaces, a read-only root of bind mounts, chroot), the
throwaway uid with no capabilities, and rlimits. CI runs as root, like every machine
of this project, so the jail must be active: ``test_the_jail_is_active`` fails otherwise.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from probes import sandbox_pids

from verbatim.envs.sandbox import Isolation, SandboxLimits, SandboxResult, jail_binds, probe_isolation, run_python

FAST = SandboxLimits(cpu_seconds=1, wall_seconds=4.0, memory_bytes=256 * 2**20, processes=8, output_chars=4000)
JAILED = Isolation(jail=True, own_uid=True)
BARE = JAILED.model_copy(update={"audit_guard": False})


def run(code: str, isolation: Isolation = BARE, limits: SandboxLimits = FAST) -> SandboxResult:
    return run_python(textwrap.dedent(code), limits, isolation)


def jail_top_level() -> set[str]:
    """The root entries the jail may show: its binds (system paths, this Python, wherever it is
    installed), its scratch folder under the temp dir, and its own /dev and /proc."""
    binds = jail_binds() + [tempfile.gettempdir()]
    return {Path(path).parts[1] for path in binds} | {"dev", "proc"}


@pytest.fixture
def secret(tmp_path):
    """A world-readable file of the host (mode 644 in a 755 folder): only the jail keeps it out of reach."""
    os.chmod(tmp_path, 0o755)
    path = tmp_path / "token.txt"
    path.write_text(f"SECRET-{uuid.uuid4().hex}")
    path.chmod(0o644)
    return path


def test_the_jail_is_active_on_this_machine():
    layers = probe_isolation()
    assert layers.jail and layers.own_uid and layers.audit_guard, layers
    assert "jail" in layers.describe()


@pytest.mark.parametrize("isolation", [BARE, None], ids=["no-hook", "default"])
def test_host_files_cannot_be_read(secret, isolation):
    targets = [str(secret), "/etc/shadow", "/etc/passwd", "/root/.bashrc", str(Path(__file__).resolve()),
               "/proc/self/../1/environ"]
    result = run(f"""
        import os
        print(sorted(os.listdir("/")))
        for path in {targets!r}:
            try:
                print("READ", path, open(path, errors="replace").read(200))
            except OSError as exc:
                print("refused", path, type(exc).__name__)
    """, isolation or probe_isolation())
    assert result.ok, result
    assert secret.read_text() not in result.stdout and "READ" not in result.stdout.replace("READ /proc", ""), result
    visible = set(eval(result.stdout.splitlines()[0]))  # noqa: S307 - our own printed list
    assert visible <= jail_top_level(), visible
    assert "root:" not in result.stdout  # neither /etc/shadow nor /etc/passwd


def test_nothing_outside_the_working_directory_can_be_written(tmp_path):
    os.chmod(tmp_path, 0o777)  # writable by anyone on the host: only the jail stops it
    marker = f"verbatim-escape-{uuid.uuid4().hex}"
    targets = [str(tmp_path / marker), f"/tmp/{marker}", f"/{marker}", f"/usr/{marker}", f"/dev/{marker}"]
    result = run(f"""
        import os, sys
        for path in {targets!r} + [os.path.join(sys.prefix, "{marker}")]:
            try:
                open(path, "w").write("x")
                print("WROTE", path)
            except OSError as exc:
                print("refused", path, type(exc).__name__)
        open("inside.txt", "w").write("fine")
        print(open("inside.txt").read())
    """)
    assert result.ok and "WROTE" not in result.stdout and result.stdout.endswith("fine\n"), result
    assert not (tmp_path / marker).exists() and not Path("/tmp", marker).exists() and not Path("/", marker).exists()


def test_no_network_tcp_or_abstract_unix_socket():
    """AF_UNIX is allowed by the hook; abstract sockets live in the network namespace, so the jail hides them."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(1)
    tcp.setblocking(False)
    name = f"\0verbatim-test-{uuid.uuid4().hex}"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(name)
    unix.listen(1)
    unix.setblocking(False)
    try:
        code = f"""
            import socket
            for family, address in [(socket.AF_INET, ("127.0.0.1", {tcp.getsockname()[1]})),
                                    (socket.AF_INET, ("1.1.1.1", 53)), (socket.AF_UNIX, {name!r})]:
                try:
                    s = socket.socket(family)
                    s.settimeout(1)
                    s.connect(address)
                    print("CONNECTED", address)
                except OSError as exc:
                    print("refused", type(exc).__name__)
        """
        for isolation in (BARE, probe_isolation()):
            result = run(code, isolation)
            assert "CONNECTED" not in result.stdout and result.wall_s < 4, result
        for server in (tcp, unix):
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        tcp.close()
        unix.close()


def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing():
    result = run("""
        import os, time
        forks = 0
        try:
            while True:
                if os.fork() == 0:
                    while True:
                        try:
                            os.fork()
                        except OSError:
                            time.sleep(0.05)
                forks += 1
        except OSError as exc:
            print(forks, exc.errno)
    """)
    forks, errno = (int(v) for v in result.stdout.split())
    assert forks < FAST.processes and errno == 11, result  # EAGAIN from RLIMIT_NPROC
    assert result.wall_s < 5
    time.sleep(0.2)
    assert sandbox_pids() == []


@pytest.mark.parametrize("code", [
    "x = bytearray(2 * 2**30)",
    "import mmap\nm = mmap.mmap(-1, 2 * 2**30)\nm[-1] = 1",
    "import numpy\nnumpy.ones(2**29)",
])
def test_memory_is_capped(code):
    result = run(code)
    assert result.exit_code != 0 and ("MemoryError" in result.stderr or "Cannot allocate" in result.stderr), result
    assert result.wall_s < 4


THREADS = "import threading\nfor _ in range(4):\n    threading.Thread(target=lambda: sum(range(10**12))).start()"


@pytest.mark.parametrize("code", ["while True:\n    pass", THREADS, "sum(range(10**13))"])
def test_cpu_time_is_capped(code):
    result = run(code)
    assert result.killed == "cpu time limit (1 s)" and result.wall_s < 4, result


def test_nothing_outlives_the_run():
    """A grandchild in its own session, ignoring hangups, dies with the run (PID 1 of its namespace is gone)."""
    started = time.monotonic()
    result = run("""
        import os, signal, time
        if os.fork() == 0:
            os.setsid()
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print("parent leaves")
    """)
    assert result.ok and result.stdout == "parent leaves\n"
    time.sleep(0.2)
    assert sandbox_pids() == [] and time.monotonic() - started < 3


def test_a_run_that_sleeps_is_killed_on_the_wall_clock_with_its_children():
    result = run("""
        import os, time
        os.fork()
        os.setsid()
        time.sleep(60)
    """, limits=FAST.model_copy(update={"wall_seconds": 1.0}))
    assert result.killed == "timeout after 1 s (wall clock)" and result.wall_s < 3
    time.sleep(0.2)
    assert sandbox_pids() == []


def test_host_processes_are_invisible_and_cannot_be_signalled():
    victim = subprocess.Popen(["sleep", "30"])
    try:
        result = run(f"""
            import os, signal
            print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
            try:
                os.kill({victim.pid}, signal.SIGKILL)
                print("KILLED")
            except OSError as exc:
                print("refused", type(exc).__name__)
        """)
        assert result.ok and "KILLED" not in result.stdout, result
        assert max(eval(result.stdout.splitlines()[0])) < 10  # noqa: S307 - only the jail's own PIDs
        time.sleep(0.1)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_native_code_cannot_regain_privileges_or_leave_the_jail():
    """What ctypes (or any C extension) could try once past the hook: each system call is refused."""
    result = run("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        attempts = {
            "setuid(0)": lambda: libc.setuid(0),
            "unshare(user namespace)": lambda: libc.unshare(0x10000000),
            "mount tmpfs": lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None),
            "remount / rw": lambda: libc.mount(None, b"/", None, 32, None),
            "chroot": lambda: libc.chroot(b"/usr"),
        }
        for name, call in attempts.items():
            print(name, "refused" if call() != 0 else "ALLOWED", os.strerror(ctypes.get_errno()))
        os.chdir("/")
        for _ in range(10):
            os.chdir("..")
        print(sorted(os.listdir(".")) == sorted(os.listdir("/")))
    """)
    assert result.ok, result
    lines = result.stdout.splitlines()
    assert all("refused" in line for line in lines[:-1]) and lines[-1] == "True", result.stdout
