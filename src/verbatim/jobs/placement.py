"""Where a run's parts go: the in-process engine's GPUs and memory share, and the trainer's device.

:func:`check_placement` is pure: given the GPUs this process sees (their memory) and what the user asked
for, it refuses, with one line naming the numbers, a placement that cannot work before anything starts.
The engine takes GPUs ``0 .. tensor_parallel − 1`` of the visible ones (vLLM's choice); the trainer the one
``--trainer-device`` names. A trainer on one of the engine's GPUs gets what the engine leaves of it.

The trainer's floor is its parameters' float32 weights, gradients and AdamW moments (16 bytes a
parameter; bf16 autocast adds a bfloat16 copy, 2 more); activations come on top, so a placement that
passes may still run out, but one that fails cannot fit. A rank of a sharded trainer (N ranks,
trainer/distributed/sharding.py) holds 1/N of those 16 bytes a parameter, and during a step what it
gathers at once (:class:`TrainerSize`): the root (the output layer and the last norm, a tied embedding)
for the whole pass and the largest unit (a decoder layer, an untied embedding) during its backward, each
with its whole gradient: 4 + 4 bytes a parameter in float32, 2 + 2 under FSDP's bfloat16 mixed
precision. (The float32 buffer a gradient is reduce-scattered from, and the next unit FSDP prefetches,
come and go within that backward: on top, like activations.) A KL penalty (``--kl-coef``) keeps a
float32 copy of the starting weights: 4 bytes a parameter, sharded on a team as the model is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verbatim.engine.runtime import VLLM_GPU_MEMORY
from verbatim.errors import InputError
from verbatim.jobs.config import EngineChoice

GIB = float(1 << 30)

TRAINER_BYTES_PER_PARAMETER = {"fp32": 16, "bf16": 18}
"""float32 weights (4), gradients (4), AdamW's two moments (8); bf16 autocast keeps a bfloat16 copy (2)."""

REFERENCE_BYTES_PER_PARAMETER = 4
"""The KL penalty's reference policy: a float32 copy of the starting weights (sharded on a team)."""

GATHERED_BYTES = {"fp32": 8, "bf16": 4}
"""A parameter gathered on a team with its gradient: float32 (4 + 4), or bfloat16 under FSDP's mixed precision."""


@dataclass(frozen=True)
class TrainerSize:
    """A model's parameters, and those a rank of a sharded trainer gathers at once."""

    parameters: int
    root: int = 0
    """The root's (output layer, last norm, a tied embedding): gathered for the whole pass."""
    unit: int = 0
    """The largest unit gathered during its own calls (a decoder layer, an untied embedding)."""

    @classmethod
    def of(cls, parameters: int, root: int, units: Sequence[int]) -> TrainerSize:
        return cls(parameters, root, max(units, default=0))


def bytes_per_parameter(dtype: str, reference: bool = False) -> float:
    """What a parameter costs one trainer process's device (no activations); ``reference``: a KL penalty's copy
    of the starting weights as well. A rank of a team: :func:`trainer_bytes`."""
    return TRAINER_BYTES_PER_PARAMETER[dtype] + (REFERENCE_BYTES_PER_PARAMETER if reference else 0)


def sharded_bytes(reference: bool, ranks: int) -> float:
    """What a parameter costs a rank of ``ranks`` between steps: its share of the float32 weights, gradients and
    AdamW state (and of the reference's weights)."""
    return (TRAINER_BYTES_PER_PARAMETER["fp32"] + (REFERENCE_BYTES_PER_PARAMETER if reference else 0)) / ranks


def trainer_bytes(size: TrainerSize | int, dtype: str, ranks: int = 1, reference: bool = False) -> int:
    """The least memory the trainer's model needs on a rank's device (no activations)."""
    size = size if isinstance(size, TrainerSize) else TrainerSize(size)
    if ranks == 1:
        return int(size.parameters * bytes_per_parameter(dtype, reference))
    return int(size.parameters * sharded_bytes(reference, ranks) + (size.root + size.unit) * GATHERED_BYTES[dtype])


def device_list(text: str | None) -> tuple[int, ...] | None:
    """``--devices 0,1,2,3``: GPU indices, or None when not given."""
    if text is None:
        return None
    try:
        devices = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InputError(f"--devices {text!r} must be GPU indices separated by commas (e.g. 0,1)") from None
    if any(d < 0 for d in devices):
        raise InputError(f"--devices {text!r}: a GPU index is 0 or more")
    return devices


