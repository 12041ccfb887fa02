"""``verbatim models tiny FAMILY``: a small random model folder of a family, with its real tokenizer.

The folder is a complete Hugging Face causal LM, so ``verbatim train --model DIR`` (or ``run``,
``generate``, the trainer's tests) can exercise another architecture with no download:

* the weights: ``trainer/tiny.py`` (2 layers, hidden 64, head_dim 32, grouped-query attention, float32,
  random from ``seed``: the same seed writes a byte-identical ``model.safetensors``);
* the tokenizer: the one the family's renderer is verified with (``renderers/tokenizers.py``: the
  real vocabulary the package ships), all of it: ``vocab_size`` covers every added token;
* the chat template: the renderer's official template, as ``chat_template.jinja``, so that
  ``renderers/detect.py`` picks the family's renderer for the folder.

SmolLM2, the default model's family, takes its tokenizer from the default model's folder (prepared from the
bundled GGUF if it is not yet), as its renderer does.

Gemma 2's own 256k vocabulary is not shipped (its renderer is verified on a SmolLM2 stand-in), so
its tiny folder takes Gemma 3's real 262k SentencePiece vocabulary, which has the same control tokens
(``<bos>``, ``<start_of_turn>``, ``<end_of_turn>``) at Gemma 3's ids, with Gemma 2's template.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verbatim.durable import staged_folder
from verbatim.errors import InputError, ModelError

MARKER = "verbatim-tiny.json"
"""Written into every tiny folder: what it is, so that it may be written over again."""


@dataclass(frozen=True)
class TinyFamily:
    """A family name a user types, its ``model_type``, its renderer and whose tokenizer it takes."""

    name: str
    model_type: str
    renderer: str
    """The registered renderer (``renderers/registry.py``) whose official template the folder carries."""
    tokenizer_of: str = ""
    """The renderer whose tokenizer the folder carries, where not ``renderer``'s own."""

    @property
    def tokenizer_family(self) -> str:
        return self.tokenizer_of or self.renderer


TINY_FAMILIES: dict[str, TinyFamily] = {f.name: f for f in (
    TinyFamily("smollm2", "llama", "smollm2"),
    TinyFamily("qwen2.5", "qwen2", "qwen2.5"),
    TinyFamily("qwen3", "qwen3", "qwen3"),
    TinyFamily("qwen3-moe", "qwen3_moe", "qwen3"),
    TinyFamily("llama3", "llama", "llama3"),
    TinyFamily("mistral", "mistral", "mistral-v3"),
    TinyFamily("phi3", "phi3", "phi3"),
    TinyFamily("gemma2", "gemma2", "gemma2", tokenizer_of="gemma3"),
    TinyFamily("gemma3", "gemma3_text", "gemma3"),
)}


def tiny_family(name: str) -> TinyFamily:
    """The family called ``name``; an unknown one is a one-line :class:`InputError` listing them."""
    key = name.strip().lower()
    if key not in TINY_FAMILIES:
        raise InputError(f"no tiny model family {name!r}", hint=f"known: {', '.join(TINY_FAMILIES)}")
    return TINY_FAMILIES[key]


@dataclass(frozen=True)
class TinyModel:
    """What :func:`write_tiny_model` wrote."""

    path: Path
    family: TinyFamily
    vocab_size: int
    template: str
    """The official template's stem (``qwen3``, ``gemma2``…)."""


def write_tiny_model(family: str, out: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write the tiny ``family`` model folder at ``out`` (see the module docstring); its path."""
    return build_tiny_folder(family, out, seed).path


def build_tiny_folder(family: str, out: str | os.PathLike[str], seed: int = 0,
                      sizes: dict[str, Any] | None = None) -> TinyModel:
    """:func:`write_tiny_model` with what it wrote. ``out`` must be missing, empty or an earlier tiny
    folder; the files are written beside it and renamed into place, so a failure leaves no half folder.
    ``sizes``: the config's sizes in place of the tiny ones (``trainer/tiny.py``), e.g. a benchmark's 0.5 B."""
    fam = tiny_family(family)
    target = _checked_out(Path(out).expanduser())
    tokenizer, renderer, (stem, template) = _chat_parts(fam)
    with staged_folder(target, f".{target.name}-") as staging:
        config = _write_weights(fam, staging, tokenizer, renderer, seed, sizes)
        tokenizer.save_pretrained(staging)
        (staging / "chat_template.jinja").write_text(template, encoding="utf-8")
        marker = {"family": fam.name, "model_type": fam.model_type, "renderer": fam.renderer,
                  "tokenizer": fam.tokenizer_family, "template": stem, "seed": seed, "sizes": sizes}
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        _check_detected(staging, fam)
    return TinyModel(path=target, family=fam, vocab_size=config.vocab_size, template=stem)


def _checked_out(path: Path) -> Path:
    if path.exists() and not path.is_dir():
        raise InputError(f"--out {path} is a file", hint="pass a folder for the model")
    if path.is_dir() and any(path.iterdir()) and not (path / MARKER).is_file():
        raise InputError(f"--out {path} already holds files that are not a tiny model",
                         hint="pass a new or empty folder")
    if not path.parent.is_dir():
        raise InputError(f"--out {path}: the folder {path.parent} does not exist", hint="create it first")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise InputError(f"--out {path}: the folder {path.parent} is not writable")
    return path


def _chat_parts(fam: TinyFamily) -> tuple[Any, Any, tuple[str, str]]:
    """The tokenizer, the renderer over it, and ``(stem, text)`` of the renderer's official template."""
    from verbatim.renderers.registry import family, get_renderer, load_family_tokenizer
    from verbatim.renderers.templates import resolve_template

    model_dir = None
    if fam.tokenizer_family == "smollm2":
        from verbatim.engine.models import resolve

        model_dir = resolve("default")
    tokenizer = load_family_tokenizer(family(fam.tokenizer_family), model_dir)
    return tokenizer, get_renderer(fam.renderer, tokenizer=tokenizer), resolve_template(fam.renderer)


def _write_weights(fam: TinyFamily, out: Path, tokenizer: Any, renderer: Any, seed: int,
                   sizes: dict[str, Any] | None) -> Any:
    from verbatim.trainer.tiny import TokenIds, write_model_files

    tokens = TokenIds(bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id,
                      stop=tuple(renderer.stop_token_ids))
    return write_model_files(fam.model_type, out, tokenizer_size=len(tokenizer), tokens=tokens, seed=seed,
                             sizes=sizes)


def _check_detected(folder: Path, fam: TinyFamily) -> None:
    from verbatim.renderers.detect import detect_folder

    detected = detect_folder(folder)
    if detected != fam.renderer:
        raise ModelError(f"the tiny {fam.name} folder's template is detected as {detected}, not {fam.renderer}")
