"""Weights into the in-process engine through shared memory: no file is written or parsed.

The learner's state dict is copied into one flat buffer, a file in ``/dev/shm`` that both sides map
(:func:`torch.from_file` with ``shared=True``); the engine core's worker, extended by
:class:`WeightReceiver` (vLLM's ``worker_extension_cls``), maps the same file and loads views of it:
on the CPU engine by the direct reload (engine/direct_reload.py) where the model allows, else through
vLLM's in-place reload (``reload_weights(weights_iterator=…)``). The tensors cross the process boundary
as memory, and only their names, dtypes, shapes and offsets travel over vLLM's RPC.

A :class:`WeightChannel` lives as long as its engine and keeps its mapping: after the first push the
pages are already there, and a push is a copy into the buffer and the engine's load from it.
The file's name is removed as soon as the worker has mapped it (a killed trainer leaves nothing in
``/dev/shm``); the worker recognises the same buffer by that name afterwards. A push whose layout
differs from the last (another model, another dtype) gets a new file. Where
``/dev/shm`` is missing or too small, the channel lives in the temporary folder instead (the page
cache then does the work, slower). The served (HTTP) engine still reloads a published folder.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verbatim.engine.direct_reload import direct_reload, reload_plan

ALIGN = 64
"""Every tensor starts on a 64-byte boundary of the buffer (a view of any dtype is aligned)."""

_channels = itertools.count()


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in the buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    def as_list(self) -> list[Any]:
        """What travels over the RPC (msgpack-able)."""
        return [self.name, self.dtype, list(self.shape), self.offset]


def layout(weights: dict[str, torch.Tensor]) -> tuple[list[Slot], int]:
    """Each tensor's slot, in order, and the buffer's size in bytes."""
    slots, offset = [], 0
    for name, tensor in weights.items():
        slots.append(Slot(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return slots, offset


def shared_folder(size: int) -> Path:
    """``/dev/shm`` where it holds ``size`` bytes with room to spare, else the temporary folder."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * size:
        return shm
    return Path(tempfile.gettempdir())


def views(buffer: torch.Tensor, slots: list[Slot]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of ``buffer`` (uint8, flat) at ``slots``, as views (no copy)."""
    found = []
    for slot in slots:
        dtype = getattr(torch, slot.dtype)
        count = int(torch.Size(slot.shape).numel())
        size = count * torch.empty((), dtype=dtype).element_size()
        found.append((slot.name, buffer[slot.offset: slot.offset + size].view(dtype).view(slot.shape)))
    return found


class WeightChannel:
    """The trainer's side: one shared buffer per layout, reused push after push."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.slots: list[Slot] = []
        self._buffer: torch.Tensor | None = None

    def stage(self, weights: dict[str, torch.Tensor]) -> tuple[str, list[list[Any]]]:
        """Copy ``weights`` into the buffer; returns (its path, the slots as lists) for the engine's worker."""
        slots, size = layout(weights)
        if self._buffer is None or slots != self.slots:
            self.close()
            folder = shared_folder(size)
            self.path = folder / f"verbatim-weights-{os.getpid()}-{next(_channels)}"
            self._buffer = torch.from_file(str(self.path), shared=True, size=max(size, 1), dtype=torch.uint8)
            self.slots = slots
        for (_, view), tensor in zip(views(self._buffer, slots), weights.values()):
            view.copy_(tensor.detach())
        return str(self.path), [slot.as_list() for slot in slots]

    def mapped_by_engine(self) -> None:
        """The engine's worker has mapped the buffer: its name can go. Both mappings stay valid, and a process
        killed later (SIGKILL included) leaves no file behind to hold its memory."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Drop the mapping and the file (the engine's worker keeps its own mapping until it maps another)."""
        self._buffer = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


class WeightReceiver:
    """Mixed into vLLM's worker (``worker_extension_cls``): reload the weights from a :class:`WeightChannel`."""

    def verbatim_reload_shared(self, path: str, slots: list[list[Any]]) -> bool:
        """Load the buffer's weights; ``True`` where the direct reload did it, ``False`` where vLLM's did."""
        mapped = getattr(self, "_verbatim_mapped", None)
        if mapped is None or mapped[0] != path:
            size = os.path.getsize(path)
            mapped = (path, torch.from_file(path, shared=True, size=size, dtype=torch.uint8))
            self._verbatim_mapped = mapped
        weights = views(mapped[1], [Slot(name, dtype, tuple(shape), offset) for name, dtype, shape, offset in slots])
        if self._verbatim_direct(path, weights):
            return True
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        return False

    def _verbatim_direct(self, path: str, weights: list[tuple[str, torch.Tensor]]) -> bool:
        """:func:`~verbatim.engine.direct_reload.direct_reload` where the CPU engine's model allows it."""
        from vllm.config import set_current_vllm_config
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or self.vllm_config.parallel_config.world_size != 1:
            return False
        runner = self.model_runner
        known = getattr(self, "_verbatim_plan", None)
        if known is None or known[0] != path:
            plan = reload_plan(runner.get_model(), {name: (t.dtype, tuple(t.shape)) for name, t in weights})
            known = self._verbatim_plan = (path, plan)
        plan = known[1]
        with set_current_vllm_config(self.vllm_config):
            if plan is None or not direct_reload(runner.get_model(), plan, dict(weights)):
                return False
        runner.reset_lora_state()  # as vLLM's reload does after new weights
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
        return True


RECEIVER = f"{WeightReceiver.__module__}.{WeightReceiver.__qualname__}"
"""The ``worker_extension_cls`` the in-process engine starts vLLM with."""
