"""Which renderer a model folder needs: the family whose official template its chat template is.

A renderer is verified token for token against the official templates it lists (``templates``,
shipped in ``verbatim/chat_templates/``). A model folder's chat template picks its family when,
after :func:`normalise` (line endings and trailing whitespace only), it equals one of them. Anything
else is refused with one line naming the closest family, by the mean of two similarities
between the normalised texts: the Jaccard index of their markup tokens (``<|im_start|>``, ``[INST]``,
``<think>``…: what decides the format) and ``difflib.SequenceMatcher(None, a, b).ratio()`` (character
level, difflib's default junk heuristic; about 0.5 s over all shipped templates). Similar is not
verified, so ``--renderer NAME`` is how to use a family anyway.

:func:`detect_family` is pure (a template text and the official texts in, a family name out);
:func:`folder_template` and :func:`detect_folder` read the files.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from verbatim.errors import InputError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
PROCESSOR_TEMPLATE = "chat_template.json"
MARKUP = re.compile(r"<[^<>\s{}%'\"]{2,40}>|\[/?[A-Za-z_]{2,30}\]")
"""A markup token a template writes: ``<|im_start|>``, ``<｜User｜>``, ``<think>``, ``[INST]``, ``[gMASK]``."""


def normalise(template: str) -> str:
    """``template`` with CRLF/CR line endings as LF, no trailing whitespace on a line, none at either end."""
    lines = template.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "\n".join(line.rstrip() for line in lines).strip()


def detect_family(template: str, official: Mapping[str, Sequence[str]] | None = None, *,
                  source: str = "the chat template") -> str:
    """The family (``official``'s key, in its order) one of whose templates equals ``template``
    after :func:`normalise`; else :class:`InputError` naming the closest family.

    ``official`` defaults to the shipped templates of every registered renderer. A text two
    families share (DeepSeek-V3.1's, read in both thinking modes) goes to the first one."""
    official = shipped_templates() if official is None else official
    text = normalise(template)
    if not text:
        raise InputError(f"{source} is empty", hint="pass --renderer NAME (see docs/renderers.md)")
    for name, texts in official.items():
        if any(normalise(t) == text for t in texts):
            return name
    name, markup, ratio = closest_family(text, official)
    raise InputError(f"{source} is none of the official templates verbatim's renderers are verified against "
                     f"(closest: {name}, with {_percent(markup)} of the markup tokens and {_percent(ratio)} of "
                     "the text alike)",
                     hint=f"pass --renderer {name} to use that family anyway, or --renderer NAME for another; "
                          "see docs/renderers.md")


def closest_family(template: str, official: Mapping[str, Sequence[str]]) -> tuple[str, float, float]:
    """The family most like ``template`` (normalised): the best mean of markup-token Jaccard index and
    difflib ratio over its templates; with those two numbers."""
    text = normalise(template)
    best = ("", 0.0, 0.0)
    for name, texts in official.items():
        for candidate in map(normalise, texts):
            markup = _jaccard(set(MARKUP.findall(text)), set(MARKUP.findall(candidate)))
            ratio = difflib.SequenceMatcher(None, text, candidate).ratio()
            if not best[0] or markup + ratio > best[1] + best[2]:
                best = (name, markup, ratio)
    return best


def _jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a | b else 0.0


def _percent(share: float) -> str:
    """Rounded down, so that only what is equal reads 100%."""
    return f"{math.floor(share * 100)}%"


def shipped_templates() -> dict[str, tuple[str, ...]]:
    """Every registered family's official template texts, in registry order (files that are missing skipped)."""
    from verbatim.paths import chat_templates_dir
    from verbatim.renderers.registry import FAMILIES

    folder = chat_templates_dir()
    found: dict[str, tuple[str, ...]] = {}
    for name, fam in FAMILIES.items():
        files = [folder / stem for stem in fam.load().templates]
        found[name] = tuple(path.read_text(encoding="utf-8") for path in files if path.is_file())
    return found


def folder_template(folder: Path) -> tuple[str, str]:
    """``(where, template text)`` of a Hugging Face folder's chat template, read as transformers does:
    ``chat_template.jinja`` first, then ``tokenizer_config.json``'s ``chat_template`` (a string, or a list
    of ``{name, template}`` of which the ``default`` one), then ``chat_template.json``."""
    jinja = folder / TEMPLATE_FILE
    if jinja.is_file():
        return str(jinja), _read(jinja)
    for name in (TOKENIZER_CONFIG, PROCESSOR_TEMPLATE):
        path = folder / name
        if path.is_file():
            template = _template_field(path)
            if template is not None:
                return str(path), template
    raise InputError(f"the model folder {folder} has no chat template (no {TEMPLATE_FILE}, no chat_template in "
                     f"its {TOKENIZER_CONFIG})", hint="pass --renderer NAME (see docs/renderers.md)")


def detect_folder(folder: str | Path) -> str:
    """The renderer family of a model folder, from its chat template (one-line errors as above)."""
    where, template = folder_template(Path(folder))
    return detect_family(template, source=f"the chat template in {where}")


def _template_field(path: Path) -> str | None:
    try:
        config = json.loads(_read(path))
    except ValueError as exc:
        raise InputError(f"{path} is not valid JSON: {exc}") from None
    value = config.get("chat_template") if isinstance(config, dict) else None
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise InputError(f"{path} has named chat templates ({', '.join(map(str, named))}) but none called "
                         "'default'", hint="pass --renderer NAME (see docs/renderers.md)")
    raise InputError(f"{path}: chat_template must be a string or a list of {{name, template}}, "
                     f"not {type(value).__name__}")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {path}: {exc}") from None
