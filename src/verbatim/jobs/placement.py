"""Where a run's parts go: the in-process engine's GPUs and memory share, and the trainer's device.

:func:`check_placement` is pure: given the GPUs this process sees (their memory) and what the user asked
for, it refuses, with one line naming the numbers, a placement that cannot work before anything starts.
The engine takes GPUs ``0 .. tensor_parallel − 1`` of the visible ones (vLLM's choice); the trainer the one
``--trainer-device`` names. A trainer on one of the engine's GPUs gets what the engine leaves of it.

The trainer's floor is its parameters' float32 weights, gradients and AdamW moments (16 bytes a
parameter; bf16 autocast adds a bfloat16 copy, 2 more); activations come on top, so a placement that
passes may still run out, but one that fails cannot fit. A rank of a sharded trainer (N ranks) holds
1/N of the float32 weights and of AdamW's state, and during an update the whole weights and gradient it
gathers: 8 + 12/N bytes a parameter (with ``bf16`` too: FSDP gathers the weights in bfloat16, no autocast
copy, and accumulates the gradient in float32). A KL penalty (``--kl-coef``) keeps a whole float32 copy of
the starting weights on every rank: 4 more bytes a parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

from verbatim.engine.runtime import VLLM_GPU_MEMORY
from verbatim.errors import InputError
from verbatim.jobs.config import EngineChoice

GIB = float(1 << 30)

TRAINER_BYTES_PER_PARAMETER = {"fp32": 16, "bf16": 18}
"""float32 weights (4), gradients (4), AdamW's two moments (8); bf16 autocast keeps a bfloat16 copy (2)."""

REFERENCE_BYTES_PER_PARAMETER = 4
"""The KL penalty's reference policy: a float32 copy of the starting weights, whole on every rank."""


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


def bytes_per_parameter(dtype: str, ranks: int = 1, reference: bool = False) -> float:
    """What a parameter costs the device of one of ``ranks`` trainer ranks (no activations); ``reference``: a KL
    penalty's copy of the starting weights as well."""
    extra = REFERENCE_BYTES_PER_PARAMETER if reference else 0
    if ranks == 1:
        return TRAINER_BYTES_PER_PARAMETER[dtype] + extra
    # the weights and gradient gathered during an update (bf16: weights in bfloat16, the gradient's bfloat16
    # and float32 accumulation, no autocast copy: 8 bytes as well), 1/N of the float32 weights and AdamW state
    return 8 + 12 / ranks + extra


def trainer_bytes(parameters: int, dtype: str, ranks: int = 1, reference: bool = False) -> int:
    """The least memory the trainer's model needs on a rank's device (no activations)."""
    return int(parameters * bytes_per_parameter(dtype, ranks, reference))


def _floor_text(parameters: int, dtype: str, ranks: int, reference: bool) -> str:
    need = trainer_bytes(parameters, dtype, ranks, reference)
    each = bytes_per_parameter(dtype, ranks, reference)
    copy = ", the KL penalty's float32 reference" if reference else ""
    if ranks == 1:
        autocast = ", a bfloat16 copy" if dtype == "bf16" else ""
        return (f"the trainer needs at least {need / GIB:.1f} GiB ({parameters / 1e9:.2f} B parameters × "
                f"{each:.4g} bytes: float32 weights, gradients and AdamW state{autocast}{copy})")
    return (f"each of the {ranks} trainer ranks needs at least {need / GIB:.1f} GiB ({parameters / 1e9:.2f} B "
            f"parameters × {each:.4g} bytes: the weights and gradient gathered during "
            f"an update, 1/{ranks} of the float32 weights and AdamW state{copy})")


def check_placement(gpus: Sequence[int], *, engine: str = "inproc", gpu_memory: float | None = None,
                    tensor_parallel: int = 1, trainer_device: str | None = None, parameters: int = 0,
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
    need, total = trainer_bytes(parameters, dtype, ranks, reference), gpus[index]
    shared = engine == "inproc" and index < tensor_parallel
    share = gpu_memory if gpu_memory is not None else VLLM_GPU_MEMORY
    room = total * (1 - share) if shared else total
    if need <= room:
        return
    floor = _floor_text(parameters, dtype, ranks, reference)
    if not shared:
        raise InputError(f"--trainer-device {trainer_device}: {floor}; the GPU has {total / GIB:.1f} GiB")
    whose = "vLLM's default" if gpu_memory is None else "--engine-gpu-memory"
    raise InputError(f"--trainer-device {trainer_device} shares GPU {index} with the engine, which takes "
                     f"{share:g} of its {total / GIB:.1f} GiB ({whose}), leaving {room / GIB:.1f} GiB; {floor}",
                     hint="lower --engine-gpu-memory, or put the trainer on a GPU of its own")


def check_here(choice: EngineChoice, trainer_device: str | None = None, parameters: int = 0,
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
