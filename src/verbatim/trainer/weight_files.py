"""A model's weights as a Hugging Face folder lays them out: ``model.safetensors``, or numbered files and an index.

A checkpoint's weights are written in files of at most :data:`FILE_BYTES` each (a tensor larger than that
alone in its file), named as ``save_pretrained`` names them: one file is ``model.safetensors``; several are
``model-00001-of-00004.safetensors`` … with ``model.safetensors.index.json`` mapping each weight to its file
(what ``from_pretrained``, vLLM and :func:`~verbatim.trainer.distributed.loading.load_shards` read). A team
gathers and writes one file at a time, so rank 0 never holds more than one file's weights beyond its shard.

A tensor two names share (a tied output layer) is written once, under its first name; the other names are
recorded as ``verbatim_aliases`` in the metadata (the file's, or the index's) and restored on reading.

:func:`file_plan` is pure: which weights go in which file, from their sizes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open

from verbatim.durable import fsync_file, io_reason
from verbatim.errors import CheckpointError

FILE_BYTES = 2 << 30
"""The most bytes of weights a file holds (2 GiB), unless one tensor alone is larger."""
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
ALIASES_KEY = "verbatim_aliases"


def file_plan(sizes: Sequence[tuple[str, int]], cap: int | None = None) -> list[tuple[str, list[str]]]:
    """``(file name, its weights)`` for weights of these ``(name, bytes)``, in their order: each file filled
    until the next weight would take it past ``cap`` (:data:`FILE_BYTES`); a weight larger than ``cap`` alone."""
    cap = FILE_BYTES if cap is None else cap
    parts: list[list[str]] = []
    held = 0
    for name, size in sizes:
        if not parts or (held + size > cap and parts[-1]):
            parts.append([])
            held = 0
        parts[-1].append(name)
        held += size
    if len(parts) <= 1:
        return [(SINGLE, parts[0] if parts else [])]
    return [(f"model-{i:05d}-of-{len(parts):05d}.safetensors", names) for i, names in enumerate(parts, 1)]


def _write_file(path: Path, tensors: Mapping[str, torch.Tensor], aliases: Mapping[str, str] | None = None) -> None:
    """One safetensors file (``aliases`` in its metadata where it is the only one), fsynced."""
    metadata = {"format": "pt"}  # "pt": what transformers' loader asks for
    if aliases is not None:
        metadata[ALIASES_KEY] = json.dumps(dict(aliases))
    safetensors.torch.save_file(dict(tensors), str(path), metadata=metadata)
    fsync_file(path)


def _write_index(folder: Path, plan: Sequence[tuple[str, list[str]]], total_bytes: int,
                 aliases: Mapping[str, str]) -> None:
    """The index of a plan of several files, fsynced."""
    index = {"metadata": {"total_size": total_bytes, ALIASES_KEY: dict(aliases)},
             "weight_map": {name: file for file, names in plan for name in names}}
    path = folder / INDEX
    path.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    fsync_file(path)


def write_weights(folder: Path, tensors: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> None:
    """``tensors`` (CPU, each with its own memory) into ``folder`` as the files of :func:`file_plan`."""
    write_planned(folder, [(name, t.numel() * t.element_size()) for name, t in tensors.items()], aliases,
                  lambda names: {name: tensors[name] for name in names})


def write_planned(folder: Path, sizes: Sequence[tuple[str, int]], aliases: Mapping[str, str],
                  tensors_of: Callable[[list[str]], Mapping[str, torch.Tensor] | None]) -> None:
    """The files of :func:`file_plan` for weights of these ``(name, bytes)``, each file's tensors asked of
    ``tensors_of`` just before it is written (a team's ranks each gather them; rank 0 alone gets them back and
    writes, the others get None), and the index where there are several."""
    plan = file_plan(sizes)
    written = False
    for file, names in plan:
        tensors = tensors_of(names)
        if tensors is not None:
            _write_file(folder / file, tensors, aliases if len(plan) == 1 else None)
            written = True
    if written and len(plan) > 1:
        _write_index(folder, plan, sum(size for _, size in sizes), aliases)


def has_weights(folder: Path) -> bool:
    """Whether ``folder`` holds a complete set of weight files (the index's files all there)."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        try:
            return all((folder / file).is_file() for file in set(_index(folder)[0].values()))
        except CheckpointError:
            return False
    return (folder / SINGLE).is_file()


def weight_index(folder: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """Each weight's name → the file holding it, and the aliases (a second name → the weight it names)."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        files, aliases = _index(folder)
        return {name: folder / file for name, file in files.items()}, aliases
    if (folder / SINGLE).is_file():
        try:
            with safe_open(str(folder / SINGLE), framework="pt", device="cpu") as handle:
                aliases = json.loads((handle.metadata() or {}).get(ALIASES_KEY, "{}"))
                return dict.fromkeys(handle.keys(), folder / SINGLE), aliases
        except Exception as exc:
            raise CheckpointError(f"cannot read {folder / SINGLE}: {io_reason(exc)}") from exc
    raise CheckpointError(f"{folder} holds no safetensors weights ({SINGLE} or {INDEX})")


def _index(folder: Path) -> tuple[dict[str, str], dict[str, str]]:
    try:
        index = json.loads((folder / INDEX).read_text())
        return dict(index["weight_map"]), dict(index.get("metadata", {}).get(ALIASES_KEY, {}))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"cannot read {folder / INDEX}: {io_reason(exc)}") from exc


DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
"""safetensors' dtype names that :class:`RowReader` reads."""


class RowReader:
    """Rows of the weights in safetensors files, read with ``pread`` into memory of their own: only the bytes of
    the rows asked for are read, and no file is mapped (a mapped file's touched pages would count in the
    reader's resident memory until it is closed, as a whole weight's would)."""

    def __init__(self) -> None:
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}

    def rows(self, file: Path, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (of dimension 0) of weight ``name`` in ``file``, in the file's dtype."""
        data_start, header = self._header(file)
        entry = header[name]
        if entry["dtype"] not in DTYPES:
            raise CheckpointError(f"cannot read {file}: {name} is {entry['dtype']}, which verbatim does not load")
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        row_bytes = torch.empty((), dtype=dtype).element_size() * math.prod(shape[1:])
        buffer = bytearray((stop - start) * row_bytes)
        offset = data_start + entry["data_offsets"][0] + start * row_bytes
        with open(file, "rb", buffering=0) as handle:
            got = os.preadv(handle.fileno(), [buffer], offset) if buffer else 0
        if got != len(buffer):
            raise CheckpointError(f"cannot read {file}: {name} is cut short ({got} of {len(buffer)} bytes)")
        if not buffer:
            return torch.empty((0, *shape[1:]), dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(stop - start, *shape[1:])

    def _header(self, file: Path) -> tuple[int, dict[str, Any]]:
        if file not in self._headers:
            try:
                with open(file, "rb") as handle:
                    size = int.from_bytes(handle.read(8), "little")
                    header = json.loads(handle.read(size))
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"cannot read {file}: {io_reason(exc)}") from exc
            header.pop("__metadata__", None)
            self._headers[file] = (8 + size, header)
        return self._headers[file]


def weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Each weight's shape (aliases included), read from the files' headers: no tensor loaded."""
    files, aliases = weight_index(folder)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        shapes |= _read(file, lambda handle, name: tuple(handle.get_slice(name).get_shape()))
    return shapes | {alias: shapes[name] for alias, name in aliases.items()}


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every weight of ``folder`` by name, aliases included (an alias is the very tensor it names)."""
    files, aliases = weight_index(folder)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(files.values())):
        tensors |= _read(file, lambda handle, name: handle.get_tensor(name))
    return tensors | {alias: tensors[name] for alias, name in aliases.items()}


def _read(file: Path, get: Callable[[Any, str], Any]) -> dict[str, Any]:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            return {name: get(handle, name) for name in handle.keys()}  # noqa: SIM118 - not a dict
    except Exception as exc:
        raise CheckpointError(f"cannot read {file}: {io_reason(exc)}") from exc



def checkpoint_format(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` (the model's state dict, or a part of it) under the names and layouts of the family's released
    checkpoints, which vLLM loads: transformers 5 fuses some weights as it loads them (a MoE's experts into one
    tensor per layer) and ``save_pretrained`` splits them back; this is that reversal (the same weights where the
    family has none, in their order: the in-memory push lays q, k and v out one after the other, so that the
    direct reload fuses them in place, engine/direct_reload.py)."""
    from transformers.core_model_loading import revert_weight_conversion

    if not weights:
        return weights
    converted = revert_weight_conversion(model, dict(weights))
    return weights if converted.keys() == weights.keys() else converted
