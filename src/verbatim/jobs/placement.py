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


ENGINE_BYTES_PER_PARAMETER = {"fp32": 4, "bf16": 2, "fp16": 2}
"""The engine's copy of the weights, in its format (``--engine-dtype``), spread over its tensor-parallel GPUs."""


def check_placement(gpus: Sequence[int], *, engine: str = "inproc", gpu_memory: float | None = None,
                    tensor_parallel: int = 1, engine_devices: tuple[int, ...] | None = None,
                    trainer_device: str | None = None, trainer_devices: tuple[int, ...] | None = None,
                    ranks_here: int = 1, parameters: TrainerSize | int = 0, dtype: str = "fp32", ranks: int = 1,
                    reference: bool = False, engine_dtype: str | None = None) -> None:
    """Refuse a placement that cannot work. ``gpus``: the memory (bytes) of each GPU this process sees, in
    index order (empty: none); ``engine``: ``inproc``, ``http`` (placed where it is started) or ``none`` (no
    engine on this machine); ``engine_devices``: the in-process engine's GPUs (``--engine-devices``; None:
    0..tensor_parallel-1); ``trainer_device``: ``cpu``, ``cuda`` or ``cuda:N`` (None: no trainer) and
    ``trainer_devices`` (``--trainer-devices``) place the ``ranks_here`` trainer ranks of this machine
    (:func:`rank_device`), each checked; ``ranks``: the team's size; ``reference``: the trainer keeps a KL
    penalty's reference; ``engine_dtype``: the engine's format (fp32, bf16, fp16), whose weights must fit its
    share of each of its GPUs."""
    explicit = engine_devices is not None
    engine_gpus = engine_devices if explicit else tuple(range(tensor_parallel))
    if engine != "inproc":
        if gpu_memory is not None or tensor_parallel > 1 or explicit:
            raise InputError("--engine-gpu-memory, --engine-tensor-parallel and --engine-devices set the in-process "
                             "engine; a served engine is placed where it is started",
                             hint="verbatim fleet up --gpu-memory/--tensor-parallel/--devices")
        engine_gpus = ()
    elif not gpus:
        if gpu_memory is not None or explicit:
            flag = f"--engine-gpu-memory {gpu_memory:g}" if gpu_memory is not None else "--engine-devices"
            raise InputError(f"{flag}: this machine has no GPU; the CPU engine's KV cache is --kv-cache-gib",
                             hint=f"drop {flag.split()[0]}")
        engine_gpus = ()
    elif not explicit and tensor_parallel > len(gpus):
        raise InputError(f"--engine-tensor-parallel {tensor_parallel} needs {tensor_parallel} GPUs; this process "
                         f"sees {len(gpus)}")
    check_device_maps(len(gpus), engine_devices if engine_gpus else None, trainer_devices)
    share = gpu_memory if gpu_memory is not None else VLLM_GPU_MEMORY
    size = parameters if isinstance(parameters, TrainerSize) else TrainerSize(parameters)
    if engine_dtype is not None and engine_gpus and size.parameters:
        _engine_fits(gpus, engine_gpus, share, size.parameters, engine_dtype, gpu_memory is None)
    devices = machine_devices(trainer_device, trainer_devices, ranks_here) if trainer_device is not None else []
    for device in devices:
        index = _cuda_index(device)
        if index is not None and index < len(gpus):  # a GPU that is not there: refused where the device is read
            _trainer_fits(gpus[index], index, device, index in engine_gpus, share, gpu_memory is None, size, dtype,
                          ranks, reference)


def check_device_maps(visible: int, engine_devices: tuple[int, ...] | None,
                      trainer_devices: tuple[int, ...] | None) -> None:
    """The GPUs the maps name: each there (``visible`` GPUs: 0..visible-1), none named twice by one map, and
    none by both (an engine and a trainer that are to share a GPU are placed by --engine-gpu-memory, not by two
    maps naming it)."""
    maps = (("--engine-devices", list(engine_devices or ())), ("--trainer-devices", list(trainer_devices or ())))
    for flag, indices in maps:
        beyond = [i for i in indices if i >= visible]
        if beyond:
            seen = f"{visible} GPU{'s' if visible != 1 else ''}" + (f" (0..{visible - 1})" if visible else "")
            raise InputError(f"{flag} names GPU {beyond[0]}, but this process sees {seen}",
                             hint="count GPUs from 0 within CUDA_VISIBLE_DEVICES")
        twice = sorted({i for i in indices if indices.count(i) > 1})
        if twice:
            raise InputError(f"{flag} names GPU {twice[0]} twice: each of its processes needs a GPU of its own")
    both = sorted(set(engine_devices or ()) & set(trainer_devices or ()))
    if both:
        raise InputError(f"--engine-devices and --trainer-devices both name GPU {both[0]}",
                         hint="give them GPUs of their own; to share one, leave --engine-devices out and set "
                         "--engine-gpu-memory")


