"""The sandbox's filesystem and process jail: loaded by ``sandbox_guard.py`` by path, never imported.

Needs root (the harness runs as root on its machines; :func:`verbatim.envs.sandbox.probe_isolation`
checks that this works before using it). :func:`enter` makes new mount, PID, network, IPC
and UTS namespaces, forks twice, and returns only in the code's process: PID 2 of the new PID namespace
(PID 1 is a small reaper that reports how the code ended), which has:

- a root filesystem that is a small read-only tmpfs holding read-only, nosuid bind mounts
  of exactly the paths the parent listed (system libraries, the Python installation) at
  their own paths, the working directory (read-write), ``/dev/{null,zero,random,urandom}``
  and a ``/proc`` of the new PID namespace; nothing else of the host is visible;
- a throwaway uid and gid with no groups, so no capabilities are left (it cannot remount,
  chroot again, raise limits or read files that are not world-readable);
- ``chroot`` into that root: a chrooted process may not create user namespaces, so it
  cannot gain namespace capabilities to climb back out;
- ``no_new_privs`` and parent-death signals: if the outer process dies, PID 1 dies, and
  with PID 1 gone the kernel kills everything left in the namespace.

The outer process waits and ends the same way the code's process did (exit status or
signal), so the harness reads the code's fate as its own.
"""

import ctypes
import os
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
DEVICES = ("null", "zero", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"sandbox jail: {what}: {os.strerror(errno)}")


def _encode(text):
    return None if text is None else os.fsencode(text)


def _mount(source, target, fstype, flags, data=None):
    _check(_libc.mount(_encode(source), _encode(target), _encode(fstype), ctypes.c_ulong(flags), _encode(data)),
           f"mount {source} on {target}")


def enter(jail, workdir):
    """Jail this process; returns in the jailed code's process only (the others wait and relay its end)."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    sys.stdout.flush()
    sys.stderr.flush()
    status_read, status_write = os.pipe()
    init = os.fork()
    if init:
        os.close(status_write)
        _relay(init, status_read)
    os.close(status_read)
    _die_with_parent()
    _build_root(jail["root"], jail["binds"], workdir)
    os.chroot(jail["root"])
    os.chdir(workdir)
    uid = jail.get("uid")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # drops every capability (and the parent-death signal: set again)
    _die_with_parent()
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    code = os.fork()  # PID 1 ignores signals it has no handler for (SIGXCPU): the code must not be PID 1
    if code:
        _reap(code, status_write)
    os.close(status_write)
    _die_with_parent()


def _die_with_parent():
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")


def _reap(code, status_write):
    """PID 1 of the namespace: reap every orphan; when the code's process ends, report how, and exit."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if pid == code:
            os.write(status_write, str(status).encode())
            os._exit(0)  # PID 1 gone: the kernel kills whatever the code left running


def _relay(init, status_read):
    """Outside the namespace: wait for it to end, then end as the code's process ended."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the harness ends this process with SIGKILL only
    _, status = os.waitpid(init, 0)
    reported = os.read(status_read, 32)
    if reported:
        status = int(reported)
    sys.stdout.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these two cannot be handled, hence not reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _build_root(root, binds, workdir):
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in binds:
        _bind(path, root + path, writable=False)
    _bind(workdir, root + workdir, writable=True)
    for name in DEVICES:
        _bind(f"/dev/{name}", f"{root}/dev/{name}", writable=True, device=True)
    os.makedirs(root + "/proc", exist_ok=True)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _bind(source, target, *, writable, device=False):
    if os.path.islink(source):  # merged /usr: /bin -> usr/bin stays a link
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "wb").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if device else MS_NODEV) | (0 if writable else MS_RDONLY)
    _mount(None, target, None, flags)
