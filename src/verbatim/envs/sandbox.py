"""Running untrusted Python: a subprocess with rlimits, its own uid and network namespace where possible.

``run_python(code)`` writes ``code`` to ``main.py`` in a fresh temporary
directory and runs it under :mod:`sandbox_guard` (rlimits + audit hook), wrapped
in ``unshare -n`` (a network namespace with no interfaces up) and ``setpriv``
(a throwaway uid whose only capability is reading files) when the machine
allows them; :func:`probe_isolation` says which layers are active. A wall-clock
timeout kills the whole process group. Nothing here raises on the code's
behaviour: limits hit become :attr:`SandboxResult.killed`. See
docs/environments.md for what this does not stop.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pydantic import Field

from verbatim.datamodel import Frozen
from verbatim.errors import EnvError

GUARD = Path(__file__).with_name("sandbox_guard.py")
UID_BASE = 1_900_000
"""Sandboxed code runs as uid ``UID_BASE + n`` (no passwd entry, owns nothing but its directory)."""
_uid_counter = itertools.count()


class SandboxLimits(Frozen):
    cpu_seconds: int = Field(default=2, ge=1)
    wall_seconds: float = Field(default=5.0, gt=0)
    memory_bytes: int = Field(default=512 * 2**20, ge=64 * 2**20)
    """Address-space limit (RLIMIT_AS) of the Python process."""
    file_bytes: int = Field(default=2**20, ge=1024)
    """Largest file the code may write; stdout and stderr are files too."""
    processes: int = Field(default=16, ge=1)
    """RLIMIT_NPROC; the kernel enforces it only when the code runs under its own uid."""
    open_files: int = Field(default=64, ge=16)
    output_chars: int = Field(default=2000, ge=100)
    """Characters of stdout and of stderr kept in the result (head and tail when longer)."""


class Isolation(Frozen):
    """Which OS layers wrap the guard: the jail, a network namespace, a throwaway uid, the audit hook."""

    jail: bool = False
    """Mount, PID, network, IPC and UTS namespaces and a read-only root of bind mounts (root only):
    the code sees the Python installation, system libraries and its own directory, nothing else."""
    network_namespace: str | None = None
    """The ``unshare`` flags that worked (``-n`` as root, ``-rn`` through a user namespace) or None."""
    own_uid: bool = False
    audit_guard: bool = True

    def describe(self) -> str:
        layers = ["rlimits", "process group kill"]
        layers += ["jail (mount, pid, net, ipc, uts namespaces; read-only bind-mounted root)"] if self.jail else []
        layers += [f"network namespace (unshare {self.network_namespace})"] if self.network_namespace else []
        own = "own uid (no capabilities)" if self.jail else "own uid (setpriv, read-only capability)"
        layers += [own] if self.own_uid else []
        layers += ["audit hook"] if self.audit_guard else []
        return ", ".join(layers)


class SandboxResult(Frozen):
    stdout: str
    stderr: str
    exit_code: int | None
    """The process's exit status; negative for a signal; None when killed on the wall clock."""
    killed: str | None = None
    """Why it was stopped (``timeout``, ``cpu time``, ``memory``, ``file size``, ``signal …``), or None."""
    truncated: bool = False
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed is None

    def observation(self) -> str:
        """The result as the model reads it."""
        head = f"killed: {self.killed}" if self.killed else f"exit status {self.exit_code}"
        parts = [head]
        if self.stdout:
            parts.append(f"stdout:\n{self.stdout.rstrip()}")
        if self.stderr:
            parts.append(f"stderr:\n{self.stderr.rstrip()}")
        if not self.stdout and not self.stderr:
            parts.append("(no output)")
        return "\n".join(parts)


@functools.cache
def probe_isolation() -> Isolation:
    """The strongest layers that work on this machine (probed once per process)."""
    if _probe_jail():
        return Isolation(jail=True, own_uid=True)
    return Isolation(network_namespace=_probe_unshare(), own_uid=_probe_setpriv())


def _probe_jail() -> bool:
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        return False
    try:
        result = run_python("import numpy\nprint('jailed', open('/proc/1/cmdline', 'rb').read()[:6] != b'')",
                            SandboxLimits(wall_seconds=20), Isolation(jail=True, own_uid=True))
    except EnvError:
        return False
    return result.ok and result.stdout == "jailed True\n"


SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
                "/etc/localtime", "/etc/alternatives")
"""What the jail shows of the host besides the Python installation (read-only)."""


def jail_binds() -> list[str]:
    """Paths bind-mounted read-only into the jail: system libraries and this Python's prefixes."""
    wanted = [p for p in SYSTEM_PATHS if os.path.lexists(p)]
    for prefix in (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix):
        path = os.path.realpath(prefix)
        if path != "/" and path not in wanted:
            wanted.append(path)
    kept: list[str] = []
    for path in sorted(wanted, key=len):  # a path inside one already bound comes with it
        if not any(path.startswith(other.rstrip("/") + "/") for other in kept if not os.path.islink(other)):
            kept.append(path)
    return kept


def _quiet(command: list[str]) -> bool:
    try:
        return subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _probe_unshare() -> str | None:
    if shutil.which("unshare") is None:
        return None
    for flags in ("-n", "-rn"):
        if _quiet(["unshare", flags, "--", sys.executable, "-I", "-c", "pass"]):
            return flags
    return None


