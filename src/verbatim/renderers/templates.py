"""Finding chat templates and tokenizers by name or path, for the linter and the tests."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from verbatim.errors import InputError
from verbatim.paths import TEMPLATES_ENV, chat_templates_dir
from verbatim.renderers import registry, tokenizers


def official_templates() -> dict[str, Path]:
    """Every official template shipped with verbatim, by file stem (``qwen3``, ``gpt_oss``…)."""
    folder = chat_templates_dir()
    return {path.stem: path for path in sorted(folder.glob("*.jinja"))}


def resolve_template(name_or_path: str) -> tuple[str, str]:
    """``(label, template text)`` for a file path, an official template's stem, or a renderer name."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return str(path), read_template(path)
    known = official_templates()
    key = name_or_path.removesuffix(".jinja")
    if key in known:
        return key, read_template(known[key])
    try:
        family = registry.family(name_or_path)
    except InputError:
        family = None
    if family is not None:
        stem = family.load().templates[0].removesuffix(".jinja")
        return stem, read_template(known[stem]) if stem in known else _missing(stem)
    choices = sorted(set(known) | set(registry.FAMILIES))
    close = difflib.get_close_matches(key, choices, n=3, cutoff=0.5)
    raise InputError(f"no template file or known template named {name_or_path!r}",
                     hint=f"did you mean {', '.join(close)}?" if close else "pass a path to a .jinja file")


def _missing(stem: str) -> str:
    raise InputError(f"the official template {stem}.jinja is missing from {chat_templates_dir()}",
                     hint=f"unset {TEMPLATES_ENV} or point it at a folder that has it")


def read_template(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read template {path}: {exc}") from None
    if not text.strip():
        raise InputError(f"template {path} is empty")
    return text


def resolve_tokenizer(name_or_path: str, model_dir: str | Path | None) -> Any:
    """A tokenizer from a path (folder or tokenizer.json) or a renderer family's name."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return tokenizers.load_tokenizer_path(path)
    return registry.load_family_tokenizer(registry.family(name_or_path), model_dir)