def _engine_fits(gpus: Sequence[int], engine_gpus: Sequence[int], share: float, parameters: int, dtype: str,
                 default_share: bool) -> None:
    """The engine's weights in its format, split over its GPUs, within its share of each (with room beyond them
    for the KV cache: vLLM refuses to start without it)."""
    per_gpu = parameters * ENGINE_BYTES_PER_PARAMETER[dtype] / len(engine_gpus)
    for index in engine_gpus:
        room = gpus[index] * share
        if per_gpu >= room:
            whose = "vLLM's default" if default_share else "--engine-gpu-memory"
            raise InputError(f"the engine's weights in {dtype} take {per_gpu / GIB:.1f} GiB of GPU {index} "
                             f"({parameters / 1e9:.2f} B parameters × {ENGINE_BYTES_PER_PARAMETER[dtype]} bytes / "
                             f"{len(engine_gpus)} GPU{'s' if len(engine_gpus) > 1 else ''}), more than its share "
                             f"{share:g} of {gpus[index] / GIB:.1f} GiB ({whose}) leaves for them and a KV cache",
                             hint="spread the engine over more GPUs (--engine-devices), use --engine-dtype bf16, or "
                             "raise --engine-gpu-memory")


def _trainer_fits(total: int, index: int, device: str, shared: bool, share: float, default_share: bool,
                  size: TrainerSize, dtype: str, ranks: int, reference: bool) -> None:
    need = trainer_bytes(size, dtype, ranks, reference)
    room = total * (1 - share) if shared else total
    if need <= room:
        return
    floor = _floor_text(size, dtype, ranks, reference)
    if not shared:
        raise InputError(f"--trainer-device {device}: {floor}; the GPU has {total / GIB:.1f} GiB")
    whose = "vLLM's default" if default_share else "--engine-gpu-memory"
    raise InputError(f"--trainer-device {device} shares GPU {index} with the engine, which takes "
                     f"{share:g} of its {total / GIB:.1f} GiB ({whose}), leaving {room / GIB:.1f} GiB; {floor}",
                     hint="lower --engine-gpu-memory, or put the trainer on a GPU of its own")


def rank_device(device: str, devices: tuple[int, ...] | None, local_rank: int | None) -> str:
    """The device of the trainer rank that is ``local_rank`` on its machine (None: the only one): the
    ``local_rank``-th of ``devices`` (``--trainer-devices``) where given, else ``device`` (``--trainer-device``),
    whose ``cuda`` means GPU ``local_rank`` (as torchrun places one rank a GPU)."""
    if devices is not None:
        at = local_rank or 0
        if at >= len(devices):
            raise InputError(f"--trainer-devices {','.join(map(str, devices))} names {len(devices)} GPU"
                             f"{'s' if len(devices) > 1 else ''} for local trainer rank {at}: name one per rank on "
                             "this machine")
        return f"cuda:{devices[at]}"
    return f"cuda:{local_rank}" if device == "cuda" and local_rank is not None else device


def machine_devices(device: str, devices: tuple[int, ...] | None, ranks_here: int) -> list[str]:
    """The devices of the ``ranks_here`` trainer ranks of this machine, by local rank (:func:`rank_device`)."""
    if ranks_here == 1:
        return [rank_device(device, devices, None)]
    return [rank_device(device, devices, rank) for rank in range(ranks_here)]


def check_here(choice: EngineChoice | None, trainer_device: str | None = None,
               trainer_devices: tuple[int, ...] | None = None, ranks_here: int = 1,
               parameters: TrainerSize | int = 0, dtype: str = "fp32", ranks: int = 1, reference: bool = False,
               engine_dtype: str | None = None) -> None:
    """:func:`check_placement` against the GPUs torch sees on this machine, asked only when a GPU is in question
    (a CPU run never loads torch's CUDA). ``choice`` None: no engine on this machine (a rank on another node)."""
    kind, memory, parallel, devices = ("none", None, 1, None) if choice is None else (
        choice.kind, choice.gpu_memory, choice.tensor_parallel, choice.devices)
    asked = (memory is not None or parallel > 1 or devices is not None or trainer_devices is not None
             or engine_dtype in ("bf16", "fp16") or (trainer_device or "").startswith("cuda"))
    if not asked:
        return
    from verbatim.trainer.reference import visible_gpus

    check_placement(visible_gpus(), engine=kind, gpu_memory=memory, tensor_parallel=parallel, engine_devices=devices,
                    trainer_device=trainer_device, trainer_devices=trainer_devices, ranks_here=ranks_here,
                    parameters=parameters, dtype=dtype, ranks=ranks, reference=reference, engine_dtype=engine_dtype)


def _cuda_index(device: str | None) -> int | None:
    if device is None or not device.startswith("cuda"):
        return None
    _, _, number = device.partition(":")
    return int(number) if number.isdigit() else 0
