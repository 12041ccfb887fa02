"""Checkpoints for weight updates: perturbed copies of a model, and state dicts on disk.

A perturbed checkpoint is a genuinely different policy (greedy outputs change)
made deterministically from a model folder, so weight-update tests and the
cache-policy table need no training run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verbatim.engine.untied import serves_untied, untie_state_dict
from verbatim.errors import InputError

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_INDEX = "model.safetensors.index.json"
_TEMPORARY = "verbatim-weights-"


def model_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """A model folder's files other than its weights: config, generation config, tokenizer, chat template."""
    return sorted(item for item in Path(model_dir).iterdir()
                  if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and item.name != _INDEX)


def _copy_metadata(src: Path, dst: Path) -> None:
    for item in model_files(src):
        shutil.copy2(item, dst / item.name)


def perturbed_checkpoint(model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                         scale: float = 0.05, seed: int = 0) -> Path:
    """Write ``model_dir``'s weights plus seeded noise (``scale`` × each tensor's std) to ``out_dir``."""
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(model_dir), Path(out_dir)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise InputError(f"{src} has no .safetensors weights to perturb")
    generator = torch.Generator().manual_seed(seed)
    dst.mkdir(parents=True, exist_ok=True)
    _copy_metadata(src, dst)
    for path in files:
        tensors = load_file(str(path))
        for name in sorted(tensors):
            t = tensors[name]
            if t.is_floating_point() and t.numel() > 1:
                noise = torch.randn(t.shape, generator=generator, dtype=torch.float32)
                tensors[name] = (t.float() + noise * (scale * t.float().std())).to(t.dtype).contiguous()
        save_file(tensors, str(dst / path.name), metadata={"format": "pt"})
    if (src / _INDEX).is_file():
        shutil.copy2(src / _INDEX, dst / _INDEX)
    return dst


def state_dict_checkpoint(state_dict: dict[str, Any], like: str | os.PathLike[str],
                          parent: str | os.PathLike[str] | None = None) -> Path:
    """Save a state dict as a one-file checkpoint folder beside ``like``'s metadata."""
    from safetensors.torch import save_file

    folder = temporary_folder(parent)
    try:
        _copy_metadata(Path(like), folder)
        save_file(_own_storage(state_dict), str(folder / "model.safetensors"), metadata={"format": "pt"})
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def _own_storage(state_dict: dict[str, Any]) -> dict[str, Any]:
    """CPU tensors, each with its own storage (safetensors refuses shared ones, e.g. a tied output layer)."""
    tensors, seen = {}, set()
    for name, t in state_dict.items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if storage in seen else t
        seen.add(storage)
    return tensors


def publish_weights(state_dict: dict[str, Any], like: str | os.PathLike[str], root: str | os.PathLike[str],
                    version: int, keep: int = 2) -> Path:
    """Write ``root/v{version:06d}`` atomically (a temporary folder renamed into place) for servers to reload.

    The output layer is spelled out where a tied model's servers serve its untied copy (engine/untied.py).

    A server never sees a half-written folder: the name appears only once every file is complete.
    A failed write leaves no temporary folder. Older published versions beyond the newest ``keep`` are removed,
    and so are later ones: publishing ``version`` again (a resumed run's checkpoint, or its base weights) means
    the versions above it were trained past the checkpoint and will be trained again.
    """
    weights = untie_state_dict(state_dict) if serves_untied(like) else state_dict
    return publish(lambda parent: state_dict_checkpoint(weights, like, parent=parent), root, version, keep,
                   "weights")


def publish(write: Callable[[Path], Path], root: str | os.PathLike[str], version: int, keep: int = 2,
            what: str = "weights") -> Path:
    """``root/v{version:06d}`` published as :func:`publish_weights` publishes weights, its files written by
    ``write`` into a temporary folder it makes in the parent it is given (a LoRA run's adapter, too)."""
    root = Path(root)
    final = root / f"v{version:06d}"
    try:
        _remove_temporaries(root)  # a write a killed trainer never finished
        root.mkdir(parents=True, exist_ok=True)
        _rename_over(write(root), final)
    except OSError as exc:
        raise InputError(f"cannot publish the version {version} {what} in {root}: {exc.strerror or exc}",
                         hint="free space or pass another --out, then --resume") from exc
    finally:
        _remove_temporaries(root)
    published = sorted(p for p in root.glob("v[0-9]*") if p.is_dir())
    upto = published.index(final) + 1
    for old in published[:max(upto - keep, 0)] + published[upto:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def temporary_folder(parent: str | os.PathLike[str] | None = None) -> Path:
    """A fresh folder in ``parent`` that :func:`publish` removes if it is left behind."""
    return Path(tempfile.mkdtemp(prefix=_TEMPORARY, dir=parent))


def _rename_over(folder: Path, final: Path) -> None:
    """``folder`` renamed to ``final``; a ``final`` already there (published by a trainer that died before
    its checkpoint) is replaced whole, or stays as it was if the new one cannot take its place."""
    if not final.exists():
        os.rename(folder, final)
        return
    aside = Path(tempfile.mkdtemp(prefix=_TEMPORARY, dir=final.parent)) / "old"
    os.rename(final, aside)
    try:
        os.rename(folder, final)
    except OSError:
        os.rename(aside, final)
        raise


def _remove_temporaries(root: Path) -> None:
    for stale in root.glob(f"{_TEMPORARY}*"):
        shutil.rmtree(stale, ignore_errors=True)
