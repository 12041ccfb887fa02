"""Weights into the in-process engine through shared memory: no file is written or parsed.

The learner's state dict is copied into one flat buffer, a file in ``/dev/shm`` that both sides map
(:func:`torch.from_file` with ``shared=True``); the engine core's worker, extended by
:class:`WeightReceiver` (part of vLLM's ``worker_extension_cls``: engine/worker_extension.py), maps the
same file and loads views of it: on the CPU engine by the direct reload (engine/direct_reload.py) where
the model allows, else through vLLM's in-place reload (``reload_weights(weights_iterator=…)``). The
tensors cross the process boundary as memory, and only their names, dtypes, shapes and offsets travel
over vLLM's RPC.

A :class:`WeightChannel` lives as long as its engine and keeps its mapping: after the first push the
pages are already there, and a push is a copy into the buffer and the engine's load from it.
The file's name is removed as soon as the worker has mapped it (a killed trainer leaves nothing in
``/dev/shm``); the worker recognises the same buffer by that name afterwards. A push whose layout
differs from the last (another model, another dtype) gets a new file. Where
``/dev/shm`` is missing or too small, the channel lives in the temporary folder instead (the page
cache then does the work, slower). The served (HTTP) engine still reloads a published folder.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verbatim.engine.direct_reload import ReloadPlan, direct_reload, reload_plan
from verbatim.engine.moe_repack import reload

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


def layout(weights: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> tuple[list[Slot], int]:
    """Each tensor's slot, in order, and the buffer's size in bytes; floating-point tensors stored as ``dtype``
    (the engine's: a bfloat16 engine is sent bfloat16, half the bytes of the trainer's float32) where given.
    Names that view exactly the same memory (a tied output layer spelled out as its embedding) share one slot:
    it is copied and read once."""
    slots, offset, seen = [], 0, {}
    for name, tensor in weights.items():
        key = _same_memory(tensor)
        if key in seen:
            slots.append(Slot(name, *seen[key]))
            continue
        stored = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        seen[key] = (str(stored).removeprefix("torch."), tuple(tensor.shape), offset)
        slots.append(Slot(name, *seen[key]))
        offset += -(-tensor.numel() * torch.empty((), dtype=stored).element_size() // ALIGN) * ALIGN
    return slots, offset


def _same_memory(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


SHM = Path("/dev/shm")


def shared_folder(size: int, shm: Path = SHM) -> Path:
    """``/dev/shm`` where it holds ``size`` bytes with room to spare, else the temporary folder, saying so once
    on stderr where a ``/dev/shm`` is there but too small (docker's default is 64 MB): the buffer then lives in a
    file the kernel writes back to disk, and every push is slower."""
    if shm.is_dir() and os.access(shm, os.W_OK):
        free = shutil.disk_usage(shm).free
        if free > 2 * size:
            return shm
        _warn_once(f"warning: {shm} has {free / 2**20:.0f} MiB free, too little for the weight buffer "
                   f"({size / 2**20:.0f} MiB, twice that wanted): weights go to the engine through "
                   f"{tempfile.gettempdir()} instead, slower (docker: --shm-size={-(-2 * size // 2**30) + 1}g)")
    return Path(tempfile.gettempdir())


_warned: set[str] = set()


def _warn_once(line: str) -> None:
    if line not in _warned:
        _warned.add(line)
        print(line, file=sys.stderr)


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

    def __init__(self, dtype: str | None = None) -> None:
        self.dtype = getattr(torch, dtype) if dtype is not None else None
        """The engine's floating-point format (``dtype``: torch's name, ``bfloat16``): what a push's
        floating-point tensors are cast to (None: as given)."""
        self.path: Path | None = None
        self.slots: list[Slot] = []
        self._buffer: torch.Tensor | None = None

    def stage(self, weights: dict[str, torch.Tensor]) -> tuple[str, list[list[Any]]]:
        """Copy ``weights`` into the buffer; returns (its path, the slots as lists) for the engine's worker.
        A tensor that already is its slot's view (a learner whose weights live in the buffer, :meth:`share`)
        is not copied."""
        slots, size = layout(weights, self.dtype)
        if self._buffer is None or slots != self.slots:
            self._open(slots, size, shared_folder(size))
        written = set()
        for slot, (_, view), tensor in zip(slots, views(self._buffer, slots), weights.values()):
            if slot.offset not in written and view.data_ptr() != tensor.data_ptr():
                view.copy_(tensor.detach())
            written.add(slot.offset)
        return str(self.path), [slot.as_list() for slot in slots]

    def share(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """A buffer in ``/dev/shm`` holding a copy of ``weights``, as views by name, for the learner to keep its
        weights in: later pushes of those views copy nothing. ``None`` where a weight is not in CPU memory (a
        learner on a GPU keeps its own), is not in the engine's format (a float32 learner beside a bfloat16
        engine: each push casts), or ``/dev/shm`` cannot hold them (the temporary folder's file would be written
        back to disk as the learner trains)."""
        cast = self.dtype is not None and any(t.is_floating_point() and t.dtype != self.dtype for t in weights.values())
        if cast or any(t.device.type != "cpu" for t in weights.values()):
            return None
        slots, size = layout(weights)
        folder = shared_folder(size)
        if folder != SHM:
            return None
        self._open(slots, size, folder)
        found = dict(views(self._buffer, slots))
        for name, tensor in weights.items():
            found[name].copy_(tensor.detach())
        return found

    def _open(self, slots: list[Slot], size: int, folder: Path) -> None:
        self.close()
        self.path = folder / f"verbatim-weights-{os.getpid()}-{next(_channels)}"
        self._buffer = torch.from_file(str(self.path), shared=True, size=max(size, 1), dtype=torch.uint8)
        self.slots = slots

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


@dataclass
class _Mapping:
    """The worker's mapping of one buffer and the direct reload's plan for its layout (one layout per file)."""

    path: str
    buffer: torch.Tensor
    planned: bool = False
    plan: ReloadPlan | None = None


class WeightReceiver:
    """Mixed into vLLM's worker (``worker_extension_cls``): reload the weights from a :class:`WeightChannel`."""

    def verbatim_map_shared(self, path: str, slots: list[list[Any]]) -> bool:
        """Map the buffer (its pages faulted in) and plan the direct reload before the first push needs them;
        ``True`` where the direct reload applies."""
        return self._verbatim_plan(self._verbatim_views(path, slots)) is not None

    def verbatim_reload_shared(self, path: str, slots: list[list[Any]]) -> bool:
        """Load the buffer's weights; ``True`` where the direct reload did it, ``False`` where vLLM's did."""
        weights = self._verbatim_views(path, slots)
        if self._verbatim_direct(weights):
            return True
        reload(self, weights_iterator=weights, is_checkpoint_format=True)
        return False

    def verbatim_reload_folder(self, weights_path: str) -> int:
        """vLLM's reload from a checkpoint folder, with the MoE experts' prepack it skips on a CPU
        (engine/moe_repack.py); returns the MoE layers repacked."""
        return reload(self, weights_path=weights_path)

    def _verbatim_views(self, path: str, slots: list[list[Any]]) -> list[tuple[str, torch.Tensor]]:
        mapping = getattr(self, "_verbatim_mapping", None)
        if mapping is None or mapping.path != path:
            buffer = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
            populate(buffer)
            mapping = self._verbatim_mapping = _Mapping(path, buffer)
        return views(mapping.buffer, [Slot(name, dtype, tuple(shape), offset) for name, dtype, shape, offset in slots])

    def _verbatim_plan(self, weights: list[tuple[str, torch.Tensor]]) -> ReloadPlan | None:
        """The direct reload's plan for the mapped layout, made once per mapping."""
        mapping = self._verbatim_mapping
        if not mapping.planned:
            mapping.plan = self._verbatim_new_plan(weights)
            mapping.planned = True
        return mapping.plan

    def _verbatim_new_plan(self, weights: list[tuple[str, torch.Tensor]]) -> ReloadPlan | None:
        """:func:`~verbatim.engine.direct_reload.reload_plan`; ``None`` where the direct reload does not apply
        (not the CPU engine, more than one worker, a model it cannot fit)."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or self.vllm_config.parallel_config.world_size != 1:
            return None
        return reload_plan(self.model_runner.get_model(), {name: (t.dtype, tuple(t.shape)) for name, t in weights})

    def _verbatim_direct(self, weights: list[tuple[str, torch.Tensor]]) -> bool:
        """:func:`~verbatim.engine.direct_reload.direct_reload` where the CPU engine's model allows it."""
        from vllm.config import set_current_vllm_config

        plan = self._verbatim_plan(weights)
        if plan is None:
            return False
        runner = self.model_runner
        with set_current_vllm_config(self.vllm_config):
            if not direct_reload(runner.get_model(), plan, dict(weights)):
                return False
        runner.reset_lora_state()  # as vLLM's reload does after new weights
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
        return True


MADV_POPULATE_READ = 22
"""Linux 5.14+: fault a mapping's pages in at once (older kernels refuse it, and the pages fault in as read)."""


def populate(buffer: torch.Tensor) -> None:
    """Map every page of ``buffer`` (a file mapping) now, so the first reload does not take each page's fault."""
    size = buffer.numel() * buffer.element_size()
    if size:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(size), MADV_POPULATE_READ)

