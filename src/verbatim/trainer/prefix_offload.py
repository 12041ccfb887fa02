"""Where PrefixFlow keeps the prefix's dormant activations between phase A and phase C.

Phase A runs the prefix forward with autograd on; the tensors autograd saves for the
backward are idle ("dormant") until phase C. :class:`DormantStore` decides where they
wait, through ``torch.autograd.graph.saved_tensors_hooks``:

* ``"keep"``: in place (device memory);
* ``"cpu"``: copied to CPU memory, copied back in phase C (tensors already on the CPU stay put);
* ``"disk"``: written to files in a temporary directory, read back in phase C;
* ``"recompute"``: not kept at all: phase A runs without autograd and phase C runs the prefix
  forward again (:func:`~verbatim.trainer.prefixflow.encode_prefix`), one more prefix forward for
  the activations of P tokens. The store itself then moves nothing.

Parameters (and views of them, FSDP2's gathered weights included) and tensors under ``min_bytes`` are
never moved.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verbatim.trainer.modes import OFFLOADS, Offload


class DormantStore:
    """Saved-tensor hooks for one prefix; :meth:`close` removes its files."""

    def __init__(self, where: Offload, parameters: Iterable[nn.Parameter], min_bytes: int = 1 << 16,
                 directory: str | Path | None = None) -> None:
        if where not in OFFLOADS:
            raise ValueError(f"offload must be one of {OFFLOADS}, got {where!r}")
        self.where = where
        self.min_bytes = min_bytes
        self._param_storages = {ptr for p in parameters if (ptr := _storage(p)) is not None}
        self._dir: Path | None = None
        self._parent = directory
        self._ids = itertools.count()
        self.moved_bytes = 0

    @property
    def recomputes(self) -> bool:
        """Phase C runs the prefix forward again: nothing is saved until then."""
        return self.where == "recompute"

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Run the prefix forward inside this context."""
        if self.where in ("keep", "recompute"):
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _stays(self, tensor: torch.Tensor) -> bool:
        small = tensor.numel() * tensor.element_size() < self.min_bytes
        return small or _a_parameter(tensor) or tensor.untyped_storage().data_ptr() in self._param_storages

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self._stays(tensor) or (self.where == "cpu" and tensor.device.type == "cpu"):
            return ("kept", tensor)
        self.moved_bytes += tensor.numel() * tensor.element_size()
        if self.where == "cpu":
            return ("cpu", tensor.device, tensor.to("cpu"))
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="prefixflow-", dir=self._parent))
        path = self._dir / f"{next(self._ids)}.pt"
        data = tensor.detach()
        if data.untyped_storage().nbytes() != data.numel() * data.element_size():
            data = data.clone()  # a view: save its own elements, not the whole storage
        torch.save(data, path)
        return ("disk", tensor.device, path)

    def _unpack(self, packed: Any) -> torch.Tensor:
        kind = packed[0]
        if kind == "kept":
            return packed[1]
        if kind == "cpu":
            return packed[2].to(packed[1])
        tensor = torch.load(packed[2], map_location=packed[1], weights_only=True)
        packed[2].unlink(missing_ok=True)
        return tensor


def _a_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one: under FSDP2 a layer's gathered weights are parameters the module holds
    only during its forward (not ``parameters()``' shards), whose memory FSDP frees after it and fills again
    for the backward. Moving them would keep a copy of the whole layer until phase C."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _storage(param: torch.Tensor) -> int | None:
    """Where ``param``'s memory starts; None for memory FSDP2 has freed (a layer's weights between its calls)."""
    try:
        return param.untyped_storage().data_ptr()
    except RuntimeError:
        return None
