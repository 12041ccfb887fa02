"""Token ids → the text of each token, with the tokenizer the run's manifest names.

The renderer family (``manifest.renderer``) says which tokenizer the run was rendered
with; families that need the default model's vocabulary find it in ``manifest.model``
when that is a folder, or in the prepared bundled model of that name. Nothing is
downloaded or converted: a run whose tokenizer cannot be loaded here is shown with
token ids in place of text, and the page says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verbatim.errors import VerbatimError

VISIBLE_WHITESPACE = {"\n": "↵", "\t": "→", "\r": "␍"}


@dataclass
class TokenText:
    """Per-token text for one run: cached by id, since a vocabulary repeats itself."""

    tokenizer: Any = None
    problem: str | None = None
    _cache: dict[int, tuple[str, bool]] = field(default_factory=dict)

    @classmethod
    def for_manifest(cls, manifest: Any) -> TokenText:
        try:
            return cls(tokenizer=load_run_tokenizer(manifest.renderer, manifest.model))
        except (VerbatimError, OSError, ValueError, ImportError) as exc:
            text = exc.one_line() if isinstance(exc, VerbatimError) else " ".join(str(exc).split())[:200]
            return cls(problem=f"tokens are shown as ids: no tokenizer ({text})")

    def texts(self, ids: Sequence[int]) -> tuple[list[str], list[bool]]:
        """``(text of each token, whether it is a special token)``."""
        texts, specials = [], []
        for token in ids:
            text, special = self._one(int(token))
            texts.append(text)
            specials.append(special)
        return texts, specials

    def _one(self, token: int) -> tuple[str, bool]:
        if token not in self._cache:
            self._cache[token] = self._decode(token)
        return self._cache[token]

    def _decode(self, token: int) -> tuple[str, bool]:
        if self.tokenizer is None:
            return f"#{token}", False
        try:
            special = token in self._special_ids()
            text = self.tokenizer.decode([token], skip_special_tokens=False)
        except (ValueError, TypeError, OverflowError, IndexError):
            return f"#{token}", False
        return (text if special else visible(text)) or f"#{token}", special

    def _special_ids(self) -> set[int]:
        if not hasattr(self, "_specials"):
            ids = set(getattr(self.tokenizer, "all_special_ids", ()) or ())
            try:
                added = self.tokenizer.get_added_vocab()
                decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
                ids |= {i for i in added.values() if getattr(decoder.get(i), "special", True)}
            except (AttributeError, TypeError):
                pass
            self._specials = ids
        return self._specials


def visible(text: str) -> str:
    """Whitespace a reader must see: newlines, tabs and carriage returns get a mark."""
    return "".join(VISIBLE_WHITESPACE.get(char, char) for char in text)


def load_run_tokenizer(renderer: str, model: str) -> Any:
    """The tokenizer of the family ``renderer`` (else of the model folder); raises if neither loads."""
    from verbatim.renderers.registry import family, load_family_tokenizer
    from verbatim.renderers.tokenizers import load_tokenizer_path

    model_dir = _model_dir(model)
    if renderer:
        return load_family_tokenizer(family(renderer), model_dir)
    if model_dir is not None:
        return load_tokenizer_path(model_dir)
    raise VerbatimError("the manifest names neither a renderer nor a model folder")


def _model_dir(model: str) -> Path | None:
    """The model's folder if it is one here, or a prepared bundled model; never prepares one."""
    if model and Path(model).expanduser().is_dir():
        return Path(model).expanduser()
    from verbatim.engine import models

    name = model or models.DEFAULT_MODEL
    if name in models.BUNDLED and models.is_prepared(name):
        return models.prepared_path(name)
    return None
