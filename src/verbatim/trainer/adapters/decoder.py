"""The PrefixFlow adapter of a Hugging Face decoder-only causal LM: ``model.model`` and ``model.lm_head``.

It runs the library's own decoder modules over token ids at explicit positions, optionally reading
earlier tokens' keys/values through a fresh ``DynamicCache`` built from them, and keeps this call's
keys/values when asked (phase A). The cache it keeps is always a plain full one, one layer of every
token, even where the family's config has sliding-window layers: a sliding cache would drop the keys
a later suffix still needs, while the attention mask the decoder builds from the positions applies
the window itself. A family module (:mod:`.llama`, :mod:`.qwen`, …) says what else its architecture
does after the decoder (:meth:`HFDecoderLM.logits`).

A model in train mode with dropout is refused (:func:`~verbatim.trainer.causal_lm.refuse_dropout`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from verbatim.errors import TrainerError
from verbatim.trainer.causal_lm import KV, refuse_dropout, target_logprobs


class HFDecoderLM:
    """:class:`~verbatim.trainer.causal_lm.PrefixCausalLM` over a ``*ForCausalLM`` with a ``.model`` decoder
    that takes ``past_key_values`` and a ``.lm_head``."""

    def __init__(self, model: nn.Module, temperature: float = 1.0) -> None:
        self.model = model
        self.decoder = model.model
        self.lm_head = model.lm_head
        self.temperature = temperature

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
            cache = DynamicCache()  # full layers, never sliding ones (see the module docstring)
        out = self.decoder(input_ids=ids, position_ids=positions, past_key_values=cache,
                           use_cache=cache is not None)
        kv = [(layer.keys, layer.values) for layer in cache.layers] if keep_kv else None
        return out.last_hidden_state, kv

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return target_logprobs(self.logits(hidden), targets, self.temperature)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()
