"""Renderer names → families, their tokenizers, and the official templates they are verified against."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verbatim.errors import DependencyError, InputError, install_hint
from verbatim.renderers import tokenizers
from verbatim.renderers.base import ChatFormat


@dataclass(frozen=True)
class Family:
    """A registered renderer: its class, how to load its tokenizer, and fixed options."""

    name: str
    load: Callable[[], type[ChatFormat]]
    tokenizer: str  # a tokenizers.* loader name, "smollm2" or "stand-in:<family>" (or "stand-in:<loader>")
    options: dict[str, Any] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()


def _cls(module: str, name: str) -> Callable[[], type[ChatFormat]]:
    def load() -> type[ChatFormat]:
        import importlib

        return getattr(importlib.import_module(f"verbatim.renderers.{module}"), name)
    return load


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("smollm2", _cls("chatml", "ChatML"), "smollm2", aliases=("chatml", "smollm2-instruct")),
    Family("qwen2.5", _cls("chatml", "QwenChat"), "qwen", aliases=("qwen2", "qwen2_5")),
    Family("qwen3-instruct-2507", _cls("chatml", "Qwen3Instruct"), "qwen", aliases=("qwen3_instruct_2507",)),
    Family("qwen3", _cls("qwen3", "Qwen3"), "qwen"),
    Family("llama3", _cls("llama3", "Llama3"), "llama3", aliases=("llama3.1", "llama3.2", "llama3.3")),
    Family("mistral-v3", _cls("mistral", "MistralV3"), "mistral_v3", aliases=("mistral", "mistral-7b-v0.3")),
    Family("mistral-v7-tekken", _cls("mistral", "MistralTekken"), "mistral_tekken",
           aliases=("mistral-small-3.2", "mistral-tekken")),
    Family("gemma3", _cls("gemma", "Gemma3"), "gemma3", aliases=("gemma",)),
    Family("phi3", _cls("phi", "Phi3"), "phi3", aliases=("phi3-mini",)),
    Family("phi3.5", _cls("phi", "Phi35"), "phi3", aliases=("phi3.5-mini",)),
    Family("phi4", _cls("phi", "Phi4"), "stand-in:phi4"),
    Family("phi4-mini", _cls("phi", "Phi4Mini"), "stand-in:phi4_mini"),
    Family("deepseek-v3", _cls("deepseek", "DeepSeekV3"), "stand-in:deepseek", aliases=("deepseek",)),
    Family("deepseek-r1", _cls("deepseek", "DeepSeekR1"), "stand-in:deepseek"),
    Family("gpt-oss", _cls("harmony", "Harmony"), "o200k_harmony", aliases=("harmony", "gpt_oss")),
    Family("qwen3.6", _cls("qwen3_6", "Qwen36"), "stand-in:qwen", aliases=("qwen3_6",)),
    Family("qwq", _cls("qwq", "QwQ"), "qwen", aliases=("qwq-32b", "qwq_32b")),
    Family("glm-4.5", _cls("glm", "GLM45"), "stand-in:glm4_5", aliases=("glm4.5", "glm4_5", "glm4_5_moe")),
    Family("kimi-k2", _cls("kimi", "KimiK2"), "stand-in:kimi_k2", aliases=("kimi", "kimi_k2", "kimi-k2-instruct")),
    Family("deepseek-v3.1", _cls("deepseek_v3_1", "DeepSeekV31"), "stand-in:deepseek", aliases=("deepseek_v3_1",)),
    Family("deepseek-v3.1-thinking", _cls("deepseek_v3_1", "DeepSeekV31Thinking"), "stand-in:deepseek"),
    Family("mistral-nemo", _cls("mistral", "MistralNemo"), "mistral_nemo", aliases=("mistral-nemo-2407",)),
    Family("gemma2", _cls("gemma", "Gemma2"), "stand-in:gemma2", aliases=("gemma-2",)),
)}

_ALIASES = {alias: f.name for f in FAMILIES.values() for alias in f.aliases}


def family(name: str) -> Family:
    """The family called ``name`` (or an alias); unknown names get close-match suggestions."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in FAMILIES:
        return FAMILIES[key]
    known = sorted(set(FAMILIES) | set(_ALIASES))
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(sorted(FAMILIES))}"
    raise InputError(f"unknown renderer {name!r}", hint=hint)


def load_family_tokenizer(fam: Family, model_dir: str | Path | None = None) -> Any:
    """The tokenizer ``fam`` is verified with. SmolLM2 and stand-ins need the default model folder."""
    loader = fam.tokenizer.removeprefix("stand-in:")
    if not hasattr(tokenizers, f"{loader}_tokenizer"):  # a stand-in on an earlier generation's vocab loads it below
        loader = fam.tokenizer
    if loader == "smollm2" or loader.startswith("stand-in:"):
        if model_dir is None:
            raise InputError(f"the {fam.name} renderer needs the default model's tokenizer",
                             hint="pass tokenizer=… or model_dir=… (run 'verbatim models prepare' first)")
        if fam.tokenizer == "smollm2":
            return tokenizers.smollm2_tokenizer(str(model_dir))
        return tokenizers.stand_in_tokenizer(fam.tokenizer.split(":", 1)[1], str(model_dir))
    try:
        return getattr(tokenizers, f"{loader}_tokenizer")()
    except ImportError as exc:  # tiktoken, sentencepiece/protobuf, gguf, mistral-common
        raise DependencyError(f"the {fam.name} tokenizer needs the package {exc.name!r}",
                              hint=install_hint("renderers")) from None


def get_renderer(name: str, tokenizer: Any = None, *, model_dir: str | Path | None = None,
                 **options: Any) -> ChatFormat:
    """A renderer for family ``name``; ``tokenizer`` defaults to the family's own (see docs/renderers.md)."""
    fam = family(name)
    if tokenizer is None:
        tokenizer = load_family_tokenizer(fam, model_dir)
    return fam.load()(tokenizer, **{**fam.options, **options})


def renderer_names() -> list[str]:
    return sorted(FAMILIES)
