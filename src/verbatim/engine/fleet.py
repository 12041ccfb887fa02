"""A local fleet: N ``vllm serve`` replicas on this machine, started together, stopped cleanly.

``verbatim fleet up`` starts the replicas in their own sessions (they outlive
the command), splits this machine's CPUs between them, waits until each is
healthy and writes a fleet file (URLs, pids, logs). ``verbatim fleet down``
reads that file and stops every replica: SIGTERM to its process group, then
SIGKILL after a grace period. A pid is only signalled while its command line
is still a vLLM server, so a stale file never kills an unrelated process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

from pydantic import Field, ValidationError

from verbatim.datamodel import Frozen
from verbatim.engine.reaper import running, stop_group
from verbatim.engine.runtime import EngineConfig
from verbatim.engine.server import LOOPBACK, ServerProcess, child_devices, is_loopback
from verbatim.errors import EngineError, InputError

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class FleetReplica(Frozen):
    name: str
    url: str
    pid: int
    log: str | None = None
    cpus: str | None = None
    gpus: str | None = None
    """The CUDA devices the replica sees (``fleet up --devices``, or its own of this machine's when there are
    several replicas); None: what ``fleet up`` saw."""


class FleetRecord(Frozen):
    """The fleet file: what ``fleet down`` stops and what ``run --url`` can read."""

    schema_version: int = 1
    replicas: tuple[FleetReplica, ...] = ()
    config: dict = Field(default_factory=dict)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]


def split_cpus(cpus: list[int], replicas: int) -> list[str]:
    """Give each replica its own CPUs when there are enough, else share them round-robin."""
    if replicas <= 0:
        raise InputError("a fleet needs at least one replica")
    if len(cpus) >= replicas:
        size = len(cpus) // replicas
        parts = [cpus[i * size:(i + 1) * size] for i in range(replicas)]
        parts[-1] = cpus[(replicas - 1) * size:]
    else:
        parts = [[cpus[i % len(cpus)]] for i in range(replicas)]
    return [",".join(str(c) for c in part) for part in parts]


def split_devices(devices: tuple[int, ...] | None, replicas: int, tensor_parallel: int) -> list[tuple[int, ...] | None]:
    """Each replica's own GPUs: ``tensor_parallel`` of ``devices`` in turn (all of them used, none twice);
    None for every replica when no devices are named."""
    if devices is None:
        return [None] * replicas
    if len(set(devices)) != len(devices):
        raise InputError(f"--devices {','.join(map(str, devices))} names a GPU twice")
    need = replicas * tensor_parallel
    if len(devices) != need:
        raise InputError(f"--devices names {len(devices)} GPUs; {replicas} replicas × --tensor-parallel "
                         f"{tensor_parallel} use {need}", hint=f"name {need} GPUs, or change --replicas")
    return [tuple(devices[i * tensor_parallel:(i + 1) * tensor_parallel]) for i in range(replicas)]


def fleet_gpus(devices: tuple[int, ...] | None, visible: int, replicas: int, tensor_parallel: int,
               gpu_memory: float | None) -> list[tuple[int, ...] | None]:
    """Each replica's GPUs. Named ``devices`` are split as given (:func:`split_devices`). Without them, on a
    machine showing ``visible`` GPUs, replicas get GPUs of their own in order (vLLM alone would start every
    replica on GPU 0); when there are fewer GPUs than replicas, single-GPU replicas share them round-robin
    only where ``gpu_memory`` says how: each one's share times the replicas on a GPU must fit in it. One
    replica, or no GPU: None (the replica sees what this process sees)."""
    if devices is not None:
        return split_devices(devices, replicas, tensor_parallel)
    if visible == 0 or replicas == 1:
        return [None] * replicas
    need = replicas * tensor_parallel
    if visible >= need:
        return split_devices(tuple(range(need)), replicas, tensor_parallel)
    per_gpu = -(-replicas // visible)
    if tensor_parallel == 1 and gpu_memory is not None and gpu_memory * per_gpu <= 1:
        return [(i % visible,) for i in range(replicas)]
    raise InputError(f"{replicas} replicas × --tensor-parallel {tensor_parallel} need {need} GPUs; this machine "
                     f"shows {visible}", hint=f"pass fewer --replicas, or share the GPUs with --tensor-parallel 1 "
                     f"and --gpu-memory at most {1 / per_gpu:.2f} ({per_gpu} replicas on a GPU)")


def replica_gpus(config: EngineConfig, replicas: int, visible: int) -> list[tuple[int, ...] | None]:
    """:func:`fleet_gpus` for ``config``, each replica's list also checked against this process's own
    ``CUDA_VISIBLE_DEVICES`` (:func:`child_devices`): refused before any replica starts."""
    gpus = fleet_gpus(config.devices, visible, replicas, config.tensor_parallel, config.gpu_memory)
    for own in gpus:
        if own is not None:
            child_devices(own, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return gpus


def fleet_up(config: EngineConfig, replicas: int, fleet_file: Path, *, host: str = LOOPBACK,
             log_dir: Path | None = None, timeout_s: float = 900.0, visible_gpus: int = 0) -> FleetRecord:
    """Start ``replicas`` servers in parallel and write the fleet file once all are healthy. Replica i sees
    only its own GPUs (:func:`replica_gpus`: of ``config.devices``, else of the ``visible_gpus`` here)."""
    if fleet_file.exists() and any(_is_server(r.pid) for r in read_fleet(fleet_file).replicas):
        raise InputError(f"{fleet_file} describes a fleet that is still running",
                         hint="run 'verbatim fleet down' first, or pass another --file")
    gpus = replica_gpus(config, replicas, visible_gpus)  # refused before anything is written
    log_dir = log_dir or fleet_file.parent / "fleet-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cpus = split_cpus(sorted(os.sched_getaffinity(0)), replicas)
    servers = []
    for i in range(replicas):
        replica_config = config.model_copy(update={"threads_bind": cpus[i], "devices": gpus[i]})
        servers.append(ServerProcess(replica_config, host=host, log_path=log_dir / f"r{i}.log").launch())
    try:
        _wait_all(servers, timeout_s)
    except EngineError:
        for server in servers:
            server.stop()
        raise
    record = FleetRecord(
        replicas=tuple(FleetReplica(name=f"r{i}", url=s.url, pid=s.proc.pid, log=str(s.log_path), cpus=cpus[i],
                                    gpus=None if gpus[i] is None else ",".join(map(str, gpus[i])))
                       for i, s in enumerate(servers) if s.proc is not None),
        config=config.model_dump() | {"host": host if not is_loopback(host) else LOOPBACK},
    )
    fleet_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = fleet_file.with_suffix(".tmp")
    tmp.write_text(record.model_dump_json(indent=2) + "\n")
    tmp.replace(fleet_file)
    return record


def _wait_all(servers: list[ServerProcess], timeout_s: float) -> None:
    """Wait for every server, failing as soon as any one exits or the time is up."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        if time.monotonic() > deadline:
            raise EngineError(f"{len(pending)} replicas did not become healthy within {timeout_s:.0f}s")
        pending = [s for s in pending if not s.ready()]
        if pending:
            time.sleep(1.0)


