"""Tiny random-initialised causal LMs, one per architecture, so tests and dry runs need no download.

:func:`tiny_config` is the family's own ``transformers`` config class at small sizes: 2 layers, hidden
64, 2 query heads and 1 key/value head (grouped-query attention) of head_dim 32 (vLLM's CPU attention
takes head sizes 32, 64, 80… only), MLP 128, no dropout, float32. Everything else stays as the family's
small released models have it: tied or untied embeddings, RoPE base, softcapping (Gemma 2), the
sliding-window layer pattern (Gemma 2 and 3 alternate a windowed and a global layer here, with a
16-token window so a test can run past it; Qwen2 keeps ``use_sliding_window`` off).

:func:`build_tiny_model` seeds torch and builds the model from the config, so the same seed gives
byte-identical weights; :func:`save_tiny_model` writes ``config.json``, ``generation_config.json`` and
``model.safetensors``. The tokenizer is not this module's business: the caller passes the token ids
and the vocabulary size (``harness/tiny_models.py`` takes both from the family's real tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verbatim.errors import InputError

SIZES: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 8192,
}
HEAD_DIM = SIZES["hidden_size"] // SIZES["num_attention_heads"]  # 32
QWEN2_05B_SIZES: dict[str, Any] = {
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
}
"""Qwen2.5-0.5B's sizes (its config.json; RoPE base 1e6 and tied embeddings are qwen2's here already): in place
of :data:`SIZES`, a random model of the size benchmarks measure (head_dim 64)."""
SLIDING_WINDOW = 16
"""Gemma 2 and 3's window here: short enough that a test's prompt runs past it."""
ALTERNATING = ["sliding_attention", "full_attention"]


def _rope(theta: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta}


@dataclass(frozen=True)
class Architecture:
    """One ``model_type``: its config class and what differs from ``transformers``' defaults for it."""

    model_type: str
    config_class: str
    tie_word_embeddings: bool
    """As the family's small released models (Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B, Gemma) have it."""
    padded_vocab: int | None = None
    """The embedding rows the family's configs have where that exceeds the tokenizer (Qwen, Phi-3)."""
    options: dict[str, Any] = field(default_factory=dict)


ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("qwen2", "Qwen2Config", True, 151936,
                 {"rope_parameters": _rope(1e6), "use_sliding_window": False, "sliding_window": None}),
    Architecture("qwen3", "Qwen3Config", True, 151936, {"head_dim": HEAD_DIM, "rope_parameters": _rope(1e6)}),
    Architecture("qwen3_moe", "Qwen3MoeConfig", False, 151936, {
        "head_dim": HEAD_DIM, "rope_parameters": _rope(1e6), "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    Architecture("llama", "LlamaConfig", True, None, {"head_dim": HEAD_DIM, "rope_parameters": _rope(500000.0)}),
    Architecture("mistral", "MistralConfig", False, None,
                 {"head_dim": HEAD_DIM, "rope_parameters": _rope(1e6), "sliding_window": None}),
    Architecture("phi3", "Phi3Config", False, 32064, {"max_position_embeddings": 4096,
                                                      "original_max_position_embeddings": 4096}),
    Architecture("gemma2", "Gemma2Config", True, None, {
        "head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": SLIDING_WINDOW,
        "layer_types": ALTERNATING}),  # final_logit_softcapping 30, attn_logit_softcapping 50: the defaults
    Architecture("gemma3_text", "Gemma3TextConfig", True, None, {
        "head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": SLIDING_WINDOW,
        "layer_types": ALTERNATING}),
)}


@dataclass(frozen=True)
class TokenIds:
    """The tokenizer's ids a config and a generation config name."""

    bos: int | None
    eos: int
    pad: int | None
    stop: tuple[int, ...]
    """Every id that ends a reply (the family's ``generation_config.json`` ``eos_token_id`` list)."""


def architecture(model_type: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise InputError(f"no tiny model is defined for model_type {model_type!r}",
                         hint=f"known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def vocab_size(model_type: str, tokenizer_size: int) -> int:
    """Embedding rows: the tokenizer's full size (added tokens included), or the family's padded size."""
    return max(tokenizer_size, architecture(model_type).padded_vocab or 0)


def tiny_config(model_type: str, *, vocab: int, tokens: TokenIds, sizes: dict[str, Any] | None = None) -> Any:
    """The family's config class at the small sizes above (or ``sizes`` over them), float32, no dropout."""
    import transformers

    arch = architecture(model_type)
    config_class = getattr(transformers, arch.config_class)
    config = config_class(
        **{**SIZES, **arch.options, **(sizes or {})}, vocab_size=vocab, tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=tokens.bos, eos_token_id=tokens.eos, pad_token_id=tokens.pad,
        attention_dropout=0.0, dtype="float32")
    for name in ("resid_pdrop", "embd_pdrop"):  # Phi-3's other dropouts
        if hasattr(config, name):
            setattr(config, name, 0.0)
    return config


def build_tiny_model(config: Any, seed: int) -> nn.Module:
    """A randomly initialised float32 causal LM for ``config``; the same seed gives the same weights.
    The caller's torch random state is left as it was."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def generation_config(tokens: TokenIds) -> Any:
    """transformers' defaults (greedy), ending on every stop id."""
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=tokens.bos, eos_token_id=list(tokens.stop) or tokens.eos,
                            pad_token_id=tokens.pad)


def save_tiny_model(model: nn.Module, out: Path, tokens: TokenIds) -> None:
    """``config.json``, ``generation_config.json`` and ``model.safetensors`` into the folder ``out``."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one small file: a progress bar is noise on the terminal
    model.generation_config = generation_config(tokens)
    model.save_pretrained(out, safe_serialization=True)


def write_model_files(model_type: str, out: Path, *, tokenizer_size: int, tokens: TokenIds, seed: int,
                      sizes: dict[str, Any] | None = None) -> Any:
    """Config, random weights and generation config of a tiny ``model_type`` (``sizes`` over the tiny ones) into
    ``out``; the config."""
    config = tiny_config(model_type, vocab=vocab_size(model_type, tokenizer_size), tokens=tokens, sizes=sizes)
    save_tiny_model(build_tiny_model(config, seed), out, tokens)
    return config