def _probe_setpriv() -> bool:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    return _quiet(_setpriv(UID_BASE) + [sys.executable, "-I", "-c", "import fractions"])


def _setpriv(uid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--"]


def uid_band() -> range:
    """The sandbox uids this process hands out, one per run in turn: processes running sandboxes beside each
    other use different uids."""
    first = UID_BASE + (os.getpid() % 1000) * 1000
    return range(first, first + 1000)


def run_python(code: str, limits: SandboxLimits | None = None, isolation: Isolation | None = None) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh directory under the sandbox; its output and fate."""
    limits = limits or SandboxLimits()
    isolation = isolation or probe_isolation()
    uid = uid_band()[next(_uid_counter) % 1000]
    with tempfile.TemporaryDirectory(prefix="verbatim-sandbox-") as scratch:
        workdir, outputs = Path(scratch, "work"), Path(scratch, "out")
        workdir.mkdir(mode=0o700)
        outputs.mkdir(mode=0o700)
        Path(scratch, "root").mkdir(mode=0o700)
        (workdir / "main.py").write_text(code, encoding="utf-8")
        if isolation.own_uid:
            os.chown(workdir, uid, uid)
            os.chown(workdir / "main.py", uid, uid)
        try:
            return _execute(_command(limits, isolation, uid, Path(scratch, "root")), workdir, outputs, limits)
        finally:
            if isolation.own_uid:
                kill_uid(uid)
            _make_removable(workdir)


def _command(limits: SandboxLimits, isolation: Isolation, uid: int, jail_root: Path) -> list[str]:
    config = limits.model_dump(include={"cpu_seconds", "memory_bytes", "file_bytes", "processes", "open_files"})
    config["audit_guard"] = isolation.audit_guard
    if isolation.jail:  # the guard enters the jail itself: namespaces, binds, chroot, then the uid
        config["jail"] = {"root": str(jail_root), "binds": jail_binds(), "uid": uid if isolation.own_uid else None}
        return [sys.executable, "-I", "-B", str(GUARD), json.dumps(config)]
    command = [sys.executable, "-I", "-B", str(GUARD), json.dumps(config)]
    if isolation.own_uid:
        command = _setpriv(uid) + command
    if isolation.network_namespace:
        command = ["unshare", isolation.network_namespace, "--"] + command
    return command


def _execute(command: list[str], workdir: Path, outputs: Path, limits: SandboxLimits) -> SandboxResult:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": str(workdir),
           "TMPDIR": str(workdir), **{f"{lib}_NUM_THREADS": "1" for lib in ("OMP", "OPENBLAS", "MKL")}}
    start = time.monotonic()
    with open(outputs / "stdout", "wb") as out, open(outputs / "stderr", "wb") as err:
        try:
            process = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                       stderr=err, start_new_session=True)
        except OSError as exc:
            raise EnvError(f"cannot start the sandbox: {exc}", hint="is sys.executable runnable?") from exc
        try:
            status = process.wait(timeout=limits.wall_seconds)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(process.pid)
        if timed_out:
            status = None
            process.wait()
    wall = time.monotonic() - start
    stdout, cut_out = _read(outputs / "stdout", limits.output_chars)
    stderr, cut_err = _read(outputs / "stderr", limits.output_chars)
    killed = f"timeout after {limits.wall_seconds:g} s (wall clock)" if timed_out else _cause(status, stderr, limits)
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=status, killed=killed,
                         truncated=cut_out or cut_err, wall_s=round(wall, 3))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def processes_of(uid: int) -> list[int]:
    """Live (not zombie) pids whose real uid is ``uid``, read from /proc."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            lines = status.read_text().splitlines()
        except OSError:
            continue
        fields = {line.split(":", 1)[0]: line.split(":", 1)[1].split() for line in lines if ":" in line}
        if fields.get("Uid", [""])[0] == str(uid) and fields.get("State", ["Z"])[0] != "Z":
            pids.append(int(status.parent.name))
    return pids


def kill_uid(uid: int) -> None:
    """SIGKILL every process of the sandbox's throwaway uid (children that left the process group)."""
    for _ in range(3):
        pids = processes_of(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)


def _read(path: Path, chars: int) -> tuple[str, bool]:
    """The file's text, or its head and tail with a marker between when longer than ``chars``."""
    data = path.read_bytes()  # bounded: the child cannot write past RLIMIT_FSIZE
    text = data.decode("utf-8", errors="replace")
    if len(text) <= chars:
        return text, False
    half = chars // 2
    return f"{text[:half]}\n[... {len(data)} bytes in all, middle cut ...]\n{text[-half:]}", True


def _cause(status: int, stderr: str, limits: SandboxLimits) -> str | None:
    if status == -signal.SIGXCPU or status == -signal.SIGKILL:
        return f"cpu time limit ({limits.cpu_seconds} s)" if status == -signal.SIGXCPU else "signal SIGKILL"
    if status < 0:
        return f"signal {signal.Signals(-status).name}"
    last = stderr.rstrip().rsplit("\n", 1)[-1]
    if last.startswith("MemoryError"):
        return f"memory limit ({limits.memory_bytes // 2**20} MiB)"
    if "File too large" in stderr:
        return f"file size limit ({limits.file_bytes} bytes)"
    return None


def _make_removable(workdir: Path) -> None:
    """Undo permissions the code may have set so the temporary directory can be deleted."""
    for path in (workdir, *workdir.rglob("*")):
        try:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o700)
        except OSError:
            pass
