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
