"""Trainer checkpoints: one folder per completed step, written atomically, resumable after a SIGKILL.

``root/step-000042/`` holds four files, and the model folder's config and tokenizer files (so that it
is a Hugging Face model folder: ``from_pretrained``, ``verbatim run --model``, ``verbatim mismatch``):

* ``model.safetensors`` (or, past 2 GiB, numbered files and their index: :mod:`.weight_files`): the model's
  ``state_dict()``; a tensor that two names share (tied embeddings: ``lm_head.weight`` is
  ``model.embed_tokens.weight``) is stored once, under its first name, and the other names are recorded
  in the metadata and restored on load;
* ``optimizer.pt``: ``optimizer.state_dict()`` (``torch.save``); a sharded learner's ranks write an
  ``optimizer/`` folder instead, ``torch.distributed.checkpoint``'s format (each rank's shards in its own
  file, ``.metadata`` beside them), which any number of ranks, one included, loads;
* ``rng.pt``: the Python ``random``, NumPy and torch generator states (and CUDA's, when CUDA
  is in use);
* ``state.json``: ``{"schema": 1, "step": N, **state}`` (the loop's JSON: version, config, metrics).

Everything is written into a ``.tmp-*`` folder inside ``root``, every file and the folder are
fsynced, and one ``os.rename`` publishes it; a kill at any moment leaves either the previous
checkpoints alone or the new one complete. :func:`latest_checkpoint` removes the ``.tmp-*``
leftovers of a killed write. One trainer writes a root at a time.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from verbatim.durable import fsync_dir, io_reason, strict_json
from verbatim.errors import CheckpointError, InputError
from verbatim.trainer import lora
from verbatim.trainer.weight_files import SINGLE, has_weights, read_weights, write_weights

CHECKPOINT_SCHEMA = 1
OPTIMIZER_FILE = "optimizer.pt"
FILES = (SINGLE, OPTIMIZER_FILE, "rng.pt", "state.json")
"""A one-process checkpoint's files under 2 GiB of weights (a team's holds the ``optimizer/`` shards in place of
``optimizer.pt``; larger weights are numbered files and their index in place of ``model.safetensors``)."""
OPTIMIZER_SHARDS = "optimizer"
TMP_PREFIX = ".tmp-"
_STEP_NAME = re.compile(r"step-(\d+)")
_RESERVED = ("schema", "step")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# ---------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------


def save_checkpoint(root: Path, step: int, model: nn.Module | None, optimizer: torch.optim.Optimizer | None,
                    state: dict[str, Any], keep: int = 2, model_files: Sequence[Path] = (),
                    tmp: Path | None = None) -> Path:
    """Write ``root/step-{step:06d}/`` atomically, then keep only the newest ``keep`` checkpoints.

    ``model_files`` (the model folder's config and tokenizer files) are copied in beside the weights:
    the checkpoint is then a Hugging Face model folder (``from_pretrained``, ``verbatim run --model``). A model
    with a LoRA adapter (:mod:`.lora`) is saved as its adapter alone, a PEFT folder whose
    ``adapter_config.json`` names the base model's folder; ``model_files`` are then left where they are.
    ``tmp``: a folder of :func:`checkpoint_tmp` a team has written its weights (``model`` None) and its
    ``optimizer/`` shards (``optimizer`` None) into, finished and published here.

    A failure while writing removes the half-written folder, leaves older checkpoints untouched and
    raises a one-line :class:`CheckpointError` that names the folder and the OS reason.
    """
    if keep < 1:
        raise InputError(f"keep must be at least 1 checkpoint, not {keep}")
    if step < 0:
        raise InputError(f"step must be the number of completed steps (0 or more), not {step}")
    clash = sorted(set(state) & set(_RESERVED))
    if clash:
        raise InputError(f"checkpoint state may not set {', '.join(clash)}: save_checkpoint writes them")
    try:
        state_text = strict_json({"schema": CHECKPOINT_SCHEMA, "step": step, **state}, indent=1)
    except (TypeError, ValueError) as exc:
        raise InputError(f"checkpoint state is not JSON data: {exc}") from exc
    root = Path(root)
    final = root / step_dir_name(step)
    written = _Write(final)
    written.tmp = tmp
    try:
        written.tmp = tmp = tmp or checkpoint_tmp(root, step)
        if model is not None and lora.has_adapter(model):  # the adapter alone, a PEFT folder
            lora.write_adapter(tmp, model)
        elif model is not None:
            write_weights(tmp, *deduplicated(model.state_dict()))
        if optimizer is not None:
            _write_torch(tmp / OPTIMIZER_FILE, optimizer.state_dict())
        _write_torch(tmp / "rng.pt", _rng_state())
        _write_bytes(tmp / "state.json", state_text.encode("utf-8"))
        for source in () if lora.is_adapter_folder(tmp) else model_files:  # a PEFT folder: the adapter alone
            _write_bytes(tmp / Path(source).name, Path(source).read_bytes())
        fsync_dir(tmp)
        written.aside = _move_aside(final)  # a folder of this step from before: back in place if we fail
        os.rename(tmp, final)
        written.published = True
        fsync_dir(root)
    except Exception as exc:
        written.undo()
        raise CheckpointError(f"cannot write checkpoint {final.name} in {root}: {io_reason(exc)}; nothing was written",
                              hint="free space or pass another --out, then --resume") from exc
    except BaseException:  # KeyboardInterrupt and friends: clean up, let them through unchanged
        written.undo()
        raise
    if written.aside is not None:
        shutil.rmtree(written.aside.parent, ignore_errors=True)
    _prune(root, step, keep)
    return final


def checkpoint_tmp(root: Path, step: int) -> Path:
    """A fresh ``.tmp-`` folder in ``root`` that step ``step``'s checkpoint is written into, then published."""
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{step_dir_name(step)}-", dir=root))


def sharded_optimizer(path: Path) -> Path | None:
    """The ``optimizer/`` shards of the checkpoint at ``path`` (a team's), or None (one process's file)."""
    shards = Path(path) / OPTIMIZER_SHARDS
    return shards if (shards / ".metadata").is_file() else None


def deduplicated(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each tensor once: a name that views exactly the same memory as an earlier one becomes an alias."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[Any, ...], str] = {}
    saved: list[tuple[Any, int, int]] = []
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        view = same_memory(tensor)
        if view in first:
            aliases[name] = first[view]
            continue
        first[view] = name
        # a view overlapping memory already saved (not an exact alias) is saved as a copy of its own; views
        # side by side in one storage (a learner's weights in the engine's shared buffer) are not
        span = (tensor.device, tensor.data_ptr(), tensor.data_ptr() + _extent(tensor))
        overlaps = any(d == span[0] and lo < span[2] and span[1] < hi for d, lo, hi in saved)
        tensors[name] = tensor.cpu().clone() if overlaps else tensor.cpu().contiguous()
        saved.append(span)
    return tensors, aliases


def same_memory(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two tensors exactly when they view the same elements of the same memory (a tied weight)."""
    return (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def _extent(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last (its strides included)."""
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def _write_torch(path: Path, obj: Any) -> None:
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


class _Write:
    """What a save has done so far, so that a failure can put the root back as it was."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.tmp: Path | None = None
        self.aside: Path | None = None
        self.published = False

    def undo(self) -> None:
        if self.published:
            shutil.rmtree(self.final, ignore_errors=True)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self.aside is not None:
            try:
                os.rename(self.aside, self.final)
                shutil.rmtree(self.aside.parent, ignore_errors=True)
            except OSError:
                pass  # it stays under its .tmp- name; latest_checkpoint removes it


def _move_aside(folder: Path) -> Path | None:
    """Move ``folder`` (if it exists) into a fresh ``.tmp-`` folder; return where it went."""
    if not folder.exists():
        return None
    aside = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}old-{folder.name}-", dir=folder.parent)) / folder.name
    os.rename(folder, aside)
    return aside


def _prune(root: Path, step: int, keep: int) -> None:
    """Keep the one just written and the newest ``keep - 1`` below it; later steps belong to an abandoned run."""
    complete = _complete_steps(root)
    older = sorted((s for s in complete if s < step), reverse=True)
    doomed = [s for s in complete if s > step] + older[keep - 1:]
    for old in doomed:
        try:
            aside = _move_aside(complete[old])  # out of the complete set at once, then deleted
        except OSError:
            continue  # an old checkpoint left over is harmless; the next save tries again
        if aside is not None:
            shutil.rmtree(aside.parent, ignore_errors=True)


# ---------------------------------------------------------------------------
# find and load
# ---------------------------------------------------------------------------


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete ``step-*`` folder of ``root`` (None if there is none); removes ``.tmp-*`` leftovers."""
    root = Path(root)
    if not root.is_dir():
        return None
    for leftover in root.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    complete = _complete_steps(root)
    return complete[max(complete)] if complete else None


def checkpoint_steps(root: Path) -> list[int]:
    """The steps of ``root``'s complete checkpoints, oldest first (reads only; removes nothing)."""
    return sorted(_complete_steps(Path(root))) if Path(root).is_dir() else []


def _complete_steps(root: Path) -> dict[int, Path]:
    found = {}
    for path in root.iterdir():
        match = _STEP_NAME.fullmatch(path.name)
        if match and path.is_dir() and _read_state(path) is not None and _complete(path):
            found[int(match.group(1))] = path
    return found


def _complete(path: Path) -> bool:
    """Every file of a checkpoint there, the optimizer's as one file or as a team's shards."""
    return (all((path / f).is_file() for f in FILES if f not in (SINGLE, OPTIMIZER_FILE))
            and (has_weights(path) or lora.is_adapter_folder(path))
            and ((path / OPTIMIZER_FILE).is_file() or sharded_optimizer(path) is not None))


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("schema"), int):
        return None
    return state


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load weights (strict; a LoRA model its adapter), the optimizer's state and the RNG states; return the
    saved state.json."""
    check_kind(path, model)
    if lora.has_adapter(model):
        state = checkpoint_state(path)
        lora.load_adapter(path, model)
    else:
        state, tensors = read_checkpoint(path)
        check_fit(path, tensors, model.state_dict())
        model.load_state_dict(tensors, strict=True)
    if optimizer is not None:
        load_optimizer(path, optimizer, read_optimizer(path))
    restore_rng(path)
    return state


def check_kind(path: Path, model: nn.Module) -> None:
    """Refuse a LoRA adapter's checkpoint for a model without one, and a whole model's for one with an adapter."""
    if lora.has_adapter(model) != lora.is_adapter_folder(path):
        held = "a LoRA adapter" if lora.is_adapter_folder(path) else "a whole model's weights"
        raise CheckpointError(f"checkpoint {path} holds {held}, which this trainer does not train",
                              hint="resume with the --lora-rank the run was started with")


def load_optimizer(path: Path, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """``saved`` (read from the checkpoint at ``path``) into ``optimizer``, refused in one line if it is another
    optimizer's."""
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise another_optimizer(path, exc) from exc


def another_optimizer(path: Path, exc: BaseException) -> CheckpointError:
    """The one line refusing the checkpoint at ``path``, whose optimizer state ``exc`` would not load."""
    return CheckpointError(f"checkpoint {path} holds another optimizer's state: {io_reason(exc)}")


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A complete checkpoint's state.json and its weights by name (aliases included), loading nothing."""
    return checkpoint_state(path), read_weights(Path(path))


def checkpoint_state(path: Path) -> dict[str, Any]:
    """A complete checkpoint's state.json, refused in one line where the checkpoint is not complete or is of
    another schema."""
    path = Path(path)
    state = _read_state(path)
    if state is None:
        raise CheckpointError(f"{path} is not a complete checkpoint (no readable state.json)",
                              hint="use latest_checkpoint to find the last complete step")
    if state["schema"] != CHECKPOINT_SCHEMA:
        raise CheckpointError(f"checkpoint {path} has schema {state['schema']}; this verbatim reads schema "
                              f"{CHECKPOINT_SCHEMA}", hint="resume with the verbatim version that wrote it")
    return state


def read_optimizer(path: Path) -> dict[str, Any]:
    """The optimizer state a checkpoint holds, as saved."""
    return torch.load(Path(path) / OPTIMIZER_FILE, map_location="cpu", weights_only=True)


def restore_rng(path: Path) -> None:
    """The RNG states a checkpoint saved, restored in this process."""
    _restore_rng(torch.load(Path(path) / "rng.pt", map_location="cpu", weights_only=True))


def check_fit(path: Path, saved: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose weights (tensors, or their shapes) are not the model's."""
    def shape(value: Any) -> tuple[int, ...]:
        return tuple(getattr(value, "shape", value))

    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = sorted(f"{n} {shape(saved[n])} (the model's {shape(expected[n])})"
                    for n in set(saved) & set(expected) if shape(saved[n]) != shape(expected[n]))
    parts = [f"{label} {_some(names)}" for label, names in
             (("missing", missing), ("unexpected", unexpected), ("other shapes", shapes)) if names]
    if parts:
        raise CheckpointError(f"checkpoint {path} was written for another model: {'; '.join(parts)}",
                              hint="resume with the model the run was started with")


def _some(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


# ---------------------------------------------------------------------------
# random number generators
# ---------------------------------------------------------------------------


def seed_generators(seed: int) -> None:
    """Seed Python's ``random``, NumPy's and torch's generators (every device's) with the run's seed, so the
    states a checkpoint keeps in ``rng.pt`` are the same in two runs of one command."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"bit_generator": numpy_state["bit_generator"], "key": numpy_state["state"]["key"].tolist(),
                  "pos": int(numpy_state["state"]["pos"]), "has_gauss": int(numpy_state["has_gauss"]),
                  "gauss": float(numpy_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = state["numpy"]
    np.random.set_state({"bit_generator": saved["bit_generator"], "has_gauss": saved["has_gauss"],
                         "gauss": saved["gauss"],
                         "state": {"key": np.asarray(saved["key"], dtype=np.uint32), "pos": saved["pos"]}})
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
