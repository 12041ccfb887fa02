"""The PrefixFlow adapter of a Hugging Face decoder-only causal LM: ``model.model`` and ``model.lm_head``.

It runs the library's own decoder modules over token ids at explicit positions, optionally reading
earlier tokens' keys/values (``past``), and keeps this call's keys/values when asked (phase A). A family
module (:mod:`.llama`, :mod:`.qwen`, …) says what else its architecture does after the decoder
(:meth:`HFDecoderLM.logits`).

Two ways to read and keep keys/values, chosen per call:

* **the attention path** (wherever :func:`~.prefix_attention.cascade_exact` holds): the decoder's
  attention is :mod:`.prefix_attention`'s, set for the call. Phase A records each layer's keys/values
  as the attention receives them; phase B's suffixes attend to one un-expanded copy of the prefix's
  (``past`` of batch 1 serves every row) through :mod:`~verbatim.trainer.cascade` attention: no cache,
  no copy of the prefix per row or per query head, no mask.
* **the cache path** (attention soft-capping, a sliding window shorter than the sequence, or a ``past``
  of batch above 1): a fresh ``DynamicCache`` built from ``past`` (expanded to the rows), the decoder's
  own attention and masks. The cache it keeps is always a plain full one, one layer of every token,
  even where the family's config has sliding-window layers: a sliding cache would drop the keys a later
  suffix still needs, while the mask the decoder builds from the positions applies the window itself.

``checkpoint_layers=True`` checkpoints every decoder layer of the attention path's calls and of whole
sequences (:mod:`.layer_checkpoint`); calls on the cache path run without it.

A model in train mode with dropout is refused (:func:`~verbatim.trainer.causal_lm.refuse_dropout`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from verbatim.errors import TrainerError
from verbatim.trainer.adapters.layer_checkpoint import checkpointed_layers
from verbatim.trainer.adapters.prefix_attention import (
    AttentionRun,
    captured_kv,
    cascade_exact,
    layer_count,
    prefix_attention,
)
from verbatim.trainer.causal_lm import KV, refuse_dropout, target_logprobs
from verbatim.trainer.routing_replay import replayed


class HFDecoderLM:
    """:class:`~verbatim.trainer.causal_lm.PrefixCausalLM` over a ``*ForCausalLM`` with a ``.model`` decoder
    and a ``.lm_head``; ``checkpoint_layers`` recomputes each decoder layer in the backward instead of
    keeping its activations."""

    def __init__(self, model: nn.Module, temperature: float = 1.0, checkpoint_layers: bool = False) -> None:
        self.model = model
        self.decoder = model.model
        self.lm_head = model.lm_head
        self.temperature = temperature
        self.checkpoint_layers = checkpoint_layers

    def hidden_states(self, ids: torch.Tensor, start: int = 0, past: KV | None = None,
                      keep_kv: bool = False, experts: torch.Tensor | None = None) -> tuple[torch.Tensor, KV | None]:
        with replayed(self.model, experts):
            return self._hidden_states(ids, start, past, keep_kv)

    def _hidden_states(self, ids: torch.Tensor, start: int, past: KV | None,
                       keep_kv: bool) -> tuple[torch.Tensor, KV | None]:
        if self.model.training:
            refuse_dropout(self.model)
        batch, length = ids.shape
        positions = torch.arange(start, start + length, device=ids.device).expand(batch, length)
        if past is not None and past[0][0].shape[-2] != start:
            raise TrainerError(f"past holds {past[0][0].shape[-2]} tokens but positions start at {start}")
        if past is None and not keep_kv:
            with self._layers():
                return self.decoder(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state, None
        if self.attention_path(start + length, past):
            return self._through_attention(ids, positions, past, keep_kv)
        return self._through_cache(ids, positions, past, keep_kv)

    def attention_path(self, length: int, past: KV | None = None) -> bool:
        """Whether a call over ``length`` tokens (past included) takes the attention path."""
        return cascade_exact(self.model.config, length) and (past is None or past[0][0].shape[0] == 1)

    def _through_attention(self, ids: torch.Tensor, positions: torch.Tensor, past: KV | None,
                           keep_kv: bool) -> tuple[torch.Tensor, KV | None]:
        run = AttentionRun(prefix=past, capture={} if keep_kv else None, length=int(positions[0, -1]) + 1)
        with prefix_attention(self.model, run), self._layers():
            hidden = self.decoder(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        if not keep_kv:
            return hidden, None
        own = captured_kv(run.capture, layer_count(self.model))
        if past is None:
            return hidden, own
        rows = ids.shape[0]
        return hidden, [(torch.cat([pk.expand(rows, -1, -1, -1), k], dim=-2),
                         torch.cat([pv.expand(rows, -1, -1, -1), v], dim=-2)) for (pk, pv), (k, v) in zip(past, own)]

    def _through_cache(self, ids: torch.Tensor, positions: torch.Tensor, past: KV | None,
                       keep_kv: bool) -> tuple[torch.Tensor, KV | None]:
        from transformers import DynamicCache

        rows = ids.shape[0]
        if past is not None:  # fresh per call: the forward concatenates into it
            cache = DynamicCache(ddp_cache_data=[(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1))
                                                 for k, v in past])
        else:
            cache = DynamicCache()  # full layers, never sliding ones (see the module docstring)
        out = self.decoder(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
        kv = [(layer.keys, layer.values) for layer in cache.layers] if keep_kv else None
        return out.last_hidden_state, kv

    def _layers(self) -> contextlib.AbstractContextManager[None]:
        if not (self.checkpoint_layers and self.model.training and torch.is_grad_enabled()):
            return contextlib.nullcontext()
        return checkpointed_layers(self.decoder, self.model.config)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return target_logprobs(self.logits(hidden), targets, self.temperature)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()