def read_fleet(fleet_file: Path) -> FleetRecord:
    try:
        return FleetRecord.model_validate(json.loads(fleet_file.read_text()))
    except FileNotFoundError:
        raise InputError(f"no fleet file at {fleet_file}", hint="start one with 'verbatim fleet up'") from None
    except (ValueError, ValidationError) as exc:
        raise InputError(f"{fleet_file} is not a fleet file ({str(exc).splitlines()[0]})") from None


def fleet_down(fleet_file: Path, *, grace_s: float = 30.0) -> list[str]:
    """Stop every replica of the fleet file (those still running); remove the file; return what stopped."""
    record = read_fleet(fleet_file)
    running = [r for r in record.replicas if _is_server(r.pid)]
    for replica in running:
        _signal_group(replica.pid, signal.SIGTERM)
    for replica in running:  # each server's whole group: its engine core and workers too
        stop_group(replica.pid, grace_s)
        _gone(replica.pid)  # reap it if this process started it
    fleet_file.unlink(missing_ok=True)
    return [r.name for r in running]


def kill_replica(replica: FleetReplica) -> None:
    """SIGKILL one replica's process group (fault tests: a replica dies mid-run)."""
    if _is_server(replica.pid):
        _signal_group(replica.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not _gone(replica.pid) and time.monotonic() < deadline:
            time.sleep(0.1)


def _is_server(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return SERVER_MODULE.encode() in cmdline and not _gone(pid)


def _gone(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)  # reap it if this process started it
        if done:
            return True
    return not running(pid)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
