"""The small model interface PrefixFlow trains through, and its Hugging Face Llama-family adapter.

PrefixFlow needs three things from a causal language model:

* run the decoder over token ids whose positions start at ``start``, optionally reading
  per-layer keys/values of earlier tokens (``past``), and return the final hidden states
  (after the last norm) and the per-layer keys/values of these tokens plus the past ones;
* turn hidden states into log-probabilities of given target tokens;
* its parameters.

:class:`PrefixCausalLM` states that contract; :class:`HFLlamaLM` implements it for
Hugging Face Llama-family models (the bundled default model is one) through the
library's own modules and a ``DynamicCache`` built from the given keys/values. Another
architecture is added by writing one more adapter and registering its ``model_type``
in :data:`ADAPTERS`.

A model in train mode with dropout is refused: the shared prefix runs once, so every
sequence of the group would see one dropout mask on it, which full-sequence training
(an independent mask per sequence) never does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
from torch import nn

from verbatim.errors import TrainerError

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per-layer (keys, values), each (batch, kv_heads, tokens, head_dim)."""


class PrefixCausalLM(Protocol):
    def hidden_states(self, ids: torch.Tensor, start: int = 0, past: KV | None = None,
                      keep_kv: bool = False) -> tuple[torch.Tensor, KV | None]:
        """(b, n) ids at positions start..start+n-1 -> ((b, n, hidden), past + own KV if keep_kv)."""

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(n, hidden) states and (n,) target ids -> (n,) log-probabilities, at least float32."""

    def parameters(self) -> Iterator[nn.Parameter]: ...


class HFLlamaLM:
    """:class:`PrefixCausalLM` over a Hugging Face ``*ForCausalLM`` of the Llama family."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.decoder = model.model
        self.lm_head = model.lm_head

    def hidden_states(self, ids: torch.Tensor, start: int = 0, past: KV | None = None,
                      keep_kv: bool = False) -> tuple[torch.Tensor, KV | None]:
        from transformers import DynamicCache

        if self.model.training:
            refuse_dropout(self.model)
        batch, length = ids.shape
        positions = torch.arange(start, start + length, device=ids.device).expand(batch, length)
        cache = None
        if past is not None:
            if past[0][0].shape[-2] != start:
                raise TrainerError(f"past holds {past[0][0].shape[-2]} tokens but positions start at {start}")
            cache = DynamicCache(ddp_cache_data=past)  # fresh per call: forward concatenates into it
        elif keep_kv:
            cache = DynamicCache(config=self.model.config)
        out = self.decoder(input_ids=ids, position_ids=positions, past_key_values=cache,
                           use_cache=cache is not None)
        kv = [(layer.keys, layer.values) for layer in cache.layers] if keep_kv else None
        return out.last_hidden_state, kv

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None].long()).squeeze(-1)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()


def dropout_settings(model: nn.Module) -> dict[str, float]:
    """Every dropout probability above 0: config entries (``*dropout*``, ``*pdrop*``) and ``nn.Dropout`` modules."""
    found: dict[str, float] = {}
    config = getattr(model, "config", None)
    pending = [("", config.to_dict())] if hasattr(config, "to_dict") else []
    while pending:
        prefix, entries = pending.pop()
        for key, value in entries.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                pending.append((name + ".", value))
            elif ("dropout" in str(key) or "pdrop" in str(key)) and _positive(value):
                found[name] = float(value)
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            found[name] = float(module.p)
    return found


def refuse_dropout(model: nn.Module) -> None:
    """A :class:`TrainerError` for a model that would apply dropout (train mode, a probability above 0)."""
    settings = dropout_settings(model)
    if settings:
        listed = ", ".join(f"{key}={value:g}" for key, value in sorted(settings.items()))
        raise TrainerError(f"PrefixFlow cannot train a model with dropout ({listed}): the shared prefix runs once, "
                           "so the whole group would share one dropout mask",
                           hint="set the dropout to 0 in the model config, or call model.eval()")


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


ADAPTERS: dict[str, Callable[[nn.Module], PrefixCausalLM]] = {"llama": HFLlamaLM}
"""``config.model_type`` -> adapter. Add an architecture here once its exactness tests pass."""


def prefix_lm(model: nn.Module) -> PrefixCausalLM:
    """The adapter for a Hugging Face causal LM, by its ``config.model_type``."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ADAPTERS:
        raise TrainerError(f"PrefixFlow has no adapter for model type {model_type!r}",
                           hint=f"supported: {', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[model_type](model)


def sequence_logprobs(lm: PrefixCausalLM, hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                      targets: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A (b, T) tensor (at least float32) holding log π of ``targets`` at (rows, cols), 0 elsewhere.

    ``hidden`` is (n, hidden): the state that predicts each target (the previous position's).
    """
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    values = lm.token_logprobs(hidden, targets) if hidden.shape[0] else hidden.new_zeros(0, dtype=dtype)
    out = torch.zeros(tuple(shape), dtype=values.dtype, device=hidden.device)
    return out.index_put((rows, cols), values)
