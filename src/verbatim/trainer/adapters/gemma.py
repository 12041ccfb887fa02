"""Gemma 2 and Gemma 3 (text): scaled embeddings, attention and final-logit soft-capping, sliding windows.

* Scaled embeddings (× √hidden) and the attention logits' soft-cap are inside the decoder's modules.
* The final logits are soft-capped after the output layer (``tanh(logits / cap) · cap``,
  ``config.final_logit_softcapping``): :meth:`GemmaLM.logits` applies it, so log π is the model's own.
* Sliding-window layers alternate with global ones: every layer's keys/values are kept in full
  (:mod:`.decoder`) and the decoder's per-layer masks apply each window.

Gemma 3's multimodal checkpoints (``model_type: gemma3``) are a vision-language model around this
decoder; they train through the plain path (no adapter), their text model (``gemma3_text``) here.
"""

from __future__ import annotations

import torch

from verbatim.trainer.adapters.decoder import HFDecoderLM


class GemmaLM(HFDecoderLM):
    """The decoder adapter with Gemma's final-logit soft-cap."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits


ADAPTERS = {"gemma2": GemmaLM, "gemma3_text": GemmaLM}
