"""The sandbox's in-process guard: run as a script by :mod:`verbatim.envs.sandbox`, never imported.

``python -I sandbox_guard.py CONFIG_JSON`` sets resource limits, installs an
audit hook, then runs ``main.py`` from the working directory as ``__main__``.
The hook refuses (``PermissionError``) process creation, signals to other
processes, non-local sockets, ctypes library loading, symbol lookup and raw
memory reads (``import ctypes`` stays allowed: numpy needs it), and opening for writing,
creating, deleting or renaming any path outside the working directory.
This is a best-effort second layer: audit hooks stop Python code, not native
code, and the OS layers (the jail of ``sandbox_jail.py``, own uid, network
namespace, rlimits) do the rest. With ``"jail"`` in the config the guard first
enters that jail (it needs root); everything after runs inside it.
"""

import importlib.util
import json
import os
import resource
import sys
import traceback

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
SPAWN_EVENTS = frozenset({"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                          "subprocess.Popen", "pty.spawn", "os.startfile"})
SIGNAL_EVENTS = frozenset({"os.kill", "os.killpg", "signal.pthread_kill"})
AF_UNIX = 1  # local socket pairs stay allowed (asyncio needs one)
NATIVE_MODULES = frozenset({"cffi", "_cffi_backend"})
PATH_EVENTS = {  # event -> indexes of (path, dir_fd) pairs among its arguments
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),), "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),), "os.chflags": ((0, None),),
    "os.setxattr": ((0, None),), "os.removexattr": ((0, None),), "shutil.rmtree": ((0, 1),),
}


def set_limits(config):
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (config["cpu_seconds"], config["cpu_seconds"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (config["file_bytes"], config["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (config["open_files"], config["open_files"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (config["processes"], config["processes"]))
    resource.setrlimit(resource.RLIMIT_AS, (config["memory_bytes"], config["memory_bytes"]))


def resolve(path, dir_fd=None):
    if isinstance(path, int):
        return None  # an already-open descriptor: checked when it was opened
    path = os.fsdecode(path)
    if not os.path.isabs(path) and dir_fd not in (None, -1):
        path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    return os.path.realpath(path)


def make_hook(root):
    inside = root.rstrip("/") + "/"

    def outside(path, dir_fd=None):
        resolved = resolve(path, dir_fd)
        return resolved is not None and resolved != root and not resolved.startswith(inside) \
            and resolved != "/dev/null"

    def hook(event, args):
        if event in SPAWN_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed (no new processes)")
        if event in SIGNAL_EVENTS and (not args or args[0] not in (0, os.getpid())):
            raise PermissionError(f"sandbox: {event} is not allowed (no signals to other processes)")
        if event == "socket.__new__" and args[1] != AF_UNIX:
            raise PermissionError("sandbox: network sockets are not allowed")
        if event == "import" and args[0].partition(".")[0] in NATIVE_MODULES:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event.startswith("ctypes.") and not (event == "ctypes.dlopen" and args[0] is None):
            raise PermissionError(f"sandbox: {event} is not allowed (no foreign libraries or raw memory)")
        if event == "open":
            check_open(args)
        elif event in PATH_EVENTS:
            for path_at, fd_at in PATH_EVENTS[event]:
                if args[path_at] is not None and outside(args[path_at], None if fd_at is None else args[fd_at]):
                    raise PermissionError(f"sandbox: {event} outside the working directory: {args[path_at]!r}")

    def check_open(args):
        path, mode, flags = args
        writing = (flags & WRITE_FLAGS) if isinstance(flags, int) and flags >= 0 \
            else isinstance(mode, str) and any(c in mode for c in "wax+")
        if path is None or isinstance(path, int) or not outside(path):
            return
        if writing:
            raise PermissionError(f"sandbox: writing outside the working directory: {path!r}")
        if os.path.isdir(resolve(path)):  # a directory fd would let os.open(dir_fd=...) escape the check
            raise PermissionError(f"sandbox: opening directories outside the working directory: {path!r}")

    return hook


def run_main(root):
    with open(os.path.join(root, "main.py"), encoding="utf-8") as f:
        source = f.read()
    try:
        code = compile(source, "main.py", "exec")
    except SyntaxError:
        traceback.print_exc(limit=0)
        return 1
    sys.argv = ["main.py"]
    scope = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    try:
        exec(code, scope)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - the user's error, printed as Python would
        print_user_traceback(exc)
        return 1
    return 0


def print_user_traceback(exc):
    """The traceback without this guard's frames (the hook's raise shows as the user's call)."""
    report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    for stack in _stacks(report):
        kept = [frame for frame in stack.stack if frame.filename != __file__]
        stack.stack = traceback.StackSummary.from_list(kept)
    print("".join(report.format()), end="", file=sys.stderr)


def _stacks(report):
    while report is not None:
        yield report
        report = report.__cause__ or report.__context__


def load_jail():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_jail.py")
    spec = importlib.util.spec_from_file_location("sandbox_jail", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    config = json.loads(sys.argv[1])
    root = os.path.realpath(os.getcwd())
    if config.get("jail"):
        load_jail().enter(config["jail"], root)
    set_limits(config)
    if config.get("audit_guard", True):
        sys.addaudithook(make_hook(root))
    status = run_main(root)
    sys.stdout.flush()
    sys.exit(status)


if __name__ == "__main__":
    main()