def _floor_text(size: TrainerSize, dtype: str, ranks: int, reference: bool) -> str:
    need = trainer_bytes(size, dtype, ranks, reference)
    copy = ", the KL penalty's float32 reference" if reference else ""
    if ranks == 1:
        autocast = ", a bfloat16 copy" if dtype == "bf16" else ""
        return (f"the trainer needs at least {need / GIB:.1f} GiB ({size.parameters / 1e9:.2f} B parameters × "
                f"{bytes_per_parameter(dtype, reference):.4g} bytes: float32 weights, gradients and AdamW "
                f"state{autocast}{copy})")
    gathered = size.root + size.unit
    return (f"each of the {ranks} trainer ranks needs at least {need / GIB:.1f} GiB ({size.parameters / 1e9:.2f} B "
            f"parameters × {sharded_bytes(reference, ranks):.3g} bytes: 1/{ranks} of the float32 weights, gradients "
            f"and AdamW state{copy}; {gathered / 1e9:.2f} B gathered at once during a step × "
            f"{GATHERED_BYTES[dtype]} bytes: the output layer and the largest unit with their gradients)")


def check_placement(gpus: Sequence[int], *, engine: str = "inproc", gpu_memory: float | None = None,
                    tensor_parallel: int = 1, trainer_device: str | None = None, parameters: TrainerSize | int = 0,
                    dtype: str = "fp32", ranks: int = 1, reference: bool = False) -> None:
    """Refuse a placement that cannot work. ``gpus``: the memory (bytes) of each GPU this process sees, in
    index order (empty: none); ``trainer_device``: ``cpu``, ``cuda`` or ``cuda:N`` (None: no trainer), the
    device of one of ``ranks`` trainer ranks; ``reference``: the trainer keeps a KL penalty's reference."""
    if engine != "inproc":
        if gpu_memory is not None or tensor_parallel > 1:
            raise InputError("--engine-gpu-memory and --engine-tensor-parallel set the in-process engine; a served "
                             "engine is placed where it is started",
                             hint="verbatim fleet up --gpu-memory/--tensor-parallel/--devices")
    elif not gpus:
        if gpu_memory is not None:
            raise InputError(f"--engine-gpu-memory {gpu_memory:g}: this machine has no GPU; the CPU engine's KV "
                             "cache is --kv-cache-gib", hint="drop --engine-gpu-memory")
    elif tensor_parallel > len(gpus):
        raise InputError(f"--engine-tensor-parallel {tensor_parallel} needs {tensor_parallel} GPUs; this process "
                         f"sees {len(gpus)}")
    index = _cuda_index(trainer_device)
    if index is None or index >= len(gpus):
        return  # the CPU, or a GPU that is not there (refused where the trainer's device is read)
    size = parameters if isinstance(parameters, TrainerSize) else TrainerSize(parameters)
    need, total = trainer_bytes(size, dtype, ranks, reference), gpus[index]
    shared = engine == "inproc" and index < tensor_parallel
    share = gpu_memory if gpu_memory is not None else VLLM_GPU_MEMORY
    room = total * (1 - share) if shared else total
    if need <= room:
        return
    floor = _floor_text(size, dtype, ranks, reference)
    if not shared:
        raise InputError(f"--trainer-device {trainer_device}: {floor}; the GPU has {total / GIB:.1f} GiB")
    whose = "vLLM's default" if gpu_memory is None else "--engine-gpu-memory"
    raise InputError(f"--trainer-device {trainer_device} shares GPU {index} with the engine, which takes "
                     f"{share:g} of its {total / GIB:.1f} GiB ({whose}), leaving {room / GIB:.1f} GiB; {floor}",
                     hint="lower --engine-gpu-memory, or put the trainer on a GPU of its own")


def check_here(choice: EngineChoice, trainer_device: str | None = None, parameters: TrainerSize | int = 0,
               dtype: str = "fp32", ranks: int = 1, reference: bool = False) -> None:
    """:func:`check_placement` against the GPUs torch sees on this machine, asked only when a GPU is in question
    (a CPU run never loads torch's CUDA)."""
    asked = (choice.gpu_memory is not None or choice.tensor_parallel > 1
             or (trainer_device or "").startswith("cuda"))
    if not asked:
        return
    from verbatim.trainer.reference import visible_gpus

    check_placement(visible_gpus(), engine=choice.kind, gpu_memory=choice.gpu_memory,
                    tensor_parallel=choice.tensor_parallel, trainer_device=trainer_device, parameters=parameters,
                    dtype=dtype, ranks=ranks, reference=reference)


def _cuda_index(device: str | None) -> int | None:
    if device is None or not device.startswith("cuda"):
        return None
    _, _, number = device.partition(":")
    return int(number) if number.isdigit() else 0
